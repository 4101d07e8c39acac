"""The state behind specdec's HTTP server: the target, its drafters, the worker (queue, batch,
thread) and the metrics, and the turning of a validated request (specdec.serve.requests) into a
Job: its prompt encoded, checked against the model, and its options built once."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Mapping

from prometheus_client import Counter

from specdec.adaptive import VerifyCosts
from specdec.drafters import Drafter
from specdec.grammar import Constraint, Grammar, tokenizer_info
from specdec.models.load import Model
from specdec.options import GenerationOptions
from specdec.sampling import Penalties
from specdec.serve.config import ServeConfig
from specdec.serve.errors import ApiError
from specdec.serve.metrics import Metrics
from specdec.serve.requests import ChatRequest, CompletionRequest
from specdec.serve.worker import Job, Worker

log = logging.getLogger("specdec.serve.server")

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; send "temperature": 0 for greedy decoding
GRAMMAR_CACHE = 256  # grammars whose compile check a server remembers
_UNCHECKED = object()


class Server:
    """The state behind the app. Built by create_app; started and stopped by the app's lifespan.

    target: the served model. drafters: {name: drafter} a request may choose (each sequence runs
    a fork). config: the settings (config.drafter is one of drafters' names or "none").
    model_name: the id clients send (config.model_name, else the target's name).

    Raises ValueError when config.drafter is neither "none" nor one of drafters.
    """

    def __init__(self, target: Model, drafters: Mapping[str, Drafter], config: ServeConfig):
        if config.drafter != "none" and config.drafter not in drafters:
            hint = " (pass draft=MODEL, or --draft MODEL on the command line)" if config.drafter == "model" else ""
            available = ", ".join([*drafters, "none"])
            raise ValueError(f"unknown drafter {config.drafter!r}; available: {available}{hint}")
        self.target, self.drafters, self.config = target, dict(drafters), config
        self.model_name = config.model_name or target.name
        self.created = int(time.time())
        self.metrics = Metrics()
        self._grammars: dict[Grammar, tuple[str, str] | None] = {}  # check_grammar's verdicts: (message, code)
        self._grammar_lock = threading.Lock()
        costs = VerifyCosts.for_model(target, config.cache)  # k = "auto": every policy plans over one curve
        forced = Counter(
            "specdec_forced_tokens_total",
            "Tokens a grammar forced (structured output), verified as free drafts; not in the draft counters.",
            registry=self.metrics.registry,
        )
        self.worker = Worker(
            target,
            costs,
            self.metrics,
            config,
            on_step=self.metrics.step,
            on_done=lambda stats: forced.inc(stats.forced),
        )
        self.inline = False  # run_server steps the batch in the calling thread
        for name, help_, read in [
            ("specdec_queue_depth", "Requests waiting in the queue.", self.worker.queue.qsize),
            ("specdec_queue_capacity", "Most requests the queue holds; past it the server answers 429.",
             lambda: config.max_queue),
            ("specdec_requests_running", "Requests in the batch now.", lambda: self.worker.running),
            ("specdec_batch_sequences", "Sequences in the batch now (a request with n choices is n).",
             lambda: self.worker.sequences),
            ("specdec_batch_capacity", "Most sequences the batch decodes at once.", lambda: config.max_batch),
        ]:  # fmt: skip
            self.metrics.gauge(name, help_, read)

    # -- lifecycle --
    def start(self) -> None:
        """Start stepping in a thread, unless run_server steps in its own thread (inline)."""
        if not self.inline:
            self.worker.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the worker (up to timeout seconds); what is queued or running gets a 503."""
        self.worker.stop(timeout)

    @property
    def alive(self) -> bool:
        return self.worker.alive

    def submit(self, job: Job) -> None:
        """Queue a job; ApiError 429 when the queue is full."""
        self.worker.submit(job)

    # -- requests --
    def job(self, req: CompletionRequest | ChatRequest, arrived: float) -> Job:
        """The Job of a validated request (arrived: its time.perf_counter() at arrival): its prompt
        encoded and its options built. Checks only what needs this server: the model's name (404),
        the drafter, the prompt's tokens, the context, logit_bias' token ids (ApiError 400 naming
        the field). Must run on the event loop (the job answers through it)."""
        ids = self.encode_chat(req) if isinstance(req, ChatRequest) else self.encode_completion(req)
        if req.model is not None and req.model != self.model_name:
            raise ApiError(
                404,
                f"model {req.model!r} is not served here; this server serves "
                f"{self.model_name!r} (GET /v1/models lists it)",
                code="model_not_found",
                param="model",
            )
        logit_bias = self._logit_bias(req.logit_bias or {})
        name, drafter = self._drafter(req.drafter)
        self._check_prompt(ids)
        max_new = req.max_completion_tokens if isinstance(req, ChatRequest) else None
        max_new = req.max_tokens if max_new is None else max_new
        self._check_context(len(ids), max_new)
        options = GenerationOptions(
            k=self.config.k if req.k is None else req.k,
            max_new_tokens=self.config.max_tokens if max_new is None else max_new,
            temperature=DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
            top_k=req.top_k or 0,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed,
            stop=(req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ()),
            penalties=Penalties(
                req.frequency_penalty or 0.0,
                req.presence_penalty or 0.0,
                1.0 if req.repetition_penalty is None else req.repetition_penalty,
            ),
            logprobs=req.top_logprobs_wanted(),
            min_p=req.min_p or 0.0,
            logit_bias=logit_bias,
            stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            grammar=req.grammar,
        )
        n = 1 if req.n is None else req.n
        return Job(ids, drafter, name, options, n, req.stream, loop=asyncio.get_running_loop(), arrived=arrived)

    def _drafter(self, requested: str | None) -> tuple[str, Drafter | None]:
        """The drafter a request names (None: the server's default) and its instance (None for
        "none"); ApiError 400 naming drafter for one this server does not have."""
        name = self.config.drafter if requested is None else requested
        if name == "none":
            return name, None
        if name in self.drafters:
            return name, self.drafters[name]
        hint = (
            " (the model drafter needs the server started with --drafter model --draft MODEL)"
            if name == "model"
            else ""
        )
        raise ApiError(
            400,
            f"unknown drafter {name!r}; this server has: {', '.join([*self.drafters, 'none'])}{hint}",
            code="invalid_parameter",
            param="drafter",
        )

    def _logit_bias(self, bias: Mapping[str, float]) -> dict[int, float]:
        """OpenAI's logit_bias ({"token id": bias}, each bias already in [-100, 100]) as {id: bias};
        ApiError 400 naming logit_bias for a key that is not a token id of the model."""
        vocab = self.target.vocab_size
        for key in bias:
            if not re.fullmatch(r"[0-9]+", key) or int(key) >= vocab:
                raise ApiError(
                    400,
                    f"logit_bias: {key!r} is not a token id of {self.model_name} (a whole number 0..{vocab - 1}, "
                    'sent as a string key: {"50": -100})',
                    code="invalid_parameter",
                    param="logit_bias",
                )
        return {int(key): float(value) for key, value in bias.items()}

    def _check_prompt(self, ids: list[int]) -> None:
        """ApiError 400 naming prompt for an empty prompt, one the context cannot hold, or a token id
        outside the vocabulary."""
        if not ids:
            raise ApiError(400, "the prompt is empty: send at least one token", code="invalid_prompt", param="prompt")
        n_ctx = self.target.n_ctx
        if len(ids) >= n_ctx:
            raise ApiError(
                400,
                f"the prompt has {len(ids)} tokens but {self.model_name}'s context holds {n_ctx}: "
                f"shorten it to at most {n_ctx - 1} tokens so that at least one can be generated",
                code="context_length_exceeded",
                param="prompt",
            )
        vocab = self.target.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(
                400,
                f"token id {bad} is outside the model's vocabulary (0..{vocab - 1})",
                code="invalid_prompt",
                param="prompt",
            )

    def _check_context(self, prompt: int, max_tokens: int | None) -> None:
        """ApiError 400 naming max_tokens when the prompt's tokens and max_tokens (None: the
        server's default, not checked) overflow the context."""
        n_ctx = self.target.n_ctx
        if max_tokens is not None and prompt + max_tokens > n_ctx:
            raise ApiError(
                400,
                f"{self.model_name}'s context holds {n_ctx} tokens, but the request asks for "
                f"{prompt + max_tokens} ({prompt} in the prompt, {max_tokens} to generate); ask for at most "
                f"{n_ctx - prompt} new tokens",
                code="context_length_exceeded",
                param="max_tokens",
            )

    def encode_completion(self, req: CompletionRequest) -> list[int]:
        """Prompt ids of a completion request: a string, a list of token ids, or a batch of one."""
        prompt = req.single_prompt()
        if isinstance(prompt, str):
            return self.target.encode(prompt)
        return [int(t) for t in prompt]

    def encode_chat(self, req: ChatRequest) -> list[int]:
        """Prompt ids of a chat request: the messages in the model's chat template, ready for the
        assistant's turn. ApiError 400 naming messages when the model has no chat template or the
        template refuses the messages."""
        tokenizer = self.target.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ApiError(
                400,
                f"{self.model_name} has no chat template: use /v1/completions with a plain prompt",
                code="no_chat_template",
                param="messages",
            )
        try:
            ids = tokenizer.apply_chat_template(req.texts(), add_generation_prompt=True, tokenize=True)
        except Exception as e:  # the template's own checks (jinja raise_exception), e.g. role order
            raise ApiError(
                400, f"the model's chat template rejected the messages: {e}", code="invalid_messages", param="messages"
            ) from None
        if hasattr(ids, "keys"):  # a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    # -- structured output --
    def warm_grammar(self) -> None:
        """Build llguidance's view of the target's tokenizer now (1-3 s on a real vocabulary, then
        cached), so that the first structured-output request does not pay for it. A tokenizer
        llguidance cannot read is left for those requests to report."""
        try:
            tokenizer_info(self.target)
        except Exception as e:  # noqa: BLE001 -- any failure: structured output is unavailable
            log.info("structured output is unavailable for %s: %s", self.model_name, e)

    def check_grammar(self, grammar: Grammar, param: str) -> None:
        """Compile `grammar` against the target before its request joins the batch (the result
        cached per grammar). ApiError 400 naming `param` for a grammar llguidance cannot compile, one
        that admits no text, or a tokenizer it cannot read. Runs in a thread, off the event loop."""
        with self._grammar_lock:
            error = self._grammars.get(grammar, _UNCHECKED)
        if error is _UNCHECKED:
            error = self._compile(grammar)
            with self._grammar_lock:
                if len(self._grammars) >= GRAMMAR_CACHE:
                    self._grammars.pop(next(iter(self._grammars)))
                self._grammars[grammar] = error
        if error is not None:
            message, code = error
            raise ApiError(400, f"{param}: {message}", code=code, param=param)

    def _compile(self, grammar: Grammar) -> tuple[str, str] | None:
        """None when `grammar` compiles against the target, else (message, error code)."""
        try:
            tokenizer_info(self.target)
        except Exception as e:  # noqa: BLE001
            return (
                f"structured output is not available for {self.model_name}: llguidance cannot read its tokenizer ({e})",
                "unsupported_parameter",
            )
        try:
            Constraint(grammar, self.target)
        except ValueError as e:  # GrammarError and llguidance's own
            return str(e), "invalid_parameter"
        return None
