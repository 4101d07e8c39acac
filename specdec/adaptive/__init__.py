"""Adaptive draft length (k = "auto"): verify costs, acceptance estimates, and the per-round decision."""

from specdec.adaptive.policy import AdaptiveK, VerifyCosts, match_class

__all__ = ["AdaptiveK", "VerifyCosts", "match_class"]
