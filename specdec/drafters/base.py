"""The one interface every drafter implements."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import ClassVar

from specdec.drafters.draft import Draft
from specdec.models.load import Model
from specdec.sampling import Sampler

KeepGoing = Callable[[int, float], bool]  # (tokens drafted so far, the last one's probability) -> draft another?
Branch = Callable[[list[float]], list[int]]  # (second choices' probabilities by depth) -> the depths to add them at


class Drafter:
    """Proposes continuations that the target then verifies. Every drafter subclasses this.

    prepare(target) is called once at the start of each generation (check compatibility, reset
    state); propose(context, k, sampler) returns at most k tokens to follow `context`, all of
    prompt plus committed output; a drafter may return fewer, or none.

    What a drafter can do beyond that, it declares:
    - `incremental = True`: it drafts token by token, and propose() takes a keyword `keep_going`
      (KeepGoing), asked after each token whether to draft another; k="auto" passes it
      (specdec.adaptive).
    - `branches = True` (with incremental, greedy only): propose() also takes a keyword `branch`
      (Branch): given its second choice's probability at each depth of the finished chain, it
      returns the depths at which to offer that choice too, as a leaf beside the drafted token;
      the draft is then a token tree. k="auto" passes it where the verifier takes trees
      (AdaptiveK.branch).
    - `reads_target_cache = True`: it reads the target's own state; the engine calls attach(kv)
      with the target's KV cache (specdec.cache) once it exists, after prepare(). Such a drafter
      cannot run without the target's forwards, so the bench does not replay it.
    - long_match(context): a drafter that sometimes proposes a lookup match alone instead of its
      usual draft returns that match's length (free to compute), else None (the default); k="auto"
      reads it when its usual draft does not pay (EagleDrafter, AdaptiveK.plan).
    """

    incremental: ClassVar[bool] = False
    branches: ClassVar[bool] = False
    reads_target_cache: ClassVar[bool] = False

    def prepare(self, target: Model) -> None:
        """Called at the start of each generation with the target model."""

    def fork(self) -> Drafter:
        """A drafter for another generation run at the same time (specdec.batch): it shares what
        no generation changes (models, heads, a learned corpus) and nothing a generation does.
        The default, a shallow copy whose parts that are drafters themselves (a prompt lookup beside
        a model, a layer-skip drafter's inner one) are forked in turn, suits drafters whose
        prepare() makes all other per-generation state."""
        other = copy.copy(self)
        for name, part in self._parts():
            setattr(other, name, part.fork())
        return other

    def prefill(self, prompt: list[int]) -> None:
        """Called once the target's prefill is done, with the prompt (token ids): a drafter that
        keeps a state of its own over the context (a draft model's KV cache) builds it here, so that
        its cost is paid with the prefill, not in the first round. The default prefills the parts
        that are drafters themselves."""
        for _, part in self._parts():
            part.prefill(prompt)

    def _parts(self) -> list[tuple[str, Drafter]]:
        """(attribute name, drafter) for each of this drafter's attributes that is a drafter itself."""
        return [(name, part) for name, part in vars(self).items() if isinstance(part, Drafter)]

    def propose(self, context: list[int], k: int, sampler: Sampler) -> Draft:
        """At most k tokens to follow `context` (prompt + committed output)."""
        raise NotImplementedError

    def attach(self, kv) -> None:
        """With reads_target_cache: the target's KV cache of this generation."""

    def long_match(self, context: list[int]) -> int | None:
        """The length of a lookup match this drafter would propose alone, or None."""
        return None
