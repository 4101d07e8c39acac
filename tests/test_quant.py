"""The quantized backend (specdec.backends.quant over the kernels of specdec/backends/csrc/quant.cpp).

Per GGML type the kernels handle: blocks decoded as gguf's reference dequantizer decodes them, bit
for bit; products within fp32 rounding of a float64 reference; every op batch-invariant (row i of an
n-row call has the bits of a one-row call, for any n and thread count). On the packaged SmolLM2 GGUF
(pulled in CI): one forward over several tokens, or over a token tree, equals one-token forwards bit
for bit, so greedy speculative decoding equals plain greedy; its logits are those of the fp32
dequantized model up to rounding. Types the kernels do not handle are dequantized to fp32, said once.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from specdec import generate, make_drafter
from specdec.backends.lean import tree_layout
from specdec.backends.qkernel import INT8_TYPES, TYPES, kernels
from specdec.backends.quant import QuantLinear, QuantModel
from specdec.cache import LeanKVCache
from specdec.errors import GGUFError
from specdec.models.gguf import QTensor
from specdec.models.load import load_model
from specdec.models.quantize import quantize_model
from specdec.models.registry import REGISTRY
from specdec.models.weights import cache_dir
from specdec.train.head import PACKAGED

from .conftest import make_model, prompt_ids, remake
from .quant_cases import (
    _block,
    assert_rows_invariant,
    attention_case,
    fp32_part,
    matmul,
    needs_int8,
    needs_regrouped,
    quantized_activations,
    random_blocks,
    reference,
)

QTYPES = list(INT8_TYPES)  # the types with int8 kernels; the others' are the fp32 path's (tests/test_qtypes.py)
# ---- products, per GGML type ------------------------------------------------------------------


@pytest.mark.parametrize("qtype", list(TYPES))
def test_dequantize_rows_is_ggufs_dequantization_bit_for_bit(qtype):
    K = 768 if _block(qtype)[0] == 256 else 96
    raw = random_blocks(qtype, 40, K, seed=1)
    want = reference(qtype, raw)
    assert torch.isfinite(want).all()
    ids = torch.tensor([5, 0, 39, 5, 17, 22, 1])  # any order, repeats
    got = kernels().dequantize_rows(torch.from_numpy(raw), TYPES[qtype], K, ids)
    assert got.shape == (len(ids), K) and got.dtype == torch.float32
    assert torch.equal(got, want[ids]), (got - want[ids]).abs().max()
    got_all = kernels().dequantize_rows(torch.from_numpy(raw), TYPES[qtype], K, torch.arange(40))
    assert torch.equal(got_all, want)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels().dequantize_rows(torch.from_numpy(raw), TYPES[qtype], K, torch.tensor([40]))


@pytest.mark.parametrize("long_rows", [False, True], ids=["short", "long"])
@pytest.mark.parametrize("qtype", list(TYPES))
def test_matmul_is_the_product_with_the_dequantized_weights_and_batch_invariant(qtype, long_rows):
    # 160: an odd number of 32-blocks; long rows (over 512 columns) take the column-blocked path for several
    # input rows, 1280 and 1184 ending in a partial column block
    K = (1280 if long_rows else 512) if _block(qtype)[0] == 256 else (1184 if long_rows else 160)
    N = 37  # not a multiple of the 16 outputs a thread takes at a time
    raw = random_blocks(qtype, N, K, seed=2)
    w = reference(qtype, raw)
    x = torch.randn(17, K, generator=torch.Generator().manual_seed(3))
    part = torch.from_numpy(raw)
    y = matmul(x, [part], [TYPES[qtype]])
    assert y.shape == (17, N) and y.dtype == torch.float32
    # (b) within fp32 rounding of the float64 product with gguf's dequantization
    want = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T  # sum of |x_k w_k|: bounds the rounding error
    assert ((y.double() - want).abs() <= 1e-6 * scale + 1e-30).all(), ((y.double() - want).abs() / scale).max()
    # the blocks decoded in registers are the dequantized weights: the same sums as an F32 part's
    assert torch.equal(y, matmul(x, [fp32_part(w)], [TYPES["F32"]]))
    # (c) row i of an n-row call is a one-row call, on 1 or 2 threads
    assert_rows_invariant(lambda rows: matmul(rows, [part], [TYPES[qtype]]), x)


@needs_int8
@pytest.mark.parametrize("shape", ["short", "long", "blocked"])
@pytest.mark.parametrize("qtype", QTYPES)
def test_int8_matmul_is_the_product_with_quantized_activations_and_batch_invariant(qtype, shape):
    """The int8 path: x quantized per 32 columns (per 256 for the K-quants, as llama.cpp's Q8_K),
    integer sums exact, within fp32 rounding of the float64 product of the quantized x with gguf's
    dequantization; row i of an n-row call is a one-row call, on 1 or 2 threads. "blocked": enough
    weight rows (and input rows) that prefill's blocking over the weights takes several blocks."""
    block = _block(qtype)[0]
    K = {"short": 512 if block == 256 else 160, "long": 1280 if block == 256 else 1184, "blocked": 2560}[shape]
    N = 150 if shape == "blocked" else 37
    raw = random_blocks(qtype, N, K, seed=2)
    w = reference(qtype, raw)
    x = torch.randn(19 if shape == "blocked" else 17, K, generator=torch.Generator().manual_seed(3))
    x[:, 7] *= 40  # an outlier column, as hidden states have
    part = torch.from_numpy(raw)
    y = matmul(x, [part], [TYPES[qtype]], int8=True)
    assert y.shape == (x.shape[0], N) and y.dtype == torch.float32
    xq = quantized_activations(x, 256 if block == 256 else 32)
    want = xq @ w.double().T
    scale = xq.abs() @ w.double().abs().T
    assert ((y.double() - want).abs() <= 2e-6 * scale + 1e-30).all(), ((y.double() - want).abs() / scale).max()
    # and not the fp32 path's product: the activations really are quantized
    assert not torch.equal(y, matmul(x, [part], [TYPES[qtype]]))
    assert_rows_invariant(lambda rows: matmul(rows, [part], [TYPES[qtype]], int8=True), x, max_n=x.shape[0])


# regrouped where their rows come in sixteens: the 32-weight types, Q4_K and Q6_K, IQ4_NL and IQ4_XS on AVX2 (regroup.h)
REGROUPED = [t for t in INT8_TYPES if kernels().repack(torch.from_numpy(random_blocks(t, 16, 256, 0)), TYPES[t], 256)]


@needs_regrouped
@pytest.mark.parametrize("qtype", REGROUPED)
@pytest.mark.parametrize("shape", ["short", "blocked"])
def test_parts_regrouped_sixteen_rows_at_a_time_are_the_same_product_and_batch_invariant(qtype, shape):
    """repack regroups the quantized types' rows sixteen at a time for the int8 kernels: the product
    is the quantized activations times gguf's dequantization, within fp32 rounding; each row invariant
    to the batch (1..19 rows: tiles of 8 and a remainder) and threads; stacked after a part that goes
    a row at a time and with a bias, each part's outputs unchanged. "blocked": enough weight rows that
    prefill's blocking over the weights takes several blocks; 160: an odd number of 32-blocks."""
    super_block = _block(qtype)[0] == 256
    K, N = {(True, "short"): (512, 48), (True, "blocked"): (2560, 160)}.get(
        (super_block, shape), (160, 48) if shape == "short" else (1184, 400)
    )
    raw = random_blocks(qtype, N, K, seed=16)
    w = reference(qtype, raw)
    packed, xtype = kernels().repack(torch.from_numpy(raw), TYPES[qtype], K)
    assert packed.shape[0] == N // 16 and xtype not in TYPES.values()
    # the same bytes reordered; Q4_K's 6-bit scales and minimums become bytes (148 for 144 a row; IQ4_XS 138 for 136)
    assert packed.numel() == {"Q4_K": raw.size // 144 * 148, "IQ4_XS": raw.size // 136 * 138}.get(qtype, raw.size)
    x = torch.randn(19, K, generator=torch.Generator().manual_seed(17))
    x[:, 5] *= 40
    y = matmul(x, [packed], [xtype], int8=True)
    xq = quantized_activations(x, 256 if super_block else 32)
    want = xq @ w.double().T
    scale = xq.abs() @ w.double().abs().T
    assert ((y.double() - want).abs() <= 2e-6 * scale + 1e-30).all(), ((y.double() - want).abs() / scale).max()
    assert_rows_invariant(lambda rows: matmul(rows, [packed], [xtype], int8=True), x, max_n=19)
    kind = "Q6_K" if super_block else "Q5_0"  # as in the file, not regrouped: a row at a time
    other = torch.from_numpy(random_blocks(kind, 16, K, seed=18))
    bias = torch.randn(N + 16, generator=torch.Generator().manual_seed(19))
    both = matmul(x, [other, packed], [TYPES[kind], xtype], bias, int8=True)
    assert torch.equal(both, torch.cat([matmul(x, [other], [TYPES[kind]], int8=True), y], dim=1) + bias)
    assert_rows_invariant(lambda rows: matmul(rows, [other, packed], [TYPES[kind], xtype], bias, True), x)
    with pytest.raises(RuntimeError, match="int8"):
        matmul(x, [packed], [xtype])
    with pytest.raises(RuntimeError, match="sixteen"):
        kernels().repack(torch.from_numpy(raw[:24]), TYPES[qtype], K)
    with pytest.raises(RuntimeError, match="sixteens"):  # a row-at-a-time part of 8 rows before a regrouped one
        matmul(x, [other[:8], packed], [TYPES[kind], xtype], int8=True)
    assert kernels().repack(fp32_part(torch.randn(16, 64)), TYPES["F32"], 64) is None


@needs_regrouped
def test_quant_linear_repacks_parts_in_sixteens_and_keeps_the_raw_rows():
    K = 512
    raws = [random_blocks("Q4_K", 32, K, seed=11), random_blocks("Q6_K", 16, K, seed=12)]
    parts = [
        QTensor("w", t, (32 if t == "Q4_K" else 16, K), torch.from_numpy(r)) for t, r in zip(("Q4_K", "Q6_K"), raws)
    ]
    linear = QuantLinear(parts, int8=True)
    packed, xtype = kernels().repack(parts[0].data, TYPES["Q4_K"], K)
    packed6, xtype6 = kernels().repack(parts[1].data, TYPES["Q6_K"], K)  # Q6_K: regrouped in every int8 build
    assert linear.types == [xtype, xtype6] and linear.raw[0] is parts[0].data and linear.raw[1] is parts[1].data
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(13))
    assert torch.equal(linear(x)[:, :32], matmul(x, [packed], [xtype], int8=True))
    assert torch.equal(linear(x)[:, 32:], matmul(x, [packed6], [xtype6], int8=True))
    assert QuantLinear(parts, int8=False).types == [TYPES["Q4_K"], TYPES["Q6_K"]]  # fp32 activations: as in the file
    legacy = [QTensor("w", t, (16, K), torch.from_numpy(random_blocks(t, 16, K, seed=20))) for t in QTYPES[:5]]
    types = [kernels().repack(p.data, TYPES[p.qtype], K)[1] for p in legacy]
    assert QuantLinear(legacy, int8=True).types == types and len(set(types)) == 5
    odd = [QTensor("w", "Q4_K", (24, K), torch.from_numpy(raws[0][:24]))]
    assert QuantLinear(odd, int8=True).types == [TYPES["Q4_K"]]  # rows not in sixteens: not repacked
    mixed = [parts[1], QTensor("w", "Q4_K", (8, K), torch.from_numpy(raws[0][:8]))]
    assert QuantLinear(mixed, int8=True).types == [TYPES["Q6_K"], TYPES["Q4_K"]]  # one part not in sixteens: none


def test_matmul_over_parts_of_different_types_with_a_bias():
    K, sizes = 512, {"Q4_0": 5, "Q6_K": 19, "F32": 3, "Q8_0": 16, "Q4_K": 9, "Q5_1": 2}
    raws = {t: random_blocks(t, n, K, seed=10 + i) for i, (t, n) in enumerate(sizes.items())}
    parts = [torch.from_numpy(r) for r in raws.values()]
    types = [TYPES[t] for t in raws]
    w = torch.cat([reference(t, r) for t, r in raws.items()])
    bias = torch.randn(w.shape[0], generator=torch.Generator().manual_seed(4))
    x = torch.randn(17, K, generator=torch.Generator().manual_seed(5))
    y = matmul(x, parts, types, bias)
    assert y.shape == (17, sum(sizes.values()))
    each = torch.cat([matmul(x, [p], [t]) for p, t in zip(parts, types)], dim=1)
    assert torch.equal(y, each + bias)  # stacking parts changes no output's bits; the bias is added once
    want = x.double() @ w.double().T + bias.double()
    scale = x.double().abs() @ w.double().abs().T + bias.double().abs()
    assert ((y.double() - want).abs() <= 1e-6 * scale).all()
    assert_rows_invariant(lambda rows: matmul(rows, parts, types, bias), x)
    if kernels().int8_available():  # the int8 path: an F32 part keeps fp32 activations
        y8 = matmul(x, parts, types, bias, int8=True)
        each8 = torch.cat([matmul(x, [p], [t], int8=True) for p, t in zip(parts, types)], dim=1)
        assert torch.equal(y8, each8 + bias)
        assert torch.equal(y8[:, 24:27], y[:, 24:27])
        assert_rows_invariant(lambda rows: matmul(rows, parts, types, bias, int8=True), x)
    with pytest.raises(RuntimeError, match="bias"):
        matmul(x, parts, types, bias[:-1])
    with pytest.raises(RuntimeError, match="not a multiple"):
        matmul(x[:, :100], parts, types, bias)


# ---- the other ops -------------------------------------------------------------------------------


def test_rms_norm_is_rowwise_invariant_and_correct():
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(17, 200, generator=g) * 3, torch.randn(200, generator=g)
    y = kernels().rms_norm(x, w, 1e-5)
    xd = x.double()
    want = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-6)
    assert_rows_invariant(lambda rows: kernels().rms_norm(rows, w, 1e-5), x)


