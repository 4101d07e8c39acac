"""The one interface every drafter implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..models import Model
from ..sampling import Sampler


@dataclass
class Draft:
    """Up to k proposed token ids, and the distribution each was drawn from.

    probs: (len(tokens), V_draft) float32, or None for a deterministic drafter, which the verifier
    treats as a one-hot distribution on each proposed token.
    """

    tokens: list[int]
    probs: torch.Tensor | None = None


class Drafter(Protocol):
    """Proposes continuations that the target then verifies.

    prepare(target) is called once at the start of each generation (check compatibility, reset
    state); propose(context, k, sampler) returns at most k tokens to follow `context`, all of
    prompt plus committed output; a drafter may return fewer, or none.
    """

    def prepare(self, target: Model) -> None: ...

    def propose(self, context: list[int], k: int, sampler: Sampler) -> Draft: ...
