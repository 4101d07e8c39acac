"""`specdec serve`: an OpenAI-compatible HTTP server in front of one target model.

Endpoints: `POST /v1/completions` and `POST /v1/chat/completions` (a JSON body back or, with
`"stream": true`, server-sent events in OpenAI's chunk format), `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus text).

One worker thread (specdec.serve.worker) decodes every admitted request in one continuous batch
(specdec.batch): each step is one target forward over all of them, and each request's output is
what it would be alone. Requests beyond the batch wait in a bounded queue; a full queue answers
429. The HTTP event loop never waits on the model. A client that disconnects frees its rows at the
next step. Each request body is validated (specdec.serve.requests: FastAPI request models)
before it is queued, and every error is a JSON body `{"error": {"message", "type", "code",
"param"}}` with a 4xx status (5xx only for a bug).

OpenAI's fields are honoured or refused, never dropped: n choices, stop, logprobs (completions:
0..20; chat: logprobs with top_logprobs), frequency and presence penalties, seed, logit_bias, and
response_format (structured output, specdec.grammar: each grammar compiled against the target in
the handler, off the event loop, before its request joins the batch). Beyond them a request may
carry `drafter` (a drafter this server has, or "none"), `k` (draft length), `top_k`,
`repetition_penalty`, and vLLM's `min_p`, `stop_token_ids`, `ignore_eos`, `structured_outputs`
and `guided_*`; its `usage` carries each choice's speculative statistics.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.adaptive import VerifyCosts
from specdec.batch import PREFILL_CHUNK, PREFILL_RATIO
from specdec.decoding import Generation
from specdec.drafters import Drafter
from specdec.drafters.factory import REGISTERED, drafter_from_options, options_for
from specdec.grammar import Constraint, Grammar, tokenizer_info
from specdec.models.load import Model, check_same_tokenizer
from specdec.options import MAX_TOP_LOGPROBS, GenerationOptions, parse_k
from specdec.sampling import Penalties, SamplingParams, TokenLogprob
from specdec.serve.errors import ApiError
from specdec.serve.metrics import Metrics
from specdec.serve.requests import (
    BODIES,
    SEND_JSON,
    ChatRequest,
    CompletionRequest,
    Params,
    grammar_of,
    invalid,
    structured_fields,
)
from specdec.serve.worker import Job, Worker
from specdec.stats import RunStats

log = logging.getLogger("specdec.serve.app")

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; send "temperature": 0 for greedy decoding
MAX_N = 16  # choices per request
MAX_BATCH = 64  # sequences decoded at once
GRAMMAR_CACHE = 256  # grammars whose compile check a server remembers


# ---- the server -------------------------------------------------------------------------------


class Server:
    """The state behind the app: the target, its drafters, the worker (queue, batch, thread) and the
    metrics. Built by create_app; started and stopped by the app's lifespan."""

    def __init__(
        self,
        target: Model,
        drafters: Mapping[str, Drafter],
        drafter: str,
        k: int | str,
        model_name: str,
        max_queue: int,
        max_tokens: int,
        cache=None,
        max_batch: int = MAX_BATCH,
        prefill_chunk: int = PREFILL_CHUNK,
        prefill_ratio: int = PREFILL_RATIO,
    ):
        self.target, self.drafters, self.drafter, self.k = target, dict(drafters), drafter, k
        self.model_name, self.max_queue, self.max_tokens, self.max_batch = model_name, max_queue, max_tokens, max_batch
        self.created = int(time.time())
        self.metrics = Metrics()
        self._grammars: dict[Grammar, tuple[str, str] | None] = {}  # check_grammar's verdicts: (message, code)
        self._grammar_lock = threading.Lock()
        # k = "auto": every sequence's policy plans over one verify-cost curve
        costs = VerifyCosts.for_model(target, cache)
        forced = Counter(
            "specdec_forced_tokens_total",
            "Tokens a grammar forced (structured output), verified as free drafts; not in the draft counters.",
            registry=self.metrics.registry,
        )
        self.worker = Worker(
            target, costs, self.metrics, max_batch, max_queue, prefill_chunk, prefill_ratio, self.metrics.step,
            on_done=lambda stats: forced.inc(stats.forced),
        )  # fmt: skip
        self.inline = False  # run_server steps the batch in the calling thread
        for name, help_, read in [
            ("specdec_queue_depth", "Requests waiting in the queue.", self.worker.queue.qsize),
            ("specdec_queue_capacity", "Most requests the queue holds; past it the server answers 429.",
             lambda: self.max_queue),
            ("specdec_requests_running", "Requests in the batch now.", lambda: self.worker.running),
            ("specdec_batch_sequences", "Sequences in the batch now (a request with n choices is n).",
             lambda: self.worker.sequences),
            ("specdec_batch_capacity", "Most sequences the batch decodes at once.", lambda: self.max_batch),
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
    def job(self, req: Params, ids: list[int], arrived: float, max_tokens: int | None, chat: bool) -> Job:
        """Check a request's parameters and build its job; ApiError 4xx naming the bad field."""
        if req.model is not None and req.model != self.model_name:
            raise ApiError(
                404,
                f"model {req.model!r} is not served here; this server serves "
                f"{self.model_name!r} (GET /v1/models lists it)",
                code="model_not_found",
                param="model",
            )
        n = 1 if req.n is None else req.n
        if not 1 <= n <= MAX_N:
            raise ApiError(400, f"n must be between 1 and {MAX_N}, got {n}", code="invalid_parameter", param="n")
        logit_bias = self._logit_bias(req.logit_bias or {})
        grammar, _ = grammar_of(req)
        try:
            penalties = Penalties(
                req.frequency_penalty or 0.0,
                req.presence_penalty or 0.0,
                1.0 if req.repetition_penalty is None else req.repetition_penalty,
            )
        except ValueError as e:
            raise ApiError(400, str(e), code="invalid_parameter", param="repetition_penalty") from None
        logprobs = self._logprobs(req, chat)
        name = req.drafter if req.drafter is not None else self.drafter
        if name == "none":
            drafter = None
        elif name in self.drafters:
            drafter = self.drafters[name]
        else:
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
        temperature = DEFAULT_TEMPERATURE if req.temperature is None else req.temperature
        top_p = 1.0 if req.top_p is None else req.top_p
        top_k = req.top_k or 0
        min_p = req.min_p or 0.0
        try:
            SamplingParams(temperature, top_k, top_p, min_p)
        except ValueError as e:
            raise ApiError(400, str(e), code="invalid_parameter") from None
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        self._check_prompt(ids)
        if max_tokens is not None and len(ids) + max_tokens > self.target.n_ctx:
            raise ApiError(
                400,
                f"{self.model_name}'s context holds {self.target.n_ctx} tokens, but the request asks for "
                f"{len(ids) + max_tokens} ({len(ids)} in the prompt, {max_tokens} to generate); ask for at most "
                f"{self.target.n_ctx - len(ids)} new tokens",
                code="context_length_exceeded",
                param="max_tokens",
            )
        k = self.k if req.k is None else req.k
        if isinstance(k, str) and k.strip().isdigit():
            k = int(k)
        if k != "auto" and not isinstance(k, int):
            raise ApiError(
                400, f'k = {k!r} is not supported: send an integer >= 0 or "auto"', code="invalid_parameter", param="k"
            )
        try:
            options = GenerationOptions(
                k=k,
                max_new_tokens=self.max_tokens if max_tokens is None else max_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=req.seed,
                stop=tuple(stop),
                penalties=penalties,
                logprobs=logprobs,
                min_p=min_p,
                logit_bias=logit_bias,
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                grammar=grammar,
            )
        except ValueError as e:
            raise ApiError(400, str(e), code="invalid_parameter") from None
        return Job(ids, drafter, name, options, n, req.stream, asyncio.get_running_loop(), arrived)

    def _logit_bias(self, bias: Mapping[str, float]) -> dict[int, float]:
        """OpenAI's logit_bias ({"token id": bias}) as {id: bias}; ApiError 400 naming logit_bias
        for a key that is not a token id of the model or a bias outside [-100, 100]."""
        out = {}
        vocab = self.target.vocab_size
        for key, value in bias.items():
            if not re.fullmatch(r"[0-9]+", key) or int(key) >= vocab:
                raise ApiError(
                    400,
                    f"logit_bias: {key!r} is not a token id of {self.model_name} (a whole number 0..{vocab - 1}, "
                    'sent as a string key: {"50": -100})',
                    code="invalid_parameter",
                    param="logit_bias",
                )
            if not -100 <= value <= 100:
                raise ApiError(
                    400,
                    f"logit_bias: the bias of token {key} must be between -100 and 100, got {value}",
                    code="invalid_parameter",
                    param="logit_bias",
                )
            out[int(key)] = float(value)
        return out

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
            try:
                tokenizer_info(self.target)
            except Exception as e:  # noqa: BLE001
                error = (
                    f"structured output is not available for {self.model_name}: llguidance cannot read its "
                    f"tokenizer ({e})",
                    "unsupported_parameter",
                )
            else:
                try:
                    Constraint(grammar, self.target)
                    error = None
                except ValueError as e:  # GrammarError and llguidance's own
                    error = (str(e), "invalid_parameter")
            with self._grammar_lock:
                if len(self._grammars) >= GRAMMAR_CACHE:
                    self._grammars.pop(next(iter(self._grammars)))
                self._grammars[grammar] = error
        if error is not None:
            message, code = error
            raise ApiError(400, f"{param}: {message}", code=code, param=param)

    @staticmethod
    def _logprobs(req: Params, chat: bool) -> int | None:
        """How many top logprobs a request asks for beside each token's (None: no logprobs).
        Completions: logprobs = 0..20; chat: logprobs = true, with top_logprobs = 0..20."""
        if chat:
            if req.top_logprobs is not None and not req.logprobs:
                raise ApiError(
                    400, "top_logprobs needs logprobs = true", code="invalid_parameter", param="top_logprobs"
                )
            if req.logprobs not in (None, False, True):
                raise ApiError(
                    400, "logprobs must be true or false in a chat request (top_logprobs: how many alternatives)",
                    code="invalid_parameter", param="logprobs",
                )  # fmt: skip
            top = req.top_logprobs or 0
            name, value = "top_logprobs", top if req.logprobs else None
        else:
            if req.top_logprobs is not None:
                raise ApiError(
                    400, "top_logprobs is a chat field; a completion request sends logprobs = 0..20",
                    code="invalid_parameter", param="top_logprobs",
                )  # fmt: skip
            if isinstance(req.logprobs, bool) or not isinstance(req.logprobs, (int, type(None))):
                raise ApiError(
                    400, "logprobs must be an integer 0..20 in a completion request",
                    code="invalid_parameter", param="logprobs",
                )  # fmt: skip
            name, value = "logprobs", req.logprobs
        if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
            raise ApiError(
                400,
                f"{name} must be between 0 and {MAX_TOP_LOGPROBS}, got {value}",
                code="invalid_parameter",
                param=name,
            )
        return value

    def _check_prompt(self, ids: list[int]) -> None:
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

    def encode_completion(self, req: CompletionRequest) -> list[int]:
        """Prompt ids of a completion request: a string, a list of token ids, or a batch of one."""
        if req.echo or req.suffix or (req.best_of or 1) > 1:
            field_ = "echo" if req.echo else "suffix" if req.suffix else "best_of"
            raise ApiError(
                400,
                f"{field_} is not supported by this server; leave the field out",
                code="unsupported_parameter",
                param=field_,
            )
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(
                    400,
                    f"a batch of {len(prompt)} prompts is not supported: send one prompt per request",
                    code="unsupported_parameter",
                    param="prompt",
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.target.encode(prompt)
        return [int(t) for t in prompt]

    def encode_chat(self, req: ChatRequest) -> list[int]:
        """Prompt ids of a chat request: the messages in the model's chat template, ready for the
        assistant's turn."""
        if req.tools:
            raise ApiError(
                400,
                "tools are not supported by this server; leave the field out",
                code="unsupported_parameter",
                param="tools",
            )
        tokenizer = self.target.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ApiError(
                400,
                f"{self.model_name} has no chat template: use /v1/completions with a plain prompt",
                code="no_chat_template",
                param="messages",
            )
        messages = []
        for i, m in enumerate(req.messages):
            if isinstance(m.content, list):
                other = [p.type for p in m.content if p.type != "text"]
                if other:
                    raise ApiError(
                        400,
                        f"messages.{i}.content: only text parts are supported, got {other[0]!r}",
                        code="unsupported_parameter",
                        param=f"messages.{i}.content",
                    )
                content = "".join(p.text or "" for p in m.content)
            else:
                content = m.content or ""
            messages.append({"role": m.role, "content": content})
        try:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # the template's own checks (jinja raise_exception), e.g. role order
            raise ApiError(
                400, f"the model's chat template rejected the messages: {e}", code="invalid_messages", param="messages"
            ) from None
        if hasattr(ids, "keys"):  # a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def usage(self, generations: list[Generation], drafter_name: str) -> dict:
        """OpenAI's token counts (the prompt once, every choice's tokens) plus the speculative
        statistics of each choice's run (see specdec.stats): a dict, or a list of them for n > 1."""
        spec = [self._speculative(g.stats, drafter_name) for g in generations]
        prompt, completion = generations[0].stats.prompt_tokens, sum(g.stats.new_tokens for g in generations)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "speculative": spec[0] if len(spec) == 1 else spec,
        }

    @staticmethod
    def _speculative(stats: RunStats, drafter_name: str) -> dict:
        return {
            "drafter": drafter_name,
            "k": stats.k,
            "mean_k": _finite(stats.drafted / stats.rounds if stats.rounds else math.nan),
            "rounds": stats.rounds,
            "drafted": stats.drafted,
            "accepted": stats.accepted,
            "acceptance_rate": _finite(stats.alpha),
            "mean_accepted_length": _finite(stats.tau),
            "acceptance_per_position": stats.acceptance_per_position,
            "forced": stats.forced,
            "tokens_per_s": _finite(stats.tokens_per_s),
            "prefill_s": stats.prefill_s,
            "draft_s": stats.draft_s,
            "verify_s": stats.verify_s,
            "total_s": stats.total_s,
        }

    def logprobs(
        self, entries: list[TokenLogprob] | None, chat: bool, before: list[int] = (), offset: int = 0
    ) -> dict | None:
        """Logprobs in OpenAI's format: chat's {"content": [{token, logprob, bytes, top_logprobs}]},
        completions' {tokens, token_logprobs, top_logprobs, text_offset}. A token's text is what it
        adds after the tokens before it (`before`: the choice's earlier tokens; offset: the
        characters of its text before these)."""
        if entries is None:
            return None
        decode = self.target.tokenizer.decode
        context = list(before)[-8:]  # a few tokens before, so that a token's leading space shows

        def piece(token: int, prior: list[int]) -> str:
            return decode(prior + [token], skip_special_tokens=False)[len(decode(prior, skip_special_tokens=False)) :]

        tokens, tops = [], []
        for e in entries:
            tokens.append(piece(e.token, context))
            tops.append([(piece(t, context), lp) for t, lp in e.top])
            context = (context + [e.token])[-8:]
        if chat:
            item = lambda text, lp: {"token": text, "logprob": lp, "bytes": list(text.encode())}  # noqa: E731
            return {
                "content": [
                    dict(item(text, e.logprob), top_logprobs=[item(t, lp) for t, lp in top])
                    for text, e, top in zip(tokens, entries, tops)
                ]
            }
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [dict(top) for top in tops],
            "text_offset": offsets,
        }


