"""The CPU's matrix products for the lean forward: y = x W^T + b with the weights prepared once.

One- and two-row fp32 products (decode steps, one-token verifies) run specdec's own gemv kernel
(specdec.backends.gemv); longer ones run oneDNN over the weight reordered once for it; other
devices and dtypes F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.backends import gemv


def _packs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether oneDNN takes this weight reordered: fp32, or bf16 where the CPU has oneDNN's bf16
    instructions (without them its reorder raises: an AVX2-only CPU runs bf16 with F.linear)."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear:
    """y = x W^T + b over a weight (out, in): on CPU, one- and two-row fp32 products run the
    specdec.backends.gemv kernel over `parts` (the weights whose concatenation is W, shared with the
    transformers model: no copy), longer ones oneDNN over W reordered once; F.linear elsewhere.
    x: (n, in) -> (n, out)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, parts: list[torch.Tensor] | None = None):
        self.out_features = weight.shape[0]
        self.packed = _packs(weight.dtype, weight.device)
        self.parts = [p.contiguous() for p in (parts or [weight])] if gemv.usable(weight) else None
        self.gemv = gemv.kernel().gemv if self.parts is not None else None
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous()) if self.packed else weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.parts is not None and x.shape[0] <= gemv.MAX_ROWS:
            return self.gemv(x, self.parts, self.bias)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def fused(*linears: torch.nn.Linear) -> Linear:
    """One Linear computing several nn.Linear layers that read the same input (q, k, v; gate, up):
    their outputs concatenated, (n, sum of out_features)."""
    parts = [m.weight.detach() for m in linears]
    weight = torch.cat(parts)
    biases = [m.bias for m in linears]
    bias = (
        None
        if all(b is None for b in biases)
        else torch.cat(
            [
                b.detach() if b is not None else torch.zeros(m.out_features, dtype=weight.dtype, device=weight.device)
                for m, b in zip(linears, biases)
            ]
        )
    )
    return Linear(weight, bias, parts=parts)