def test_swiglu_is_rowwise_invariant_and_correct():
    F = 100  # six 16-lane vectors and a tail of 4
    gate_up = torch.randn(17, 2 * F, generator=torch.Generator().manual_seed(7)) * 4
    y = kernels().swiglu(gate_up)
    assert y.shape == (17, F)
    g, u = gate_up.double()[:, :F], gate_up.double()[:, F:]
    want = g * torch.sigmoid(g) * u
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-6)
    assert_rows_invariant(kernels().swiglu, gate_up)


def test_rope_is_rowwise_invariant_and_correct():
    heads, D = 3, 64
    x = torch.randn(17, heads, D, generator=torch.Generator().manual_seed(8))
    positions = torch.tensor([0, 1, 2, 5, 9, 40, 41, 100, 7, 7, 3, 999, 12, 13, 14, 500, 2047])
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D))

    def rope(rows, pos):
        out = rows.clone()
        kernels().rope(out, pos, inv_freq)
        return out

    y = rope(x, positions)
    angle = (positions.float()[:, None, None] * inv_freq).double()  # (n, 1, D/2), rounded to fp32 as the kernel does
    a, b = x.double()[..., : D // 2], x.double()[..., D // 2 :]
    want = torch.cat((a * angle.cos() - b * angle.sin(), b * angle.cos() + a * angle.sin()), dim=-1)
    assert torch.allclose(y.double(), want, rtol=1e-5, atol=1e-5)
    torch.set_num_threads(1)
    single = [rope(x[i : i + 1], positions[i : i + 1]) for i in range(17)]
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for n in range(1, 18):
            out = rope(x[:n], positions[:n])
            assert all(torch.equal(out[i : i + 1], single[i]) for i in range(n)), (n, threads)


def _attention_reference(q, k_cache, v_cache, keys: list[list[int]], scale):
    """float64 attention of row i of q over the cache positions keys[i]."""
    H, KVH = q.shape[1], k_cache.shape[0]
    out = []
    for i, visible in enumerate(keys):
        kk = k_cache[:, visible].double().repeat_interleave(H // KVH, 0)  # (H, m, D)
        vv = v_cache[:, visible].double().repeat_interleave(H // KVH, 0)
        p = torch.softmax((kk @ q[i].double()[:, :, None])[..., 0] * scale, -1)  # (H, m)
        out.append((p[:, None, :] @ vv)[:, 0].reshape(-1))
    return torch.stack(out)


def test_attention_rows_equal_one_row_calls_and_a_chain_tree_is_causal():
    start, n = 9, 17
    q, kc, vc, scale = attention_case(start, n)
    att = kernels().attention
    y = att(q, kc, vc, start, None, scale)
    assert y.shape == (n, q.shape[1] * q.shape[2])
    want = _attention_reference(q, kc, vc, [list(range(start + i + 1)) for i in range(n)], scale)
    assert torch.allclose(y.double(), want, atol=1e-5)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for m in range(1, n + 1):
            out = att(q[:m], kc, vc, start, None, scale)
            for i in range(m):  # position start+i alone, over the same cache
                assert torch.equal(out[i : i + 1], att(q[i : i + 1], kc, vc, start + i, None, scale)), (m, i)
    # a tree whose nodes form a chain is the causal sequence
    positions, mask = tree_layout([-1] + list(range(n - 1)), start)
    assert torch.equal(positions, torch.arange(start, start + n))
    assert torch.equal(att(q, kc, vc, start, mask, scale), y)


def test_attention_over_an_fp16_cache_is_attention_over_its_values_widened_and_batch_invariant():
    start, n = 21, 9
    q, kc, vc, scale = attention_case(start, n, seed=4)
    k16, v16 = kc.half(), vc.half()
    att = kernels().attention
    parents = [-1, 0, 0, 1, 1, 2, 3, 5, 7]
    _, mask = tree_layout(parents, start)
    for m in (None, mask):
        y = att(q, k16, v16, start, m, scale)
        assert torch.equal(y, att(q, k16.float(), v16.float(), start, m, scale))  # the same values, the same bits
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for i in range(n):  # one row alone reads the fp16 cache as it is; several widen it first
                one_mask = None if m is None else m[i : i + 1, : start + i + 1]
                assert torch.equal(y[i : i + 1], att(q[i : i + 1], k16, v16, start + i, one_mask, scale)), (i, threads)
    with pytest.raises(RuntimeError, match="bad cache"):
        att(q, k16, vc, start, None, scale)  # keys and values of two dtypes
    with pytest.raises(RuntimeError, match="float32 or float16"):
        att(q, kc.bfloat16(), vc.bfloat16(), start, None, scale)


def test_attention_over_a_tree_is_each_paths_own_attention():
    parents = [-1, 0, 0, 1, 1, 2, 3, 5, 7, 0]
    start, n = 6, len(parents)
    q, kc, vc, scale = attention_case(start, n, seed=11)
    _, mask = tree_layout(parents, start)
    y = kernels().attention(q, kc, vc, start, mask, scale)
    keys = [mask[i].nonzero()[:, 0].tolist() for i in range(n)]
    assert torch.allclose(y.double(), _attention_reference(q, kc, vc, keys, scale), atol=1e-5)
    for i in range(n):  # node i alone, seeing the cache and its ancestors: the same bits
        one = kernels().attention(q[i : i + 1], kc, vc, start + i, mask[i : i + 1, : start + i + 1], scale)
        assert torch.equal(y[i : i + 1], one), i


def test_attention_under_any_mask_sees_exactly_its_keys():
    # rows that hide cached keys at different places (the leading run of visible keys differs from row to row, and
    # is shorter than the cache), beside a causal row: each equals its reference and its own one-row call, bitwise
    start, n = 40, 7
    q, kc, vc, scale = attention_case(start, n, seed=12)
    mask = torch.rand(n, start + n, generator=torch.Generator().manual_seed(13)) < 0.7
    mask[:, 0] = True
    mask[0] = torch.arange(start + n) <= start  # causal
    mask[1, : start - 3] = True  # hides only near the end of the cache
    for kv in ((kc, vc), (kc.half(), vc.half())):
        y = kernels().attention(q, *kv, start, mask, scale)
        keys = [mask[i].nonzero()[:, 0].tolist() for i in range(n)]
        want = _attention_reference(q, kv[0].float(), kv[1].float(), keys, scale)
        assert torch.allclose(y.double(), want, atol=1e-5)
        for i in range(n):
            one = kernels().attention(q[i : i + 1], *kv, start + n - 1, mask[i : i + 1], scale)
            assert torch.equal(y[i : i + 1], one), i


# ---- types the kernels do not handle -----------------------------------------------------------


def test_quant_linear_dequantizes_other_types_to_fp32():
    K = 256
    tq2 = random_blocks("TQ2_0", 7, K, seed=12)
    tq1 = random_blocks("TQ1_0", 6, K, seed=13)
    q4 = random_blocks("Q4_0", 5, K, seed=14)
    parts = [
        QTensor("a", "TQ2_0", (7, K), torch.from_numpy(tq2)),
        QTensor("b", "TQ1_0", (6, K), torch.from_numpy(tq1)),
        QTensor("c", "Q4_0", (5, K), torch.from_numpy(q4)),
    ]
    bias = [torch.randn(7), None, torch.randn(5)]
    fallback: set[str] = set()
    linear = QuantLinear(parts, bias, fallback)
    assert fallback == {"TQ2_0", "TQ1_0"}
    assert linear.types == [TYPES["F32"], TYPES["F32"], TYPES["Q4_0"]] and linear.out_features == 18
    assert linear.data[2].data_ptr() == parts[2].data.data_ptr()  # a kernel type is not copied
    w = torch.cat([reference("TQ2_0", tq2), reference("TQ1_0", tq1), reference("Q4_0", q4)])
    b = torch.cat([bias[0], torch.zeros(6), bias[2]])
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(15))
    assert torch.equal(linear(x), matmul(x, [fp32_part(w[:13]), parts[2].data], [0, TYPES["Q4_0"]], b))
    want = x.double() @ w.double().T + b.double()
    assert ((linear(x).double() - want).abs() <= 1e-6 * (x.double().abs() @ w.double().abs().T + b.abs())).all()


# ---- the real model -------------------------------------------------------------------------------

SMOL = REGISTRY["smollm2-135m"]
TEXT = (
    "Rewrite the following text in your own words: The committee met on Tuesday. The committee approved "
    "the budget. The committee will meet again on Tuesday to approve the budget for the next year."
)
CODE = "Add comments to this code:\ndef add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"


def test_smollm2_runs_at_its_gguf_precision_on_the_quantized_kernels(smol):
    assert smol.gguf is not None and smol.backend == "lean" and isinstance(smol.lean(), QuantModel)
    assert smol.precision == "gguf Q4_1+Q8_0" and smol.lean().fallback == []
    assert smol.lean().int8 == kernels().int8_available()  # int8 activations wherever the CPU has AVX2 or VNNI


def _ids(model, text=TEXT):
    return model.encode(text, chat=True)


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.float32])
def test_one_forward_over_many_tokens_is_one_token_forwards(smol, kv_dtype):
    smol = remake(smol, lean=QuantModel(smol.gguf, smol.config, kv_dtype=kv_dtype))
    ids = _ids(smol)
    prompt, new = ids[:-12], ids[-12:]
    many, one = LeanKVCache(smol, capacity=64), LeanKVCache(smol, capacity=64)
    assert many.k[0].dtype == many.v[-1].dtype == kv_dtype and many.features.dtype == torch.float32
    many.extend(prompt)
    one.extend(prompt)
    torch.set_num_threads(2)
    logits = many.extend(new, all_logits=True)
    torch.set_num_threads(1)  # and on another thread count
    singles = torch.cat([one.extend([t], all_logits=True) for t in new])
    assert logits.shape == (12, smol.vocab_size)
    assert torch.equal(logits, singles)
    end = len(ids)
    for a, b in zip(many.k + many.v, one.k + one.v):
        assert torch.equal(a[:, :end], b[:, :end])
    assert torch.equal(many.features[:end], one.features[:end])
    whole = LeanKVCache(smol, capacity=64)  # and the whole sequence in one forward
    assert torch.equal(whole.extend(ids, all_logits=True)[-12:], logits)


