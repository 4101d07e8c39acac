"""A negative control: random drafts that the target (almost) never accepts.

Running the bench with it measures what speculation costs when nothing pays: the verify forward
over k+1 tokens instead of 1, and the round's bookkeeping. It is how `k="auto"` is checked to fall
back to plain decoding (specdec.adaptive.policy)."""

from __future__ import annotations

import copy

import torch

from specdec.drafters.base import Drafter
from specdec.drafters.draft import Draft
from specdec.models.load import Model
from specdec.sampling import Sampler


class RandomDrafter(Drafter):
    """Proposes k token ids drawn uniformly from the target's vocabulary, from its own generator
    (seeded with `seed`), so that the run's sampling draws are not disturbed."""

    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)
        self.vocab = 0

    def prepare(self, target: Model) -> None:
        self.vocab = len(target.tokenizer)

    def fork(self) -> RandomDrafter:
        """A copy whose generator continues from this one's state, apart from it (Drafter.fork)."""
        other = copy.copy(self)
        other.generator = torch.Generator().set_state(self.generator.get_state())
        return other

    def propose(self, context: list[int], k: int, sampler: Sampler) -> Draft:
        return Draft(torch.randint(0, self.vocab, (k,), generator=self.generator).tolist())
