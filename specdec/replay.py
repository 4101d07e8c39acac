"""Replay: a draft-length policy (a fixed k, or k = "auto") run on a prompt's recorded greedy
output under fixed measured costs, with no target forward, so that policies are compared without
the timing noise of a shared machine.

Under greedy decoding a round's outcome depends only on the draft and the target's greedy
continuation: the drafted tokens are accepted up to the first that differs from it, then the
target's next token is committed (a token tree: its longest path that agrees). So once plain
greedy decoding has produced a prompt's output, every policy's rounds on that prompt can be
replayed by running the drafter alone, each round timed with the bench's measured costs
(specdec.bench.measure_costs, the same figures specdec.costmodel predicts with): drafting m tokens
takes draft(m) (draft_catchup(m) after a round that accepted all it drafted), verifying n drafted
tokens V(n + 1), and every round `overhead_ms`. The drafter runs for real (its drafts, a draft
model's confidences, auto's early stops); only the clock is simulated. Two policies' replayed
speeds thus differ by their choices alone, where the measured ones also differ by the machine:
one prompt's repeated runs spread by 5-20% (SmolLM2-135M and Qwen2.5-Coder-1.5B fp32, Spec-Bench
dev, a shared 2-core EPYC), more than the 3% that issue 5's per-category test asks to resolve.

What a replay leaves out: the verify curve is the one measured at the bench's typical context
(the engine's own curve follows the context length); drafters that read the target's KV cache
(EAGLE heads) cannot run without the target's forwards and are refused. A draft model in bf16
proposes what it would in the real run only up to its own rounding: its kernels (and so its
near-tied argmaxes) can differ with the history of its cache and the row padding timed at load.
"""

from __future__ import annotations

import torch

from .adaptive import AdaptiveK, VerifyCosts
from .costmodel import draft_ms_at, verify_ms
from .drafters import Draft, Drafter, steerable
from .engine import AUTO_K_MAX, _usable
from .models import Model
from .sampling import Sampler, SamplingParams
from .stats import RunStats


class _Clock:
    """Simulated seconds, advanced by the costs of what the replay runs."""

    def __init__(self) -> None:
        self.s = 0.0

    def __call__(self) -> float:
        return self.s

    def tick(self, ms: float) -> None:
        self.s += ms / 1e3


def controller(costs: dict, k_max: int = AUTO_K_MAX, **kwargs) -> AdaptiveK:
    """A fresh k = "auto" policy whose verify-cost curve is `costs`' (bench's measured V(n), at
    its context length), as if calibrated there. kwargs go to AdaptiveK (e.g. explore=0)."""
    curve = {int(n): ms for n, ms in costs["verify_ms"].items()}
    verify = VerifyCosts(ms=dict(curve), shapes={costs["context_tokens"]: {n: ms / curve[1] for n, ms in curve.items()}})
    verify.at(costs["context_tokens"])
    return AdaptiveK(verify, k_max=k_max, **kwargs)


def replayable(drafter: Drafter | None) -> bool:
    """Whether a drafter can be replayed: it must not read the target's KV cache (attach())."""
    return drafter is None or not hasattr(drafter, "attach")


