"""`specdec serve`: an OpenAI-compatible HTTP server in front of one target model.

Endpoints: `POST /v1/completions` and `POST /v1/chat/completions` (a JSON body back or, with
`"stream": true`, server-sent events in OpenAI's chunk format), `GET /v1/models`, `GET /health`,
`GET /metrics` (Prometheus text).

One worker thread runs `specdec.engine.generate`, one request at a time, taken from a bounded queue;
the HTTP event loop never waits on the model. A full queue answers 429. A client that disconnects
cancels its generation: a queued one is skipped, a running one stops after its current round (the
engine's stream callback raises). Each request is validated before it is queued, and every error is
a JSON body `{"error": {"message", "type", "code", "param"}}` with a 4xx status (5xx only for a bug).

Beyond OpenAI's fields a request may carry `drafter` (a drafter this server has, or "none"), `k`
(draft length) and `top_k`; its `usage` carries the run's speculative statistics.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.adaptive import AdaptiveK, VerifyCosts
from specdec.drafters import Drafter
from specdec.drafters.factory import DRAFTERS, REQUIRED, drafter_from_options, options_for
from specdec.engine import Generation, generate
from specdec.models.load import Model, check_same_tokenizer
from specdec.sampling import SamplingParams
from specdec.serve.metrics import Metrics
from specdec.stats import RunStats
from specdec.textstream import TextDeltas

log = logging.getLogger("specdec.serve.app")

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; send "temperature": 0 for greedy decoding


class ApiError(Exception):
    """An error answered as HTTP `status` with an OpenAI-style body:
    {"error": {"message": ..., "type": ..., "code": ..., "param": ...}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


# ---- requests ---------------------------------------------------------------------------------


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Params(BaseModel):
    """The fields both endpoints share. A field the server does not know is refused (400), never
    silently dropped; OpenAI's penalties and logit_bias are accepted at their neutral values only."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)  # extension (vLLM has it too); 0 = off
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)  # what torch.Generator.manual_seed takes
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None
    n: int | None = None
    logprobs: Any = None
    frequency_penalty: float | None = None  # only 0: penalties are not applied (yet)
    presence_penalty: float | None = None
    repetition_penalty: float | None = None  # extension (vLLM's); only 1
    logit_bias: dict | None = None  # only empty
    drafter: str | None = None  # extension: a drafter this server has, or "none"
    k: StrictInt | str | None = None  # extension: draft length (a string goes to the engine as it is)

    @field_validator("k")
    @classmethod
    def _k_not_negative(cls, v):
        if isinstance(v, int) and v < 0:
            raise ValueError("k (draft length) must be >= 0 (0 = plain decoding)")
        return v


class CompletionRequest(_Params):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class _ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[_ContentPart] | None = None


class ChatRequest(_Params):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    tools: Any = None


async def _parse(request: Request, cls: type[BaseModel], max_bytes: int) -> Any:
    """The request body as `cls`; ApiError 413 for a body over max_bytes, 400 for a body that is not
    JSON or a bad field."""
    too_large = ApiError(
        413,
        f"the request body is over this server's limit of {max_bytes} bytes; send a shorter prompt",
        code="request_too_large",
    )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_large
    raw = await request.body()
    if len(raw) > max_bytes:
        raise too_large
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(
            400,
            f"the request body is not valid JSON ({e}); send a JSON object with Content-Type: application/json",
            code="invalid_json",
        ) from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        extra = [err["loc"][0] for err in e.errors() if err["type"] == "extra_forbidden" and len(err["loc"]) == 1]
        if extra:
            honoured = ", ".join(cls.model_fields)
            raise ApiError(
                400,
                f"{extra[0]!r} is not a field this server honours; leave it out (the fields it reads: {honoured})",
                code="unsupported_parameter",
                param=str(extra[0]),
            ) from None
        parts: dict[str, str] = {}
        for err in e.errors():
            loc = err["loc"]
            got = "" if err["type"] == "missing" else f" (got {json.dumps(err.get('input'), default=str)[:80]})"
            pattern = ".".join("*" if isinstance(x, int) else str(x) for x in loc[:-1])
            if pattern in _ONE_OF and isinstance(loc[-1], str):  # a union's branch failed: say what is expected
                where = ".".join(str(x) for x in loc[:-1])
                parts.setdefault(where, f"{where}: expected {_ONE_OF[pattern]}{got}")
            else:
                where = ".".join(str(x) for x in loc) or "body"
                parts.setdefault(where, f"{where}: {err['msg']}{got}")
        param = next(iter(parts)).split(".")[0] if parts else None
        raise ApiError(
            400, "invalid request: " + "; ".join(parts.values()), code="invalid_parameter", param=param
        ) from None


_ONE_OF = {  # fields that take one of several types, and how to say so
    "prompt": "a string or a list of token ids (or a list holding one of these)",
    "stop": "a string or a list of strings",
    "k": 'an integer >= 0 (0 = plain decoding) or "auto"',
    "messages.*.content": 'a string or a list of text parts ({"type": "text", "text": ...})',
}


# ---- the queue and the worker -----------------------------------------------------------------


class _Cancelled(Exception):
    """Raised from the engine's stream callback to stop a generation whose client went away."""


@dataclass
class _Job:
    """One generation request on its way through the queue. The worker thread reports back through
    `events` (on the event loop): ("delta", text) when streaming, then ("done", Generation) or
    ("error", ApiError). `cancelled` is set when the client goes away."""

    ids: list[int]
    drafter: Drafter | None
    drafter_name: str
    run: dict  # the rest of engine.generate's keyword arguments
    stream: bool
    loop: asyncio.AbstractEventLoop
    arrived: float  # time.perf_counter() at arrival
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    started_output: bool = False

    def push(self, kind: str, value: Any = None) -> None:
        """From the worker thread: hand an event to the request's handler."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancelled.set()


class Server:
    """The state behind the app: the target, its drafters, the bounded queue, the worker thread
    and the metrics. Built by create_app; started and stopped by the app's lifespan."""

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
    ):
        self.target, self.drafters, self.drafter, self.k = target, dict(drafters), drafter, k
        # k = "auto": one policy per drafter, kept across requests, over one verify-cost curve
        costs = VerifyCosts.for_model(target, cache)
        self.policies = {name: AdaptiveK(costs) for name in self.drafters}
        self.model_name, self.max_queue, self.max_tokens = model_name, max_queue, max_tokens
        self.created = int(time.time())
        self.queue: queue.Queue[_Job] = queue.Queue(maxsize=max_queue)
        self.running = 0
        self.current: _Job | None = None
        self.metrics = Metrics(self._gauges)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _gauges(self) -> dict[str, tuple[str, float]]:
        return {
            "specdec_queue_depth": ("Requests waiting in the queue.", self.queue.qsize()),
            "specdec_queue_capacity": (
                "Most requests the queue holds; past it the server answers 429.",
                self.max_queue,
            ),
            "specdec_requests_running": ("Requests being generated now (0 or 1).", self.running),
        }

    # -- lifecycle --
    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._work, name="specdec-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel what is queued and running, and wait (up to timeout seconds) for the worker."""
        self._stop.set()
        current = self.current
        if current is not None:
            current.cancelled.set()
        if self._thread is not None:
            self._thread.join(timeout)
        while True:  # whoever still waits gets an answer
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            self.metrics.count("cancelled")
            job.push(
                "error",
                ApiError(
                    503,
                    "the server is shutting down; retry on another instance",
                    type="server_error",
                    code="shutting_down",
                ),
            )

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- the worker thread --
    def submit(self, job: _Job) -> None:
        """Queue a job; ApiError 429 when the queue is full."""
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            raise ApiError(
                429,
                f"the server is busy: {self.max_queue} requests are already waiting; retry in a moment",
                type="rate_limit_error",
                code="queue_full",
            ) from None

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                job = self.queue.get(timeout=0.2)
            except queue.Empty:
                continue
            if job.cancelled.is_set() or self._stop.is_set():
                self.metrics.count("cancelled")
                continue
            self.current, self.running = job, 1
            try:
                event = self._run(job)
            except BaseException as e:  # never let the worker die, nor a client wait forever
                log.exception("the worker failed outside a generation")
                event = ("error", ApiError(500, f"internal error: {type(e).__name__}: {e}", type="server_error"))
            self.current, self.running = None, 0  # before the client hears: it may ask /metrics next
            if event is not None:
                job.push(*event)

    def _run(self, job: _Job) -> tuple[str, Any] | None:
        """Generate one job; returns its last event for the client: ("done", Generation) or
        ("error", ApiError), or None when it was cancelled. Counts it in the metrics."""
        deltas = TextDeltas(self.target.tokenizer, job.run["stop"]) if job.stream else None

        def on_round(tokens: list[int]) -> None:
            if job.cancelled.is_set():
                raise _Cancelled
            job.started_output = True
            if deltas is not None:
                piece = deltas(tokens)
                if piece:
                    job.push("delta", piece)

        try:
            gen = generate(self.target, job.ids, job.drafter, stream=on_round, **job.run)
        except _Cancelled:
            self.metrics.count("cancelled")
            return None
        except Exception as e:
            if isinstance(e, (ValueError, TypeError)) and not job.started_output:  # the engine refused a parameter
                k = job.run["k"]
                message = (
                    f'k = {k!r} is not supported: send an integer >= 0 or "auto"'
                    if isinstance(e, TypeError) and isinstance(k, str)
                    else str(e)
                )
                self.metrics.count("invalid")
                return "error", ApiError(
                    400, message, code="invalid_parameter", param="k" if isinstance(k, str) else None
                )
            log.exception("generation failed")
            self.metrics.count("failed")
            return "error", ApiError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error")
        self.metrics.record(gen.stats, time.perf_counter() - job.arrived)
        return "done", gen

    # -- requests --
    def job(self, req: _Params, ids: list[int], arrived: float, max_tokens: int | None) -> _Job:
        """Check a request's parameters and build its job; ApiError 4xx naming the bad field."""
        if req.model is not None and req.model != self.model_name:
            raise ApiError(
                404,
                f"model {req.model!r} is not served here; this server serves "
                f"{self.model_name!r} (GET /v1/models lists it)",
                code="model_not_found",
                param="model",
            )
        if req.n not in (None, 1):
            raise ApiError(
                400,
                f"n = {req.n} is not supported: this server returns one choice per request; send n separate requests",
                code="unsupported_parameter",
                param="n",
            )
        for name_, value, neutral in (
            ("frequency_penalty", req.frequency_penalty, 0),
            ("presence_penalty", req.presence_penalty, 0),
            ("repetition_penalty", req.repetition_penalty, 1),
            ("logit_bias", req.logit_bias or None, None),
        ):
            if value is not None and value != neutral:
                raise ApiError(
                    400,
                    f"{name_} = {json.dumps(value)[:80]} is not supported by this server: it would change the "
                    f"distribution at every position; leave the field out"
                    + (f" (or send {neutral})" if neutral is not None else ""),
                    code="unsupported_parameter",
                    param=name_,
                )
        if req.logprobs not in (None, False, 0):
            raise ApiError(
                400,
                "logprobs are not supported by this server; leave the field out",
                code="unsupported_parameter",
                param="logprobs",
            )
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
        try:
            SamplingParams(temperature, top_k, top_p)
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
        run = dict(
            k=k,
            policy=self.policies.get(name) if k == "auto" else None,
            max_new_tokens=self.max_tokens if max_tokens is None else max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=req.seed,
            stop=stop,
        )
        return _Job(ids, drafter, name, run, req.stream, asyncio.get_running_loop(), arrived)

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

    def usage(self, stats: RunStats, drafter_name: str) -> dict:
        """OpenAI's token counts plus the run's speculative statistics (see specdec.stats)."""
        return {
            "prompt_tokens": stats.prompt_tokens,
            "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens,
            "speculative": {
                "drafter": drafter_name,
                "k": stats.k,
                "mean_k": _finite(stats.drafted / stats.rounds if stats.rounds else math.nan),
                "rounds": stats.rounds,
                "drafted": stats.drafted,
                "accepted": stats.accepted,
                "acceptance_rate": _finite(stats.alpha),
                "mean_accepted_length": _finite(stats.tau),
                "acceptance_per_position": stats.acceptance_per_position,
                "tokens_per_s": _finite(stats.tokens_per_s),
                "prefill_s": stats.prefill_s,
                "draft_s": stats.draft_s,
                "verify_s": stats.verify_s,
                "total_s": stats.total_s,
            },
        }


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