def test_the_fp16_cache_holds_the_fp32_caches_keys_and_values_rounded(smol):
    ids = _ids(smol)
    caches = {}
    for kv_dtype in (torch.float16, torch.float32):
        model = remake(smol, lean=QuantModel(smol.gguf, smol.config, kv_dtype=kv_dtype))
        caches[kv_dtype] = LeanKVCache(model, capacity=64)
        caches[kv_dtype].extend(ids)
    half, full = caches[torch.float16], caches[torch.float32]
    n = len(ids)  # the first layer's inputs are the same: its keys and values are the fp32 ones, rounded
    assert torch.equal(half.k[0][:, :n], full.k[0][:, :n].half())
    assert torch.equal(half.v[0][:, :n], full.v[0][:, :n].half())
    assert not torch.equal(half.k[-1][:, :n].float(), full.k[-1][:, :n])  # later layers see the rounding


def test_a_token_tree_forward_is_each_paths_linear_forward(smol):
    prompt = _ids(smol)
    tree, parents = [504, 260, 1083, 30, 2377, 253, 216, 28], [-1, 0, 0, 1, 1, 2, 3, 6]
    cache = LeanKVCache(smol, capacity=64)
    cache.extend(prompt)
    logits = cache.extend(tree, all_logits=True, parents=parents)
    assert logits.shape == (len(tree), smol.vocab_size)
    linear = LeanKVCache(smol, capacity=64)
    linear.extend(prompt)
    for node in range(len(tree)):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        linear.rollback(len(prompt))
        row = linear.extend([tree[i] for i in path], all_logits=True)[-1]
        assert torch.equal(logits[node], row), node
    # keeping a path leaves the cache as the linear forward along it left it
    cache.keep_path(len(prompt), [0, 1, 3])
    linear.rollback(len(prompt))
    linear.extend([tree[0], tree[1], tree[3]])
    end = len(prompt) + 3
    assert all(torch.equal(a[:, :end], b[:, :end]) for a, b in zip(cache.k + cache.v, linear.k + linear.v))


