"""Turning logits into the distribution a token is drawn from.

The same transformation (temperature, then min-p, top-k and top-p) is applied to the draft's and the
target's logits, so that speculative sampling reproduces the distribution plain sampling of the
target draws from (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen.

    temperature: 0 means greedy (argmax, ties to the lowest id); > 0 divides the logits.
    top_k: keep the k most likely tokens (0 keeps all).
    top_p: keep the smallest set of most likely tokens whose probability reaches top_p (1.0 keeps all).
    min_p: keep the tokens whose probability is at least min_p times the most likely one's (0 keeps
    all; Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling"; as vLLM, after temperature).

    Raises ValueError on a negative temperature or top_k, or a top_p outside (0, 1], or a min_p
    outside [0, 1].
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 turns it off), got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 turns it off), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities after temperature, then min-p, top-k and top-p (each over what the previous
    left; min-p's threshold is read from the tempered distribution, as vLLM does).

    logits: (n, V) any float dtype, on any device. Returns (n, V) float32 rows on the CPU (where the
    run's generator draws, so a seed gives the same draws on every device) that sum to 1. Tokens removed by
    top-k or top-p get probability exactly 0. Not for greedy params (temperature 0): raises
    ValueError, since greedy needs no distribution.
    """
    if params.greedy:
        raise ValueError("processed_probs needs temperature > 0; greedy decoding uses argmax")
    logits = logits.float().cpu() / params.temperature
    if params.min_p > 0:
        probs = logits.softmax(dim=-1)
        floor = params.min_p * probs.max(dim=-1, keepdim=True).values  # (n, 1)
        logits = logits.masked_fill(probs < floor, float("-inf"))
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
            return argmax_rows(logits)[0], None
        probs = processed_probs(logits[None], self.params)[0]
        return int(torch.multinomial(probs, 1, generator=self.generator)), probs


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """Each row's argmax of logits (n, V), or of one row (V,) as a list of one: the first maximal index,
    as torch.argmax gives it. For fp32 on the CPU it is numpy's, on one thread: torch's parallel
    reduction wakes the thread pool for a few microseconds of work (docs/engine.md, "Exactness")."""
    rows = logits.reshape(-1, logits.shape[-1])
    if rows.device.type == "cpu" and rows.dtype == torch.float32:
        return rows.detach().numpy().argmax(-1).tolist()
    return rows.argmax(dim=-1).tolist()


@dataclass(frozen=True)
class Penalties:
    """OpenAI's frequency and presence penalties and the repetition penalty (an extension, as in
    vLLM and transformers), applied to the target's logits before sampling or the argmax.

    frequency: subtracted once per earlier occurrence of a token in the output; presence:
    subtracted once from every token the output holds (both in [-2, 2] in OpenAI's API);
    repetition: > 0, divides the positive logits (multiplies the negative ones) of every token of
    the prompt and the output (CTRL, Keskar et al. 2019). As vLLM applies them: repetition first.
    Raises ValueError for a repetition penalty <= 0 or a non-finite value.
    """

    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0

    def __post_init__(self) -> None:
        if not all(math.isfinite(x) for x in (self.frequency, self.presence, self.repetition)):
            raise ValueError("penalties must be finite numbers")
        if self.repetition <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 turns it off), got {self.repetition}")

    @property
    def neutral(self) -> bool:
        return self.frequency == 0 and self.presence == 0 and self.repetition == 1

    def apply(self, logits: torch.Tensor, prompt: list[int], output: list[int], draft: list[int]) -> torch.Tensor:
        """The penalised logits of a verified block: logits (n, V), row i scoring the position after
        output + draft[:i] (row 0 the next token, n <= len(draft) + 1). Returns (n, V) float32 on
        the CPU; row i depends only on logits[i] and that history, elementwise, so it has the bits
        plain decoding gets at the same position."""
        logits = logits.float().cpu()
        n, vocab = logits.shape
        if self.neutral:
            return logits
        counts = torch.zeros(n, vocab)
        counts += torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab)[:vocab].float()
        for i, t in enumerate(draft[: n - 1]):  # row i + 1 has also seen draft token i
            if 0 <= t < vocab:
                counts[i + 1 :, t] += 1
        if self.repetition != 1:
            seen = counts > 0
            if prompt:
                seen[:, torch.tensor(sorted({t for t in prompt if 0 <= t < vocab}), dtype=torch.long)] = True
            scaled = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
            logits = torch.where(seen, scaled, logits)
        if self.frequency:
            logits = logits - self.frequency * counts
        if self.presence:
            logits = logits - self.presence * (counts > 0).float()
        return logits


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of a committed token (its raw logits' log-softmax, before
    penalties and temperature, as vLLM reports them) and the `top` most likely tokens there, as
    (token, log-probability) pairs, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def logprobs_of(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """TokenLogprob of tokens[i] under logits row i (rows (n, V), n >= len(tokens)), with the `top`
    most likely tokens (0: none). Each row is computed alone, so its bits do not depend on the
    other rows (a speculative block gives what plain decoding gives)."""
    out = []
    for i, t in enumerate(tokens):
        row = torch.log_softmax(logits[i].float().cpu(), dim=-1)
        best = torch.topk(row, top) if top else None
        pairs = tuple(zip(best.indices.tolist(), best.values.tolist())) if best is not None else ()
        out.append(TokenLogprob(t, float(row[t]), pairs))
    return out
