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

What the target does is behind a Verifier (specdec.verifier): the engine's runs the target's forward over its KV cache
and times it with the clock; the replay's compares the draft with a recorded greedy output and
advances a simulated clock by measured costs. Everything else is this one function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from specdec.adaptive import AdaptiveK, Outcome, RoundPlan, Share
from specdec.drafters.base import Drafter
from specdec.drafters.draft import Draft
from specdec.sampling import Sampler
from specdec.stats import RunStats
from specdec.verifier import Verifier


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
    n_verified drafted tokens were scored, n_accepted kept (a grammar's forced tokens counted in
    neither); depth: the draft's (a chain's: n_verified)."""

    committed: list[int]
    n_verified: int
    n_accepted: int
    depth: int


@dataclass
class Proposal:
    """A round up to its verify: `checked`, the draft the target scores after the last committed
    token (a chain, or a tree where the verifier takes one); kk, the draft length planned;
    n_verified drafted tokens to score, depth the draft's; times from spec.clock; plan: the
    policy's RoundPlan (None without a policy); n_forced: the tokens a grammar forced, first in
    `checked` and not counted in n_verified."""

    tokens: list[int]
    checked: Draft
    kk: int
    n_verified: int
    depth: int
    match_length: int | None
    t_round: float  # when planning began
    draft_s: float  # seconds drafting
    plan: RoundPlan | None = None
    n_forced: int = 0


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


def propose(
    spec: Speculation,
    tokens: list[int],
    budget: int,
    room: int,
    trees: bool,
    share: Share | None = None,
    forced: list[int] = (),
) -> Proposal:
    """A round's plan and draft (steps 1-2): what the target is to score after `tokens`.
    trees: whether the verifier takes a token tree (else a tree's main chain is verified).
    share: in a batch, its part in the round's costs (specdec.adaptive.policy.Share), for the
    policy. forced: tokens a grammar allows only one way from here (specdec.grammar): they lead
    the draft for free, the drafter drafting after them, and the policy plans the rest as if they
    were committed. Other arguments as speculative_round."""
    forced = list(forced)[: max(0, min(budget, room) - 1)]
    if forced:
        proposal = propose(spec, tokens + forced, budget - len(forced), room - len(forced), False, share)
        return _after_forced(proposal, tokens, forced)
    policy, drafter, clock = spec.policy, spec.drafter, spec.clock
    t_round = clock()
    kk = min(spec.k_max if policy else spec.k, budget - 1, room - 1)
    if drafter is None:
        kk = 0
    plan = None
    if policy:
        policy.costs.at(len(tokens))
        match = (lambda: drafter.long_match(tokens)) if spec.sampler.params.greedy else None
        plan = policy.plan(kk, spec.incremental, match, share)
        kk = plan.k
    t0 = clock()
    if kk <= 0:
        draft = Draft([])
    elif spec.incremental:
        draft = drafter.propose(tokens, kk, spec.sampler, keep_going=partial(policy.keep_going, plan))
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
        cut_at = policy.cut(plan, chain, deterministic, len(tokens), draft.match_length)
    if tree:
        checked = draft.pruned(cut_at, spec.vocab, kk)
        n_verified, depth = len(checked.tokens), max(checked.depths(), default=0)
    else:
        probs = None if draft.probs is None else draft.probs[:cut_at]
        checked = Draft(chain[:cut_at], probs)
        n_verified = depth = cut_at
    return Proposal(tokens, checked, kk, n_verified, depth, draft.match_length, t_round, t1 - t0, plan)


def _after_forced(proposal: Proposal, tokens: list[int], forced: list[int]) -> Proposal:
    """A proposal drafted after `forced` tokens, as one after `tokens`: the forced tokens lead its
    chain, with one-hot draft probabilities where the draft has probabilities."""
    draft = proposal.checked
    probs = draft.probs
    if probs is not None:
        onehot = torch.zeros(len(forced), probs.shape[1], dtype=probs.dtype)
        onehot[torch.arange(len(forced)), torch.tensor(forced)] = 1.0
        probs = torch.cat([onehot, probs])
    checked = Draft(forced + draft.tokens, probs)
    return replace(proposal, tokens=tokens, checked=checked, n_forced=len(forced))


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
    forced = min(len(accepted), proposal.n_forced)  # forced tokens stay out of the drafter's counts
    n_accepted = len(accepted) - forced
    stats.record_round(proposal.n_verified, n_accepted, proposal.depth)
    stats.forced += forced
    if policy:
        other_ms = (clock() - proposal.t_round - draft_s - verify_s) * 1e3
        outcome = Outcome(
            proposal.n_verified,
            n_accepted,
            verify_s * 1e3,
            draft_s * 1e3,
            other_ms,
            requested=proposal.kk,
            depth=proposal.depth,
            match_length=proposal.match_length,
            timed=timed,
            forced=proposal.n_forced,
        )
        policy.observe(proposal.plan, outcome)
    return Round(accepted + [token], proposal.n_verified, n_accepted, proposal.depth)


def usable(tokens: list[int], vocab: int) -> list[int]:
    """The draft up to its first id the target cannot score (a draft with a wider vocabulary)."""
    for i, t in enumerate(tokens):
        if not 0 <= t < vocab:
            return tokens[:i]
    return tokens
