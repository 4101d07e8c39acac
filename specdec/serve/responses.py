"""The answers of specdec's HTTP server in OpenAI's formats: the usage (with each choice's
speculative statistics), logprobs, a whole JSON body once a job is done (`complete`), and the
server-sent events of a streamed one (`events`, sent as an `EventStream`)."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specdec.decoding import Generation
from specdec.sampling import TokenLogprob
from specdec.serve.worker import Job
from specdec.stats import RunStats

if TYPE_CHECKING:
    from specdec.serve.server import Server

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


def usage(generations: list[Generation], drafter_name: str) -> dict:
    """OpenAI's token counts (the prompt once, every choice's tokens) plus the speculative
    statistics of each choice's run (see specdec.stats): a dict, or a list of them for n > 1."""
    spec = [_speculative(g.stats, drafter_name) for g in generations]
    prompt, completion = generations[0].stats.prompt_tokens, sum(g.stats.new_tokens for g in generations)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "speculative": spec[0] if len(spec) == 1 else spec,
    }


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


def format_logprobs(
    tokenizer, entries: list[TokenLogprob] | None, chat: bool, before: list[int] = (), offset: int = 0
) -> dict | None:
    """Logprobs in OpenAI's format: chat's {"content": [{token, logprob, bytes, top_logprobs}]},
    completions' {tokens, token_logprobs, top_logprobs, text_offset}. A token's text is what it
    adds after the tokens before it (`before`: the choice's earlier tokens; offset: the
    characters of its text before these)."""
    if entries is None:
        return None
    decode = tokenizer.decode
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


def _finite(x: float) -> float | None:
    return None if math.isnan(x) or math.isinf(x) else x


# ---- sent to the client ----------------------------------------------------------------------


class EventStream(StreamingResponse):
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


async def events(server: Server, job: Job, chat: bool, ident: str, include_usage: bool) -> AsyncIterator[str]:
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
            logprobs = format_logprobs(server.target.tokenizer, entries, chat, earlier[i], offsets[i])
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
                last.update(choices=[], usage=usage(generations, job.drafter_name))
                yield _sse(last)
            yield _sse("[DONE]")
            return


async def complete(request: Request, server: Server, job: Job, chat: bool, ident: str) -> Response:
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
        logprobs = format_logprobs(server.target.tokenizer, gen.logprobs, chat)
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
            "usage": usage(generations, job.drafter_name),
        }
    )
