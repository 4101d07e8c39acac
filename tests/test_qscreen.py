"""The 4-bit screen of a Q8_0 output layer (specdec.backends.qscreen): each row's argmax and its logit
are the full layer's bit for bit, ties and near-ties included, every input row on its own; greedy
decoding with it is greedy decoding without it; sampling never reads it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize

from specdec import generate
from specdec.backends.lean import BatchItem
from specdec.backends.qkernel import kernels
from specdec.backends.qscreen import ScreenedHead
from specdec.backends.quant import QuantLinear, QuantModel
from specdec.cache import new_cache

from .quant_cases import assert_rows_invariant

needs_int8 = pytest.mark.skipif(not kernels().int8_available(), reason="the screen multiplies with int8 activations")

K, V = 256, 16 * 40


def q8_rows(weights: np.ndarray) -> torch.Tensor:
    """fp32 weights (V, K) -> their Q8_0 rows (V, K / 32 * 34) uint8, as gguf (llama.cpp) quantizes them."""
    raw = gguf_quantize(weights.astype(np.float32), GGMLQuantizationType.Q8_0)
    return torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8)).contiguous()


def head_of(rows: torch.Tensor) -> QuantLinear:
    part = SimpleNamespace(qtype="Q8_0", shape=(rows.shape[0], K), data=rows)
    return QuantLinear([part], int8=True)


def codes(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d (V, K / 32) fp32, q (V, K / 32, 32) int8 as int64) of Q8_0 rows."""
    blocks = rows.view(rows.shape[0], -1, 34)
    d = blocks[..., :2].contiguous().view(torch.float16).float().squeeze(-1)
    return d, blocks[..., 2:].contiguous().view(torch.int8).long()


def int8_rounding(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx (M, K / 32), xq (M, K / 32, 32)) of inputs x (M, K): the int8 path's rounding per 32-block."""
    b = x.view(len(x), -1, 32)
    dx = b.abs().amax(-1) / 127
    return dx, torch.round(b * torch.where(dx > 0, 1 / dx, 0)[..., None])


