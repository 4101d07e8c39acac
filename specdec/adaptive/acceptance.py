"""Acceptance estimates of adaptive k, learned online: how likely a drafted token is accepted.

- Per draft position j: P(token j accepted | tokens 1..j-1 accepted), as decayed counts per match
  class (Draft.match_length: a long lookup match predicts its continuation better than a short
  one). A position's counts decay only when a draft reaches it.
- Per confidence bin: P(a token accepted | the drafter gave it this probability), for drafters
  that report their probabilities (draft models, heads); and P(the next drafted token accepted |
  this one accepted with this probability), what a draft model's last confidence says of the
  token it has not drafted yet (acceptance runs in streaks).
- Shadow verification: a free deterministic draft (prompt lookup, suffix) is held until the tokens
  it guessed are committed, then learned from as if verified, whether it was verified or not.
"""

from __future__ import annotations

import math

BIN_EDGES = (0.2, 0.4, 0.6, 0.8, 0.9, 0.97)  # confidence bins: [0, .2), [.2, .4), ..., [.97, 1]
MATCH_EDGES = (1, 2, 3, 4, 6, 10, 16)  # match classes: unknown, 1, 2, 3, 4-5, 6-9, 10-15, 16+


def confidence_bin(confidence: float) -> int:
    """The confidence bin of a drafter's probability for a token (0..len(BIN_EDGES))."""
    return sum(confidence >= edge for edge in BIN_EDGES)


def match_class(match_length: int | None) -> int:
    """Acceptance-table row of a draft: 0 when the drafter gives no match length, else its class."""
    return 0 if not match_length else sum(match_length >= edge for edge in MATCH_EDGES)


