"""Row padding: run a short forward with more rows when oneDNN's kernel for more rows is faster.

On a CPU, oneDNN picks its matrix-product kernel by the number of rows, and its one- and two-row
kernels can be slower than its four-row one: V(4) < V(1) on some models (V(n): one forward over n
new tokens; figures per model in docs/lean-backend.md). A plain decoding step, or a verify of one
drafted token, is then faster when padded with filler rows whose outputs are discarded. The
filler comes after the real tokens, so causal attention keeps it out of their results; its cache
rows lie past the sequence's length and are overwritten by the next forward. Only the kernel
changes, as it does between a plain step and a verify: the output agrees with the unpadded
forward to floating-point rounding.

The table is timed once per model when its lean form is built (tune_rows), at a short context;
a length is padded only when that saves a clear `gain` (default 15%), since the attention over a
long context adds per-row cost the short timing does not see: a small gain at a short context can
turn into a loss at a long one. The timing runs the real forward, specdec.backends.gemv's one- and
two-row kernel included where it is built, so a model on which that kernel makes one and two rows
the fastest forwards gets an empty table.
"""

from __future__ import annotations

import math
import time

import torch

TUNE_MIN_BYTES = 100e6  # models whose forward reads fewer bytes of weights are not timed (tests' tiny models)


def tune_rows(lean, n_max: int = 9, context: int = 32, gain: float = 0.15, repeats: int = 3) -> dict[int, int]:
    """Time one forward of n = 1..n_max rows of `lean` (a specdec.backends.lean.LeanModel, its own rows
    table unset) after `context` cached tokens, the fastest of `repeats` passes each, and return
    {n: m} for each n that runs faster as m > n rows: m minimises V(m) over n..n_max and
    V(m) <= (1 - gain) V(n). Costs about 3 x n_max one-token forwards; the scratch cache is freed."""
    capacity = context + n_max
    empty = lambda: torch.empty(lean.n_kv, capacity, lean.head_dim, dtype=lean.kv_dtype, device=lean.device)  # noqa: E731
    keys, values = [empty() for _ in lean.layers], [empty() for _ in lean.layers]
    features = torch.empty(capacity, lean.hidden_size, dtype=lean.dtype, device=lean.device)
    ids = torch.arange(context + n_max, device=lean.device) % lean.embed.shape[0]
    lean.forward(ids[:context], keys, values, features, 0, 1)
    ms = {n: math.inf for n in range(1, n_max + 1)}
    for _ in range(repeats):
        for n in ms:
            start = time.perf_counter()
            lean.forward(ids[context : context + n], keys, values, features, context, n)
            ms[n] = min(ms[n], (time.perf_counter() - start) * 1e3)
    return choose_rows(ms, gain)


def choose_rows(ms: dict[int, float], gain: float = 0.15) -> dict[int, int]:
    """From V(n) in ms for n = 1..n_max: {n: m} for each n whose fastest longer forward m (the
    argmin of V over n..n_max) takes at most (1 - gain) V(n)."""
    table = {}
    for n in ms:
        m = min((m for m in ms if m >= n), key=ms.__getitem__)
        if ms[m] <= (1 - gain) * ms[n]:
            table[n] = m
    return table