@pytest.mark.parametrize("text", [TEXT, CODE], ids=["rewrite", "code"])
def test_speculative_greedy_is_plain_greedy(smol, text):
    ids = _ids(smol, text)
    plain = generate(smol, ids, k=0, max_new_tokens=48)
    assert len(plain.tokens) >= 20
    runs = [("prompt-lookup", 4), ("suffix-tree", 4)]
    if text == TEXT:  # eagle-tree: token trees drafted by the packaged head over the quantized model's features
        runs += [("prompt-lookup", 1), ("prompt-lookup", "auto"), ("eagle-tree", 4)]
    for name, k in runs:
        drafter = (
            make_drafter(name, head=PACKAGED / "smollm2-135m.safetensors")
            if name == "eagle-tree"
            else make_drafter(name)
        )
        spec = generate(smol, ids, drafter, k=k, max_new_tokens=48)
        first = next((i for i, (a, b) in enumerate(zip(spec.tokens, plain.tokens)) if a != b), None)
        assert spec.tokens == plain.tokens, (name, k, "first differs at", first)
        if k != "auto":
            assert spec.stats.drafted > 0 and spec.stats.rounds < plain.stats.rounds, (name, k)
    assert smol._hf is None  # the quantized model ran alone: its fp32 transformers model was never loaded