_UNCHECKED = object()


def _finite(x: float) -> float | None:
    return None if math.isnan(x) or math.isinf(x) else x


# ---- responses --------------------------------------------------------------------------------


class _EventStream(StreamingResponse):
    """A text/event-stream response that calls on_close however it ends: finished, or cut short
    by a client that went away (starlette then cancels the body iterator)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def _until_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _chunk(
    server: Server,
    chat: bool,
    ident: str,
    text: str | None,
    finish: str | None = None,
    role: bool = False,
    index: int = 0,
    logprobs: dict | None = None,
) -> dict:
    """One streamed chunk in OpenAI's format: a chat delta (the first one of a choice carries the
    role), or a completion's text."""
    if chat:
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    return {
        "id": ident,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": server.model_name,
        "choices": [choice],
    }


async def _events(server: Server, job: Job, chat: bool, ident: str, include_usage: bool) -> AsyncIterator[str]:
    """A job's server-sent events: each choice's text as the worker commits it, then each choice's
    finish reason, the usage when asked for, and [DONE]; or an error body."""
    sent = [0] * job.n  # characters streamed per choice
    earlier: list[list[int]] = [[] for _ in range(job.n)]  # tokens whose logprobs were streamed, per choice
    offsets = [0] * job.n  # their characters
    if chat:
        for i in range(job.n):
            yield _sse(_chunk(server, chat, ident, None, role=True, index=i))
    while True:
        kind, value = await job.events.get()
        if kind == "delta":
            i, text, entries = value
            logprobs = server.logprobs(entries, chat, earlier[i], offsets[i])
            if entries is not None:
                earlier[i] += [e.token for e in entries]
                offsets[i] = len(server.target.tokenizer.decode(earlier[i], skip_special_tokens=False))
            sent[i] += len(text)
            yield _sse(_chunk(server, chat, ident, text if text or not chat else None, index=i, logprobs=logprobs))
        elif kind == "error":
            yield _sse(value.body())
            return
        else:
            generations: list[Generation] = value
            for i, gen in enumerate(generations):
                if gen.text[sent[i] :]:
                    yield _sse(_chunk(server, chat, ident, gen.text[sent[i] :], index=i))
                yield _sse(_chunk(server, chat, ident, None, FINISH_REASONS[gen.stats.stop_reason], index=i))
            if include_usage:
                last = _chunk(server, chat, ident, None)
                last.update(choices=[], usage=server.usage(generations, job.drafter_name))
                yield _sse(last)
            yield _sse("[DONE]")
            return