class Acceptance:
    """The acceptance estimates of one (drafter, target).

    k_max: draft positions kept (deeper ones share the last). decay: weight kept by a position's
    (or a bin's) counts each time a draft reaches it (0.9: about the last 10 such drafts). prior:
    acceptance assumed at position 1 before any draft, worth prior_weight drafts. lift: how far a
    deeper position's prior moves from the estimate before it toward 1 (see per_position).
    explore: standard errors added to an estimate read optimistically (UCB).

    reached[c][j] / accepted[c][j]: decayed counts of drafts of match class c whose token j + 1
    was checked (tokens 1..j accepted) / accepted too. bin_reached[b] / bin_accepted[b]: the same
    per confidence bin; next_reached[b] / next_accepted[b]: per confidence bin of the token before.
    pending: shadow drafts not yet settled, (position, tokens, class).
    """

    def __init__(
        self,
        k_max: int,
        decay: float = 0.9,
        prior: float = 0.5,
        prior_weight: float = 1.0,
        lift: float = 0.5,
        explore: float = 1.0,
    ):
        self.k_max, self.decay = k_max, decay
        self.prior, self.prior_weight, self.lift, self.explore = prior, prior_weight, lift, explore
        self.reached = [[0.0] * k_max for _ in range(len(MATCH_EDGES) + 1)]
        self.accepted = [[0.0] * k_max for _ in range(len(MATCH_EDGES) + 1)]
        self.bin_reached = [0.0] * (len(BIN_EDGES) + 1)
        self.bin_accepted = [0.0] * (len(BIN_EDGES) + 1)
        self.next_reached = [0.0] * (len(BIN_EDGES) + 1)
        self.next_accepted = [0.0] * (len(BIN_EDGES) + 1)
        self.pending: list[tuple[int, list[int], int]] = []

    # ---- reading ------------------------------------------------------------------------------
    def per_position(
        self, n: int, cls: int = 0, optimistic: bool = False, lifted: bool = True, cautious: bool = False
    ) -> list[float]:
        """[P(draft token j accepted | tokens 1..j-1 accepted) for j = 1..n] for drafts of match
        class cls (0: drafters without a match length); positions past k_max share k_max's.

        Each position's estimate is its decayed counts over a prior worth prior_weight drafts.
        The prior of position 1 is `prior`; that of a deeper position is the estimate at the one
        before it, since acceptance runs in streaks and few drafts reach deep positions. With
        lifted=True (a draft that is not shadow-verified, whose deep positions are seen only when
        the policy drafts them) that prior is moved by `lift` toward 1: optimism where the
        policy's own choices decide what is observed. For a match class >= 2 the prior is at
        least the next shorter class's estimate at the same position: a longer match is at least
        as good a sign, and long matches are rare.

        optimistic=True adds `explore` standard errors to each estimate (UCB, Auer et al. 2002):
        a position's counts change only when a draft reaches it, so a low estimate that stops
        drafts short of it would never be corrected. cautious=True subtracts them instead (a lower
        bound), for a draft that is learned from whether or not it is verified (shadowed): it needs
        no exploration, and verifying where a noisy estimate happens to be high pays for that
        noise (the winner's curse)."""
        lift = self.lift if lifted else 0.0
        side = float(optimistic) - float(cautious)  # standard errors added: +1, -1, or 0 (neither, or both)
        shorter = self.per_position(n, cls - 1, lifted=lifted) if cls >= 2 else None
        out, estimate = [], self.prior
        for i in range(min(n, self.k_max)):
            prior = estimate if i == 0 else estimate + lift * (1.0 - estimate)
            if shorter:
                prior = max(prior, shorter[i])
            weight = self.reached[cls][i] + self.prior_weight
            estimate = (self.accepted[cls][i] + prior * self.prior_weight) / weight
            error = math.sqrt(estimate * (1.0 - estimate) / weight)  # standard error
            out.append(min(1.0, max(0.0, estimate + side * self.explore * error)))
        return out + out[-1:] * (n - len(out))

    def given_confidence(self, confidence: float) -> float:
        """P(a token accepted | the drafter gave it this probability), prior: the confidence."""
        b = confidence_bin(confidence)
        return (self.bin_accepted[b] + confidence * self.prior_weight) / (self.bin_reached[b] + self.prior_weight)

    def after_confidence(self, confidence: float, prior: float) -> float:
        """P(the next drafted token accepted | this one accepted, the drafter gave it this
        probability), from `prior` (the next position's estimate) worth prior_weight drafts."""
        b = confidence_bin(confidence)
        return (self.next_accepted[b] + prior * self.prior_weight) / (self.next_reached[b] + self.prior_weight)

    # ---- learning -----------------------------------------------------------------------------
    def learn(self, cls: int, reached: int, accepted: int) -> None:
        """One draft of match class cls: its tokens 1..reached were checked, 1..accepted were
        accepted. Only the positions it reached decay."""
        for j in range(reached):
            i = min(j, self.k_max - 1)
            self.reached[cls][i] = self.reached[cls][i] * self.decay + 1
            self.accepted[cls][i] = self.accepted[cls][i] * self.decay + (j < accepted)

    def learn_confidences(self, confidences: list[float], accepted: int) -> None:
        """One draft's checked tokens, by the drafter's confidence in each (and in the token before
        each but the first): the first `accepted` were accepted. Only the bins it reached decay, so
        a rarely reached bin (a good draft model's low-confidence tokens) keeps its estimate instead
        of fading back to its prior."""
        n = len(confidences)
        self._count_bins(self.bin_reached, self.bin_accepted, confidences, [j < accepted for j in range(n)])
        # token j + 1 was checked, so token j was accepted: what followed it
        self._count_bins(self.next_reached, self.next_accepted, confidences[:-1], [j < accepted for j in range(1, n)])

    def _count_bins(self, reached: list[float], accepted: list[float], confidences: list[float], hits: list[bool]):
        """Decay the bins these confidences fall in, once each, then count each (confidence, hit)."""
        for b in {confidence_bin(c) for c in confidences}:
            reached[b] *= self.decay
            accepted[b] *= self.decay
        for confidence, hit in zip(confidences, hits):
            b = confidence_bin(confidence)
            reached[b] += 1
            accepted[b] += hit

    # ---- shadow verification ------------------------------------------------------------------
    def shadow(self, position: int, tokens: list[int], cls: int) -> None:
        """Hold a free deterministic draft (its first token at sequence index `position`) until
        resolve() can check it against the committed tokens."""
        self.pending.append((position, list(tokens), cls))

    def resolve(self, sequence: list[int], final: bool = False) -> None:
        """Check the held drafts against the committed `sequence` (prompt + output): a draft is
        learned from once it mismatches or is covered, or at the end (final=True) with what is
        known. Under greedy decoding that is exactly what verifying it would have accepted."""
        waiting = []
        for position, tokens, cls in self.pending:
            seen = sequence[position : position + len(tokens)]
            run = 0
            while run < len(seen) and seen[run] == tokens[run]:
                run += 1
            if run < len(seen):  # mismatch at draft position run + 1
                self.learn(cls, run + 1, run)
            elif len(seen) == len(tokens) or final:
                self.learn(cls, run, run)
            else:
                waiting.append((position, tokens, cls))
        self.pending = waiting

    def begin(self) -> None:
        """A new generation: drop the drafts held from an earlier one."""
        self.pending = []