def hard_rows(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows where only the screen's bound keeps the argmax a candidate, and inputs: Gaussian rows, then
    rows along row 7's weights (the last one aimed). For that input, rows 100..139 are row 7 with one high
    nibble raised by one and low nibbles lowered so that each has a larger center than row 7 and an exact
    logit between row 7's center and its exact logit: the floor's eight rows are all wrong ones and lie above
    row 7's center. Row 3 is row 7's copy (an exact tie, which the first index wins)."""
    g = np.random.default_rng(seed)
    rows = q8_rows(g.standard_normal((V, K)) * 0.05)
    blocks = rows.view(V, -1, 34)
    blocks[3] = blocks[7]
    d, q = codes(rows)
    noise = torch.randn(14, K, generator=torch.Generator().manual_seed(seed))
    x = torch.cat([noise[:8], (d[7][:, None] * q[7]).reshape(1, -1) * 30 + 0.05 * noise[8:]])
    dx, xq = int8_rounding(x[-1:])
    c = (d[7].double() * dx[0].double())[:, None] * xq[0].double()  # a logit's change per unit of a weight's code
    c, u7 = c.flatten(), (q[7] + 128).flatten()  # u = q + 128 = 16 hi + lo
    gap = float(c @ (u7 - 128).double() - c @ (16 * (u7 >> 4) - 120.5).double())  # exact minus center, row 7
    assert gap > 0.05
    order = torch.argsort(c, descending=True).tolist()
    for v in range(100, 140):
        u = u7.clone()
        up = [j for j in order if u[j] < 0xF0][v - 100]
        u[up] += 16  # center and exact logit both rise by 16 c[up]
        rest = 16 * float(c[up]) + gap / 2  # lower the exact logit by about this much, through low nibbles
        for j in order:
            if j != up and c[j] > 0 and rest > 0:
                t = min(int(u[j] & 15), int(rest // float(c[j])))
                u[j] -= t
                rest -= t * float(c[j])
        blocks[v, :, :2] = blocks[7, :, :2]
        blocks[v, :, 2:] = (u - 128).to(torch.int8).view(-1, 32).view(torch.uint8)
    return rows, x


@needs_int8
def test_argmax_and_its_logit_are_the_full_layers_bit_for_bit():
    rows, x = hard_rows()
    head = head_of(rows)
    screen = ScreenedHead.of(head)
    assert screen is not None and screen.nbytes * 34 == rows.numel() * 18
    full, logits = head(x), screen(x)
    assert torch.equal(logits.argmax(1), full.argmax(1))
    picked = full.argmax(1, keepdim=True)
    assert torch.equal(logits.gather(1, picked), full.gather(1, picked))
    assert (full[8:].argmax(1) == 3).all()  # the tie with row 7: the first index, as torch.argmax
    centers = ScreenedHead(screen.kernels, rows, screen.screen, -1e6)(x[-1:])[0]  # a negative width: no candidates
    assert centers[7] < full[-1, 100:140].amin() and full[-1, 100:140].amax() < full[-1, 7]
    assert centers[100:140].amin() > centers[7]  # the floor's rows are wrong ones, above row 7's center
    approximate = logits != full
    assert approximate.any(1).all()  # the screen did replace the full product in every row
    assert (logits[approximate] < full.amax(1, keepdim=True).expand_as(full)[approximate]).all()
    # every entry within the screen's width: 7.5 * sum over blocks of d * dx * sum(|xq|), dx and xq the int8 rounding
    d, _ = codes(rows)
    dx, xq = int8_rounding(x)
    width = 7.5 * (dx * xq.abs().sum(-1)).double() @ d.double().T
    assert ((logits - full).abs().double() <= width * (1 + 1e-3)).all()


@needs_int8
def test_each_row_is_its_own_one_row_call_whatever_the_batch_and_threads():
    rows, x = hard_rows(seed=1)
    assert_rows_invariant(ScreenedHead.of(head_of(rows)), x, max_n=len(x))


@needs_int8
def test_an_input_without_a_finite_floor_gets_the_full_heads_logits():
    """An infinite input: no floor to screen by, so the row's logits are the full head's, bit for bit, on every
    build (a VNNI build's full head quantizes the infinite block its own way: -inf where row-at-a-time products
    give NaN)."""
    rows, x = hard_rows()
    head = head_of(rows)
    x = x[:2].clone()
    x[0, 5] = float("inf")
    logits, full = ScreenedHead.of(head)(x), head(x)
    assert not full[0].isfinite().any()
    torch.testing.assert_close(logits[0], full[0], rtol=0, atol=0, equal_nan=True)
    assert logits[1].argmax() == full[1].argmax()  # the finite row beside it is screened as ever


@needs_int8
def test_layers_the_bound_does_not_cover_have_no_screen():
    rows, _ = hard_rows()
    negative = rows.clone()
    negative.view(V, -1, 34)[5, 2, :2] = torch.tensor([-0.01], dtype=torch.float16).view(torch.uint8)
    assert ScreenedHead.of(head_of(negative)) is None
    q4 = SimpleNamespace(qtype="Q4_0", shape=(V, K), data=torch.zeros(V, K // 32 * 18, dtype=torch.uint8))
    assert ScreenedHead.of(QuantLinear([q4], int8=True)) is None
    assert ScreenedHead.of(QuantLinear([SimpleNamespace(qtype="Q8_0", shape=(V, K), data=rows)], int8=False)) is None


@needs_int8
def test_greedy_reads_the_screen_and_decodes_as_without_it(smol, monkeypatch):
    q = smol.lean()
    screen = q.greedy_head
    assert screen is not None  # SmolLM2's output layer (its tied embedding) is Q8_0
    assert q.subset(list(range(4))).greedy_head is screen  # views of the model share it
    prompt = smol.encode("def fib(n):\n    if n < 2:\n        return n\n    return", chat=False)
    calls = []
    monkeypatch.setattr(QuantModel, "greedy_head", property(lambda self: lambda h: calls.append(len(h)) or screen(h)))
    screened = {d: generate(smol, prompt, d, k=4, max_new_tokens=40).tokens for d in (None, "prompt-lookup")}
    assert calls
    n = len(calls)
    generate(smol, prompt, "prompt-lookup", k=3, max_new_tokens=12, temperature=1.0, seed=0)
    assert len(calls) == n  # sampling reads the full layer
    monkeypatch.setattr(QuantModel, "greedy_head", property(lambda self: None))
    plain = generate(smol, prompt, None, max_new_tokens=40).tokens
    assert screened[None] == plain and screened["prompt-lookup"] == plain


def test_a_vocabulary_cut_has_no_screen(smol):
    assert smol.lean().with_output_rows(torch.arange(0, 1000)).greedy_head is None


@needs_int8
def test_a_decode_step_is_screened_per_request_and_a_verify_forward_reads_the_full_layer(smol):
    q = smol.lean()
    ids = smol.encode("The quick brown fox jumps over", chat=False)

    def item(argmax_only: bool, rows: int = 1) -> BatchItem:
        kv = new_cache(smol)
        kv.argmax_only = argmax_only
        return kv.item(ids, all_logits=rows > 1)

    alone = [q.forward_batch([item(a)])[0] for a in (True, False)]
    mixed = q.forward_batch([item(True), item(False), item(True, rows=len(ids))])
    assert torch.equal(mixed[0], alone[0]) and torch.equal(mixed[1], alone[1])
    assert not torch.equal(alone[0], alone[1])  # the greedy step was screened...
    assert torch.equal(alone[0].argmax(1), alone[1].argmax(1))  # ...to the same argmax
    assert torch.equal(mixed[2], q.forward_batch([item(False, rows=len(ids))])[0])  # several rows: the full layer
