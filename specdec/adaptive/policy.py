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

In a batch (specdec.batch) a drafted row costs what it adds to the batch's forward (shared_cost,
after shared_rows other rows) and rho is at least the batch's rate (shared_rate): SmartSpec's
goodput rule (Liu et al. 2024).
Related work: SpecDec++ (Huang et al. 2024) and dynamic speculation lookahead (Mamou et al. 2024)
choose the draft length per round; BanditSpec and SWIFT adapt online. Design and measurements:
docs/adaptive-k.md.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

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


class AdaptiveK:
    """The per-round draft-length policy of `generate(..., k="auto")` for one (drafter, target).

    costs: the target's verify-cost curve (VerifyCosts). k_max: the longest draft of a round
    (>= 1). decay, prior, prior_weight, lift, explore: of the acceptance estimates (`estimates`,
    an Acceptance). probe_after: plain rounds before a probe (one depth of the usual draft); it
    doubles after each probe, up to probe_max, and resets when the policy chooses to draft again.
    margin: the part of V(1) any verify of drafted tokens is taken to cost beyond the measured
    curve, for the noise of a curve timed once per context range. clock: seconds, read to time a
    draft model's steps (specdec.bench.replay passes a simulated one).

    Raises ValueError for k_max < 1.
    """

    def __init__(
        self,
        costs: VerifyCosts,
        k_max: int = 8,
        decay: float = 0.9,
        prior: float = 0.5,
        prior_weight: float = 1.0,
        probe_after: int = 4,
        probe_max: int = 64,
        margin: float = 0.02,
        lift: float = 0.5,
        explore: float = 1.0,
        clock=time.perf_counter,
    ):
        if k_max < 1:
            raise ValueError(f"k_max must be >= 1 for k='auto', got {k_max}")
        self.verify, self.k_max = costs, k_max
        self.estimates = Acceptance(k_max, decay, prior, prior_weight, lift, explore)
        self.probe_after, self.probe_max = probe_after, probe_max
        self.margin = margin
        self.clock = clock
        self.shadowing = False  # this round's draft is free and learned from by shadow verification
        self.tokens_ema: float | None = None  # realised tokens per round (running average)
        self.ms_ema: float | None = None  # realised ms per round
        self.draft_first_ms: float | None = None  # draft model: first step of a proposal
        self.draft_step_ms: float | None = None  # draft model: each further step
        self.draft_token_ms: float | None = None  # all-at-once drafter: ms per requested token
        self.overhead_ms = 0.0  # per round, outside drafting and verifying
        self.nodes_per_depth = 1.0  # tokens verified per depth of the drafts: 1 for chains
        self.fresh = True  # no draft step timed yet in this generation
        self.plain_streak = 0
        self.probe_interval = probe_after
        self.probing = False
        # the round in progress
        self.rho = 0.0  # tokens per ms
        self.cap = k_max
        self.confidence: list[float] = []  # the drafter's probability for each token drafted
        self._t_last = 0.0  # when the last draft step ended
        # in a batch (specdec.batch): rows the rest of this step's forward runs, the batch's
        # committed tokens per ms and its forward's ms by rows (a RowCosts); 0, 0.0 and None alone
        self.shared_rows = 0
        self.shared_rate = 0.0
        self.shared_cost = None

    # ---- estimates ----------------------------------------------------------------------------
    def acceptances(self, n: int, cls: int = 0, optimistic: bool = False) -> list[float]:
        """[P(draft token j accepted | tokens 1..j-1 accepted) for j = 1..n] for this round's
        draft, of match class cls (Acceptance.per_position; lifted unless shadow-verified)."""
        return self.estimates.per_position(n, cls, optimistic, lifted=not self.shadowing)

    def acceptance(self, j: int, cls: int = 0) -> float:
        """P(draft token j accepted | tokens 1..j-1 accepted), j from 1 (see acceptances)."""
        return self.acceptances(j, cls)[-1]

    def draft_ms(self, m: int, incremental: bool) -> float:
        """Estimated ms to draft m tokens from scratch (unknown costs count as free)."""
        if m == 0:
            return 0.0
        if incremental:
            first = self.draft_first_ms or 0.0
            step = self.draft_step_ms if self.draft_step_ms is not None else first
            return first + (m - 1) * step
        return m * (self.draft_token_ms or 0.0)

    def nodes(self, depth: int) -> int:
        """Tokens verified for a draft `depth` deep: depth for a chain; for a token tree about
        nodes_per_depth x depth, at most the round's cap (the engine prunes a tree to it)."""
        return max(depth, min(self.cap, round(depth * self.nodes_per_depth))) if depth > 0 else 0

    def extra_verify_ms(self, m: int) -> float:
        """What verifying a draft m tokens deep costs over a plain step, in ms: V(n + 1) - V(1)
        at the current context, n = nodes(m), plus margin x V(1); 0 for m = 0. It may be negative
        where the kernel for n + 1 rows beats the one-row kernel: verifying even a useless draft
        then beats a plain step. In a batch, C(b + n + 1) - C(b + 1) instead, C = shared_cost
        (ms by rows of a batched forward), b = shared_rows: the forward's other rows come first,
        so that drafts get dearer as rows fill the CPU."""
        if m == 0:
            return 0.0
        if self.shared_cost is not None:
            base, cost = self.shared_rows, self.shared_cost
            return cost(base + self.nodes(m) + 1) - cost(base + 1) + self.margin * self.verify(1)
        return self.verify(self.nodes(m) + 1) - self.verify(1) + self.margin * self.verify(1)

    def _best_rate(self, cap: int, incremental: bool) -> float:
        """rho: the best tokens per ms of a fixed draft length 0..cap under the estimates."""
        tokens = values(self.acceptances(cap), [0.0] * (cap + 1), 0.0, tokens=1.0)  # per round
        best = 0.0
        for m in range(cap + 1):
            ms = self.draft_ms(m, incremental) + self.verify(1) + self.extra_verify_ms(m) + self.overhead_ms
            best = max(best, tokens[m] / ms if ms > 0 else 0.0)
        return best

    def _best_depth(self, accept: list[float], incremental: bool) -> int:
        """The draft length worth most under these acceptances, drafting and verifying it paid."""
        cost = [self.draft_ms(m, incremental) + self.extra_verify_ms(m) for m in range(len(accept) + 1)]
        return best_length(values(accept, cost, self.rho))

    def _given(self, confidence: list[float], accept: list[float]) -> list[float]:
        """The acceptance per position of a draft whose first len(confidence) tokens were drafted
        with these probabilities (read through the confidence bins); accept for the rest."""
        known = [self.estimates.given_confidence(c) for c in confidence[: len(accept)]]
        return known + accept[len(known) :]

    # ---- one round ----------------------------------------------------------------------------
    def plan(self, cap: int, incremental: bool, match=None) -> int:
        """How many tokens to ask the drafter for this round (0: a plain round). cap: the most the
        budget and context allow. An incremental drafter is then steered by keep_going().

        match: for a drafter that sometimes proposes a lookup match alone instead of its usual
        draft (eagle-tree), a callable () -> that match's length or None, read only when the usual
        draft is not worth drafting: such a draft is judged by its own match class, and is free to
        draft. Without it a long copyable match would go unproposed once the usual draft stopped
        paying."""
        self.confidence, self.probing = [], False
        if cap <= 0:
            return 0
        if not self.verify.known():
            return 0  # the first round times V(1) before any choice
        self.cap = cap
        cheap = self.draft_token_ms is None or self.draft_token_ms * cap < CHEAP * self.verify(1)
        self.shadowing = not incremental and cheap
        if self.shadowing:  # free: always draft fully, then cut() decides what to verify
            plain = 1.0 / (self.verify(1) + self.overhead_ms)
            self.rho = max(plain, self.tokens_ema / self.ms_ema if self.ms_ema else 0.0, self.shared_rate)
            return cap
        self.rho = max(self._best_rate(cap, incremental), self.shared_rate)
        best_m = self._best_depth(self.acceptances(cap, optimistic=True), incremental)  # UCB
        length = match() if match is not None and not best_m else None
        if length:  # lookup's draft: no draft steps to pay
            best_m = self._best_depth(self.acceptances(cap, match_class(length), optimistic=True), incremental=False)
        if best_m:
            self.probe_interval = self.probe_after  # drafting pays: probe promptly if it stops
            self._t_last = self.clock()
            return cap if incremental else best_m  # keep_going() steers an incremental drafter
        self.plain_streak += 1
        if self.plain_streak >= self.probe_interval:
            self.probing = True
            self._t_last = self.clock()
            # one depth of the drafter's usual draft (a token for a chain, a depth's tokens for a
            # tree): a one-token tree would be learned as a worse draft than the tree is
            return self.nodes(1)
        return 0

    def keep_going(self, n_drafted: int, confidence: float) -> bool:
        """Called by an incremental drafter after each drafted token (n_drafted so far, the last
        one's probability under the drafter): draft another? Also times the draft steps.

        Stopping now is worth the best length m <= n_drafted, or a plain round (as cut() would
        choose); going on must beat that, paying the further draft steps too."""
        now = self.clock()
        step = now - self._t_last
        self._t_last = now
        if n_drafted == 1 and self.fresh:
            self.fresh = False  # a generation's first step also reads the prompt: not a step cost
        elif n_drafted == 1:
            self.draft_first_ms = self._ema(self.draft_first_ms, step * 1e3)
        else:
            self.draft_step_ms = self._ema(self.draft_step_ms, step * 1e3)
        self.confidence.append(confidence)
        if self.probing or n_drafted >= self.cap:
            return False
        known = (ms for ms in (self.draft_step_ms, self.draft_first_ms) if ms is not None)
        step_ms = next(known, 0.0)  # unknown: free
        ahead = self.acceptances(self.cap, optimistic=True)
        accept = self._given(self.confidence[:n_drafted], ahead)
        worth = values(accept, [self.extra_verify_ms(m) for m in range(self.cap + 1)], self.rho)
        stop = max(worth[: n_drafted + 1])
        return any(worth[m] - self.rho * (m - n_drafted) * step_ms > stop for m in range(n_drafted + 1, self.cap + 1))

    def cut(self, drafted: list[int], deterministic: bool, position: int = 0, match_length: int | None = None) -> int:
        """The best length to verify of a finished draft (<= len(drafted)). Only a deterministic
        draft may be cut by what it contains: cutting a sampled draft by its own tokens'
        probabilities would bias speculative sampling. A free draft (shadowing) is also held for
        shadow verification: `position` is the index its first token would have in the sequence."""
        n = len(drafted)
        cls = match_class(match_length)
        if self.shadowing and n:
            self.estimates.shadow(position, drafted, cls)
        if n == 0 or self.probing:
            return min(n, 1)
        if not deterministic:
            return n
        accept = self._given(self.confidence[:n], self.acceptances(n, cls))
        worth = values(accept, [self.extra_verify_ms(m) for m in range(n + 1)], self.rho)
        best_m = best_length(worth)
        if best_m == 0 and not self.shadowing:  # not worth verifying: a plain round, maybe a probe
            self.plain_streak += 1
            if self.plain_streak >= self.probe_interval:
                self.probing = True
                return 1
        return best_m

    def observe(
        self,
        n_verified: int,
        n_accepted: int,
        verify_ms: float,
        draft_ms: float,
        other_ms: float,
        requested: int,
        incremental: bool,
        depth: int | None = None,
        match_length: int | None = None,
        timed: bool = True,
    ) -> None:
        """Learn from the finished round: n_verified drafted tokens were scored in a forward of
        verify_ms, the first n_accepted were kept; draft_ms spent drafting `requested` tokens.
        depth: of a token tree, its depth (default n_verified, a chain). match_length: the draft's
        (Draft.match_length), whose class the acceptance is learned under, as cut() reads it.
        timed: whether that forward scored this round alone; a batched forward (specdec.batch)
        is put on the verify-cost curve by the batch, once, with all its rows."""
        depth = n_verified if depth is None else depth
        if timed:
            self.verify.observe(n_verified + 1, verify_ms)
        if n_verified and depth:
            self.nodes_per_depth = self._ema(self.nodes_per_depth, n_verified / depth)
        self.overhead_ms = self._ema(self.overhead_ms, other_ms)
        self.tokens_ema = self._ema(self.tokens_ema, n_accepted + 1.0, 0.1)
        self.ms_ema = self._ema(self.ms_ema, verify_ms + draft_ms + other_ms, 0.1)
        if requested and not incremental:
            self.draft_token_ms = self._ema(self.draft_token_ms, draft_ms / requested)
        if n_verified and not self.shadowing:  # a shadowed draft is learned from in resolve()
            checked = min(depth, n_accepted + 1)
            self.estimates.learn(match_class(match_length), checked, n_accepted)
            self.estimates.learn_confidences(self.confidence[:checked], n_accepted)
            if self.probing:  # an accepted probe need not mean drafting pays: back off
                self.probe_interval = min(2 * self.probe_interval, self.probe_max)
            self.plain_streak = 0

    def resolve(self, sequence: list[int], final: bool = False) -> None:
        """Shadow verification: learn from the held free drafts that the committed `sequence`
        (prompt + output) now settles; final=True settles all of them (Acceptance.resolve)."""
        self.estimates.resolve(sequence, final)

    def begin(self) -> None:
        """A new generation: drop shadow drafts left from an earlier one."""
        self.estimates.begin()
        self.fresh = True

    @staticmethod
    def _ema(old: float | None, new: float, weight: float = 0.3) -> float:
        return new if old is None else (1 - weight) * old + weight * new
