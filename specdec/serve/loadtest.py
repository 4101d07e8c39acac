"""`specdec loadtest`: drive an OpenAI-compatible server (specdec's, vLLM's, llama.cpp's) with
concurrent streaming requests through the `openai` client, and report what its users see:
aggregate tokens/s, time to first token (TTFT), time per output token after the first (TPOT) and
the gaps between streamed chunks (ITL), as percentiles over requests, named as vLLM's
benchmark_serving names them.

Every level of concurrency sends the same requests; greedy outputs are compared with those of the
lowest level (one at a time, when it is 1): a server whose output depends on what else is in its
batch shows it here.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class Request:
    """One request: a prompt as token ids (sent to /v1/completions) or as chat messages (sent to
    /v1/chat/completions)."""

    ids: list[int] | None = None
    messages: list[dict] | None = None


@dataclass
class Answer:
    """What one streamed request got: text, completion tokens (the server's usage, else chunks),
    seconds to the first text, between streamed chunks, and in all; error: why it failed."""

    text: str = ""
    tokens: int = 0
    ttft_s: float = math.nan
    gaps_s: list[float] = field(default_factory=list)
    latency_s: float = math.nan
    error: str | None = None

    @property
    def tpot_s(self) -> float:
        """Seconds per output token after the first."""
        return (self.latency_s - self.ttft_s) / (self.tokens - 1) if self.tokens > 1 else math.nan


@dataclass
class Level:
    """One concurrency level's run: `answers` in request order, over wall_s seconds."""

    concurrency: int
    wall_s: float
    answers: list[Answer]

    def summary(self) -> dict:
        ok = [a for a in self.answers if a.error is None]
        tokens = sum(a.tokens for a in ok)
        gaps = [g for a in ok for g in a.gaps_s]
        return {
            "concurrency": self.concurrency,
            "requests": len(self.answers),
            "failed": len(self.answers) - len(ok),
            "tokens": tokens,
            "wall_s": self.wall_s,
            "tokens_per_s": tokens / self.wall_s if self.wall_s else math.nan,
            "ttft_ms": _percentiles([a.ttft_s * 1e3 for a in ok]),
            "tpot_ms": _percentiles([a.tpot_s * 1e3 for a in ok if not math.isnan(a.tpot_s)]),
            "itl_ms": _percentiles([g * 1e3 for g in gaps]),
        }


def _percentiles(values: list[float]) -> dict:
    """p50, p90 and p99 (nearest rank: the smallest value with at least that share of the values
    at or below it, so always one of them) and the mean; NaN for none."""
    if not values:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan, "mean": math.nan}
    p50, p90, p99 = np.percentile(values, [50, 90, 99], method="inverted_cdf")
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(np.mean(values))}


async def _one(client, model: str, request: Request, params: dict, extra: dict) -> Answer:
    answer = Answer()
    start = time.perf_counter()
    last = None
    try:
        if request.ids is not None:
            stream = await client.completions.create(
                model=model, prompt=request.ids, stream=True, stream_options={"include_usage": True},
                extra_body=extra or None, **params,
            )  # fmt: skip
        else:
            stream = await client.chat.completions.create(
                model=model, messages=request.messages, stream=True, stream_options={"include_usage": True},
                extra_body=extra or None, **params,
            )  # fmt: skip
        chunks = 0
        async for chunk in stream:
            if chunk.usage is not None:
                answer.tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                text = choice.text if request.ids is not None else (choice.delta.content or "")
                if not text:
                    continue
                now = time.perf_counter()
                if last is None:
                    answer.ttft_s = now - start
                else:
                    answer.gaps_s.append(now - last)
                last = now
                answer.text += text
                chunks += 1
        answer.tokens = answer.tokens or chunks
    except Exception as e:  # a failed request is counted, not fatal
        answer.error = f"{type(e).__name__}: {e}"
    answer.latency_s = time.perf_counter() - start
    return answer


async def run_level(
    url: str,
    model: str,
    requests: list[Request],
    concurrency: int,
    params: dict,
    extra: dict | None = None,
    api_key: str = "none",
) -> Level:
    """Send every request, at most `concurrency` in flight at once, streaming. params: the
    OpenAI sampling fields (max_tokens, temperature, ...); extra: fields beyond OpenAI's (a
    specdec server's drafter and k). Raises ValueError for concurrency < 1."""
    from openai import AsyncOpenAI

    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    gate = asyncio.Semaphore(concurrency)

    async def bounded(client, r: Request) -> Answer:
        async with gate:
            return await _one(client, model, r, params, extra or {})

    async with AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key, max_retries=0, timeout=600) as client:
        start = time.perf_counter()
        answers = await asyncio.gather(*(bounded(client, r) for r in requests))
        wall = time.perf_counter() - start
    return Level(concurrency, wall, list(answers))


def agreement(levels: list[Level]) -> list[int]:
    """For each level, how many answers equal the first level's answer to the same request."""
    base = levels[0].answers
    return [sum(a.error is None and a.text == b.text for a, b in zip(level.answers, base)) for level in levels]


def report(name: str, levels: list[Level]) -> list[dict]:
    """Each level's summary with `server` and `same_as_first` (answers equal to the first level's)."""
    out = []
    for level, same in zip(levels, agreement(levels)):
        out.append({"server": name, **level.summary(), "same_as_first": same})
    return out


def table(rows: list[dict]) -> str:
    """A markdown table of report() rows, with each level's aggregate over the same server's first."""
    first: dict[str, float] = {}
    lines = [
        "| server | concurrent | requests | tokens/s (aggregate) | x first | TTFT p50 / p99 ms | "
        "TPOT p50 / p99 ms | ITL p50 / p99 ms | same as first | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        base = first.setdefault(r["server"], r["tokens_per_s"])
        lines.append(
            f"| {r['server']} | {r['concurrency']} | {r['requests']} | {r['tokens_per_s']:.1f} | "
            f"{r['tokens_per_s'] / base:.2f} | {r['ttft_ms']['p50']:.0f} / {r['ttft_ms']['p99']:.0f} | "
            f"{r['tpot_ms']['p50']:.1f} / {r['tpot_ms']['p99']:.1f} | {r['itl_ms']['p50']:.1f} / "
            f"{r['itl_ms']['p99']:.1f} | {r['same_as_first']}/{r['requests']} | {r['failed']} |"
        )
    return "\n".join(lines)


def levels_as_dicts(levels: list[Level]) -> list[dict]:
    """Every answer of every level, for a results file."""
    return [
        {"concurrency": lv.concurrency, "wall_s": lv.wall_s, "answers": [asdict(a) for a in lv.answers]}
        for lv in levels
    ]
