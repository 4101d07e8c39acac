"""The routes of specdec's HTTP server, each reading the Server from request.app.state:
POST /v1/completions and /v1/chat/completions, GET /v1/models, /health and /metrics."""

from __future__ import annotations

import asyncio
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from specdec.serve.errors import ApiError
from specdec.serve.requests import ChatRequest, CompletionRequest
from specdec.serve.responses import EventStream, complete, events
from specdec.serve.server import Server

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
        "default_drafter": server.config.drafter,
        "default_k": server.config.k,
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


async def _generate(request: Request, req: CompletionRequest | ChatRequest, chat: bool) -> Response:
    """Queue a validated request's job and answer it (streamed or whole); a 4xx (429: the queue is
    full) counted in the metrics."""
    server = _server(request)
    try:
        job = server.job(req, request.state.arrived)
        if req.grammar is not None:  # compiled here, in a thread off the event loop, before the batch
            await asyncio.to_thread(server.check_grammar, req.grammar, req.grammar_field)
        server.submit(job)
    except ApiError as e:
        server.metrics.count("rejected" if e.status == 429 else "invalid")
        return e.response()
    ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return EventStream(events(server, job, chat, ident, include_usage), on_close=job.cancelled.set)
    return await complete(request, server, job, chat, ident)
