"""One speculative round (Leviathan et al. 2023; gpt-fast's loop): speculative_round, the one function
that runs a round, for the engine (specdec.decoding's Decoding.step), the batched engine (specdec.batch:
the same steps, its score step one forward for many sequences) and the bench's replay (specdec.bench.replay).

Call map of speculative_round(spec, context, budget, room, verifier, stats, forced):
  1. propose              plan k (spec.policy.plan: fixed k, or adaptive, specdec.adaptive),
                          draft (spec.drafter.propose: a chain or a token tree), cut it (policy.cut);
                          a grammar's forced tokens lead the draft for free
  2. verifier.score       the target's ONE forward over context[-1] + the draft (specdec.scoring)
  3. conclude             verifier.judge: the longest prefix (tree path) the target agrees with, plus
                          one target token, recovered or bonus (the rejection rule, specdec.rejection);
                          verifier.rollback: the target's cache cut to the committed tokens but the last;
                          the round counted in stats; the policy learns its costs and outcome
  -> Round: the tokens it commits; the caller applies EOS, stop strings and the budget
     (specdec.decoding.Decoding.take).

What the target does is behind a Verifier: the engine's (specdec.scoring.TargetVerifier) runs the
target's forward over its KV cache and times it with the clock; the replay's compares the draft with a
recorded greedy output and advances a simulated clock by measured costs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from specdec.adaptive import AdaptiveK, Outcome, RoundPlan, Share
from specdec.cache import common_prefix
from specdec.drafters.base import Drafter
from specdec.drafters.draft import Draft
from specdec.sampling import Sampler
from specdec.scoring import Verifier
from specdec.stats import RunStats


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
    """A round up to its verify.

    context: the prompt and the committed tokens the draft follows. checked: the draft the target
    scores after context[-1] (a chain, or a tree where the verifier takes one). planned: the draft
    length planned (k this round). n_verified: drafted tokens to score; depth: the draft's.
    match_length: prompt lookup's match, when the drafter reports one. t_round: spec.clock() when
    planning began; draft_s: seconds drafting. plan: the policy's RoundPlan (None without a
    policy). n_forced: the tokens a grammar forced, first in `checked`, not counted in n_verified.
    """

    context: list[int]
    checked: Draft
    planned: int
    n_verified: int
    depth: int
    match_length: int | None
    t_round: float
    draft_s: float
    plan: RoundPlan | None = None
    n_forced: int = 0


def speculative_round(
    spec: Speculation,
    context: list[int],
    budget: int,
    room: int,
    verifier: Verifier,
    stats: RunStats,
    forced: list[int] = (),
) -> Round:
    """Run one round after `context` (prompt + committed output): it commits 1 to k+1 tokens.

    budget: new tokens still allowed (>= 1); room: positions left in the target's context (>= 1).
    A round commits at most k+1 tokens and its forward reaches position len(context) - 1 + k, so k
    is clamped to budget - 1 and room - 1. forced: tokens a grammar allows only one way from here
    (specdec.grammar), drafted for free. The round's draft and verify seconds and its counts are
    added to stats; the policy, if any, learns from it.
    """
    proposal = propose(spec, context, budget, room, verifier.verifies_trees, forced=forced)  # 1
    t1 = spec.clock()
    scores = verifier.score(context, proposal.checked)  # 2
    return conclude(spec, proposal, scores, spec.clock() - t1, verifier, stats)  # 3


def propose(
    spec: Speculation,
    context: list[int],
    budget: int,
    room: int,
    trees: bool,
    share: Share | None = None,
    forced: list[int] = (),
) -> Proposal:
    """Step 1 of a round: its plan and draft, what the target is to score after `context`.
    trees: whether the verifier takes a token tree (else a tree's main chain is verified).
    share: in a batch, its part in the round's costs (specdec.adaptive.policy.Share), for the
    policy. forced: tokens a grammar allows only one way from here (specdec.grammar): they lead
    the draft, the drafter drafting after them, and the policy plans the rest as if they were
    committed (no tree then). Other arguments as speculative_round."""
    forced = list(forced)[: max(0, min(budget, room) - 1)]
    if not forced:
        return _draft(spec, context, budget, room, trees, share)
    proposal = _draft(spec, context + forced, budget - len(forced), room - len(forced), False, share)
    return _after_forced(proposal, context, forced)


def _draft(spec: Speculation, context: list[int], budget: int, room: int, trees: bool, share: Share | None) -> Proposal:
    """propose() after any forced tokens: plan k, draft, cut the draft to what the target scores."""
    policy, drafter, clock = spec.policy, spec.drafter, spec.clock
    t_round = clock()
    k = 0 if drafter is None else min(spec.k_max if policy else spec.k, budget - 1, room - 1)
    plan = None
    if policy:
        policy.costs.at(len(context))
        match = (lambda: drafter.long_match(context)) if spec.sampler.params.greedy else None
        plan = policy.plan(k, spec.incremental, match, share)
        k = plan.k
    t0 = clock()
    if k <= 0:
        draft = Draft([])
    elif spec.incremental:
        steer = {"keep_going": partial(policy.keep_going, plan)}
        if trees and drafter.branches and spec.sampler.params.greedy:
            steer["branch"] = partial(policy.branch, plan)
        draft = drafter.propose(context, k, spec.sampler, **steer)
    else:
        draft = drafter.propose(context, k, spec.sampler)
    t1 = clock()
    tree = draft.parents is not None
    if tree and not trees:
        draft, tree = draft.chain(), False
    chain = usable((draft.chain() if tree else draft).tokens[:k], spec.vocab)
    cut_at = len(chain)
    if policy:  # a tree is cut by depth, as its main chain would be
        deterministic = spec.sampler.params.greedy or draft.probs is None
        cut_at = policy.cut(plan, chain, deterministic, len(context), draft.match_length)
    if tree:
        checked = draft.pruned(cut_at, spec.vocab, k)
        n_verified, depth = len(checked.tokens), max(checked.depths(), default=0)
    else:
        probs = None if draft.probs is None else draft.probs[:cut_at]
        checked = Draft(chain[:cut_at], probs)
        n_verified = depth = cut_at
    return Proposal(
        context=context,
        checked=checked,
        planned=k,
        n_verified=n_verified,
        depth=depth,
        match_length=draft.match_length,
        t_round=t_round,
        draft_s=t1 - t0,
        plan=plan,
    )


def _after_forced(proposal: Proposal, context: list[int], forced: list[int]) -> Proposal:
    """A proposal drafted after `forced` tokens, as one after `context`: the forced tokens lead its
    chain, with one-hot draft probabilities where the draft has probabilities."""
    draft = proposal.checked
    probs = draft.probs
    if probs is not None:
        onehot = torch.zeros(len(forced), probs.shape[1], dtype=probs.dtype)
        onehot[torch.arange(len(forced)), torch.tensor(forced)] = 1.0
        probs = torch.cat([onehot, probs])
    checked = Draft(forced + draft.tokens, probs)
    return replace(proposal, context=context, checked=checked, n_forced=len(forced))


def conclude(
    spec: Speculation,
    proposal: Proposal,
    scores: Any,
    verify_s: float,
    verifier: Verifier,
    stats: RunStats,
    timed: bool = True,
) -> Round:
    """Step 3 of a round, after its verify: judge the target's `scores` of proposal.checked (a
    forward of verify_s seconds), roll back, count, and let the policy learn. timed: whether that
    forward scored this round alone (else the caller times the forward for the verify-cost curve)."""
    policy, clock = spec.policy, spec.clock
    context = proposal.context
    draft_s = proposal.draft_s
    stats.draft_s += draft_s
    stats.verify_s += verify_s
    accepted, token = verifier.judge(scores, context, proposal.checked)
    verifier.rollback(len(context) + len(accepted))
    forced = min(len(accepted), proposal.n_forced)  # forced tokens stay out of the drafter's counts
    n_accepted = len(accepted) - forced
    chain = proposal.checked.chain().tokens if proposal.checked.parents is not None else None
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
            requested=proposal.planned,
            depth=proposal.depth,
            match_length=proposal.match_length,
            timed=timed,
            forced=proposal.n_forced,
            chain_accepted=None if chain is None else common_prefix(accepted, chain),
        )
        policy.observe(proposal.plan, outcome)
    return Round(accepted + [token], proposal.n_verified, n_accepted, proposal.depth)


def usable(tokens: list[int], vocab: int) -> list[int]:
    """The draft up to its first id the target cannot score (a draft with a wider vocabulary)."""
    for i, t in enumerate(tokens):
        if not 0 <= t < vocab:
            return tokens[:i]
    return tokens