async def _complete(request: Request, server: Server, job: Job, chat: bool, ident: str) -> Response:
    """A job's whole answer as one JSON body, once it is done; 499 (and the job cancelled) when
    the client goes away first."""
    result = asyncio.ensure_future(job.events.get())
    gone = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not result.done():  # the client went away, or the server is shutting down
            result.cancel()
            job.cancelled.set()
    if not result.done() or result.cancelled():
        return Response(status_code=499)  # nobody is listening
    kind, value = result.result()
    if kind == "error":
        return value.response()
    generations: list[Generation] = value
    choices = []
    for i, gen in enumerate(generations):
        finish = FINISH_REASONS[gen.stats.stop_reason]
        logprobs = server.logprobs(gen.logprobs, chat)
        if chat:
            message = {"role": "assistant", "content": gen.text}
            choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish})
        else:
            choices.append({"index": i, "text": gen.text, "logprobs": logprobs, "finish_reason": finish})
    return JSONResponse(
        {
            "id": ident,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": server.model_name,
            "choices": choices,
            "usage": server.usage(generations, job.drafter_name),
        }
    )


# ---- routes: each reads the Server from request.app.state -------------------------------------

router = APIRouter()


def _server(request: Request) -> Server:
    return request.app.state.server


@router.get("/health")
async def health(request: Request) -> Response:
    """200 with the model and the queue, or 503 when the generation worker is not running."""
    server = _server(request)
    if not server.alive:
        return JSONResponse({"status": "error", "message": "the generation worker is not running"}, status_code=503)
    return JSONResponse(
        {
            "status": "ok",
            "model": server.model_name,
            "queue_depth": server.worker.queue.qsize(),
            "running": server.worker.running,
        }
    )


