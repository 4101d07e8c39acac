"""Adaptive speculation (`k="auto"`): choose the draft length every round from measured costs, so
that speculating is never much slower than plain decoding.

A round that verifies m drafted tokens yields 1 + P_1 + ... + P_m tokens (P_j: the probability
that the first j drafted tokens are all accepted) and takes draft(m) + V(m + 1) + overhead ms
(V(n): one target forward over n new tokens, specdec.adaptive.costs). By the renewal-reward
argument, the long-run rate tokens / time is maximised by choosing, every round, the m that
maximises tokens(m) - rho * time(m), rho being the best achievable rate (Dinkelbach's method for
ratio objectives, Dinkelbach 1967). rho is estimated as the best rate of a fixed draft length
under the current estimates, never below plain decoding's 1 / (V(1) + overhead); m = 0 is a plain
round. `values` gives that worth for every draft length; estimating rho, planning a round,
stopping a draft model and cutting a finished draft all read it.

How the policy drafts:
- a drafter that proposes all at once and cheaply (prompt lookup, suffix) is asked for a full
  draft every round, cut to its best length (maybe 0) and shadow-verified (see
  specdec.adaptive.acceptance), so its acceptance is learned every round, verified or not;
- a draft model (or head) is asked after every drafted token whether to go on (keep_going: the
  confidence stop of transformers' `assistant_confidence_threshold` and llama.cpp's
  `--draft-p-min`, with the threshold replaced by the same cost-benefit test);
- a finished draft is cut to its best length only when it is deterministic (greedy drafting, or a
  drafter without probabilities), so that speculative sampling stays exact;
- when plain rounds win for a while, one depth of the usual draft is probed now and then
  (exponential back-off) to notice when drafting starts paying again.

In a batch (specdec.batch) a drafted row costs what it adds to the batch's forward after its
other rows, and rho is at least the batch's rate (a Share, passed to plan()): SmartSpec's goodput
rule (Liu et al. 2024).
Related work: SpecDec++ (Huang et al. 2024) and dynamic speculation lookahead (Mamou et al. 2024)
choose the draft length per round; BanditSpec and SWIFT adapt online. Design and measurements:
docs/adaptive-k.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specdec.adaptive.acceptance import Acceptance, match_class
from specdec.adaptive.costs import VerifyCosts

CHEAP = 0.02  # a proposal of k_max tokens under this fraction of V(1) counts as free


def values(accept: Sequence[float], cost_ms: Sequence[float], rho: float, tokens: float = 0.0) -> list[float]:
    """What verifying each draft length m = 0..n is worth in tokens (n = len(accept)), by
    Dinkelbach's rule: tokens + P_1 + ... + P_m - rho * cost_ms[m].

    accept[j - 1]: P(drafted token j accepted | tokens 1..j-1 accepted), so that P_m =
    accept[0] x ... x accept[m - 1]. cost_ms: n + 1 costs in ms, cost_ms[0] that of m = 0 (0 when
    costs are counted beyond a plain round). rho: tokens per ms. tokens: what a round yields
    anyway (1 counts the bonus token; with rho = 0 the values are a round's expected tokens)."""
    out = [tokens - rho * cost_ms[0]]
    p = 1.0
    for a, cost in zip(accept, cost_ms[1:]):
        p *= a
        tokens += p
        out.append(tokens - rho * cost)
    return out


def best_length(worth: Sequence[float]) -> int:
    """The draft length m with the greatest worth[m], the shortest of equals (0: a plain round)."""
    best = 0
    for m in range(1, len(worth)):
        if worth[m] > worth[best]:
            best = m
    return best


@dataclass
class Share:
    """A batch's part in one sequence's round (specdec.batch): `rows`, the rows the rest of the
    step's forward runs (the drafts planned so far included); `rate`, the batch's committed tokens
    per ms; `cost`, ms of a batched forward by its rows (a RowCosts)."""

    rows: int
    rate: float
    cost: Callable[[int], float]


@dataclass
class RoundPlan:
    """One round's decision, made by AdaptiveK.plan() and read by keep_going(), cut() and observe().

    k: tokens to ask the drafter for (0: a plain round). cap: the most the budget and context
    allow. rho: the rate a draft must beat, tokens per ms (Dinkelbach's). incremental: the drafter
    is steered token by token (keep_going). shadowing: the draft is free: drafted fully, cut by
    cut(), and learned from by shadow verification. probing: one depth of the usual draft after
    plain rounds. share: the batch's part (None alone). confidence: the drafter's probability of
    each token drafted so far (keep_going appends). t_last: when the last draft step ended (the
    policy's clock, seconds). extra_ms: what verifying m = 0..cap drafted tokens adds, computed once
    by plan() (the costs do not change within a round).
    """

    k: int = 0
    cap: int = 0
    rho: float = 0.0
    incremental: bool = False
    shadowing: bool = False
    probing: bool = False
    share: Share | None = None
    confidence: list[float] = field(default_factory=list)
    t_last: float = 0.0
    extra_ms: list[float] = field(default_factory=list)  # extra_verify_ms for m = 0..cap, set by plan()
    branched: list[tuple[int, float]] = field(default_factory=list)  # (depth, probability) of each branch() added


@dataclass
class Outcome:
    """A finished round, for AdaptiveK.observe(): n_verified drafted tokens were scored in a
    forward of verify_ms and the first n_accepted kept; draft_ms went to drafting `requested`
    tokens and other_ms to the rest of the round. depth: a token tree's (None: n_verified, a
    chain). match_length: the draft's (Draft.match_length). timed: whether that forward scored
    this round alone (a batched forward is put on the cost curves by the batch, once). forced:
    tokens a grammar forced ahead of the draft (specdec.grammar), verified in the same forward
    but no part of the drafter's acceptance."""

    n_verified: int
    n_accepted: int
    verify_ms: float
    draft_ms: float = 0.0
    other_ms: float = 0.0
    requested: int = 0
    depth: int | None = None
    match_length: int | None = None
    timed: bool = True
    forced: int = 0
    chain_accepted: int | None = None


@dataclass
class Learned:
    """What a policy has learned besides the acceptance estimates, all in one place: running
    averages of a round's tokens and ms (tokens_ema, ms_ema), of a draft model's first and further
    steps (draft_first_ms, draft_step_ms), of an all-at-once drafter's ms per requested token
    (draft_token_ms) and of a round's ms outside drafting and verifying (overhead_ms); tokens
    verified per depth of the drafts (nodes_per_depth, 1 for chains); the second choices
    (branch()) the target reached, as decayed sums of the drafter's probabilities for them and of
    those it took (second_expected, second_taken: their ratio scales those probabilities;
    a prior of 0.5 each); whether a draft step was timed
    yet in this generation (fresh); plain rounds in a row (plain_streak) and the plain rounds
    before the next probe (probe_interval)."""

    probe_interval: int
    tokens_ema: float | None = None
    ms_ema: float | None = None
    draft_first_ms: float | None = None
    draft_step_ms: float | None = None
    draft_token_ms: float | None = None
    overhead_ms: float = 0.0
    nodes_per_depth: float = 1.0
    fresh: bool = True
    plain_streak: int = 0
    second_expected: float = 0.5
    second_taken: float = 0.5


class AdaptiveK:
    """The per-round draft-length policy of `generate(..., k="auto")` for one (drafter, target).

    - costs: the target's verify-cost curve (VerifyCosts).
    - k_max: the longest draft of a round (>= 1).
    - probe_after: plain rounds before a probe (one depth of the usual draft); it doubles after
      each probe, up to probe_max, and resets when the policy chooses to draft again.
    - margin: the part of V(1) any verify of drafted tokens is taken to cost beyond the measured
      curve, for the noise of a curve timed once per context range.
    - clock: seconds, read to time a draft model's steps (specdec.bench.replay passes a simulated one).
    - acceptance: the knobs of the acceptance estimates (`estimates`, an Acceptance: decay, prior,
      prior_weight, lift, explore); TypeError for another name.

    A round: plan() (what to draft, a RoundPlan, from the cap and, in a batch, a Share), then
    keep_going() after each step of an incremental drafter, cut() of the finished draft, and
    observe() of the round's Outcome. What it learns is in `estimates` and `learned` (a Learned).

    Raises ValueError for k_max < 1.
    """

    def __init__(
        self,
        costs: VerifyCosts,
        k_max: int = 8,
        *,
        probe_after: int = 4,
        probe_max: int = 64,
        margin: float = 0.02,
        clock=time.perf_counter,
        **acceptance: float,
    ):
        if k_max < 1:
            raise ValueError(f"k_max must be >= 1 for k='auto', got {k_max}")
        self.costs, self.k_max = costs, k_max
        self.estimates = Acceptance(k_max, **acceptance)
        self.probe_after, self.probe_max = probe_after, probe_max
        self.margin = margin
        self.clock = clock
        self.learned = Learned(probe_interval=probe_after)

    # ---- estimates ----------------------------------------------------------------------------
    def acceptances(
        self, n: int, cls: int = 0, optimistic: bool = False, shadowed: bool = False, cautious: bool = False
    ) -> list[float]:
        """[P(draft token j accepted | tokens 1..j-1 accepted) for j = 1..n] for a draft of match
        class cls (Acceptance.per_position; lifted unless the draft is shadow-verified; a lower
        bound with cautious)."""
        return self.estimates.per_position(n, cls, optimistic, lifted=not shadowed, cautious=cautious)

    def acceptance(self, j: int, cls: int = 0, shadowed: bool = False) -> float:
        """P(draft token j accepted | tokens 1..j-1 accepted), j from 1 (see acceptances)."""
        return self.acceptances(j, cls, shadowed=shadowed)[-1]

    def draft_ms(self, m: int, incremental: bool) -> float:
        """Estimated ms to draft m tokens from scratch (unknown costs count as free)."""
        learned = self.learned
        if m == 0:
            return 0.0
        if incremental:
            first = learned.draft_first_ms or 0.0
            step = learned.draft_step_ms if learned.draft_step_ms is not None else first
            return first + (m - 1) * step
        return m * (learned.draft_token_ms or 0.0)

    def nodes(self, plan: RoundPlan, depth: int) -> int:
        """Tokens verified for a draft `depth` deep: depth for a chain; for a token tree about
        nodes_per_depth x depth, at most the round's cap (the engine prunes a tree to it)."""
        return max(depth, min(plan.cap, round(depth * self.learned.nodes_per_depth))) if depth > 0 else 0

    def extra_verify_ms(self, plan: RoundPlan, m: int) -> float:
        """What verifying a draft m tokens deep costs over a plain step, in ms: V(n + 1) - V(1)
        at the current context, n = nodes(m), plus margin x V(1); 0 for m = 0. It may be negative
        where the kernel for n + 1 rows beats the one-row kernel: verifying even a useless draft
        then beats a plain step. In a batch (plan.share), C(b + n + 1) - C(b + 1) instead, C the
        batch's ms by rows, b its other rows: the forward's other rows come first, so that drafts
        get dearer as rows fill the CPU."""
        if m == 0:
            return 0.0
        margin = self.margin * self.costs(1)
        if plan.share is not None:
            base, cost = plan.share.rows, plan.share.cost
            return cost(base + self.nodes(plan, m) + 1) - cost(base + 1) + margin
        return self.costs(self.nodes(plan, m) + 1) - self.costs(1) + margin

    def _extra(self, plan: RoundPlan, n: int) -> list[float]:
        """extra_verify_ms(plan, m) for m = 0..n-1, from the plan's cache where it reaches."""
        if n <= len(plan.extra_ms):
            return plan.extra_ms[:n]
        return [self.extra_verify_ms(plan, m) for m in range(n)]

    def _best_rate(self, plan: RoundPlan) -> float:
        """rho: the best tokens per ms of a fixed draft length 0..cap under the estimates."""
        cap = plan.cap
        tokens = values(self.acceptances(cap), [0.0] * (cap + 1), 0.0, tokens=1.0)  # per round
        best, extra, v1 = 0.0, self._extra(plan, cap + 1), self.costs(1)
        for m in range(cap + 1):
            ms = self.draft_ms(m, plan.incremental) + v1 + extra[m] + self.learned.overhead_ms
            best = max(best, tokens[m] / ms if ms > 0 else 0.0)
        return best

    def _best_depth(self, plan: RoundPlan, accept: list[float], incremental: bool) -> int:
        """The draft length worth most under these acceptances, drafting and verifying it paid."""
        extra = self._extra(plan, len(accept) + 1)
        cost = [self.draft_ms(m, incremental) + extra[m] for m in range(len(accept) + 1)]
        return best_length(values(accept, cost, plan.rho))

    def _given(self, confidence: list[float], accept: list[float]) -> list[float]:
        """The acceptance per position of a draft whose first len(confidence) tokens were drafted
        with these probabilities (read through the confidence bins); accept for the rest, the next
        one's raised to what followed tokens drafted as confidently as the last of them
        (Acceptance.after_confidence). Only raised: read alone, a few early rejections after
        confident tokens stopped drafts at 1-2 tokens, and a draft of one token never teaches it."""
        known = [self.estimates.given_confidence(c) for c in confidence[: len(accept)]]
        if confidence and len(known) < len(accept):
            after = self.estimates.after_confidence(confidence[len(known) - 1], accept[len(known)])
            known.append(max(accept[len(known)], after))
        return known + accept[len(known) :]

    # ---- one round ----------------------------------------------------------------------------
    def plan(self, cap: int, incremental: bool, match=None, share: Share | None = None) -> RoundPlan:
        """This round's plan: plan.k is how many tokens to ask the drafter for (0: a plain round).
        cap: the most the budget and context allow. An incremental drafter is then steered by
        keep_going(). share: the batch's part in the round, None alone.

        match: for a drafter that sometimes proposes a lookup match alone instead of its usual
        draft (eagle-tree), a callable () -> that match's length or None, read only when the usual
        draft is not worth drafting: such a draft is judged by its own match class, and is free to
        draft. Without it a long copyable match would go unproposed once the usual draft stopped
        paying."""
        plan = RoundPlan(cap=cap, incremental=incremental, share=share)
        if cap <= 0 or not self.costs.known():  # the first round times V(1) before any choice
            return plan
        learned = self.learned
        shared_rate = share.rate if share is not None else 0.0
        plan.extra_ms = [self.extra_verify_ms(plan, m) for m in range(cap + 1)]
        cheap = learned.draft_token_ms is None or learned.draft_token_ms * cap < CHEAP * self.costs(1)
        plan.shadowing = not incremental and cheap
        if plan.shadowing:  # free: always draft fully, then cut() decides what to verify
            plain = 1.0 / (self.costs(1) + learned.overhead_ms)
            realised = learned.tokens_ema / learned.ms_ema if learned.ms_ema else 0.0
            plan.rho = max(plain, realised, shared_rate)
            plan.k = cap
            return plan
        plan.rho = max(self._best_rate(plan), shared_rate)
        best_m = self._best_depth(plan, self.acceptances(cap, optimistic=True), incremental)  # UCB
        length = match() if match is not None and not best_m else None
        if length:  # lookup's draft: no draft steps to pay
            accept = self.acceptances(cap, match_class(length), optimistic=True)
            best_m = self._best_depth(plan, accept, incremental=False)
        if best_m:
            learned.probe_interval = self.probe_after  # drafting pays: probe promptly if it stops
            plan.t_last = self.clock()
            plan.k = cap if incremental else best_m  # keep_going() steers an incremental drafter
            return plan
        learned.plain_streak += 1
        if learned.plain_streak >= learned.probe_interval:
            plan.probing = True
            plan.t_last = self.clock()
            # one depth of the drafter's usual draft (a token for a chain, a depth's tokens for a
            # tree): a one-token tree would be learned as a worse draft than the tree is
            plan.k = self.nodes(plan, 1)
        return plan

    def keep_going(self, plan: RoundPlan, n_drafted: int, confidence: float) -> bool:
        """Called by an incremental drafter after each drafted token (n_drafted so far, the last
        one's probability under the drafter): draft another? Also times the draft steps.

        Stopping now is worth the best length m <= n_drafted, or a plain round (as cut() would
        choose); going on must beat that, paying the further draft steps too."""
        learned = self.learned
        now = self.clock()
        step = now - plan.t_last
        plan.t_last = now
        if n_drafted == 1 and learned.fresh:
            learned.fresh = False  # a generation's first step also reads the prompt: not a step cost
        elif n_drafted == 1:
            learned.draft_first_ms = self._ema(learned.draft_first_ms, step * 1e3)
        else:
            learned.draft_step_ms = self._ema(learned.draft_step_ms, step * 1e3)
        plan.confidence.append(confidence)
        if plan.probing or n_drafted >= plan.cap:
            return False
        known = (ms for ms in (learned.draft_step_ms, learned.draft_first_ms) if ms is not None)
        step_ms = next(known, 0.0)  # unknown: free
        ahead = self.acceptances(plan.cap, optimistic=True, shadowed=plan.shadowing)
        accept = self._given(plan.confidence[:n_drafted], ahead)
        worth = values(accept, self._extra(plan, plan.cap + 1), plan.rho)
        stop = max(worth[: n_drafted + 1])
        return any(worth[m] - plan.rho * (m - n_drafted) * step_ms > stop for m in range(n_drafted + 1, plan.cap + 1))

    def branch(self, plan: RoundPlan, second: list[float]) -> list[int]:
        """Called by a drafter that can offer its second choice at each depth of its finished chain
        (ModelDrafter, greedy): second[d - 1] is the drafter's probability for its second choice
        at depth d. Returns the depths whose second choice to verify too, as a leaf beside that
        depth's drafted token (a token tree, SpecInfer: Miao et al. 2024), best first.

        A second choice at depth d yields one more token where the first d - 1 drafted tokens are
        accepted and it, not the drafted token, is the target's: worth reach(d) x p, p its
        probability under the drafter scaled by how often such choices were accepted against that
        probability so far (Learned: a draft model that is the target is never right twice). It costs one more
        verified token at the tree's size so far: rho x (V(n + 2) - V(n + 1) + margin x V(1)),
        n the tokens in the tree (in a batch, the batch's cost by rows, as extra_verify_ms). They
        are added best first while they pay, up to the round's cap."""
        depth = len(second)
        if plan.probing or not depth:
            return []
        accept = [self.estimates.given_confidence(c) for c in plan.confidence[:depth]]  # every depth was drafted
        scale = self.learned.second_taken / self.learned.second_expected
        reach, worth = 1.0, []
        for d, p in enumerate(second, 1):
            worth.append((reach * min(1.0, scale * p), d))
            reach *= accept[d - 1]
        cost, base = (plan.share.cost, plan.share.rows) if plan.share is not None else (self.costs, 0)
        margin = self.margin * self.costs(1)
        chosen, n = [], depth
        for value, d in sorted(worth, reverse=True):
            if n >= plan.cap or value <= plan.rho * (cost(base + n + 2) - cost(base + n + 1) + margin):
                break
            chosen.append(d)
            plan.branched.append((d, second[d - 1]))
            n += 1
        return chosen

    def cut(
        self,
        plan: RoundPlan,
        drafted: list[int],
        deterministic: bool,
        position: int = 0,
        match_length: int | None = None,
    ) -> int:
        """The best length to verify of a finished draft (<= len(drafted)). Only a deterministic
        draft may be cut by what it contains: cutting a sampled draft by its own tokens'
        probabilities would bias speculative sampling. A free draft (shadowing) is also held for
        shadow verification: `position` is the index its first token would have in the sequence."""
        n = len(drafted)
        cls = match_class(match_length)
        if plan.shadowing and n:
            self.estimates.shadow(position, drafted, cls)
        if n == 0 or plan.probing:
            return min(n, 1)
        if not deterministic:
            return n
        # in a batch a row costs about a whole row: a free draft, learned from anyway, is verified only
        # where even a lower bound pays (alone rows are cheap, and the bound would forgo good drafts)
        cautious = plan.shadowing and plan.share is not None
        accept = self._given(plan.confidence[:n], self.acceptances(n, cls, shadowed=plan.shadowing, cautious=cautious))
        worth = values(accept, self._extra(plan, n + 1), plan.rho)
        best_m = best_length(worth)
        learned = self.learned
        if best_m == 0 and not plan.shadowing:  # not worth verifying: a plain round, maybe a probe
            learned.plain_streak += 1
            if learned.plain_streak >= learned.probe_interval:
                plan.probing = True
                return 1
        return best_m

    def observe(self, plan: RoundPlan, outcome: Outcome) -> None:
        """Learn from the finished round of this plan: its costs go to `learned` (and, when timed,
        to the verify-cost curve), its acceptance to `estimates` (a shadowed draft is learned from
        in resolve() instead)."""
        o, learned = outcome, self.learned
        depth = o.n_verified if o.depth is None else o.depth
        if o.timed:
            self.costs.observe(o.forced + o.n_verified + 1, o.verify_ms)
        if o.n_verified and depth:  # branch()'s second choices aside: it pays for them itself
            chain_nodes = max(depth, o.n_verified - len(plan.branched))
            learned.nodes_per_depth = self._ema(learned.nodes_per_depth, chain_nodes / depth)
        learned.overhead_ms = self._ema(learned.overhead_ms, o.other_ms)
        learned.tokens_ema = self._ema(learned.tokens_ema, o.n_accepted + 1.0, 0.1)
        learned.ms_ema = self._ema(learned.ms_ema, o.verify_ms + o.draft_ms + o.other_ms, 0.1)
        if o.requested and not plan.incremental:
            learned.draft_token_ms = self._ema(learned.draft_token_ms, o.draft_ms / o.requested)
        if o.n_verified and not plan.shadowing:
            accepted = o.n_accepted if o.chain_accepted is None else o.chain_accepted
            for d, p in plan.branched:  # reached where the chain's first d - 1 tokens were accepted
                if d <= accepted + 1:
                    taken = d == accepted + 1 and o.n_accepted > accepted  # the path went through it
                    decay = self.estimates.decay
                    learned.second_expected = decay * learned.second_expected + p
                    learned.second_taken = decay * learned.second_taken + taken
            checked = min(depth, accepted + 1)
            self.estimates.learn(match_class(o.match_length), checked, accepted)
            self.estimates.learn_confidences(plan.confidence[:checked], accepted)
            if plan.probing:  # an accepted probe need not mean drafting pays: back off
                learned.probe_interval = min(2 * learned.probe_interval, self.probe_max)
            learned.plain_streak = 0

    def resolve(self, sequence: list[int], final: bool = False) -> None:
        """Shadow verification: learn from the held free drafts that the committed `sequence`
        (prompt + output) now settles; final=True settles all of them (Acceptance.resolve)."""
        self.estimates.resolve(sequence, final)

    def begin(self) -> None:
        """A new generation: drop shadow drafts left from an earlier one."""
        self.estimates.begin()
        self.learned.fresh = True

    @staticmethod
    def _ema(old: float | None, new: float, weight: float = 0.3) -> float:
        return new if old is None else (1 - weight) * old + weight * new
