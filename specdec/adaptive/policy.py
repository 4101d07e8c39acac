"""Adaptive speculation (`k="auto"`): choose the draft length every round from measured costs, so
that speculating is never much slower than plain decoding.

The choice maximises long-run tokens per second. A round that drafts m tokens yields
1 + P_1 + ... + P_m tokens (P_j: probability that the first j drafted tokens are all accepted) and
takes draft(m) + V(m + 1) + overhead ms (V(n): one target forward over n new tokens). By the
renewal-reward argument (Dinkelbach's method for ratio objectives), the rate is maximised by
choosing, every round, the m that maximises  tokens(m) - rho * time(m), where rho is the best
achievable rate; rho is estimated as the best rate of a fixed draft length under the current
estimates, never below plain decoding's 1 / (V(1) + overhead). m = 0 is plain decoding.

Estimates, all learned online while generating:
- V(n): timed once for n = 1..k_max+1 at the target's first generation (VerifyCosts.calibrate,
  about k_max+1 forwards), which fixes the curve's shape; every timed verify forward then moves
  its level (a running average); an n never timed is interpolated between timed ones, or
  extrapolated with a deliberately optimistic slope;
- draft costs: for a drafter that drafts token by token (a draft model), the first step (which
  also reads the tokens committed since its last proposal) and each further step; for one that
  proposes all at once (prompt lookup), its cost per requested token;
- acceptance: per draft position, the probability that token j is accepted given that tokens
  1..j-1 were, as decayed counts (recent drafts reaching j weigh more) over a weak prior (for
  j > 1, the estimate at j - 1, lifted halfway toward 1 for drafts that are not shadow-verified:
  acceptance runs in streaks, and such a draft's deep positions are seen only when the policy
  drafts them); when the drafter reports its confidence in each token (its probability for it),
  acceptance per confidence bin (decayed, like a position's, only in rounds that reach it).

A drafter that proposes all at once and cheaply (prompt lookup, suffix matching) is asked for a
full draft every round, which is then cut to its best length, maybe 0. Such a draft is
deterministic, so it is also checked later against the tokens the target actually committed
("shadow" verification, free): that is exactly what verifying it would have accepted under greedy
decoding (and, when sampling, an unbiased draw of it), so acceptance is learned every round,
verified or not, per draft position and per match length (Draft.match_length: a 12-token match
predicts its continuation better than a 1-token one).

Within a round, a draft model is asked after every drafted token whether to go on (the confidence
stop of transformers' `assistant_confidence_threshold` and llama.cpp's `--draft-p-min`, with the
threshold replaced by the same cost-benefit test), and a finished draft is cut to its best length
(only when it is deterministic: greedy drafting, or a drafter without probabilities, so that
speculative sampling stays exact). When plain decoding wins for a while, a one-token probe (one
depth of a token tree) is drafted now and then (exponential back-off) to notice when speculation
starts paying again.

The verify-cost table is kept per target model and the acceptance and draft-cost estimates per
(drafter, target), across generations: a server or a bench learns them once.

Related work: SpecDec++ (Huang et al. 2024) and "dynamic speculation lookahead" (Mamou et al. 2024)
choose the draft length per round; BanditSpec and SWIFT adapt online.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from specdec.bench.costmodel import interpolate
from specdec.models.load import Model, synchronize

BIN_EDGES = (0.2, 0.4, 0.6, 0.8, 0.9, 0.97)  # confidence bins: [0, .2), [.2, .4), ..., [.97, 1]
MATCH_EDGES = (1, 2, 3, 4, 6, 10, 16)  # match-length classes: unknown, 1, 2, 3, 4-5, 6-9, 10-15, 16+
CHEAP = 0.02  # a proposal of k_max tokens under this fraction of V(1) counts as free


def _bin(confidence: float) -> int:
    return sum(confidence >= edge for edge in BIN_EDGES)


def match_class(match_length: int | None) -> int:
    """Acceptance-table row of a draft: 0 when the drafter gives no match length, else its class."""
    return 0 if not match_length else sum(match_length >= edge for edge in MATCH_EDGES)


@dataclass
class VerifyCosts:
    """Estimates of V(n) in ms, n = new tokens in one target forward, at the current context length.

    The curve's shape V(n)/V(1) is timed back to back (calibrate) at a few context lengths, since
    attention over the cache makes it steeper as the context grows (SmolLM2, 2-core EPYC, fp32:
    V(4)/V(1) = 0.94 at 64 tokens, 1.04 at 1024); between them the shape is interpolated linearly
    in the context length (at()). Every timed round moves one level, V(1), which scales the whole
    curve: so a length the policy rarely chooses is not left at its calibration time while the
    lengths it uses pick up every slow round (that made rarely used lengths look cheap, and auto
    chose them for it). Lengths outside the calibrated ones (and everything before calibration)
    keep running averages of their own."""

    ema: float = 0.3  # weight of the newest observation
    optimistic_slope: float = 0.25  # extrapolation: V(n + 1) - V(n) = slope * V(1) beyond the tried n
    spacing: float = math.sqrt(2)  # a context within this factor of a calibrated one needs no calibration
    ahead_max: int = 256  # calibrate() fills at most this many tokens to time the context ahead
    ms: dict[int, float] = field(default_factory=dict)
    shape: dict[int, float] = field(default_factory=dict)  # V(n) / V(1) at the current context
    shapes: dict[int, dict[int, float]] = field(default_factory=dict)  # context length -> shape timed there
    step: int = 16  # at() redoes the interpolation after the context moved this many tokens
    _at: tuple[int, int] = (-1 << 30, 0)  # (context, number of shapes) of the last interpolation

    @classmethod
    def for_model(cls, model) -> "VerifyCosts":
        """The verify-cost curve of `model` on this machine: empty until calibrate() times it."""
        return cls()

    def observe(self, n: int, ms: float) -> None:
        if n in self.shape:
            level = (1 - self.ema) * self.ms[1] + self.ema * ms / self.shape[n]
            self.ms.update({m: level * ratio for m, ratio in self.shape.items()})
            return
        old = self.ms.get(n)
        self.ms[n] = ms if old is None else (1 - self.ema) * old + self.ema * ms

    def known(self) -> bool:
        return bool(self.ms)

    def needs(self, context: int) -> bool:
        """Whether no shape has been timed within a factor `spacing` of this context length."""
        return not any(c / self.spacing <= context <= c * self.spacing for c in self.shapes)

    def calibrate(self, kv, context: list[int], n_max: int, ahead: int = 0, repeats: int = 3) -> None:
        """Time V(1..n_max) on kv (a target cache holding the prompt; left as it was), the fastest
        of `repeats` passes each, so that the choice of k rests on the whole measured curve rather
        than on an extrapolation (on a CPU the curve is not smooth: oneDNN picks kernels by the
        number of rows). Times it at len(kv) and, with ahead > 0, at len(kv) + min(ahead,
        ahead_max) (the cache first filled with that many tokens of the context, then rolled back):
        the context a generation of `ahead` tokens reaches, or toward it, as the fill is a prefill
        paid once (not on a transformers cache with sliding-window layers, which can undo only its
        last forward). Skips a length within `spacing` of one
        already timed. The first calibration also sets the level; rounds then move it (see the class).
        A shape is timed once per context range and kept, so one burst of load over both passes of
        V(1) used to stick (fastest of 2: in a bench, SmolLM2-135M fp32 on a 2-core EPYC, Spec-Bench
        summarization and rag, the never-right `random` drafter was verified 4 tokens a round at
        660-769 tokens of context, 0.92x plain, where alone the same calibration read V(5)/V(1) =
        1.05 and auto drafted nothing): 3 passes."""
        keep = len(kv)
        if getattr(kv, "sliding", None):  # a sliding-window cache can undo only its last forward
            ahead = 0
        for at in (keep, keep + min(ahead, self.ahead_max)) if ahead else (keep,):
            if not self.needs(at) or at >= kv.model.n_ctx - 1:
                continue
            if at > keep:
                kv.extend(_repeated(context, at - keep), all_logits=False)
            self._time(kv, context, min(n_max, kv.model.n_ctx - at), repeats)
            kv.rollback(keep)
        self.at(keep)

    def _time(self, kv, context: list[int], n_max: int, repeats: int) -> None:
        here = len(kv)
        block = _repeated(context, n_max)
        best: dict[int, float] = {}
        for _ in range(repeats):
            for n in range(1, n_max + 1):
                synchronize(kv.model.device)
                start = time.perf_counter()
                kv.extend(block[:n])
                synchronize(kv.model.device)
                best[n] = min(best.get(n, math.inf), (time.perf_counter() - start) * 1e3)
                kv.rollback(here)
        if not self.shapes:  # the first calibration also sets the level
            self.ms.update(best)
        self.shapes[here] = {n: best[n] / best[1] for n in best}

    def at(self, context: int) -> None:
        """Use the shape at this context length: interpolated between the two nearest timed
        lengths, the nearest one's outside them. The level (V(1)) is kept. Cheap when called every
        round: redone only after the context moved by `step` tokens or a new calibration."""
        if not self.shapes or (abs(context - self._at[0]) < self.step and self._at[1] == len(self.shapes)):
            return
        self._at = (context, len(self.shapes))
        below = max((c for c in self.shapes if c <= context), default=None)
        above = min((c for c in self.shapes if c >= context), default=None)
        if below is None or above is None or below == above:
            shape = self.shapes[below if above is None else above]
        else:
            w = (context - below) / (above - below)
            lo, hi = self.shapes[below], self.shapes[above]
            shape = {n: (1 - w) * lo[n] + w * hi[n] for n in lo.keys() & hi.keys()}
        if shape != self.shape:
            self.shape = shape
            self.ms.update({m: self.ms[1] * ratio for m, ratio in shape.items()})

    def __call__(self, n: int) -> float:
        """Estimated V(n) in ms (0 when nothing has been timed yet)."""
        if not self.ms:
            return 0.0
        inside = interpolate(self.ms, n)
        if inside is not None:
            return inside
        first, last = min(self.ms), max(self.ms)
        v1 = self.ms.get(1, self.ms[first] / (1 + self.optimistic_slope * (first - 1)))
        if n < first:
            return max(0.0, self.ms[first] - self.optimistic_slope * v1 * (first - n))
        return self.ms[last] + self.optimistic_slope * v1 * (n - last)


def _repeated(tokens: list[int], n: int) -> list[int]:
    """n tokens: `tokens` repeated (filler of a realistic kind for timing forwards)."""
    return (tokens * (n // max(len(tokens), 1) + 1))[:n]




class AdaptiveK:
    """The per-round draft-length policy of `generate(..., k="auto")` for one (drafter, target).

    k_max: the longest draft of a round (>= 1). decay: weight kept by a draft position's (or a
    confidence bin's) old acceptance counts each time a draft reaches it (0.9: about the last 10
    such drafts). prior: acceptance assumed before any round, worth prior_weight rounds. probe_after: plain rounds
    before a one-token probe (one depth of a tree); it doubles after each probe, up to probe_max,
    and resets when the policy chooses to draft again. margin: the part of V(1) any verify of
    drafted tokens is taken to cost beyond the measured curve (see _extra_verify_ms). lift: how far
    the prior of a deeper position moves from the estimate at the position before toward 1 (see
    acceptances). explore: standard errors added to each position's estimate when deciding how
    deep to draft (see acceptances). clock: seconds, read to time a draft model's steps
    (specdec.bench.replay runs the policy on a simulated one).

    Raises ValueError for k_max < 1.
    """

    def __init__(self, costs: VerifyCosts, k_max: int = 8, decay: float = 0.9, prior: float = 0.5,
                 prior_weight: float = 1.0, probe_after: int = 4, probe_max: int = 64, margin: float = 0.02,
                 lift: float = 0.5, explore: float = 1.0, clock=time.perf_counter):
        if k_max < 1:
            raise ValueError(f"k_max must be >= 1 for k='auto', got {k_max}")
        self.verify, self.k_max, self.decay = costs, k_max, decay
        self.prior, self.prior_weight = prior, prior_weight
        self.probe_after, self.probe_max = probe_after, probe_max
        self.margin, self.lift, self.explore = margin, lift, explore
        self.clock = clock
        # decayed counts per match class and draft position: drafts whose j-th token was checked
        # after tokens 1..j-1 were accepted, and those whose j-th token was accepted too
        self.reached = [[0.0] * k_max for _ in range(len(MATCH_EDGES) + 1)]
        self.accepted = [[0.0] * k_max for _ in range(len(MATCH_EDGES) + 1)]
        self.pending: list[tuple[int, list[int], int]] = []  # shadow drafts: (position, tokens, class)
        self.shadowing = False  # this round's draft is free and learned from by shadow verification
        self.tokens_ema: float | None = None  # realised tokens per round (running average)
        self.ms_ema: float | None = None  # realised ms per round
        self.bin_reached = [0.0] * (len(BIN_EDGES) + 1)
        self.bin_accepted = [0.0] * (len(BIN_EDGES) + 1)
        self.draft_first_ms: float | None = None  # draft model: first step of a proposal
        self.draft_step_ms: float | None = None  # draft model: each further step
        self.draft_token_ms: float | None = None  # all-at-once drafter: proposal ms per requested token
        self.overhead_ms = 0.0  # per round, outside drafting and verifying
        self.nodes_per_depth = 1.0  # tokens verified per depth of this drafter's drafts: 1 for chains, more for trees
        self.fresh = True  # no draft step timed yet in this generation
        self.plain_streak = 0
        self.probe_interval = probe_after
        self.probing = False
        # the round in progress
        self.rho = 0.0
        self.cap = k_max
        self.confidence: list[float] = []
        self._t_last = 0.0  # when the last draft step ended

    # ---- estimates ----------------------------------------------------------------------------
    def acceptances(self, n: int, cls: int = 0, optimistic: bool = False) -> list[float]:
        """[P(draft token j accepted | tokens 1..j-1 accepted) for j = 1..n], for drafts of match
        class cls (0: drafters without a match length); positions past k_max share k_max's.

        The prior of position 1 is `prior`; that of a deeper position is the estimate at the one
        before it, since few drafts reach deep positions and acceptance runs in streaks: a token
        that follows accepted ones is more likely right than a first one (fixed k = 4, greedy,
        Spec-Bench dev: Qwen2.5-Coder 0.5B drafting for 1.5B 0.71 at position 1, then 0.94, 0.88,
        0.81 given the ones before; SmolLM2 prompt lookup 0.31, then 0.58, 0.72, 0.77). Unless this
        round's draft is shadow-verified, that estimate is lifted by `lift` toward 1, optimism where
        the policy's own choices decide what is observed: without it, a policy that rarely drafted
        past one token never learnt that the second pays (Qwen pair as above, fp32 target, bf16
        draft, 2-core EPYC, writing: auto's mean k 1.18, tau 1.64, against k = 4's tau 2.67). A
        shadow-verified draft (prompt lookup) is checked at every position every round, verified
        or not, so it needs no optimism; with it, auto verified 7-8 lookup tokens where 3-4 did as
        well for less (SmolLM2 fp32, lean, 2-core EPYC, stem: mean k 3.45 against 2.01, same tau).
        A fixed 0.5 compounded over 8 positions made long verified drafts look hopeless.

        optimistic=True (plan() and keep_going(), which decide how deep to draft) adds `explore`
        standard errors to each estimate: optimism in the face of uncertainty (UCB, Auer et al.
        2002). A position's counts change only when a draft reaches it, so a low estimate that
        stops drafts short of it is never corrected. At the first position, near break-even, one
        unlucky streak stopped all drafting for most of a generation (eagle-tree, SmolLM2 fp32,
        2-core EPYC, MT-bench coding and stem: 126 plain rounds of 128 where k = 4 read 1.04x /
        1.11x plain); at deeper ones, two low-acceptance prompts left the Qwen pair (2.5-Coder
        1.5B fp32 target on the lean backend, 0.5B bf16 draft, 2-core EPYC) drafting one token a
        round through 82 of 85 rounds of Spec-Bench dev reasoning, math and coding, 64 tokens each
        (math: 31 of 32 drafts accepted). A drafter that is never right has a small estimate and
        a smaller error, and stays plain.

        Match classes (cls >= 2) are learnt apart, and long matches are rare, so the prior at each
        position of a class is at least the estimate of the next shorter match's class there: a
        longer match is at least as good a sign. With the fixed prior, two 17- and 23-token matches, a
        class not seen yet, read 0.5 at every position and were cut to 5 of 8 tokens, and one
        rejection left a 10-15-token class at 0.25 everywhere, so 12- and 14-token matches were cut
        to 1 (SmolLM2-135M fp32 lean, prompt lookup, Spec-Bench dev extraction, 128 tokens, replayed
        under costs measured on a 2-core Xeon: auto 0.88x the speed of k = 8)."""
        lift = 0.0 if self.shadowing else self.lift
        shorter = self.acceptances(n, cls - 1) if cls >= 2 else None  # the next shorter match's class
        out, estimate = [], self.prior
        for i in range(min(n, self.k_max)):
            prior = estimate if i == 0 else estimate + lift * (1.0 - estimate)
            if shorter:  # a longer match is at least as good a sign
                prior = max(prior, shorter[i])
            weight = self.reached[cls][i] + self.prior_weight
            estimate = (self.accepted[cls][i] + prior * self.prior_weight) / weight
            bonus = self.explore * math.sqrt(estimate * (1.0 - estimate) / weight) if optimistic else 0.0
            out.append(min(1.0, estimate + bonus))
        return out + out[-1:] * (n - len(out))

    def acceptance(self, j: int, cls: int = 0) -> float:
        """P(draft token j accepted | tokens 1..j-1 accepted), j from 1 (see acceptances)."""
        return self.acceptances(j, cls)[-1]

    def confident_acceptance(self, confidence: float) -> float:
        """P(a token accepted | the drafter gave it this probability), prior: the confidence."""
        b = _bin(confidence)
        return (self.bin_accepted[b] + confidence * self.prior_weight) / (self.bin_reached[b] + self.prior_weight)

    def _draft_ms(self, m: int, incremental: bool) -> float:
        """Estimated ms to draft m tokens from scratch."""
        if m == 0:
            return 0.0
        if incremental:
            first = self.draft_first_ms or 0.0
            return first + (m - 1) * (self.draft_step_ms if self.draft_step_ms is not None else first)
        return m * (self.draft_token_ms or 0.0)

    def _nodes(self, depth: int) -> int:
        """Tokens verified for a draft `depth` deep: depth for a chain; for a token tree (eagle-tree,
        suffix-tree) about nodes_per_depth x depth, at most the round's cap (the engine prunes a
        tree to it)."""
        return max(depth, min(self.cap, round(depth * self.nodes_per_depth))) if depth > 0 else 0

    def _extra_verify_ms(self, m: int) -> float:
        """What verifying a draft m >= 1 tokens deep is taken to cost over a plain step, in ms: the
        measured V(n + 1) - V(1) at the current context, n = _nodes(m) (m for a chain, more for a
        tree), plus `margin` x V(1) (for the noise of a curve timed once per context range).
        It may be negative: where oneDNN's kernel for n + 1 rows beats its one-row kernel (2-core
        EPYC, lean, fp32, 64 tokens of context: SmolLM2 V(4) = 0.94 V(1) before specdec.backends.gemv,
        Qwen2.5-Coder-1.5B 0.73), verifying even a useless draft is faster than a plain step, and a
        fixed k = 2 with a random drafter gained 4% from it while auto, refusing junk, did not."""
        return self.verify(self._nodes(m) + 1) - self.verify(1) + self.margin * self.verify(1)

    def _best_rate(self, cap: int, incremental: bool) -> float:
        """rho: the best tokens per ms of a fixed draft length 0..cap under the estimates."""
        best, tokens, p = 0.0, 1.0, 1.0
        accept = self.acceptances(cap)
        for m in range(cap + 1):
            if m:
                p *= accept[m - 1]
                tokens += p
            ms = self._draft_ms(m, incremental) + self.verify(1) + (self._extra_verify_ms(m) if m else 0.0) + self.overhead_ms
            best = max(best, tokens / ms if ms > 0 else 0.0)
        return best

    def _deepest_worth(self, accept: list[float], incremental: bool) -> int:
        """The draft length m maximising tokens(m) - rho * (draft(m) + extra verify(m)) under these
        acceptances, 0 when no length beats a plain round."""
        gain, p, best, best_m = 0.0, 1.0, 0.0, 0
        for m, a in enumerate(accept, start=1):
            p *= a
            gain += p
            value = gain - self.rho * (self._draft_ms(m, incremental) + self._extra_verify_ms(m))
            if value > best:
                best, best_m = value, m
        return best_m

    # ---- one round ----------------------------------------------------------------------------
    def plan(self, cap: int, incremental: bool, match=None) -> int:
        """How many tokens to ask the drafter for this round (0: a plain round). cap: the most the
        budget and context allow. An incremental drafter is then steered by keep_going().

        match: for a drafter that sometimes proposes a lookup match alone instead of its usual
        draft (eagle-tree, EagleDrafter.long_match), a callable () -> that match's length or None,
        read only when the usual draft is not worth drafting: such a draft is judged by its own
        match class, and is free to draft. Otherwise a plain round never looked for it, and once
        the head's trees stopped paying and probes had backed off, a long copyable match went
        unproposed (eagle-tree, SmolLM2-135M fp32 on the lean backend, 2-core EPYC, Spec-Bench dev
        extraction, 128 tokens: 2 tokens drafted in 126 rounds, 1.00x plain, where another run of
        the same policy reached 2.8x)."""
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
            self.rho = max(plain, self.tokens_ema / self.ms_ema if self.ms_ema else 0.0)
            return cap
        self.rho = self._best_rate(cap, incremental)
        best_m = self._deepest_worth(self.acceptances(cap, optimistic=True), incremental)  # UCB: see acceptances()
        length = match() if match is not None and not best_m else None
        if length:
            best_m = self._deepest_worth(self.acceptances(cap, match_class(length), optimistic=True),
                                         incremental=False)  # lookup's draft: no draft steps to pay
        if best_m:
            self.probe_interval = self.probe_after  # drafting pays: probe promptly if it stops paying
            self._t_last = self.clock()
            return cap if incremental else best_m  # keep_going() steers an incremental drafter
        self.plain_streak += 1
        if self.plain_streak >= self.probe_interval:
            self.probing = True
            self._t_last = self.clock()
            # one depth of the drafter's usual draft: a token for a chain, the head's token, its
            # sibling and lookup's for eagle-tree. A one-token tree is a worse draft than the
            # first depth the estimates describe: rejected, it taught the policy that trees do not
            # pay (eagle-tree, SmolLM2 fp32, 2-core EPYC, MT-bench coding: 126 plain rounds of 128)
            return self._nodes(1)
        return 0

    def keep_going(self, n_drafted: int, confidence: float) -> bool:
        """Called by an incremental drafter after each drafted token (n_drafted so far, the last
        one's probability under the drafter): draft another? Also times the draft steps."""
        now = self.clock()
        step = now - self._t_last
        self._t_last = now
        if n_drafted == 1 and self.fresh:
            self.fresh = False  # a generation's first step also reads its whole prompt: not a step cost
        elif n_drafted == 1:
            self.draft_first_ms = self._ema(self.draft_first_ms, step * 1e3)
        else:
            self.draft_step_ms = self._ema(self.draft_step_ms, step * 1e3)
        self.confidence.append(confidence)
        if self.probing or n_drafted >= self.cap:
            return False
        # the value (tokens) of verifying the first m tokens: gain(m) - rho * extra verify ms; stopping
        # now is worth the best of m <= n_drafted or 0 (a plain round, as cut() would choose); going
        # on must beat that, paying the further draft steps too. Measured against the value of the
        # draft as it stands instead, a draft not worth verifying was drafted deeper only to be cut
        # to nothing (eagle-tree, SmolLM2 fp32, 2-core EPYC, MT-bench writing: 2 head steps then 0 verified in
        # 1 round in 10)
        step_ms = next((ms for ms in (self.draft_step_ms, self.draft_first_ms) if ms is not None), 0.0)  # unknown: free
        gain, p, stop = 0.0, 1.0, 0.0
        accept = self.acceptances(self.cap, optimistic=True)
        for m in range(1, self.cap + 1):
            p *= self.confident_acceptance(self.confidence[m - 1]) if m <= n_drafted else accept[m - 1]
            gain += p
            value = gain - self.rho * self._extra_verify_ms(m)
            if m <= n_drafted:
                stop = max(stop, value)
            elif value - self.rho * (m - n_drafted) * step_ms > stop:
                return True
        return False

    def cut(self, drafted: list[int], deterministic: bool, position: int = 0, match_length: int | None = None) -> int:
        """The best length to verify of a finished draft (<= len(drafted)). Only a deterministic
        draft may be cut by what it contains: cutting a sampled draft by its own tokens'
        probabilities would bias speculative sampling. A free draft (shadowing) is also kept for
        shadow verification: `position` is the index its first token would have in the sequence."""
        n = len(drafted)
        cls = match_class(match_length)
        if self.shadowing and n:
            self.pending.append((position, list(drafted), cls))
        if n == 0 or self.probing:
            return min(n, 1)
        if not deterministic:
            return n
        have = self.confidence[:n]
        accept = self.acceptances(n, cls)
        best_m, best, gain, p = 0, 0.0, 0.0, 1.0
        for m in range(1, n + 1):
            p *= self.confident_acceptance(have[m - 1]) if m <= len(have) else accept[m - 1]
            gain += p
            value = gain - self.rho * self._extra_verify_ms(m)
            if value > best:
                best_m, best = m, value
        if best_m == 0 and not self.shadowing:  # not worth verifying: a plain round, maybe a probe
            self.plain_streak += 1
            if self.plain_streak >= self.probe_interval:
                self.probing = True
                return 1
        return best_m

    def observe(self, n_verified: int, n_accepted: int, verify_ms: float, draft_ms: float, other_ms: float,
                requested: int, incremental: bool, depth: int | None = None,
                match_length: int | None = None) -> None:
        """Learn from the finished round: n_verified drafted tokens were scored in a forward of
        verify_ms, the first n_accepted were kept; draft_ms spent drafting `requested` tokens.
        depth: of a token tree, its depth (default n_verified, a chain). match_length: the draft's
        (Draft.match_length), whose class the acceptance is learned under, as cut() reads it: a
        drafter that sometimes proposes a long lookup match alone (eagle-tree) and otherwise a
        head's tree keeps the two apart."""
        depth = n_verified if depth is None else depth
        self.verify.observe(n_verified + 1, verify_ms)
        if n_verified and depth:
            self.nodes_per_depth = self._ema(self.nodes_per_depth, n_verified / depth)
        self.overhead_ms = self._ema(self.overhead_ms, other_ms)
        self.tokens_ema = self._ema(self.tokens_ema, n_accepted + 1.0, 0.1)
        self.ms_ema = self._ema(self.ms_ema, verify_ms + draft_ms + other_ms, 0.1)
        if requested and not incremental:
            self.draft_token_ms = self._ema(self.draft_token_ms, draft_ms / requested)
        if n_verified and not self.shadowing:  # a shadowed draft is learned from in resolve()
            self._learn(match_class(match_length), min(depth, n_accepted + 1), n_accepted)
            self._learn_bins(self.confidence[: min(depth, n_accepted + 1)], n_accepted)
            if self.probing:  # an accepted probe need not make drafting pay (costs): back off until plan() drafts
                self.probe_interval = min(2 * self.probe_interval, self.probe_max)
            self.plain_streak = 0

    def _learn(self, cls: int, reached: int, accepted: int) -> None:
        """One draft's outcome: its tokens 1..reached were checked, 1..accepted were accepted.
        A position's counts decay only when a draft reaches it: a deep position, reached by few
        drafts, keeps its last ~10 outcomes instead of fading back to its prior in the rounds that
        stop short of it (a prompt-lookup draft reached position 5 in one round in 12: SmolLM2,
        Spec-Bench dev, k = 8)."""
        for j in range(reached):
            i = min(j, self.k_max - 1)
            self.reached[cls][i] = self.reached[cls][i] * self.decay + 1
            self.accepted[cls][i] = self.accepted[cls][i] * self.decay + (j < accepted)

    def _learn_bins(self, confidences: list[float], accepted: int) -> None:
        """One draft's checked tokens, by the drafter's confidence in each: the first `accepted` were
        accepted. As for draft positions (_learn), a bin's counts decay only in rounds that reach
        it: decayed every round, a rarely seen bin (the low-confidence tokens of a good draft model)
        faded back to its prior, the confidence itself, and the policy stopped drafting at tokens
        the target accepted more often than that. Bins decaying only when reached lifted the
        Qwen pair (2.5-Coder 1.5B fp32 target on the lean backend, 0.5B bf16 draft, 2-core EPYC,
        Spec-Bench dev, 4 prompts x 128 tokens per category, replayed) on translation from 0.96x to
        1.03x the best fixed k, and on qa from 0.99x to 1.01x."""
        for b in {_bin(c) for c in confidences}:
            self.bin_reached[b] *= self.decay
            self.bin_accepted[b] *= self.decay
        for j, confidence in enumerate(confidences):
            b = _bin(confidence)
            self.bin_reached[b] += 1
            self.bin_accepted[b] += j < accepted

    def resolve(self, sequence: list[int], final: bool = False) -> None:
        """Shadow verification: check the pending free drafts against the committed `sequence`
        (prompt + output); a draft is settled once it mismatches or is covered, or at the end
        (final=True) with what is known."""
        waiting = []
        for position, tokens, cls in self.pending:
            seen = sequence[position: position + len(tokens)]
            run = 0
            while run < len(seen) and seen[run] == tokens[run]:
                run += 1
            if run < len(seen):  # mismatch at draft position run + 1
                self._learn(cls, run + 1, run)
            elif len(seen) == len(tokens) or final:
                self._learn(cls, run, run)
            else:
                waiting.append((position, tokens, cls))
        self.pending = waiting

    def begin(self) -> None:
        """A new generation: drop shadow drafts left from an earlier one."""
        self.pending = []
        self.fresh = True

    @staticmethod
    def _ema(old: float | None, new: float, weight: float = 0.3) -> float:
        return new if old is None else (1 - weight) * old + weight * new
