"""Checking that a speculative greedy run is plain greedy decoding, and explaining it when not.

A difference is a bug until shown to be a floating-point near-tie: the verify forward scores k+1
positions at once, and its logits may differ from one-token logits in the last bits, which can
flip an argmax only where the target's top two logits are (almost) equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdec.cache import new_cache
from specdec.models.load import Model

NEAR_TIE_ULP = 4  # a greedy divergence at a top-2 logit gap of at most this many ulp is rounding


def near_tie(logit_gap: float, logit_ulp: float) -> bool:
    """Whether a top-2 logit gap is a floating-point near-tie: at most NEAR_TIE_ULP ulp of the
    logits' dtype, within what kernels that round differently can move an argmax (specdec.exactness)."""
    return logit_gap <= NEAR_TIE_ULP * logit_ulp


@dataclass(frozen=True)
class Divergence:
    """position: index in the new tokens of the first difference; plain_token / other_token: the
    ids each run chose there; logit_gap: the target's top-1 minus top-2 logit at that position, on
    a fresh forward over prompt + the shared prefix; logit_ulp: the spacing of the logits' dtype
    at the top-1 logit (fp32 at a logit of 20: 2e-6; bf16: 0.125). A gap of a few ulp or less is
    a floating-point near-tie: the verify forward's kernels round differently from a one-token
    forward's, by about an ulp per operation."""

    position: int
    plain_token: int | None
    other_token: int | None
    logit_gap: float
    logit_ulp: float = float("nan")

    @property
    def near_tie(self) -> bool:
        """Whether the gap is within NEAR_TIE_ULP ulp of the logits' dtype (rounding can flip
        such an argmax)."""
        return near_tie(self.logit_gap, self.logit_ulp)


@torch.inference_mode()
def first_divergence(target: Model, prompt: list[int], plain: list[int], other: list[int]) -> Divergence | None:
    """None when the two token lists are equal, else where and by how much they differ: the target's
    top-2 logit gap there, from its own forward (the backend and precision that produced the tokens)."""
    if plain == other:
        return None
    pos = next((i for i, (a, b) in enumerate(zip(plain, other)) if a != b), min(len(plain), len(other)))
    logits = new_cache(target).extend(prompt + plain[:pos], all_logits=False)[-1]  # (V,)
    top2 = torch.topk(logits.float(), 2).values
    at = lambda seq: seq[pos] if pos < len(seq) else None  # noqa: E731
    return Divergence(pos, at(plain), at(other), float(top2[0] - top2[1]), ulp(float(top2[0]), logits.dtype))


def ulp(x: float, dtype: torch.dtype) -> float:
    """The spacing of `dtype`'s numbers at x: eps * 2^floor(log2 |x|) (for x = 0, eps)."""
    exponent = math.floor(math.log2(abs(x))) if x else 0
    return torch.finfo(dtype).eps * 2.0**exponent