def test_logits_are_the_fp32_dequantized_models_up_to_rounding(smol):
    """With fp32 activations, the quantized forward is the dequantized fp32 model up to the rounding
    of the sums; with int8 activations (the default where the CPU has VNNI), up to that
    quantization too, as in llama.cpp: close in distribution, the same top token almost always. The
    fp16 KV cache (the default) rounds keys and values as llama.cpp's default cache does: close too."""
    ref = load_model(SMOL.name, dtype=torch.float32)
    assert ref.gguf is None and ref.precision == "float32"
    ids = _ids(smol) + _ids(smol, CODE)[1:]
    with torch.inference_mode():
        want = ref.hf(input_ids=torch.tensor([ids])).logits[0].float()
    runs = [("fp32", torch.float32), ("fp32", torch.float16)]
    runs += [("int8", torch.float32)] if kernels().int8_available() else []
    for activations, kv_dtype in runs:
        model = remake(smol, lean=QuantModel(smol.gguf, smol.config, activations=activations, kv_dtype=kv_dtype))
        quant = LeanKVCache(model, capacity=128).extend(ids, all_logits=True)
        assert quant.shape == want.shape
        agree = (quant.argmax(-1) == want.argmax(-1)).float().mean().item()
        if kv_dtype == torch.float16:
            assert (quant - want).abs().max() < 2e-2 * want.std()  # measured: 5e-3 of it
            assert agree >= 0.97, agree  # measured: 1.0 over these 132 positions
        elif activations == "fp32":
            # the same (dequantized) weights: only the rounding of the sums differs
            assert (quant - want).abs().max() < 1e-3 * want.std()  # measured: 1.3e-5 of it
            assert agree >= 0.97, agree  # measured: 1.0 over these 132 positions
        else:
            logp, logq = want.log_softmax(-1), quant.log_softmax(-1)
            kl = (logp.exp() * (logp - logq)).sum(-1).mean()  # KL(fp32 model || quantized), nats per position
            assert kl < 0.01, kl  # measured: 0.003
            assert agree >= 0.9, agree  # measured: 0.96


