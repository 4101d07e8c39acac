"""Drafters: one interface (base.Drafter), the draft it returns (draft.Draft: a chain or a token
tree), one module per drafter, and a factory that builds them by name (factory)."""

from specdec.drafters.base import Drafter, KeepGoing
from specdec.drafters.draft import Draft
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.factory import DRAFTERS, drafter_from_options, make_drafter
from specdec.drafters.layerskip import LayerSkipDrafter
from specdec.drafters.lookup import PromptLookup
from specdec.drafters.model import ModelDrafter
from specdec.drafters.random import RandomDrafter
from specdec.drafters.suffix import SuffixDrafter

__all__ = [
    "DRAFTERS",
    "Draft",
    "Drafter",
    "EagleDrafter",
    "KeepGoing",
    "LayerSkipDrafter",
    "ModelDrafter",
    "PromptLookup",
    "RandomDrafter",
    "SuffixDrafter",
    "drafter_from_options",
    "make_drafter",
]
