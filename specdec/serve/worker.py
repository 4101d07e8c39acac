"""The server's generation worker: one thread that runs every admitted request in one continuous
batch (specdec.batch), a step at a time, off the HTTP event loop.

Requests wait in a bounded queue; between steps the worker admits them while the batch has room
(max_batch sequences; a request with n choices is n sequences), and drops the sequences of a
request whose client went away. Each sequence's tokens are those of its run alone (specdec.batch).
Events go back to the request's handler on the event loop: ("delta", (index, text, logprobs)) per
round when streaming, then ("done", [Generation per choice]) or ("error", ApiError).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specdec.adaptive import AdaptiveK, VerifyCosts
from specdec.batch import Batch, Step
from specdec.decoding import Decoding, Generation
from specdec.drafters.base import Drafter
from specdec.models.load import Model
from specdec.options import AUTO_K_MAX, GenerationOptions
from specdec.serve.config import ServeConfig
from specdec.serve.errors import ApiError
from specdec.serve.metrics import Metrics
from specdec.stats import RunStats
from specdec.textstream import TextDeltas

log = logging.getLogger("specdec.serve.worker")


@dataclass
class Job:
    """One request on its way through the queue and the batch: n choices of the prompt `ids`.
    options: its GenerationOptions; choice i's seed is seed + i. `cancelled` is set when the client goes away."""

    ids: list[int]
    drafter: Drafter | None  # the server's instance, forked per choice
    drafter_name: str
    options: GenerationOptions
    n: int
    stream: bool
    loop: asyncio.AbstractEventLoop
    arrived: float  # time.perf_counter() at arrival
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def push(self, kind: str, value: Any = None) -> None:
        """From the worker thread: hand an event to the request's handler."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancelled.set()


@dataclass
class _Live:
    """A job in the batch: its sequences, their text streams, and the choices finished so far."""

    job: Job
    seqs: list[Decoding]
    deltas: list[TextDeltas | None]
    done: dict[int, Generation] = field(default_factory=dict)


class Worker:
    """The queue, the batch and the thread that steps it. costs: the target's verify-cost curve,
    shared by every k="auto" sequence's policy. config: the server's settings, of which the worker
    reads max_batch (sequences decoded at once), max_queue (requests that may wait beyond them;
    past it, submit raises a 429), prefill_chunk and prefill_ratio. on_step: called with each
    Step (the metrics); on_done: with each completed generation's RunStats (after the metrics')."""

    def __init__(
        self,
        target: Model,
        costs: VerifyCosts,
        metrics: Metrics,
        config: ServeConfig,
        on_step: Callable[[Step], None] | None = None,
        on_done: Callable[[RunStats], None] | None = None,
    ):
        self.target, self.costs, self.metrics = target, costs, metrics
        self.max_batch, self.max_queue = config.max_batch, config.max_queue
        self.prefill_chunk, self.prefill_ratio = config.prefill_chunk, config.prefill_ratio
        self.on_step, self.on_done = on_step, on_done
        self.queue: queue.Queue[Job] = queue.Queue(maxsize=config.max_queue)
        self.live: dict[int, _Live] = {}  # id(job) -> its state, for the jobs in the batch
        self.owner: dict[int, tuple[_Live, int]] = {}  # id(sequence) -> (its job, its choice index)
        self.finished: list[_Live] = []  # jobs a step finished, answered once the step is counted
        self.batch = self._new_batch()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._inline = False  # run() steps in a caller's thread

    @property
    def running(self) -> int:
        """Requests in the batch now."""
        return len(self.live)

    @property
    def sequences(self) -> int:
        """Sequences in the batch now."""
        return len(self.batch)

    # -- lifecycle --
    def start(self) -> None:
        """Step in a thread of its own (the app's lifespan starts it)."""
        self._stop.clear()
        self._thread = threading.Thread(target=self.run, name="specdec-worker", daemon=True)
        self._thread.start()

    def run(self, until: Callable[[], bool] = lambda: False) -> None:
        """Step in the calling thread until stop() or until() is true. specdec.serve.app.run_server
        steps in the main thread, the one that loaded the model: the OpenMP threads of a forward
        then stay one team (a second thread's team beside the loading thread's idle one makes GNU
        OpenMP stop spinning at its barriers, and a forward about 2.5x slower on 2 cores)."""
        self._inline = threading.current_thread() is not self._thread
        try:
            self._work(until)
        finally:
            self._inline = False

    def stop(self, timeout: float = 10.0) -> None:
        """Stop stepping (up to timeout seconds), and answer every request still waiting or running
        with a 503."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        gone = ApiError(
            503, "the server is shutting down; retry on another instance", type="server_error", code="shutting_down"
        )
        for live in list(self.live.values()):
            self.metrics.count("cancelled")
            live.job.push("error", gone)
        self.live.clear()
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            self.metrics.count("cancelled")
            job.push("error", gone)

    @property
    def alive(self) -> bool:
        return self._inline or (self._thread is not None and self._thread.is_alive())

    def submit(self, job: Job) -> None:
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

    # -- the thread --
    def _work(self, until: Callable[[], bool] = lambda: False) -> None:
        while not self._stop.is_set() and not until():
            step = None
            try:
                self._admit()
                self._drop_cancelled()
                if len(self.batch):
                    step = self.batch.step()
            except Exception as e:  # never let the worker die, nor a client wait forever (Ctrl-C still stops it)
                log.exception("a batch step failed")
                self._fail_all(ApiError(500, f"generation failed: {type(e).__name__}: {e}", type="server_error"))
            if step is not None and self.on_step is not None:
                self.on_step(step)
            self._answer_finished()

    def _admit(self) -> None:
        """Take queued jobs while the batch has room (waiting a moment when it is empty)."""
        while len(self.batch) < self.max_batch:
            try:
                job = self.queue.get(timeout=0.1) if not len(self.batch) else self.queue.get_nowait()
            except queue.Empty:
                return
            if job.cancelled.is_set():
                self.metrics.count("cancelled")
                continue
            try:
                seqs = [self._sequence(job, i) for i in range(job.n)]
            except (ValueError, TypeError) as e:  # a parameter the engine refuses
                self.metrics.count("invalid")
                job.push("error", ApiError(400, str(e), code="invalid_parameter"))
                continue
            deltas = [TextDeltas(self.target.tokenizer, job.options.stop) if job.stream else None for _ in seqs]
            live = _Live(job, seqs, deltas)
            self.live[id(job)] = live
            for i, seq in enumerate(seqs):
                self.owner[id(seq)] = (live, i)
                self.batch.add(seq, self._on_commit, self._on_finish)

    def _sequence(self, job: Job, index: int) -> Decoding:
        options = job.options
        if options.seed is not None:
            options = options.replace(seed=(options.seed + index) % 2**64)
        drafter = job.drafter.fork() if job.drafter is not None else None
        auto = options.k == "auto" and drafter is not None
        policy = AdaptiveK(self.costs.fork(), k_max=AUTO_K_MAX) if auto else None  # its context's curve
        return Decoding(self.target, job.ids, drafter, options, policy)

    def _drop_cancelled(self) -> None:
        for live in [v for v in self.live.values() if v.job.cancelled.is_set()]:
            self._forget(live)
            self.metrics.count("cancelled")

    def _forget(self, live: _Live) -> None:
        for seq in live.seqs:
            self.batch.remove(seq)
            self.owner.pop(id(seq), None)
        self.live.pop(id(live.job), None)

    def _on_commit(self, seq: Decoding, tokens: list[int]) -> None:
        live, i = self.owner[id(seq)]
        deltas = live.deltas[i]
        if deltas is None:
            return
        piece = deltas(tokens)
        logprobs = seq.logprobs[len(seq.logprobs) - len(tokens) :] if seq.logprobs is not None else None
        if piece or logprobs:
            live.job.push("delta", (i, piece, logprobs))

    def _on_finish(self, seq: Decoding, generation: Generation) -> None:
        live, i = self.owner.pop(id(seq))
        live.done[i] = generation
        if len(live.done) == len(live.seqs):
            self.live.pop(id(live.job), None)
            latency = time.perf_counter() - live.job.arrived
            for g in live.done.values():
                self.metrics.record(g.stats, latency)
                if self.on_done is not None:
                    self.on_done(g.stats)
            self.finished.append(live)

    def _answer_finished(self) -> None:
        """Answer the jobs the last step finished, after the step's metrics (on_step), so that a
        client that scrapes /metrics after its answer sees every step that made it."""
        for live in self.finished:
            live.job.push("done", [live.done[j] for j in range(len(live.seqs))])
        self.finished.clear()

    def _fail_all(self, error: ApiError) -> None:
        """After a failed step: answer every job in the batch and start a new batch."""
        for live in list(self.live.values()):
            self.metrics.count("failed")
            live.job.push("error", error)
        self.live.clear()
        self.owner.clear()
        self.batch = self._new_batch()

    def _new_batch(self) -> Batch:
        return Batch(self.target, self.prefill_chunk, prefill_ratio=self.prefill_ratio)