def test_a_type_the_kernels_do_not_handle_is_dequantized_and_said_once(smol, capsys):
    """ffn_down of two layers turned TQ2_0 (gguf's quantization of their weights): the model says once
    that it dequantizes TQ2_0, and its logits are those of the same weights given as F32 blocks."""
    capsys.readouterr()
    tensors16, tensors32 = dict(smol.gguf.tensors), dict(smol.gguf.tensors)
    for i in (0, 5):
        t = smol.gguf.tensors[f"blk.{i}.ffn_down.weight"]
        blocks = gguf_quantize(t.dequantize().numpy(), GGMLQuantizationType.TQ2_0)
        tensors16[t.name] = QTensor(t.name, "TQ2_0", t.shape, torch.from_numpy(blocks))
        tensors32[t.name] = QTensor(t.name, "F32", t.shape, fp32_part(reference("TQ2_0", blocks)))
    m16 = QuantModel(dataclasses.replace(smol.gguf, tensors=tensors16), smol.config)
    m32 = QuantModel(dataclasses.replace(smol.gguf, tensors=tensors32), smol.config)
    assert m16.fallback == ["TQ2_0"] and m32.fallback == []
    ids = torch.tensor(_ids(smol)[:20])

    def run(m):
        keys = [torch.empty(m.n_kv, 32, m.head_dim) for _ in m.layers]
        values = [torch.empty(m.n_kv, 32, m.head_dim) for _ in m.layers]
        return m.forward(ids, keys, values, torch.empty(32, m.hidden_size), 0, len(ids))

    assert torch.equal(run(m16), run(m32))
    run(m16)
    err = capsys.readouterr().err
    assert err.count("dequantized to fp32") == 1 and "TQ2_0" in err.splitlines()[0], err


