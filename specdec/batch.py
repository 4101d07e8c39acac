"""Continuous batching: many generations at once, every sequence's tokens those of its run alone.

Each step runs ONE target forward (specdec.cache.extend_batch) over the rows of every active
sequence: a decoding sequence's last committed token plus its draft (lengths differ from sequence
to sequence), and a chunk of a joining sequence's prompt (chunked prefill, as in Sarathi-Serve and
vLLM, so that a long prompt does not stall the others). Each sequence keeps its own KV cache, so it
verifies, samples, stops and rolls back alone, with no copies. Decodings join and leave between
steps (continuous batching, Orca, Yu et al. 2022).

Exactness: on the quantized backend, whose kernels are batch-invariant, a sequence's logits have
the bits of its forward alone, and so its tokens and logprobs are those of specdec.engine.generate
with the same arguments, whatever else is in the batch. The fp32 lean and transformers backends
run the sequences' forwards one after another (no speed-up), each prompt in one block: tokens as
generate's, logprobs up to the last bits (their verify forwards are not batch-invariant, see
docs/engine.md).

Speculation under a shared budget: with k="auto" each sequence's policy (specdec.adaptive) plans
its draft as if alone, except that a drafted row costs what it adds to the batch's forward after
the other rows (a line through the batch's own steps and a pass over the weights for each further
tile of rows, specdec.adaptive.rowcosts) and the rate a draft must beat is the batch's committed
tokens per ms (Dinkelbach's rho, as for one sequence).
Drafted tokens then pay only while the batch's forward is still bound by reading the weights, or
where they are likely to be accepted; as rows fill the CPU, draft lengths shrink toward 0
(goodput, as SmartSpec, Liu et al. 2024, chooses them). One sequence alone plans exactly as
generate(k="auto") does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch

from specdec.adaptive import AdaptiveK, Share, VerifyCosts
from specdec.adaptive.rowcosts import RowCosts
from specdec.cache import extend_batch
from specdec.decoding import Decoding, Generation
from specdec.drafters.base import Drafter
from specdec.models.load import Model, synchronize
from specdec.options import GenerationOptions, options_from
from specdec.round import Proposal

PREFILL_CHUNK = 128  # prompt tokens a step's forward may take, over all joining sequences
PREFILL_RATIO = 16  # or this many per decoding sequence where that is more (Batch.prefill_budget)


@dataclass
class Step:
    """What one step ran: `decoders` sequences verified drafts of `drafted` tokens each (0 for a
    plain round), `prefilling` sequences fed prompt chunks; `rows` new tokens in the forward of
    `forward_s` seconds, which committed `committed` tokens."""

    decoders: int
    prefilling: int
    rows: int
    drafted: list[int]
    forward_s: float
    committed: int


@dataclass
class _Slot:
    seq: Decoding
    on_commit: Callable[[Decoding, list[int]], None] | None
    on_finish: Callable[[Decoding, Generation], None] | None
    prompt: list[int]  # prompt tokens still to feed
    joined: float = field(default_factory=time.perf_counter)
    ready: bool = False


class Batch:
    """Decodings of one target decoded together, a step at a time (see the module's docstring).

    prefill_chunk, prefill_ratio: a step feeds the joining sequences' prompts, oldest first, up to
    prefill_budget() tokens (on a backend whose kernels are not batch-invariant a prompt goes in one
    block, as generate feeds it). calibrate: time the verify-cost curve for a k="auto" sequence's
    context when it is not yet timed (as generate does; it stalls that one step). Raises ValueError
    for prefill_chunk < 1 or prefill_ratio < 0.
    """

    def __init__(
        self,
        target: Model,
        prefill_chunk: int = PREFILL_CHUNK,
        calibrate: bool = True,
        prefill_ratio: int = PREFILL_RATIO,
    ):
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if prefill_ratio < 0:
            raise ValueError(f"prefill_ratio must be >= 0, got {prefill_ratio}")
        self.target, self.prefill_chunk, self.calibrate = target, prefill_chunk, calibrate
        self.prefill_ratio = prefill_ratio
        self.slots: list[_Slot] = []
        # chunked prefill only where a prompt's cache rows have the same bits in any chunks
        self.invariant = target.backend == "lean" and target.lean().batch_invariant
        self.tile = target.lean().row_tile if self.invariant else None  # rows per pass
        self.rate = 0.0  # the batch's committed tokens per ms, a running average over steps
        self.costs: RowCosts | None = None  # ms of a forward by rows, fitted to the steps (k = "auto")

    def __len__(self) -> int:
        return len(self.slots)

    def add(
        self,
        seq: Decoding,
        on_commit: Callable[[Decoding, list[int]], None] | None = None,
        on_finish: Callable[[Decoding, Generation], None] | None = None,
    ) -> None:
        """Let a new Decoding join at the next step. on_commit(seq, tokens) is called after each of
        its rounds with the tokens committed; on_finish(seq, generation) once, when it ends."""
        self.slots.append(_Slot(seq, on_commit, on_finish, seq.unfed()))

    def remove(self, seq: Decoding) -> None:
        """Drop a sequence (its client went away): its rows leave from the next step on."""
        self.slots = [s for s in self.slots if s.seq is not seq]

    def prefill_budget(self, decoders: int) -> int:
        """Prompt tokens a step with `decoders` decoding sequences feeds at most: prefill_chunk, or
        prefill_ratio per decoding sequence where that is more. A step's time grows with its rows, so
        the decoders' rows stay a bounded share of it (1 / (1 + prefill_ratio) with many decoders)
        and a burst of prompts goes in at nearly the speed of prefill alone, while a few decoders
        keep short steps (Sarathi-Serve's token budget, Agrawal et al. 2024, here scaled with the
        decoders rather than fixed)."""
        return max(self.prefill_chunk, self.prefill_ratio * decoders)

    def step(self) -> Step:
        """One forward over every active sequence's rows; commits each decoders sequence's round
        and ends the finished ones (on_finish). Returns what it ran. Raises ValueError when the
        batch is empty."""
        if not self.slots:
            raise ValueError("the batch is empty: add() a sequence first")
        for s in list(self.slots):  # a sequence with nothing to feed, or finished from the start
            if not s.prompt and not s.ready:
                self._ready(s)
        decoders = [s for s in self.slots if s.ready]  # the sequences past their prompt: a round each
        prefill, budget = [], self.prefill_budget(len(decoders))  # (slot, its prompt tokens this step)
        for s in self.slots:
            if not s.ready and budget > 0:
                prefill.append((s, min(budget, len(s.prompt)) if self.invariant else len(s.prompt)))
                budget -= prefill[-1][1]
        shared = len(self.slots) > 1
        rows = len(decoders) + sum(n for _, n in prefill)
        proposals: list[Proposal] = []
        for s in decoders:
            costs = s.seq.verify_costs
            if costs is not None and self.costs is None:
                self.costs = RowCosts(costs, self.tile)
            # the rest of the forward, drafts so far included, at the batch's rate
            share = Share(rows - 1, self.rate, self.costs) if shared and costs is not None else None
            proposals.append(s.seq.next_round(share))
            rows += len(proposals[-1].checked.tokens)
        if not decoders and not prefill:  # every sequence ended before its first round
            return Step(0, 0, 0, [], 0.0, 0)
        forward = [s.seq.verify_rows(p) for s, p in zip(decoders, proposals)]
        forward += [s.seq.prefill_rows(s.prompt[:n]) for s, n in prefill]
        for s, n in prefill:
            s.prompt = s.prompt[n:]
        blocks = [r.tokens for r in forward]
        synchronize(self.target.device)
        t0 = time.perf_counter()
        logits = extend_batch(
            [r.cache for r in forward], blocks, [r.all_logits for r in forward], [r.parents for r in forward]
        )
        synchronize(self.target.device)
        forward_s = time.perf_counter() - t0
        committed = 0
        for s, p, scores in zip(decoders, proposals, logits):
            tokens = s.seq.commit(p, scores, forward_s, timed=False)
            committed += len(tokens)
            if s.on_commit is not None:
                s.on_commit(s.seq, tokens)
        rows = sum(len(b) for b in blocks)
        if len(blocks) == 1 and decoders and decoders[0].seq.verify_costs:  # alone: on its curve, as generate times it
            decoders[0].seq.verify_costs.observe(rows, forward_s * 1e3)
        if self.costs is not None and len(blocks) > 1:  # a lone sequence's steps are its own curve's
            self.costs.observe(rows, forward_s * 1e3)
        if decoders:
            self.rate = self._rate(committed, forward_s * 1e3, rows, sum(len(b) for b in blocks[: len(decoders)]))
        for s, _ in prefill:
            if not s.prompt:
                self._ready(s)
        for s in decoders:
            if s.seq.finished:
                self._finish(s)
        drafted = [len(p.checked.tokens) for p in proposals]
        return Step(len(decoders), len(prefill), rows, drafted, forward_s, committed)

    def _rate(self, committed: int, ms: float, rows: int, decoding_rows: int) -> float:
        """The batch's committed tokens per ms, a running average, after a step whose forward of
        `rows` rows took `ms`, decoding_rows of them the decoding sequences' and the rest prompt
        chunks': a chunk's rows commit nothing, so such a step is counted at what its decoding
        rows alone would have cost (or not at all before the costs are known)."""
        if decoding_rows < rows:
            if self.costs is None:
                return self.rate
            ms = self.costs(decoding_rows)
        rate = committed / (ms + 1e-9)
        return rate if not self.rate else 0.8 * self.rate + 0.2 * rate

    def run(self) -> None:
        """Step until every sequence has finished."""
        while self.slots:
            self.step()

    def _ready(self, s: _Slot) -> None:
        """A sequence's prompt is in its cache: calibrate if need be, then decode from the next step."""
        s.seq.ready(self.calibrate)
        s.seq.stats.prefill_s = time.perf_counter() - s.joined
        s.ready = True
        if s.seq.finished:  # max_new_tokens = 0
            self._finish(s)

    def _finish(self, s: _Slot) -> None:
        self.slots.remove(s)
        generation = s.seq.result(time.perf_counter() - s.joined)
        if s.on_finish is not None:
            s.on_finish(s.seq, generation)


def generate_batch(
    target: Model,
    prompts: Seq[Seq[int] | torch.Tensor],
    drafter: str | None = None,
    options: GenerationOptions | None = None,
    *,
    drafters: Seq[Drafter] | None = None,
    prefill_chunk: int = PREFILL_CHUNK,
    prefill_ratio: int = PREFILL_RATIO,
    **option_fields,
) -> list[Generation]:
    """specdec.engine.generate of several prompts at once, batched (see the module's docstring):
    each Generation's tokens are those generate(target, prompt, ...) gives for its prompt alone.
    drafter: a registry name (or None), built for each prompt; or drafters=[...], one Drafter per
    prompt (a drafter's state is its sequence's). options or option_fields: generate's.
    prefill_chunk, prefill_ratio: Batch's. With k="auto" each sequence has its own policy over a
    fork of one verify-cost curve (VerifyCosts.fork). Raises what generate raises, before any forward runs."""
    options = options_from(options, option_fields)
    if drafters is not None and len(drafters) != len(prompts):
        raise ValueError(f"drafters: one per prompt, got {len(drafters)} for {len(prompts)} prompts")
    if drafters is None and not isinstance(drafter, (str, type(None))):
        raise ValueError("a Drafter object cannot serve several sequences at once: pass its name, or drafters=[...]")
    costs = VerifyCosts.for_model(target) if options.k == "auto" else None
    batch = Batch(target, prefill_chunk, prefill_ratio=prefill_ratio)
    out: dict[int, Generation] = {}
    seqs = []
    for i, prompt in enumerate(prompts):
        policy = AdaptiveK(costs.fork(), k_max=options.k_max) if costs is not None else None
        seqs.append(Decoding(target, prompt, drafters[i] if drafters is not None else drafter, options, policy))
    for i, seq in enumerate(seqs):
        batch.add(seq, on_finish=lambda _s, g, i=i: out.__setitem__(i, g))
    batch.run()
    return [out[i] for i in range(len(prompts))]
