"""The output layer for greedy decoding: read it in bf16, recompute in fp32 only the tokens that
could be the argmax.

Greedy decoding and greedy verification need only each row's argmax of the logits, yet an fp32
output layer is a large part of what a decode step reads (a large vocabulary over a small model:
weight sizes in docs/lean-backend.md). So the logits are first computed from a bf16
copy of the weight (half the bytes), with a bound on how far each can be from the fp32 product;
every token whose bf16 logit, raised by its bound, reaches the best lowered one is recomputed from
the fp32 weight. The fp32 argmax is always among them, so the row's argmax is the fp32 output
layer's (up to the last-bit rounding any two fp32 kernels differ by, as a batched forward does from
a one-token one). The other entries stay approximations: for sampling, use the full fp32 layer.

The bound, per row h (fp32, d) and token v with fp32 weight row w_v: rounding h and w_v to bf16
(unit roundoff 2^-8 each) moves each product h_i w_vi by at most (2^-7 + 2^-16) |h_i| |w_vi|, so the
dot product by at most that times ||h|| ||w_v|| (Cauchy-Schwarz); the bf16 result is rounded once
more (2^-8 of its magnitude); fp32 accumulation, in the bf16 product and in the fp32 one it is
compared with, adds about d 2^-24 of ||h|| ||w_v|| each. The bound used is twice the first two
terms, whose spare 2^-7 ||h|| ||w_v|| covers the accumulation for d up to 2^16. The bound is loose
(the errors seen, and how few tokens a row keeps for recomputation: docs/lean-backend.md), so the
recomputation usually reads a handful of fp32 rows, not the layer.
"""

from __future__ import annotations

import torch

from specdec.backends.linear import Linear

REL = 2.0**-6  # bound: REL * ||h|| * ||w_v|| + OUT * |bf16 logit|
OUT = 2.0**-7


def screening_pays(weight: torch.Tensor) -> bool:
    """Whether the bf16 screen can replace this output weight: fp32, on a CPU whose oneDNN runs
    bf16 products (where it does not, a bf16 product is emulated and slower than the fp32 one)."""
    return (
        weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


class ScreenedHead:
    """An fp32 output layer (V, d), no bias, whose rows' argmaxes are computed from a bf16 copy
    plus an fp32 recomputation of the candidates (see the module docstring). Memory: one bf16 copy
    of the weight (half the fp32 one's size) and its row norms; the fp32 weight is shared."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight  # (V, d) fp32, the model's own
        self.screen = Linear(weight.to(torch.bfloat16))
        self.row_norms = weight.norm(dim=1)  # (V,)
        self.saved_bytes = weight.numel() * 2  # per forward, against reading the fp32 weight

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h: (n, d) fp32 -> logits (n, V) fp32 whose argmax per row is the fp32 layer's; the
        entries of tokens that cannot be the argmax of any row are bf16 approximations."""
        logits = self.screen(h.to(torch.bfloat16)).float()  # (n, V)
        bound = REL * h.norm(dim=1, keepdim=True) * self.row_norms + OUT * logits.abs()
        floor = (logits - bound).amax(dim=1, keepdim=True)  # (n, 1): the argmax's exact logit is at least this
        candidates = (logits + bound >= floor).any(dim=0).nonzero()[:, 0]  # (c,) over every row
        logits[:, candidates] = h @ self.weight[candidates].T
        return logits