def test_activations_are_named_or_refused(smol):
    if kernels().int8_available():
        assert "int8 activations" in QuantModel(smol.gguf, smol.config, activations="int8").kernel
    else:
        with pytest.raises(ValueError, match="AVX512-VNNI"):
            QuantModel(smol.gguf, smol.config, activations="int8")
    assert "fp32 activations" in QuantModel(smol.gguf, smol.config, activations="fp32").kernel
    with pytest.raises(ValueError, match="'auto', 'int8' or 'fp32'"):
        QuantModel(smol.gguf, smol.config, activations="int4")


def test_a_truncated_gguf_fails_to_load_naming_the_file(tmp_path):
    source = cache_dir() / "gguf" / SMOL.gguf_file
    if not source.exists():
        pytest.skip(f"{SMOL.name} is not pulled: run `specdec models pull {SMOL.name}`")
    bad = tmp_path / "x.gguf"
    with open(source, "rb") as src:
        bad.write_bytes(src.read(4 << 20))  # the header and the first tensors' data
    with pytest.raises(GGUFError, match=str(bad)):
        load_model(str(bad))


# --- --quantize: a Hugging Face model quantized at load (specdec.models.quantize) ----------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_quantized_hf_model_is_the_dequantized_model_and_batch_invariant(arch):
    fp32 = make_model(arch, seed=3)
    gguf = quantize_model(fp32.hf, "q8_0", "tiny")
    assert gguf.precision == "gguf Q8_0" and "output.weight" in gguf.tensors  # the tiny models are untied
    # an fp32 KV cache, so that Q8_0's rounding is the only difference from the fp32 model
    quant = remake(fp32, hf=None, lean=None, gguf=gguf, config=fp32.hf.config, backend="auto", kv_dtype=torch.float32)
    assert quant.backend == "lean" and isinstance(quant.lean(), QuantModel)
    ids = prompt_ids(16)
    many = LeanKVCache(quant, capacity=32).extend(ids, all_logits=True)
    one = LeanKVCache(quant, capacity=32)
    assert torch.equal(many, torch.cat([one.extend([t], all_logits=True) for t in ids]))
    # its logits are the fp32 model's up to Q8_0's rounding of the weights
    want = LeanKVCache(fp32, capacity=32).extend(ids, all_logits=True)
    assert (many - want).abs().max() < 0.05 * want.std()
    plain = generate(quant, ids, k=0, max_new_tokens=24)
    spec = generate(quant, ids, drafter=make_drafter("prompt-lookup"), k=4, max_new_tokens=24)
    assert spec.tokens == plain.tokens and spec.stats.drafted > 0


