"""Adaptive draft length (k = "auto"): the verify-cost curve (costs), a batched forward's cost by
rows (rowcosts), the acceptance estimates (acceptance) and the per-round decision (policy)."""

from specdec.adaptive.acceptance import Acceptance, match_class
from specdec.adaptive.costs import VerifyCosts
from specdec.adaptive.policy import AdaptiveK, Outcome, RoundPlan, Share, best_length, values

__all__ = [
    "Acceptance",
    "AdaptiveK",
    "Outcome",
    "RoundPlan",
    "Share",
    "VerifyCosts",
    "best_length",
    "match_class",
    "values",
]