def replay(target: Model, prompt: list[int], output: list[int], drafter: Drafter | None, k: int | str,
           costs: dict, k_max: int = AUTO_K_MAX, policy: AdaptiveK | None = None) -> RunStats:
    """The rounds that greedy generation with this drafter and k would run to produce `output`
    (plain greedy decoding's new tokens after `prompt`, an EOS included), timed by `costs`.

    k: a draft length >= 0 (0: plain decoding) or "auto", then policy (default: a fresh
    controller(costs, k_max); pass one from controller() to carry its estimates across prompts, as
    the engine does per drafter; the replay sets its clock, so not the engine's own). costs: bench's measure_costs dict, its overhead_ms filled in. Returns a RunStats
    whose times are simulated seconds (prefill 0), so decode_tokens_per_s is the replayed speed
    (tokens/s), and whose rounds, drafted and accepted tokens are those a real run would have.
    Raises ValueError for a bad k or a drafter that reads the target's KV cache."""
    if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise ValueError(f"k (draft length) must be an integer >= 0 or 'auto', got {k!r}")
    if not replayable(drafter):
        raise ValueError(f"{type(drafter).__name__} reads the target's KV cache, which a replay does not run: "
                         "measure it with specdec bench, which replays only the drafters it can")
    if drafter is None:
        k = 0
    auto = k == "auto"
    stepwise = steerable(drafter)
    clock = _Clock()
    if auto:
        policy = policy or controller(costs, k_max)
        policy.clock = clock
        policy.begin()
    if drafter is not None:
        drafter.prepare(target)
    sampler = Sampler(SamplingParams(temperature=0.0), torch.Generator().manual_seed(0))
    lagging = {"draft_ms": costs.get("draft_catchup_ms", costs["draft_ms"])}  # the drafter 2 tokens behind
    stats = RunStats(k=k, prompt_tokens=len(prompt))
    tokens, done, caught_up = list(prompt), 0, True
    while done < len(output):
        draft_costs = costs if caught_up else lagging
        kk = min(k_max if auto else k, len(output) - done - 1)
        if auto:
            kk = policy.plan(kk, stepwise)
        start = clock()
        if kk <= 0:
            draft = Draft([])
        elif auto and stepwise:  # each drafted step is paid before auto is asked whether to go on

            def keep_going(n: int, confidence: float) -> bool:
                clock.tick(draft_ms_at(draft_costs, n) - draft_ms_at(draft_costs, n - 1))
                return policy.keep_going(n, confidence)

            draft = drafter.propose(tokens, kk, sampler, keep_going=keep_going)
        else:
            draft = drafter.propose(tokens, kk, sampler)
            clock.tick(draft_ms_at(draft_costs, kk))
        draft_ms = (clock() - start) * 1e3
        tree = draft.parents is not None
        if tree and target.backend != "lean":  # as the engine: only the lean cache verifies a tree
            draft, tree = draft.chain(), False
        chain = _usable((draft.chain() if tree else draft).tokens[:kk], target.vocab_size)
        cut_at = policy.cut(chain, True, len(tokens), draft.match_length) if auto else len(chain)
        truth = output[done:]
        if tree:
            draft = draft.pruned(cut_at, target.vocab_size, kk)
            n_verified, n_accepted, depth = len(draft.tokens), _path(draft, truth), max(draft.depths(), default=0)
        else:
            n_verified = depth = cut_at
            n_accepted = next((i for i, (a, b) in enumerate(zip(chain[:cut_at], truth)) if a != b), cut_at)
        v_ms = verify_ms(costs, n_verified + 1)
        stats.record_round(n_verified, n_accepted, depth)
        stats.draft_s += draft_ms / 1e3
        stats.verify_s += v_ms / 1e3
        stats.total_s += (draft_ms + v_ms + costs["overhead_ms"]) / 1e3
        if auto:
            policy.observe(n_verified, n_accepted, v_ms, draft_ms, costs["overhead_ms"], kk, stepwise, depth,
                           draft.match_length)
        caught_up = 0 < n_verified and n_accepted < depth  # else a draft model lags 2 tokens or more
        committed = truth[: n_accepted + 1]
        tokens += committed
        done += len(committed)
        if auto:
            policy.resolve(tokens)
    if auto:
        policy.resolve(tokens, final=True)
    stats.new_tokens = done
    return stats


def _path(draft: Draft, truth: list[int]) -> int:
    """How deep a token tree agrees with the target's continuation `truth`: the accepted tokens."""
    node, depth = -1, 0
    while depth < len(truth):
        node = next((i for i, (t, p) in enumerate(zip(draft.tokens, draft.parents)) if p == node and t == truth[depth]), None)
        if node is None:
            break
        depth += 1
    return depth
