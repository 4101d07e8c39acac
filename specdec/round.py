"""One speculative round, shared by the engine (specdec.engine) and the bench's replay
(specdec.bench.replay).

A round, as in gpt-fast and Leviathan et al. 2023:
  1. plan: the draft length k, fixed or chosen by the adaptive policy (specdec.adaptive), clamped
     to the budget and the context left;
  2. propose: the drafter proposes up to k tokens after the committed ones (a chain, or a token
     tree where the verifier takes one);
  3. verify: the target scores the last committed token plus the drafted ones in ONE forward;
     the verifier keeps the longest prefix (the longest path of a tree) the target agrees with and
     adds one target token (recovered, or bonus when every drafted token was accepted);
  4. roll back: the target's cache is cut to the committed tokens minus the last;
  5. learn: the policy observes the round's costs and outcome.

What the target does is behind a Verifier: the engine's runs the target's forward over its KV cache
and times it with the clock; the replay's compares the draft with a recorded greedy output and
advances a simulated clock by measured costs. Everything else is this one function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from specdec.adaptive import AdaptiveK
from specdec.drafters.base import Drafter
from specdec.drafters.draft import Draft
from specdec.sampling import Sampler
from specdec.stats import RunStats


class Verifier(Protocol):
    """The target's side of a round.

    verifies_trees: whether score() takes a token tree (else a tree's main chain is verified).
    score(tokens, draft): the target's forward over tokens[-1] plus the draft (a chain, or a tree
    with parents), timed as the round's verify; returns what judge() reads (logits).
    judge(scores, tokens, draft): the accepted draft tokens and the one token the target adds.
    rollback(n): the target's cache keeps the first n tokens of the sequence.
    """

    verifies_trees: bool

    def score(self, tokens: list[int], draft: Draft) -> Any: ...

    def judge(self, scores: Any, tokens: list[int], draft: Draft) -> tuple[list[int], int]: ...

    def rollback(self, n: int) -> None: ...


@dataclass
class Speculation:
    """What a generation's rounds share.

    drafter: None for plain decoding. k: the fixed draft length, ignored when policy is given
    (k = "auto": the policy chooses up to k_max each round). sampler: the run's sampling
    (greedy when its temperature is 0). vocab: the target's vocabulary size (draft ids outside it
    end the draft). clock: seconds, read after the device's queued work has finished.
    """

    drafter: Drafter | None
    k: int
    k_max: int
    policy: AdaptiveK | None
    sampler: Sampler
    vocab: int
    clock: Callable[[], float]

    @property
    def incremental(self) -> bool:
        """Whether the policy steers the drafter token by token (keep_going)."""
        return self.policy is not None and self.drafter is not None and self.drafter.incremental


@dataclass
class Round:
    """A finished round: `committed`, the accepted tokens plus the target's (before any stop rule);
    n_verified drafted tokens were scored, n_accepted kept; depth: the draft's (a chain's: n_verified)."""

    committed: list[int]
    n_verified: int
    n_accepted: int
    depth: int


@dataclass
class Proposal:
    """A round up to its verify: `checked`, the draft the target scores after the last committed
    token (a chain, or a tree where the verifier takes one); kk, the draft length planned;
    n_verified drafted tokens to score, depth the draft's; times from spec.clock."""

    tokens: list[int]
    checked: Draft
    kk: int
    n_verified: int
    depth: int
    match_length: int | None
    t_round: float  # when planning began
    draft_s: float  # seconds drafting


def speculative_round(
    spec: Speculation, tokens: list[int], budget: int, room: int, verifier: Verifier, stats: RunStats
) -> Round:
    """Run one round after `tokens` (prompt + committed output): it commits 1 to k+1 tokens.

    budget: new tokens still allowed (>= 1); room: positions left in the target's context (>= 1).
    A round commits at most k+1 tokens and its forward reaches position len(tokens) - 1 + k, so k is
    clamped to budget - 1 and room - 1. The round's draft and verify seconds and its counts are
    added to stats; the policy, if any, learns from it. It is propose(), the verifier's score, and
    conclude(); a batched engine (specdec.batch) runs the score of many sequences as one forward.
    """
    proposal = propose(spec, tokens, budget, room, verifier.verifies_trees)
    t1 = spec.clock()
    scores = verifier.score(tokens, proposal.checked)
    return conclude(spec, proposal, scores, spec.clock() - t1, verifier, stats)


