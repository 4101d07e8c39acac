"""Cases and checks the kernel tests share (test_quant, test_qtypes, test_isa, test_qscreen): random
blocks of each GGML type, gguf's dequantization as the reference, the row-invariance check."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from specdec.backends.qkernel import kernels
from specdec.bench.kernels import FP16_FIELDS as KERNEL_FP16_FIELDS

# Where each block type keeps its fp16 fields (ggml-common.h): scale d, and min m / dmin where it has one.
FP16_FIELDS = {**KERNEL_FP16_FIELDS, "TQ1_0": (52,), "TQ2_0": (64,)}  # TQ*: not kernel types, the fallback tests'


def _block(qtype: str) -> tuple[int, int]:
    """(elements, bytes) of one block of `qtype`."""
    return GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]


def random_blocks(qtype: str, rows: int, K: int, seed: int) -> np.ndarray:
    """(rows, K / block * bytes) uint8 rows of `qtype`: every byte random (so every code a block can
    hold occurs, -128 in Q8_0, every 6-bit scale of Q4_K, ...) except the fp16 fields, which are
    finite values of either sign; plus, where gguf can quantize the type, rows it quantized from
    Gaussian weights (what real files hold). F32, F16, BF16: Gaussian weights."""
    g = np.random.default_rng(seed)
    if qtype in ("F32", "F16", "BF16"):
        weights = g.standard_normal((rows, K)).astype(np.float32)
        return np.ascontiguousarray(gguf_quantize(weights, GGMLQuantizationType[qtype])).view(np.uint8)
    block, nbytes = _block(qtype)
    raw = g.integers(0, 256, (rows, K // block, nbytes), dtype=np.uint8)
    for at in FP16_FIELDS[qtype]:
        scale = g.uniform(-0.02, 0.02, (rows, K // block)).astype(np.float16)
        raw[..., at : at + 2] = scale.view(np.uint8).reshape(rows, K // block, 2)
    raw = raw.reshape(rows, -1)
    try:
        real = gguf_quantize(g.standard_normal((rows // 2, K)).astype(np.float32) * 0.05, GGMLQuantizationType[qtype])
    except NotImplementedError:  # gguf has no quantizer for the K-quants
        return raw
    return np.concatenate([real, raw[: rows - rows // 2]])


def reference(qtype: str, raw: np.ndarray) -> torch.Tensor:
    """gguf's own dequantization of rows `raw`, fp32 (rows, K)."""
    out = gguf_dequantize(raw, GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))


def matmul(x, parts, types, bias=None, int8=False):
    return kernels().matmul(x, parts, types, bias, int8)


needs_int8 = pytest.mark.skipif(not kernels().int8_available(), reason="int8 activations need AVX2 or AVX512-VNNI")
needs_regrouped = pytest.mark.skipif(
    not kernels().int8_available(), reason="rows regrouped sixteen at a time: int8 builds only (AVX2 or AVX512-VNNI)"
)


def quantized_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """x (M, K) as the int8 path sees it: per `block` columns, scale d = max|x| / 127 and values
    round(x / d) (to nearest even, computed as x * (1 / d) in fp32), dequantized: (M, K) float64."""
    M, K = x.shape
    b = x.reshape(M, K // block, block)
    d = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return (torch.round(b * inv).double() * d.double()).reshape(M, K)


def fp32_part(w: torch.Tensor) -> torch.Tensor:
    """fp32 weights (N, K) as an F32 part of the kernels: their raw bytes, (N, 4K) uint8."""
    return w.contiguous().view(torch.uint8)


def assert_rows_invariant(fn, x: torch.Tensor, max_n: int = 17) -> None:
    """fn over the first n rows of x, for n = 1..max_n and 1 or 2 threads: row i always has the bits
    of fn over row i alone (one thread)."""
    torch.set_num_threads(1)
    single = [fn(x[i : i + 1]) for i in range(max_n)]
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for n in range(1, max_n + 1):
            out = fn(x[:n])
            for i in range(n):
                assert torch.equal(out[i : i + 1], single[i]), (n, i, threads)


def attention_case(start: int, n: int, seed: int = 9):
    """A random attention case: q (n, 4, 64), fp32 caches (2, 48, 64), and the q.k scale."""
    H, KVH, D, cap = 4, 2, 64, 48
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, H, D, generator=g)
    k_cache, v_cache = torch.randn(KVH, cap, D, generator=g) * 2, torch.randn(KVH, cap, D, generator=g)
    return q, k_cache, v_cache, 1.0 / math.sqrt(D)
