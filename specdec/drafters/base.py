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
    confidence: the drafter's probability for each proposed token, when it reports one, else None.
    match_length: for a drafter that copies what followed an earlier occurrence of the context's
    end, how many tokens that occurrence matches (longer matches are accepted more often).
    Both feed the adaptive draft length (specdec.adaptive).
    """

    tokens: list[int]
    probs: torch.Tensor | None = None
    confidence: list[float] | None = None
    match_length: int | None = None


class Drafter(Protocol):
    """Proposes continuations that the target then verifies.

    prepare(target) is called once at the start of each generation (check compatibility, reset
    state); propose(context, k, sampler) returns at most k tokens to follow `context`, all of
    prompt plus committed output; a drafter may return fewer, or none.

    A drafter that drafts token by token may also take a keyword `keep_going`: a callable
    (n drafted so far, probability of the last drafted token) -> bool, asked after each token
    whether to draft another (k="auto" passes it; see specdec.adaptive).

    A drafter that reads the target's own state may define attach(kv): the engine calls it with
    the target's KV cache (specdec.cache) once it exists, after prepare().
    """

    def prepare(self, target: Model) -> None: ...

    def propose(self, context: list[int], k: int, sampler: Sampler) -> Draft: ...
