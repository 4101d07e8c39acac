"""Per-run statistics of speculative decoding, in the field's terms.

- drafted tokens: tokens the drafter proposed and the target verified (summed over rounds; for
  a token tree, every node);
- accepted tokens: drafted tokens the verifier kept;
- acceptance rate alpha = accepted / drafted;
- acceptance per draft position i = rounds whose i-th drafted token was accepted / rounds that
  drafted an i-th token (for a tree: a token at depth i);
- mean accepted length tau = new tokens / rounds, which COUNTS the recovered or bonus token
  (vLLM's "mean acceptance length"); plain decoding has tau = 1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RunStats:
    k: int | str  # the draft length asked for: an int, or "auto"
    prompt_tokens: int = 0
    new_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)  # per draft position
    accepted_at: list[int] = field(default_factory=list)
    k_per_round: list[int] = field(default_factory=list)  # tokens drafted and verified in each round
    forced: int = 0  # tokens a grammar forced (specdec.grammar): verified as free drafts, not in drafted/accepted
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    stop_reason: str = ""  # eos | stop | length | context

    def record_round(self, n_drafted: int, n_accepted: int, depth: int | None = None) -> None:
        """One round: n_drafted tokens verified, n_accepted kept. depth: for a token tree, its
        depth (the positions it drafted; default n_drafted, a chain)."""
        depth = n_drafted if depth is None else depth
        self.rounds += 1
        self.k_per_round.append(n_drafted)
        self.drafted += n_drafted
        self.accepted += n_accepted
        while len(self.drafted_at) < depth:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for i in range(depth):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < n_accepted

    @property
    def alpha(self) -> float:
        """Acceptance rate: accepted / drafted tokens (nan when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def tau(self) -> float:
        """Mean accepted length per round, the recovered / bonus token included."""
        return self.new_tokens / self.rounds if self.rounds else float("nan")

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def other_s(self) -> float:
        """Time outside prefill, drafting and verifying: sampling, bookkeeping, stop checks."""
        return self.total_s - self.prefill_s - self.draft_s - self.verify_s

    @property
    def tokens_per_s(self) -> float:
        """New tokens over the whole run's wall time, prefill included."""
        return self.new_tokens / self.total_s if self.total_s else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        """New tokens over the wall time after prefill: the speed speculation changes."""
        decode = self.total_s - self.prefill_s
        return self.new_tokens / decode if decode > 0 else float("nan")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            alpha=self.alpha,
            tau=self.tau,
            acceptance_per_position=self.acceptance_per_position,
            other_s=self.other_s,
            mean_k=self.mean_k,
            tokens_per_s=self.tokens_per_s,
            decode_tokens_per_s=self.decode_tokens_per_s,
        )
        return d

    @property
    def mean_k(self) -> float:
        """Mean tokens drafted per round (for k="auto", the mean chosen k)."""
        return self.drafted / self.rounds if self.rounds else float("nan")

    def summary(self) -> str:
        per_pos = " ".join(f"{a:.2f}" for a in self.acceptance_per_position) or "-"
        auto = ""
        if self.k == "auto" and self.rounds:
            counts = {n: self.k_per_round.count(n) for n in sorted(set(self.k_per_round))}
            auto = (
                f" (mean drafted {self.mean_k:.2f}; rounds by k: "
                + ", ".join(f"{n}: {c}" for n, c in counts.items())
                + ")"
            )
        return "\n".join(
            [
                f"new tokens {self.new_tokens} (prompt {self.prompt_tokens}) in {self.total_s:.2f} s: "
                f"{self.tokens_per_s:.1f} tokens/s, stopped by {self.stop_reason}",
                f"k {self.k}{auto}, rounds {self.rounds}, drafted {self.drafted}, accepted {self.accepted}, "
                f"acceptance rate alpha {self.alpha:.3f}, mean accepted length tau {self.tau:.2f} (bonus included)",
                f"acceptance by draft position: {per_pos}",
                f"time: prefill {self.prefill_s * 1e3:.0f} ms, draft {self.draft_s * 1e3:.0f} ms, "
                f"verify {self.verify_s * 1e3:.0f} ms, other {self.other_s * 1e3:.0f} ms",
            ]
        )