@router.get("/v1/models")
async def models(request: Request) -> Response:
    """The one served model, with its context length, drafters and defaults."""
    server = _server(request)
    model = {
        "id": server.model_name,
        "object": "model",
        "created": server.created,
        "owned_by": "specdec",
        "max_model_len": server.target.n_ctx,
        "drafters": [*server.drafters, "none"],
        "default_drafter": server.drafter,
        "default_k": server.k,
    }
    return JSONResponse({"object": "list", "data": [model]})


@router.get("/metrics")
async def prometheus_metrics(request: Request) -> Response:
    """The server's metrics in Prometheus' text format (specdec.serve.metrics)."""
    return Response(_server(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    """OpenAI's completions: a JSON body, or server-sent events with "stream": true."""
    return await _generate(request, body, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request) -> Response:
    """OpenAI's chat completions: a JSON body, or server-sent events with "stream": true."""
    return await _generate(request, body, chat=True)


async def _generate(request: Request, req: Params, chat: bool) -> Response:
    """Check a validated request, queue its job, and answer it (streamed or whole); a 4xx
    (429: the queue is full) counted in the metrics."""
    server = _server(request)
    try:
        if chat:
            ids = server.encode_chat(req)
            max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        else:
            ids = server.encode_completion(req)
            max_new = req.max_tokens
        job = server.job(req, ids, request.state.arrived, max_new, chat)
        if job.options.grammar is not None:  # compiled here, in a thread off the event loop, before the batch
            await asyncio.to_thread(server.check_grammar, job.options.grammar, structured_fields(req)[0])
        server.submit(job)
    except ApiError as e:
        server.metrics.count("rejected" if e.status == 429 else "invalid")
        return e.response()
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _EventStream(_events(server, job, chat, ident, include_usage), on_close=job.cancelled.set)
    return await _complete(request, server, job, chat, ident)


# ---- the app: its lifespan, middleware and error handlers ---------------------------------------


@asynccontextmanager
async def _lifespan(app: FastAPI):
    server: Server = app.state.server
    await asyncio.to_thread(server.warm_grammar)
    server.start()
    try:
        yield
    finally:
        await asyncio.to_thread(server.stop)


async def _guard(request: Request, call_next) -> Response:
    """Before any route: note the request's arrival (its latency counts from here), refuse a /v1/
    request without the server's API key when it has one (401), and a request body over the
    server's limit (413)."""
    request.state.arrived = time.perf_counter()
    state = request.app.state
    if state.api_key is not None and request.url.path.startswith("/v1/"):
        sent = request.headers.get("authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {state.api_key}".encode()):
            return ApiError(
                401,
                "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the key this "
                "server was started with (--api-key)",
                code="invalid_api_key",
            ).response()
    if request.url.path in BODIES and await _too_large(request, state.max_body_bytes):
        state.server.metrics.count("invalid")
        return ApiError(
            413,
            f"the request body is over this server's limit of {state.max_body_bytes} bytes; send a shorter prompt",
            code="request_too_large",
        ).response()
    return await call_next(request)


async def _too_large(request: Request, max_bytes: int) -> bool:
    """Whether the request body, declared (Content-Length) or read, is over max_bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        return True
    return len(await request.body()) > max_bytes  # read once; the route reads it again from the cache


async def _invalid_request(request: Request, exc: RequestValidationError) -> Response:
    """A body the route's request model refused: a 400 naming the field (see invalid)."""
    _server(request).metrics.count("invalid")
    cls = BODIES.get(request.url.path, Params)
    return invalid(exc.errors(), cls, request.headers.get("content-type")).response()


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """Starlette's and FastAPI's own HTTP errors (no such route, a body it could not decode) in
    the OpenAI error format."""
    if exc.status_code == 404:
        message = (
            f"no route {request.method} {request.url.path}; this server has POST /v1/completions, "
            "POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics"
        )
        return ApiError(404, message, code="404").response()
    if exc.status_code == 400 and request.url.path in BODIES:  # FastAPI could not decode it (not UTF-8, ...)
        _server(request).metrics.count("invalid")
        message = f"the request body could not be read as JSON ({exc.detail}); {SEND_JSON}, in UTF-8"
        return ApiError(400, message, code="invalid_json").response()
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return ApiError(exc.status_code, message, code=str(exc.status_code)).response()


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()


def _registry_drafters(
    draft: Model | None, max_ngram: int, min_ngram: int, cache=None, head_quantize: str | None = None
) -> dict[str, Drafter]:
    """One instance of every registered drafter whose required options the server has (all but the
    model drafter, which comes only with `draft`), each built with the server's settings it takes
    (prompt lookup's n-gram sizes; the draft model; the heads' quantization) and its defaults otherwise.
    Each sequence of the batch runs a fork of one of these (Drafter.fork)."""
    settings = dict(draft=draft, max_ngram=max_ngram, min_ngram=min_ngram, cache=cache, quantize=head_quantize)
    out: dict[str, Drafter] = {}
    for name, entry in REGISTERED.items():
        options = options_for(name, settings)
        if all(option in options for option in entry.required):
            out[name] = drafter_from_options(name, **options)
    return out


def create_app(
    target: Model,
    drafter: str | None = "prompt-lookup",
    k: int | str = "auto",
    *,
    draft: Model | None = None,
    drafters: Mapping[str, Drafter] | None = None,
    model_name: str | None = None,
    max_queue: int = 64,
    max_tokens: int = 256,
    max_batch: int = MAX_BATCH,
    prefill_chunk: int = PREFILL_CHUNK,
    prefill_ratio: int = PREFILL_RATIO,
    max_ngram: int = 3,
    min_ngram: int = 1,
    cache=None,
    head_quantize: str | None = None,
    api_key: str | None = None,
    max_body_bytes: int = 4 * 2**20,
) -> FastAPI:
    """The FastAPI app serving `target`; run it with uvicorn (see run_server).

    drafter: the default drafter of a request that names none: a name in specdec.DRAFTERS
    ("prompt-lookup" uses max_ngram and min_ngram; "model" needs `draft`, a model sharing the
    target's tokenizer), a key of `drafters`, or None / "none" for plain decoding. k: the default
    draft length. drafters: extra named drafter objects requests may choose (they override
    built-in names). model_name: the id clients send as "model" (default: target.name).
    max_batch: sequences decoded at once in one continuous batch (specdec.batch; a request with
    n choices is n sequences); max_queue: requests that may wait beyond them; past it the server
    answers 429. prefill_chunk, prefill_ratio: while prompts wait, a step feeds the larger of
    prefill_chunk and prefill_ratio per decoding sequence of their tokens (chunked prefill,
    specdec.batch.Batch.prefill_budget).
    max_tokens: the default of a request's max_tokens (a request asking for more than the context
    holds gets a 400). api_key: when given, every /v1/ request must send `Authorization: Bearer
    <api_key>` (else 401), as vLLM's and llama.cpp's servers do. max_body_bytes: larger request
    bodies get a 413. cache: the specdec cache folder (layer-skip
    calibrations, draft heads, the verify-cost curve; default: the usual one). head_quantize: the
    GGUF type the eagle drafters' heads run in against a quantized target (default q8_0). The app
    starts its worker thread on startup (its lifespan) and cancels what is left on shutdown.

    Raises ValueError on a bad default (unknown drafter, negative k, max_queue < 1, ...), and
    TokenizerMismatchError when `draft` does not share the target's tokenizer.
    """
    if draft is not None:
        check_same_tokenizer(target, draft)  # at start, rather than as every request's error
    available = _registry_drafters(draft, max_ngram, min_ngram, cache, head_quantize)
    available.update(drafters or {})
    drafter = drafter or "none"
    if drafter != "none" and drafter not in available:
        hint = " (pass draft=MODEL, or --draft MODEL on the command line)" if drafter == "model" else ""
        raise ValueError(f"unknown drafter {drafter!r}; available: {', '.join([*available, 'none'])}{hint}")
    k = parse_k(k)
    if max_queue < 1:
        raise ValueError(f"max_queue must be >= 1, got {max_queue}")
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    if prefill_ratio < 0:
        raise ValueError(f"prefill_ratio must be >= 0, got {prefill_ratio}")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    if api_key is not None and not api_key.strip():
        raise ValueError("api_key must not be empty (leave it out to serve without one)")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    server = Server(
        target, available, drafter, k, model_name or target.name, max_queue, max_tokens, cache, max_batch,
        prefill_chunk, prefill_ratio,
    )  # fmt: skip

    app = FastAPI(
        title="specdec",
        summary="Exact speculative decoding behind an OpenAI-compatible API",
        lifespan=_lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.server, app.state.api_key, app.state.max_body_bytes = server, api_key, max_body_bytes
    app.middleware("http")(_guard)
    app.add_exception_handler(RequestValidationError, _invalid_request)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    app.include_router(router)
    return app


def run_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve `app` until interrupted (Ctrl-C). Blocks. uvicorn answers HTTP in a thread while the
    calling thread, the one that loaded the model, steps the batch (Worker.run says why)."""
    import uvicorn

    server: Server = app.state.server
    server.inline = True
    http = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level))
    thread = threading.Thread(target=http.run, name="specdec-http", daemon=True)
    thread.start()
    try:
        while not http.started and thread.is_alive():
            time.sleep(0.05)
        server.worker.run(until=lambda: not thread.is_alive() or http.should_exit)
    except KeyboardInterrupt:
        pass
    finally:
        http.should_exit = True
        thread.join(30)
