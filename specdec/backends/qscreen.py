"""A Q8_0 output layer for greedy decoding: screened in 4 bits, exact where it matters.

Greedy decoding and greedy verification read only each row's argmax of the logits, yet a small
model's Q8_0 output layer is a large part of the bytes a decode step reads (a large vocabulary over
a small model: sizes in docs/quantized.md). The screen (csrc/quant/screen.h) keeps the high 4 bits
of every weight with the block's scale, 18 bytes per 32 weights against Q8_0's 34, and bounds what
the low 4 bits can add: each row's logit lies within a width of the screen's center. The exact
logits of the eight rows of largest center give a floor; every row whose center plus width reaches
it is recomputed exactly from the file's Q8_0 rows (how many, on real prompts: docs/quantized.md),
with the regrouped kernels' integers and fp32 steps. So each row's argmax, and its logit, have the
bits of the full output layer (tests/test_qscreen.py), for every input row on its own:
batch-invariant. The other entries are the screen's centers, approximations within the width: for
sampling or log-probabilities the full layer is used (specdec.cache.KVCache.argmax_only).
"""

from __future__ import annotations

import weakref

import torch

_SCREENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # output layer -> its screen, or None


class ScreenedHead:
    """A Q8_0 output layer's greedy form. Memory: the screen, 18/34 of the layer's bytes;
    the exact rows are the file's (its memory map), read only for the candidates."""

    def __init__(self, kernels, rows: torch.Tensor, screen: torch.Tensor, factor: float, head=None):
        self.kernels, self.rows, self.screen, self.factor = kernels, rows, screen, factor
        self.nbytes = screen.numel()  # what a forward reads of the layer, the candidates' rows aside
        self.head = weakref.ref(head) if head is not None else None  # the full layer (weak: it keys _SCREENS)

    @classmethod
    def of(cls, head) -> ScreenedHead | None:
        """The screen of an output layer (a specdec.backends.quant.QuantLinear), built at the first call
        and shared by every model view holding that layer; None where it does not apply: a layer of
        several parts or with a bias, a type other than Q8_0, fp32 activations, a build without int8
        kernels, a row count not a multiple of 16, or a negative block scale."""
        if head not in _SCREENS:
            _SCREENS[head] = cls._build(head)
        return _SCREENS[head]

    @classmethod
    def _build(cls, head) -> ScreenedHead | None:
        from specdec.backends.qkernel import TYPES

        if len(head.raw) != 1 or head.bias is not None or head.raw_types[0] != TYPES["Q8_0"] or not head.int8:
            return None
        rows = head.raw[0]
        if rows.shape[0] % 16:
            return None
        screen, factor = head.kernels.q8_screen(rows, head.in_features)
        return None if screen is None else cls(head.kernels, rows, screen, factor, head)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h: (n, d) fp32 -> logits (n, V) fp32 whose argmax per row (the first, on ties), and its
        entry, are the full output layer's, bit for bit; the other entries are approximations. A row
        of h with an inf or nan has no finite floor to screen by: its logits are the full layer's."""
        logits = self.kernels.screened_logits(h, self.screen, self.rows, self.factor)
        bad = ~torch.isfinite(h).all(dim=-1)
        head = self.head() if self.head is not None else None
        if head is not None and bool(bad.any()):
            logits[bad] = head(h[bad])  # batch-invariant: the bits of the full layer on all of h
        return logits
