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

This module assembles the app (create_app: middleware, error handlers, lifespan) and runs it
(run_server). The rest: serve.config (ServeConfig, the settings), serve.requests (the request
models: every check that needs only the request), serve.server (Server: the state, and a request
turned into a Job), serve.routes (the endpoints), serve.responses (JSON bodies and server-sent
events), serve.worker (the queue, the batch, its thread), serve.metrics, serve.errors.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from collections.abc import Mapping
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec.drafters import Drafter
from specdec.drafters.factory import REGISTERED, drafter_from_options, options_for
from specdec.models.load import Model, check_same_tokenizer
from specdec.serve.config import ServeConfig
from specdec.serve.errors import ApiError
from specdec.serve.requests import BODIES, SEND_JSON, Params, invalid
from specdec.serve.routes import router
from specdec.serve.server import Server

log = logging.getLogger("specdec.serve.app")


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
    server: Server = request.app.state.server
    api_key, max_body_bytes = server.config.api_key, server.config.max_body_bytes
    if api_key is not None and request.url.path.startswith("/v1/"):
        sent = request.headers.get("authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {api_key}".encode()):
            return ApiError(
                401,
                "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the key this "
                "server was started with (--api-key)",
                code="invalid_api_key",
            ).response()
    if request.url.path in BODIES and await _too_large(request, max_body_bytes):
        server.metrics.count("invalid")
        return ApiError(
            413,
            f"the request body is over this server's limit of {max_body_bytes} bytes; send a shorter prompt",
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
    request.app.state.server.metrics.count("invalid")
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
        request.app.state.server.metrics.count("invalid")
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
    config: ServeConfig | None = None,
    *,
    draft: Model | None = None,
    drafters: Mapping[str, Drafter] | None = None,
) -> FastAPI:
    """The FastAPI app serving `target`; run it with uvicorn (see run_server).

    config: the server's settings (specdec.serve.config.ServeConfig; None: its defaults), among
    them the default drafter: a name in specdec.DRAFTERS ("prompt-lookup" uses config.max_ngram
    and min_ngram; "model" needs `draft`), a key of `drafters`, or "none" for plain decoding.
    draft: a draft model sharing the target's tokenizer (the model drafters). drafters: extra
    named drafter objects requests may choose (they override built-in names).

    The app starts its worker thread on startup (its lifespan) and cancels what is left on
    shutdown.

    Raises ValueError for a default drafter the server does not have, and TokenizerMismatchError
    when `draft` does not share the target's tokenizer.
    """
    config = ServeConfig() if config is None else config
    if draft is not None:
        check_same_tokenizer(target, draft)  # at start, rather than as every request's error
    available = _registry_drafters(draft, config.max_ngram, config.min_ngram, config.cache, config.head_quantize)
    available.update(drafters or {})
    app = FastAPI(
        title="specdec",
        summary="Exact speculative decoding behind an OpenAI-compatible API",
        lifespan=_lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.server = Server(target, available, config)
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