# ---- the app ----------------------------------------------------------------------------------


def _registry_drafters(draft: Model | None, max_ngram: int, min_ngram: int, cache=None) -> dict[str, Drafter]:
    """One instance of every registered drafter whose required options the server has (all but the
    model drafter, which comes only with `draft`), each built with the server's settings it takes
    (prompt lookup's n-gram sizes; the draft model) and its defaults otherwise.
    Requests run one at a time, so they can share these instances (prepare() resets each run)."""
    settings = dict(draft=draft, max_ngram=max_ngram, min_ngram=min_ngram, cache=cache)
    out: dict[str, Drafter] = {}
    for name in DRAFTERS:
        options = options_for(name, settings)
        if all(option in options for option in REQUIRED.get(name, ())):
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
    max_ngram: int = 3,
    min_ngram: int = 1,
    cache=None,
    api_key: str | None = None,
    max_body_bytes: int = 4 * 2**20,
) -> FastAPI:
    """The FastAPI app serving `target`; run it with uvicorn (see run_server).

    drafter: the default drafter of a request that names none: a name in specdec.DRAFTERS
    ("prompt-lookup" uses max_ngram and min_ngram; "model" needs `draft`, a model sharing the
    target's tokenizer), a key of `drafters`, or None / "none" for plain decoding. k: the default
    draft length. drafters: extra named drafter objects requests may choose (they override
    built-in names). model_name: the id clients send as "model" (default: target.name).
    max_queue: requests that may wait while one runs; past it the server answers 429.
    max_tokens: the default of a request's max_tokens (a request asking for more than the context
    holds gets a 400). api_key: when given, every /v1/ request must send `Authorization: Bearer
    <api_key>` (else 401), as vLLM's and llama.cpp's servers do. max_body_bytes: larger request
    bodies get a 413. cache: the specdec cache folder (layer-skip
    calibrations, draft heads, the verify-cost curve; default: the usual one). The app starts its worker thread on
    startup (its lifespan) and cancels what is left on shutdown.

    Raises ValueError on a bad default (unknown drafter, negative k, max_queue < 1, ...), and
    TokenizerMismatchError when `draft` does not share the target's tokenizer.
    """
    if draft is not None:
        check_same_tokenizer(target, draft)  # at start, rather than as every request's error
    available = _registry_drafters(draft, max_ngram, min_ngram, cache)
    available.update(drafters or {})
    drafter = drafter or "none"
    if drafter != "none" and drafter not in available:
        hint = " (pass draft=MODEL, or --draft MODEL on the command line)" if drafter == "model" else ""
        raise ValueError(f"unknown drafter {drafter!r}; available: {', '.join([*available, 'none'])}{hint}")
    if isinstance(k, bool) or (isinstance(k, int) and k < 0) or not isinstance(k, (int, str)):
        raise ValueError(
            f"k (draft length) must be an integer >= 0 (or a mode the engine takes, such as 'auto'), got {k!r}"
        )
    if max_queue < 1:
        raise ValueError(f"max_queue must be >= 1, got {max_queue}")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    if api_key is not None and not api_key.strip():
        raise ValueError("api_key must not be empty (leave it out to serve without one)")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    server = Server(target, available, drafter, k, model_name or target.name, max_queue, max_tokens, cache)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.stop)

    app = FastAPI(
        title="specdec",
        summary="Exact speculative decoding behind an OpenAI-compatible API",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.server = server

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1/"):
            sent = request.headers.get("authorization", "")
            if not hmac.compare_digest(sent.encode(), f"Bearer {api_key}".encode()):
                return ApiError(
                    401,
                    "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the key this "
                    "server was started with (--api-key)",
                    code="invalid_api_key",
                ).response()
        return await call_next(request)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            message = (
                f"no route {request.method} {request.url.path}; this server has POST /v1/completions, "
                "POST /v1/chat/completions, GET /v1/models, GET /health, GET /metrics"
            )
        else:
            message = f"{request.method} {request.url.path}: {exc.detail}"
        return ApiError(exc.status_code, message, code=str(exc.status_code)).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()

    @app.get("/health")
    async def health():
        if not server.alive:
            return JSONResponse({"status": "error", "message": "the generation worker is not running"}, status_code=503)
        return {
            "status": "ok",
            "model": server.model_name,
            "queue_depth": server.queue.qsize(),
            "running": server.running,
        }

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": server.model_name,
                    "object": "model",
                    "created": server.created,
                    "owned_by": "specdec",
                    "max_model_len": server.target.n_ctx,
                    "drafters": [*server.drafters, "none"],
                    "default_drafter": server.drafter,
                    "default_k": server.k,
                }
            ],
        }

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _handle(request, chat=True)

    async def _handle(request: Request, chat: bool) -> Response:
        arrived = time.perf_counter()
        try:
            if chat:
                req = await _parse(request, ChatRequest, max_body_bytes)
                ids = server.encode_chat(req)
                max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            else:
                req = await _parse(request, CompletionRequest, max_body_bytes)
                ids = server.encode_completion(req)
                max_new = req.max_tokens
            job = server.job(req, ids, arrived, max_new)
            server.submit(job)
        except ApiError as e:
            server.metrics.count("rejected" if e.status == 429 else "invalid")
            return e.response()
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream:
            return _EventStream(_events(job, chat, ident, include_usage), on_close=job.cancelled.set)
        return await _complete(request, job, chat, ident)

    def _chunk(chat: bool, ident: str, text: str | None, finish: str | None = None, role: bool = False) -> dict:
        if chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {
            "id": ident,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": server.model_name,
            "choices": [choice],
        }

    async def _events(job: _Job, chat: bool, ident: str, include_usage: bool) -> AsyncIterator[str]:
        sent = 0
        if chat:
            yield _sse(_chunk(chat, ident, None, role=True))
        while True:
            kind, value = await job.events.get()
            if kind == "delta":
                sent += len(value)
                yield _sse(_chunk(chat, ident, value))
            elif kind == "error":
                yield _sse(value.body())
                return
            else:
                gen: Generation = value
                if gen.text[sent:]:
                    yield _sse(_chunk(chat, ident, gen.text[sent:]))
                yield _sse(_chunk(chat, ident, None, FINISH_REASONS[gen.stats.stop_reason]))
                if include_usage:
                    last = _chunk(chat, ident, None)
                    last.update(choices=[], usage=server.usage(gen.stats, job.drafter_name))
                    yield _sse(last)
                yield _sse("[DONE]")
                return

    async def _complete(request: Request, job: _Job, chat: bool, ident: str) -> Response:
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
        gen: Generation = value
        finish = FINISH_REASONS[gen.stats.stop_reason]
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": gen.text},
                "logprobs": None,
                "finish_reason": finish,
            }
        else:
            choice = {"index": 0, "text": gen.text, "logprobs": None, "finish_reason": finish}
        return JSONResponse(
            {
                "id": ident,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": server.model_name,
                "choices": [choice],
                "usage": server.usage(gen.stats, job.drafter_name),
            }
        )

    return app


def run_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve `app` with uvicorn until interrupted (Ctrl-C). Blocks."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level)
