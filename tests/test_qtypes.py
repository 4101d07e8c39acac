"""The types the kernels multiply in their blocks with no int8 kernel: Q2_K, Q3_K, Q5_K, IQ4_NL,
IQ4_XS, F16 and BF16 (csrc/quant/decode.h). Each decodes to gguf's dequantization bit for bit (signs
of zero included); its product is the fp32 product with those weights, and batch-invariant, alone or
stacked with parts of other types; with int8 activations it runs the fp32-activation kernel, with
the same bits; a QuantLinear keeps its blocks (no fp32 copy)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from specdec.backends.qkernel import INT8_TYPES, TYPES, kernels
from specdec.backends.quant import QuantLinear
from specdec.models.gguf import QTensor

from .quant_cases import assert_rows_invariant, fp32_part, matmul, needs_int8, reference
from .quant_cases import random_blocks as file_blocks  # any kernel type's, as test_quant makes them

NEW = ("Q2_K", "Q3_K", "Q5_K", "IQ4_NL", "IQ4_XS", "F16", "BF16")
FP32_ONLY = tuple(t for t in NEW if t not in INT8_TYPES)  # no int8 kernel: the fp32 kernel also on the int8 path

HALF = 0  # an fp16 field's size in STRUCTS
# Each block type's fields in order, as ggml-common.h's block_* structs: (name, bytes), HALF for fp16.
STRUCTS = {
    "Q2_K": (("scales", 16), ("qs", 64), ("d", HALF), ("dmin", HALF)),
    "Q3_K": (("hmask", 32), ("qs", 64), ("scales", 12), ("d", HALF)),
    "Q5_K": (("d", HALF), ("dmin", HALF), ("scales", 12), ("qh", 32), ("qs", 128)),
    "IQ4_NL": (("d", HALF), ("qs", 16)),
    "IQ4_XS": (("d", HALF), ("scales_h", 2), ("scales_l", 4), ("qs", 128)),
}


def block_elements(qtype: str) -> int:
    """Weights per block as the kernels go over a row: 32 for F16 and BF16 (gguf says 1)."""
    return max(32, GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][0])


def fp16_scales(g: np.random.Generator, n: int) -> np.ndarray:
    """n finite fp16 scales of moderate size and either sign, as (n, 2) bytes; a few zero, a few
    subnormal (fp16's, which widen to normal fp32 values)."""
    d = g.uniform(1e-4, 0.05, n) * g.choice([-1.0, 1.0], n)
    d[g.random(n) < 0.03] = 0.0
    d[g.random(n) < 0.03] *= 1e-3  # below fp16's smallest normal, 6.1e-5
    return d.astype(np.float16).view(np.uint8).reshape(n, 2)


def random_blocks(qtype: str, rows: int, K: int, seed: int) -> np.ndarray:
    """(rows, K / block * bytes) uint8 rows of valid `qtype` blocks, built field by field: fp16 scales
    from fp16_scales, every other byte random (every code, sub-block scale and minimum a block can
    hold). F16 and BF16: Gaussian weights rounded to the type, with zeros of both signs."""
    g = np.random.default_rng(seed)
    if qtype in ("F16", "BF16"):
        w = g.standard_normal((rows, K)).astype(np.float32)
        w.flat[::37], w.flat[5::41] = 0.0, -0.0
        return np.ascontiguousarray(gguf_quantize(w, GGMLQuantizationType[qtype])).view(np.uint8)
    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    n = rows * (K // block)
    fields = [
        fp16_scales(g, n) if size == HALF else g.integers(0, 256, (n, size), np.uint8) for _, size in STRUCTS[qtype]
    ]
    blocks = np.concatenate(fields, axis=1)
    assert blocks.shape[1] == nbytes, (qtype, blocks.shape)
    return blocks.reshape(rows, -1)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def within_rounding(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y within fp32 rounding of the float64 product x w^T (bounded by sum |x_k w_k|)."""
    want = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    assert ((y.double() - want).abs() <= 1e-6 * scale + 1e-30).all(), ((y.double() - want).abs() / scale).max()


def test_the_new_types_are_kernel_types_and_which_have_int8_kernels():
    for name in NEW:
        assert TYPES[name] == int(GGMLQuantizationType[name])
    assert FP32_ONLY == ("Q2_K", "Q3_K", "F16", "BF16")  # Q5_K, IQ4_NL and IQ4_XS: int8 kernels (test_quant)
    for name, fields in STRUCTS.items():  # the structs add up to gguf's block sizes
        assert sum(size or 2 for _, size in fields) == GGML_QUANT_SIZES[GGMLQuantizationType[name]][1]


@pytest.mark.parametrize("qtype", NEW)
def test_dequantize_rows_is_ggufs_dequantization_bit_for_bit(qtype):
    K, rows = 512, 48
    raw = random_blocks(qtype, rows, K, seed=1)
    want = reference(qtype, raw)
    assert torch.isfinite(want).all() and (want == 0).any()
    got = kernels().dequantize_rows(torch.from_numpy(raw), TYPES[qtype], K, torch.arange(rows))
    assert torch.equal(bits(got), bits(want)), (got != want).sum()
    ids = torch.tensor([7, 0, 47, 7, 23])  # any order, repeats
    assert torch.equal(bits(kernels().dequantize_rows(torch.from_numpy(raw), TYPES[qtype], K, ids)), bits(want[ids]))


@pytest.mark.parametrize("long_rows", [False, True], ids=["short", "long"])
@pytest.mark.parametrize("qtype", NEW)
def test_matmul_is_the_fp32_product_and_batch_invariant(qtype, long_rows):
    # long rows (over 512 columns) take the column-blocked path for several input rows, ending in a partial block
    K = (1280 if long_rows else 512) if block_elements(qtype) == 256 else (1184 if long_rows else 160)
    N = 37  # not a multiple of the 16 outputs a thread takes at a time
    raw = random_blocks(qtype, N, K, seed=2)
    w = reference(qtype, raw)
    part = torch.from_numpy(raw)
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(3))
    for M in range(1, 10):
        y = matmul(x[:M], [part], [TYPES[qtype]])
        assert y.shape == (M, N)
        within_rounding(y, x[:M], w)
        # the weights decoded in registers are the dequantized ones: an F32 part of them gives the same sums
        assert torch.equal(bits(y), bits(matmul(x[:M], [fp32_part(w)], [TYPES["F32"]])))
    assert_rows_invariant(lambda rows: matmul(rows, [part], [TYPES[qtype]]), x, max_n=9)


def _mixed_parts(K: int, others: tuple[str, ...], rows: int | None = None) -> tuple[list, list[int]]:
    """(parts, type ids): one part of each new type (`rows` rows, by default 3 to 9 by type), then 16 rows
    of each of `others`, K columns."""
    parts = [random_blocks(n, rows or 3 + i % 7, K, seed=30 + i) for i, n in enumerate(NEW)]
    parts += [file_blocks(n, 16, K, seed=50 + i) for i, n in enumerate(others)]
    return [torch.from_numpy(p) for p in parts], [TYPES[n] for n in (*NEW, *others)]


def test_parts_of_mixed_types_stacked_in_one_call():
    K = 512
    parts, types = _mixed_parts(K, ("Q4_K", "Q8_0"))
    parts.append(fp32_part(torch.randn(5, K, generator=torch.Generator().manual_seed(40))))
    types.append(TYPES["F32"])
    N = sum(p.shape[0] for p in parts)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(41))
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(42))
    y = matmul(x, parts, types, bias)
    each = torch.cat([matmul(x, [p], [t]) for p, t in zip(parts, types)], dim=1)
    assert torch.equal(bits(y), bits(each + bias))  # stacking changes no output's bits
    assert_rows_invariant(lambda rows: matmul(rows, parts, types, bias), x, max_n=9)


@needs_int8
@pytest.mark.parametrize("qtype", FP32_ONLY)
def test_int8_activations_run_the_fp32_kernel_for_the_new_types(qtype):
    K = 512
    raw = torch.from_numpy(random_blocks(qtype, 32, K, seed=4))
    assert kernels().repack(raw, TYPES[qtype], K) is None  # rows go one at a time
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(5))
    for M in range(1, 10):
        assert torch.equal(
            bits(matmul(x[:M], [raw], [TYPES[qtype]], int8=True)), bits(matmul(x[:M], [raw], [TYPES[qtype]]))
        )
    assert_rows_invariant(lambda rows: matmul(rows, [raw], [TYPES[qtype]], int8=True), x, max_n=9)


@needs_int8
def test_int8_activations_with_mixed_parts_keep_the_new_types_fp32_bits():
    """Beside a regrouped Q4_K part and Q5_0 rows going one at a time (int8 kernels, their inputs
    rounded to int8), each new type's outputs are its own product's bits: fp32, or its int8 kernel's."""
    K = 512
    parts, types = _mixed_parts(K, ("Q4_K", "Q5_0"), rows=16)  # with a regrouped part: rows in sixteens
    # regrouped where the build regroups (VNNI); as they are elsewhere
    packed, xtype = kernels().repack(parts[len(NEW)], TYPES["Q4_K"], K) or (parts[len(NEW)], TYPES["Q4_K"])
    int8_parts, int8_types = [*parts[: len(NEW)], packed, parts[-1]], [*types[: len(NEW)], xtype, types[-1]]
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(6))
    y = matmul(x, int8_parts, int8_types, int8=True)
    ends = np.cumsum([0, *(p.shape[0] for p in parts)])
    for i, name in enumerate(NEW):  # the fp32 kernel's bits, or the type's int8 kernel's alone
        alone = matmul(x, [parts[i]], [types[i]], int8=name in INT8_TYPES)
        assert torch.equal(bits(y[:, ends[i] : ends[i + 1]]), bits(alone)), name
    alone = matmul(x, [packed], [xtype], int8=True)
    assert torch.equal(bits(y[:, ends[len(NEW)] : ends[len(NEW) + 1]]), bits(alone))
    assert_rows_invariant(lambda rows: matmul(rows, int8_parts, int8_types, int8=True), x, max_n=9)


def test_a_quant_linear_of_the_new_types_keeps_their_blocks():
    K = 512
    parts = [QTensor(n, n, (16, K), torch.from_numpy(random_blocks(n, 16, K, seed=60 + i))) for i, n in enumerate(NEW)]
    fallback: set[str] = set()
    linear = QuantLinear(parts, None, fallback)
    assert fallback == set() and linear.types == [TYPES[n] for n in NEW]
    assert all(d.data_ptr() == p.data.data_ptr() for d, p in zip(linear.data, parts))  # no fp32 copy
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(61))
    within_rounding(linear(x), x, torch.cat([p.dequantize() for p in parts]))
    if kernels().int8_available():  # rows in sixteens: regrouped where the build regroups the type (IQ4_NL on AVX2)
        int8 = QuantLinear(parts, None, fallback, int8=True)
        regrouped = [kernels().repack(p.data, TYPES[n], K) for p, n in zip(parts, NEW)]
        assert fallback == set() and int8.types == [r[1] if r else TYPES[n] for r, n in zip(regrouped, NEW)]
        alone = [
            matmul(x, [r[0] if r else p.data], [r[1] if r else TYPES[n]], int8=n in INT8_TYPES)
            for p, n, r in zip(parts, NEW, regrouped)
        ]
        assert torch.equal(bits(int8(x)), bits(torch.cat(alone, dim=1)))
