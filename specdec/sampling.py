"""Turning logits into the distribution a token is drawn from.

The same transformation (temperature, then top-k, then top-p) is applied to the draft's and the
target's logits, so that speculative sampling reproduces the distribution plain sampling of the
target draws from (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen.

    temperature: 0 means greedy (argmax, ties to the lowest id); > 0 divides the logits.
    top_k: keep the k most likely tokens (0 keeps all).
    top_p: keep the smallest set of most likely tokens whose probability reaches top_p (1.0 keeps all).

    Raises ValueError on a negative temperature or top_k, or a top_p outside (0, 1].
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 turns it off), got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p.

    logits: (n, V) any float dtype, on any device. Returns (n, V) float32 rows on the CPU (where the
    run's generator draws, so a seed gives the same draws on every device) that sum to 1. Tokens removed by
    top-k or top-p get probability exactly 0. Not for greedy params (temperature 0): raises
    ValueError, since greedy needs no distribution.
    """
    if params.greedy:
        raise ValueError("processed_probs needs temperature > 0; greedy decoding uses argmax")
    logits = logits.float().cpu() / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # (n, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # (n, V) mass of more likely tokens
        drop_sorted = mass_before >= params.top_p  # the most likely token is never dropped
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(dim=-1)


class Sampler:
    """Sampling params plus the one explicit random generator a run draws from.

    Every random number of a run (draft sampling, the accept test, the resample) comes from
    `generator`, so the same seed gives the same output.
    """

    def __init__(self, params: SamplingParams, generator: torch.Generator | None = None):
        self.params = params
        self.generator = generator if generator is not None else torch.Generator()

    def choose(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """One token from logits of shape (V,): argmax when greedy (probs None), else a sample
        from processed_probs, returned with that distribution (V,)."""
        if self.params.greedy:
            return int(logits.argmax()), None
        probs = processed_probs(logits[None], self.params)[0]
        return int(torch.multinomial(probs, 1, generator=self.generator)), probs