def test_a_quantized_model_keeps_copies_of_its_vectors_not_views_of_the_loaded_model():
    """The loaded fp32 model's tensors can be views of its memory-mapped file: a norm kept as a view holds
    every page of the file that quantizing read (a 0.5B draft kept 2.4 GB resident)."""
    fp32 = make_model("qwen2", seed=3)
    gguf = quantize_model(fp32.hf, "q8_0", "tiny")
    storages = {p.untyped_storage().data_ptr() for p in fp32.hf.parameters()}
    vectors = [t for t in gguf.tensors.values() if t.qtype == "F32"]
    assert len(vectors) >= 5  # the norms and the biases
    assert all(t.data.untyped_storage().data_ptr() not in storages for t in vectors)


def test_our_q4_k_quantizer_writes_blocks_gguf_decodes_to_the_weights():
    """quantize_q4_k's blocks, read by gguf's reference dequantizer: every weight within half a
    quantization step (plus the 6-bit scale's and minimum's rounding) of the original; the kernels
    multiply them."""
    from specdec.models.quantize import quantize_q4_k

    g = np.random.default_rng(14)
    w = (g.standard_normal((16, 768)) * 0.05).astype(np.float32)
    w[3, :256] = 0.0  # an all-zero super-block
    w[5] += 0.2  # all positive: no minimum below zero
    blocks = quantize_q4_k(w)
    assert blocks.shape == (16, 3 * 144) and blocks.dtype == np.uint8
    back = reference("Q4_K", blocks).numpy()
    sub = w.reshape(16, 3, 8, 32)
    step = (sub.max(-1) - np.minimum(sub.min(-1), 0)) / 15  # (16, 3, 8)
    err = np.abs(back - w).reshape(16, 3, 8, 32).max(-1)
    assert (err <= 0.75 * step + 1e-6).all(), (err / np.maximum(step, 1e-9)).max()
    assert np.array_equal(back[3, :256], np.zeros(256, np.float32))
    x = torch.randn(2, 768, generator=torch.Generator().manual_seed(15))
    y = matmul(x, [torch.from_numpy(blocks)], [TYPES["Q4_K"]])
    assert torch.allclose(y.double(), x.double() @ torch.from_numpy(back).double().T, rtol=1e-5, atol=1e-5)


def test_quantize_q4_k_takes_q4_1_for_rows_not_a_multiple_of_256():
    gguf = quantize_model(make_model("llama", seed=3).hf, "q4_k", "tiny")  # hidden size 64
    assert gguf.precision == "gguf Q4_1"


def test_quantize_refuses_what_it_cannot_run(model_dir):
    with pytest.raises(ValueError, match="q6_k"):
        quantize_model(make_model("llama", seed=3).hf, "q6_k", "tiny")
    with pytest.raises(ValueError, match="gemma3"):
        quantize_model(make_model("gemma3", seed=3).hf, "q8_0", "tiny")
    with pytest.raises(ValueError, match="--device cpu"):
        load_model(str(model_dir), quantize="q8_0", dtype=torch.bfloat16)


def test_a_gguf_draft_requantized_at_load_drafts_exactly(smol):
    """--draft-quantize: a GGUF model requantized from its dequantized weights (here Q4_1 -> Q4_0)
    is another precision of the same model, cheaper to run as a draft; the output stays the target's."""
    draft = load_model(SMOL.name, quantize="q4_0")
    assert draft.precision.startswith("gguf Q4_0") and draft.precision != smol.precision
    ids = _ids(smol)
    plain = generate(smol, ids, k=0, max_new_tokens=32)
    from specdec.drafters.model import ModelDrafter

    got = generate(smol, ids, ModelDrafter(draft), k=3, max_new_tokens=32)
    assert got.tokens == plain.tokens and got.stats.accepted > 0