def propose(spec: Speculation, tokens: list[int], budget: int, room: int, trees: bool) -> Proposal:
    """A round's plan and draft (steps 1-2): what the target is to score after `tokens`.
    trees: whether the verifier takes a token tree (else a tree's main chain is verified).
    Arguments as speculative_round."""
    policy, drafter, clock = spec.policy, spec.drafter, spec.clock
    t_round = clock()
    kk = min(spec.k_max if policy else spec.k, budget - 1, room - 1)
    if drafter is None:
        kk = 0
    if policy:
        policy.verify.at(len(tokens))
        match = (lambda: drafter.long_match(tokens)) if spec.sampler.params.greedy else None
        kk = policy.plan(kk, spec.incremental, match)
    t0 = clock()
    if kk <= 0:
        draft = Draft([])
    elif spec.incremental:
        draft = drafter.propose(tokens, kk, spec.sampler, keep_going=policy.keep_going)
    else:
        draft = drafter.propose(tokens, kk, spec.sampler)
    t1 = clock()
    tree = draft.parents is not None
    if tree and not trees:
        draft, tree = draft.chain(), False
    chain = usable((draft.chain() if tree else draft).tokens[:kk], spec.vocab)
    cut_at = len(chain)
    if policy:  # a tree is cut by depth, as its main chain would be
        deterministic = spec.sampler.params.greedy or draft.probs is None
        cut_at = policy.cut(chain, deterministic, len(tokens), draft.match_length)
    if tree:
        checked = draft.pruned(cut_at, spec.vocab, kk)
        n_verified, depth = len(checked.tokens), max(checked.depths(), default=0)
    else:
        probs = None if draft.probs is None else draft.probs[:cut_at]
        checked = Draft(chain[:cut_at], probs)
        n_verified = depth = cut_at
    return Proposal(tokens, checked, kk, n_verified, depth, draft.match_length, t_round, t1 - t0)


def conclude(
    spec: Speculation,
    proposal: Proposal,
    scores: Any,
    verify_s: float,
    verifier: Verifier,
    stats: RunStats,
    timed: bool = True,
) -> Round:
    """A round after its verify (steps 3-5): judge the target's `scores` of proposal.checked (a
    forward of verify_s seconds), roll back, count, and let the policy learn. timed: whether that
    forward scored this round alone (else the caller times the forward for the verify-cost curve)."""
    policy, clock = spec.policy, spec.clock
    tokens = proposal.tokens
    draft_s = proposal.draft_s
    stats.draft_s += draft_s
    stats.verify_s += verify_s
    accepted, token = verifier.judge(scores, tokens, proposal.checked)
    verifier.rollback(len(tokens) + len(accepted))
    stats.record_round(proposal.n_verified, len(accepted), proposal.depth)
    if policy:
        other_ms = (clock() - proposal.t_round - draft_s - verify_s) * 1e3
        policy.observe(
            proposal.n_verified,
            len(accepted),
            verify_s * 1e3,
            draft_s * 1e3,
            other_ms,
            proposal.kk,
            spec.incremental,
            proposal.depth,
            proposal.match_length,
            timed=timed,
        )
    return Round(accepted + [token], proposal.n_verified, len(accepted), proposal.depth)


def usable(tokens: list[int], vocab: int) -> list[int]:
    """The draft up to its first id the target cannot score (a draft with a wider vocabulary)."""
    for i, t in enumerate(tokens):
        if not 0 <= t < vocab:
            return tokens[:i]
    return tokens
