"""Replay: a draft-length policy (a fixed k, or k = "auto") run on a prompt's recorded greedy
output under fixed measured costs, with no target forward, so that policies are compared without
the timing noise of a shared machine.

Under greedy decoding a round's outcome depends only on the draft and the target's greedy
continuation: the drafted tokens are accepted up to the first that differs from it, then the
target's next token is committed (a token tree: its longest path that agrees). So once plain
greedy decoding has produced a prompt's output, every policy's rounds on that prompt can be
replayed by running the drafter alone, each round timed with the bench's measured costs
(specdec.bench.measure.measure_costs, the same figures specdec.bench.costmodel predicts with): drafting m tokens
takes draft(m) (draft_catchup(m) after a round that accepted all it drafted), verifying n drafted
tokens V(n + 1), and every round `overhead_ms`. The drafter runs for real (its drafts, a draft
model's confidences, auto's early stops); only the clock is simulated. Two policies' replayed
speeds thus differ by their choices alone, where the measured ones also differ by the machine:
on a shared machine one prompt's repeated runs spread by more than the few percent that tell
k = "auto" from the best fixed k in one category (figures: docs/bench.md).

What a replay leaves out: the verify curve is the one measured at the bench's typical context
(the engine's own curve follows the context length); drafters that read the target's KV cache
(EAGLE heads) cannot run without the target's forwards and are refused. A draft model in bf16
proposes what it would in the real run only up to its own rounding: its kernels (and so its
near-tied argmaxes) can differ with the history of its cache and the row padding timed at load.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from specdec.adaptive import AdaptiveK, VerifyCosts
from specdec.bench.costmodel import draft_ms_at, verify_ms
from specdec.drafters.base import Drafter, KeepGoing
from specdec.drafters.draft import Draft
from specdec.models.load import Model
from specdec.options import AUTO_K_MAX, parse_k
from specdec.round import Speculation, speculative_round
from specdec.sampling import Sampler, SamplingParams
from specdec.stats import RunStats


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
    verify = VerifyCosts(
        ms=dict(curve), shapes={costs["context_tokens"]: {n: ms / curve[1] for n, ms in curve.items()}}
    )
    verify.at(costs["context_tokens"])
    return AdaptiveK(verify, k_max=k_max, **kwargs)


def replayable(drafter: Drafter | None) -> bool:
    """Whether a drafter can be replayed: it must not read the target's KV cache."""
    return drafter is None or not drafter.reads_target_cache


class _TimedDrafter(Drafter):
    """A drafter whose proposals advance the simulated clock by the bench's measured draft costs:
    each step as it is drafted when the policy steers it (keep_going), else the whole request."""

    def __init__(self, inner: Drafter, clock: _Clock, costs: dict):
        self.inner, self.clock = inner, clock
        self.incremental, self.branches = inner.incremental, inner.branches
        self.caught_up = {"draft_ms": costs["draft_ms"]}
        self.lagging = {"draft_ms": costs.get("draft_catchup_ms", costs["draft_ms"])}  # 2 tokens behind or more
        self.costs = self.caught_up

    def propose(
        self, context: list[int], k: int, sampler: Sampler, keep_going: KeepGoing | None = None, **steer
    ) -> Draft:
        if keep_going is None:
            draft = self.inner.propose(context, k, sampler)
            self.clock.tick(draft_ms_at(self.costs, k))
            return draft

        def timed(n: int, confidence: float) -> bool:  # each drafted step is paid before auto is asked to go on
            self.clock.tick(draft_ms_at(self.costs, n) - draft_ms_at(self.costs, n - 1))
            return keep_going(n, confidence)

        return self.inner.propose(context, k, sampler, keep_going=timed, **steer)  # steer: branch, if any


class _ReplayVerifier:
    """The replay's Verifier (specdec.round): a draft is checked against the target's recorded
    greedy continuation; the verify forward costs V(n + 1) and the rest of a round overhead_ms."""

    def __init__(self, target: Model, prompt_len: int, output: list[int], costs: dict, clock: _Clock):
        self.verifies_trees = target.backend == "lean"  # as the engine: only the lean cache verifies a tree
        self.start, self.output, self.costs, self.clock = prompt_len, output, costs, clock

    def score(self, tokens: list[int], draft: Draft) -> None:
        self.clock.tick(verify_ms(self.costs, len(draft.tokens) + 1))

    def judge(self, scores: None, tokens: list[int], draft: Draft) -> tuple[list[int], int]:
        truth = self.output[len(tokens) - self.start :]
        if draft.parents is not None:
            n = _path(draft, truth)
        else:
            n = next((i for i, (a, b) in enumerate(zip(draft.tokens, truth)) if a != b), len(draft.tokens))
        return truth[:n], truth[n]

    def rollback(self, n: int) -> None:
        self.clock.tick(self.costs["overhead_ms"])


