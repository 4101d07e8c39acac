"""The server's counters, in the Prometheus text exposition format (version 0.0.4).

Hand-formatted: a handful of counters, gauges and histograms need no client library. Every
update takes one lock, since the generation worker thread and the HTTP event loop both write.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

from specdec.stats import RunStats

OUTCOMES = ("completed", "cancelled", "rejected", "invalid", "failed")
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)  # seconds
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # sequences
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # rows per forward
DRAFT_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16)  # drafted tokens


class Metrics:
    """Server-wide totals over completed generations, plus request outcomes and the queue.

    gauges: called at render time, returns {name: (help, value)} for the live values (queue
    depth, running requests) that the server owns.
    """

    def __init__(self, gauges: Callable[[], dict[str, tuple[str, float]]] = dict):
        self._lock = threading.Lock()
        self._gauges = gauges
        self.requests = dict.fromkeys(OUTCOMES, 0)
        self.rounds = self.drafts = self.drafted = self.accepted = 0
        self.prompt_tokens = self.generated_tokens = 0
        self.drafted_at: list[int] = []
        self.accepted_at: list[int] = []
        self.latency_buckets = [0] * len(LATENCY_BUCKETS)
        self.latency_sum = 0.0
        self.latency_count = 0
        # per step of the batch: sequences decoding, rows per forward, each sequence's draft length
        self.steps = 0
        self.batch_size = _Histogram(BATCH_BUCKETS)
        self.rows = _Histogram(ROW_BUCKETS)
        self.draft_length = _Histogram(DRAFT_BUCKETS)
        self.forward_s = 0.0

    def count(self, outcome: str) -> None:
        """Count one request that ended with `outcome` (one of OUTCOMES)."""
        with self._lock:
            self.requests[outcome] += 1

    def record(self, stats: RunStats, latency_s: float) -> None:
        """Add one completed generation: its speculative stats and its latency in seconds (from
        the request's arrival, queueing included, to its last token)."""
        with self._lock:
            self.requests["completed"] += 1
            self.rounds += stats.rounds
            self.drafts += stats.drafted_at[0] if stats.drafted_at else 0
            self.drafted += stats.drafted
            self.accepted += stats.accepted
            self.prompt_tokens += stats.prompt_tokens
            self.generated_tokens += stats.new_tokens
            for i, (d, a) in enumerate(zip(stats.drafted_at, stats.accepted_at)):
                if i == len(self.drafted_at):
                    self.drafted_at.append(0)
                    self.accepted_at.append(0)
                self.drafted_at[i] += d
                self.accepted_at[i] += a
            for i, bound in enumerate(LATENCY_BUCKETS):
                self.latency_buckets[i] += latency_s <= bound
            self.latency_sum += latency_s
            self.latency_count += 1

    def step(self, step) -> None:
        """Add one step of the batch (a specdec.batch.Step)."""
        with self._lock:
            self.steps += 1
            self.forward_s += step.forward_s
            if step.decoding:
                self.batch_size.add(step.decoding)
            self.rows.add(step.rows)
            for k in step.drafted:
                self.draft_length.add(k)

    def render(self) -> str:
        """All metrics as Prometheus text."""
        with self._lock:
            out: list[str] = []

            def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
                out.append(f"# HELP {name} {help_}")
                out.append(f"# TYPE {name} {kind}")
                out.extend(f"{name}{suffix} {_num(v)}" for suffix, v in samples)  # suffix: labels, or _sum etc.

            metric(
                "specdec_requests_total",
                "counter",
                "Generation requests by outcome: completed; cancelled (the client went away); rejected "
                "(429, queue full); invalid (4xx); failed (5xx).",
                [(f'{{outcome="{o}"}}', n) for o, n in self.requests.items()],
            )
            for name, help_, value in [
                ("specdec_rounds_total", "Draft-verify rounds (each commits at least one token).", self.rounds),
                ("specdec_drafts_total", "Rounds in which the drafter proposed at least one token.", self.drafts),
                ("specdec_draft_tokens_total", "Tokens the drafter proposed.", self.drafted),
                ("specdec_accepted_tokens_total", "Drafted tokens the target accepted.", self.accepted),
                ("specdec_prompt_tokens_total", "Prompt tokens of completed requests.", self.prompt_tokens),
                ("specdec_generation_tokens_total", "Tokens generated by completed requests.", self.generated_tokens),
            ]:
                metric(name, "counter", help_, [("", value)])
            metric(
                "specdec_draft_tokens_by_position_total",
                "counter",
                "Drafted tokens by draft position (0 = the first token of a draft).",
                [(f'{{position="{i}"}}', n) for i, n in enumerate(self.drafted_at)],
            )
            metric(
                "specdec_accepted_tokens_by_position_total",
                "counter",
                "Accepted tokens by draft position (0 = the first token of a draft).",
                [(f'{{position="{i}"}}', n) for i, n in enumerate(self.accepted_at)],
            )
            metric(
                "specdec_acceptance_rate",
                "gauge",
                "Accepted / drafted tokens since start (NaN before any draft).",
                [("", self.accepted / self.drafted if self.drafted else math.nan)],
            )
            metric(
                "specdec_acceptance_rate_by_position",
                "gauge",
                "Accepted / drafted tokens at each draft position since start.",
                [(f'{{position="{i}"}}', a / d) for i, (a, d) in enumerate(zip(self.accepted_at, self.drafted_at))],
            )
            buckets = [(f'{{le="{_num(b)}"}}', n) for b, n in zip(LATENCY_BUCKETS, self.latency_buckets)]
            metric(
                "specdec_request_latency_seconds",
                "histogram",
                "Completed requests' latency, arrival (queueing included) to the last token, in seconds.",
                [("_bucket" + lbl, n) for lbl, n in buckets]
                + [
                    ('_bucket{le="+Inf"}', self.latency_count),
                    ("_sum", self.latency_sum),
                    ("_count", self.latency_count),
                ],
            )
            metric("specdec_steps_total", "counter", "Batch steps (one target forward each).", [("", self.steps)])
            metric(
                "specdec_forward_seconds_total", "counter", "Seconds in the steps' target forwards.",
                [("", self.forward_s)],
            )  # fmt: skip
            for name, help_, hist in [
                ("specdec_batch_size", "Sequences decoding per step (prefilling ones not counted).", self.batch_size),
                ("specdec_forward_rows", "New tokens (rows) per target forward, prompt chunks included.", self.rows),
                (
                    "specdec_draft_length",
                    "Draft length chosen per sequence per step (0: a plain round).",
                    self.draft_length,
                ),
            ]:
                metric(name, "histogram", help_, hist.samples())
            for name, (help_, value) in self._gauges().items():
                metric(name, "gauge", help_, [("", value)])
        return "\n".join(out) + "\n"


class _Histogram:
    """A Prometheus histogram's cumulative buckets, sum and count."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds, self.counts, self.sum, self.count = bounds, [0] * len(bounds), 0.0, 0

    def add(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            self.counts[i] += value <= bound
        self.sum += value
        self.count += 1

    def samples(self) -> list[tuple[str, float]]:
        buckets = [(f'_bucket{{le="{_num(b)}"}}', n) for b, n in zip(self.bounds, self.counts)]
        return buckets + [('_bucket{le="+Inf"}', self.count), ("_sum", self.sum), ("_count", self.count)]


def _num(v: float) -> str:
    """A sample value as Prometheus writes it: integers without a decimal point, NaN, +Inf."""
    if isinstance(v, float) and math.isnan(v):
        return "NaN"
    if v == math.inf:
        return "+Inf"
    if float(v).is_integer():
        return str(int(v))
    return repr(float(v))
