"""Drafters: one interface (base.Drafter), one module each, and a registry mapping names to them."""

from __future__ import annotations

from functools import partial
from typing import Callable

from .base import Draft, Drafter, steerable
from .eagle import EagleDrafter
from .layerskip import LayerSkipDrafter
from .lookup import PromptLookup
from .model import ModelDrafter
from .random import RandomDrafter
from .suffix import SuffixDrafter

DRAFTERS: dict[str, Callable[..., Drafter]] = {
    "prompt-lookup": PromptLookup,
    "model": ModelDrafter,
    "random": RandomDrafter,
    "suffix": SuffixDrafter,
    "suffix-tree": partial(SuffixDrafter, tree=True),
    "layer-skip": LayerSkipDrafter,
    "eagle": EagleDrafter,
    "eagle-tree": partial(EagleDrafter, alternatives=1, lookup=True),
}


def make_drafter(name: str, **kwargs) -> Drafter:
    """Build the drafter registered as `name` with its keyword arguments, e.g.
    make_drafter("prompt-lookup", max_ngram=3) or make_drafter("model", draft="qwen2.5-coder-0.5b").
    Raises ValueError for an unknown name, listing the known ones."""
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}; known: {', '.join(DRAFTERS)}")
    return DRAFTERS[name](**kwargs)


__all__ = ["DRAFTERS", "Draft", "Drafter", "EagleDrafter", "LayerSkipDrafter", "ModelDrafter", "PromptLookup", "RandomDrafter", "SuffixDrafter", "make_drafter", "steerable"]