def replay(
    target: Model,
    prompt: list[int],
    output: list[int],
    drafter: Drafter | None,
    k: int | str,
    costs: dict,
    k_max: int = AUTO_K_MAX,
    policy: AdaptiveK | None = None,
) -> RunStats:
    """The rounds that greedy generation with this drafter and k would run to produce `output`
    (plain greedy decoding's new tokens after `prompt`, an EOS included), timed by `costs`.

    k: a draft length >= 0 (0: plain decoding) or "auto", then policy (default: a fresh
    controller(costs, k_max); pass one from controller() to carry its estimates across prompts;
    the replay sets its clock). costs: bench's measure_costs dict, its overhead_ms filled in.
    Returns a RunStats whose times are simulated seconds (prefill 0), so decode_tokens_per_s is the
    replayed speed (tokens/s), and whose rounds, drafted and accepted tokens are those a real run
    would have. The round itself is the engine's (specdec.round). Raises ValueError for a bad k or
    a drafter that reads the target's KV cache."""
    k = parse_k(k)
    if not replayable(drafter):
        raise ValueError(
            f"{type(drafter).__name__} reads the target's KV cache, which a replay does not run: "
            "measure it with specdec bench, which replays only the drafters it can"
        )
    if drafter is None:
        k = 0
    clock = _Clock()
    if k == "auto":
        policy = policy or controller(costs, k_max)
        policy.clock = clock
        policy.begin()
    else:
        policy = None
    timed = None
    if drafter is not None:
        drafter.prepare(target)
        timed = _TimedDrafter(drafter, clock, costs)
    sampler = Sampler(SamplingParams(temperature=0.0), torch.Generator().manual_seed(0))
    spec = Speculation(
        drafter=timed,
        k=0 if policy else k,
        k_max=policy.k_max if policy else 0,
        policy=policy,
        sampler=sampler,
        vocab=target.vocab_size,
        clock=clock,
    )
    verifier = _ReplayVerifier(target, len(prompt), output, costs, clock)
    stats = RunStats(k=k, prompt_tokens=len(prompt))
    tokens = list(prompt)
    while len(tokens) - len(prompt) < len(output):
        done = speculative_round(spec, tokens, len(output) - (len(tokens) - len(prompt)), 1 << 30, verifier, stats)
        tokens += done.committed
        if policy:
            policy.resolve(tokens)
        if timed is not None:  # a draft model 2 tokens behind or more pays its catch-up next round
            timed.costs = timed.caught_up if 0 < done.n_verified and done.n_accepted < done.depth else timed.lagging
    if policy:
        policy.resolve(tokens, final=True)
    stats.new_tokens = len(tokens) - len(prompt)
    stats.total_s = clock()
    return stats


def replay_prompts(
    target: Model,
    drafter: Drafter,
    runs: list[tuple[list[int], list[int]]],
    ks: list[int | str],
    costs: dict,
    *,
    desc: str,
    progress: bool = True,
) -> list[dict]:
    """Each prompt's "replay" of its record (results.PromptRecord): plain decoding and every k of ks
    replayed (replay) on the prompt's plain output under the measured costs, auto's policy carried
    across prompts as in the measured runs. runs: per prompt, (its ids, plain decoding's output).
    Returns per prompt {"plain" and each str(k): the replayed run's speed, rounds and tokens}; raises
    as replay does."""
    policy = controller(costs) if "auto" in ks else None
    return [
        {str(k) if k else "plain": _brief(replay(target, ids, out, drafter, k, costs, policy=policy)) for k in [0, *ks]}
        for ids, out in tqdm(runs, desc=desc, disable=not progress)
    ]


def _brief(stats: RunStats) -> dict:
    """What results.json keeps of a replayed run: simulated speed, rounds, tokens."""
    return {
        "decode_tokens_per_s": stats.decode_tokens_per_s,
        "rounds": stats.rounds,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "tau": stats.tau,
        "mean_k": stats.mean_k,
    }


def _path(draft: Draft, truth: list[int]) -> int:
    """How deep a token tree agrees with the target's continuation `truth`: the accepted tokens."""
    node, depth = -1, 0
    while depth < len(truth):
        node = next(
            (i for i, (t, p) in enumerate(zip(draft.tokens, draft.parents)) if p == node and t == truth[depth]), None
        )
        if node is None:
            break
        depth += 1
    return depth
