"""The cost of a batched forward as a function of its rows, for speculation under a shared budget
(specdec.batch): ms(rows) = a + b x rows + s x (tiles - 1), a and b fitted online to the batch's
own steps by exponentially weighted least squares; tiles = ceil(rows / tile), the passes the
kernels make over the weights, each tile of input rows reading them again (8 rows with VNNI).

A batch's forwards have too many row counts, each timed too rarely and too noisily, for the
per-length curve one sequence uses (specdec.adaptive.costs); a line through all of them is what a
draft's marginal cost needs: b, the ms one more row adds. But a row that starts a new tile costs
that pass too: s, read off the verify-cost curve where one tile becomes two (V(tile + 1) - V(tile)
beyond V(tile) - V(tile - 1)). Without it a batch of eight one-row sequences would price its first
drafted row at b when it costs b + s (measured in docs/serving.md), and draft at a loss. While
the steps have not spread over enough row counts to fit the line, the verify-cost curve answers,
made non-decreasing.
"""

from __future__ import annotations

from collections.abc import Callable


class RowCosts:
    """ms(rows) of a batched forward. fallback: V(n) in ms (a VerifyCosts) for before the fit and
    for the tile step. tile: input rows per pass over the weights (None: no step). decay: the
    weight an old step keeps per new one. min_spread: the rows' weighted standard deviation the
    fit needs."""

    def __init__(
        self,
        fallback: Callable[[int], float],
        tile: int | None = None,
        decay: float = 0.98,
        min_spread: float = 2.0,
    ):
        self.fallback, self.tile, self.decay, self.min_spread = fallback, tile, decay, min_spread
        self.w = self.sx = self.sy = self.sxx = self.sxy = self.sz = self.sxz = 0.0
        self.highest: list[float] = []  # max of fallback(1..n) at index n - 1, until the next observe()
        self.fit: tuple[float, float] | None = None  # (a, b), refitted by each observe()
        self.s = 0.0  # the tile step the fit was made with

    def passes(self, rows: int) -> int:
        """Passes over the weights beyond the first for a forward of `rows` rows."""
        return (rows - 1) // self.tile if self.tile else 0

    def step(self) -> float:
        """s: the ms a further tile costs beyond its rows, from the verify-cost curve (0 without a
        tile, or where the curve is flat or falls there)."""
        t = self.tile
        if not t or t < 2:
            return 0.0
        f = self.fallback
        return max(0.0, (f(t + 1) - f(t)) - (f(t) - f(t - 1)))

    def observe(self, rows: int, ms: float) -> None:
        """A forward over `rows` new tokens took `ms`."""
        d, z = self.decay, self.passes(rows)
        self.w, self.sx, self.sy = d * self.w + 1, d * self.sx + rows, d * self.sy + ms
        self.sxx, self.sxy = d * self.sxx + rows * rows, d * self.sxy + rows * ms
        self.sz, self.sxz = d * self.sz + z, d * self.sxz + rows * z
        self.highest, self.fit = [], None
        mx = self.sx / self.w
        var = self.sxx / self.w - mx * mx
        if self.w >= 2 and var >= self.min_spread**2:  # the steps' times less s for each further tile
            self.s = self.step()
            my = (self.sy - self.s * self.sz) / self.w
            b = max(0.0, ((self.sxy - self.s * self.sxz) / self.w - mx * my) / var)
            self.fit = (my - b * mx, b)

    def line(self) -> tuple[float, float] | None:
        """(a, b) of the fit, b >= 0, or None while the rows have not spread enough."""
        return self.fit

    def __call__(self, rows: int) -> float:
        """Estimated ms of a forward over `rows` new tokens."""
        if self.fit is not None:
            return self.fit[0] + self.fit[1] * rows + self.s * self.passes(rows)
        high = self.highest  # a step asks for many row counts: the running maximum, extended as asked
        while len(high) < rows:
            n = len(high) + 1
            high.append(max(high[-1], self.fallback(n)) if high else self.fallback(n))
        return high[rows - 1]
