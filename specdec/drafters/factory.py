"""Building drafters by name: the registry used by the Python API, cli, bench and serve."""

from __future__ import annotations

from functools import partial
from typing import Callable

from specdec.drafters.base import Drafter
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.layerskip import LayerSkipDrafter
from specdec.drafters.lookup import PromptLookup
from specdec.drafters.model import ModelDrafter
from specdec.drafters.random import RandomDrafter
from specdec.drafters.suffix import SuffixDrafter

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
