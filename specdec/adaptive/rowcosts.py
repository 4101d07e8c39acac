"""The cost of a batched forward as a function of its rows, for speculation under a shared budget
(specdec.batch): ms(rows) = a + b x rows, fitted online to the batch's own steps by exponentially
weighted least squares.

A batch's forwards have too many row counts, each timed too rarely and too noisily, for the
per-length curve one sequence uses (specdec.adaptive.costs); a line through all of them is what a
draft's marginal cost needs: b, the ms one more row adds. While the steps have not spread over
enough row counts to fit it, the verify-cost curve answers, made non-decreasing.
"""

from __future__ import annotations

from collections.abc import Callable


class RowCosts:
    """ms(rows) of a batched forward. fallback: V(n) in ms (a VerifyCosts) for before the fit.
    decay: the weight an old step keeps per new one. min_spread: the rows' weighted standard
    deviation the fit needs."""

    def __init__(self, fallback: Callable[[int], float], decay: float = 0.98, min_spread: float = 2.0):
        self.fallback, self.decay, self.min_spread = fallback, decay, min_spread
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0

    def observe(self, rows: int, ms: float) -> None:
        """A forward over `rows` new tokens took `ms`."""
        d = self.decay
        self.w, self.sx, self.sy = d * self.w + 1, d * self.sx + rows, d * self.sy + ms
        self.sxx, self.sxy = d * self.sxx + rows * rows, d * self.sxy + rows * ms

    def line(self) -> tuple[float, float] | None:
        """(a, b) of the fit, b >= 0, or None while the rows have not spread enough."""
        if self.w < 2:
            return None
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        if var < self.min_spread**2:
            return None
        b = max(0.0, (self.sxy / self.w - mx * my) / var)
        return my - b * mx, b

    def __call__(self, rows: int) -> float:
        """Estimated ms of a forward over `rows` new tokens."""
        fit = self.line()
        if fit is not None:
            return fit[0] + fit[1] * rows
        return max(self.fallback(n) for n in range(1, rows + 1))
