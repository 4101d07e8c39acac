"""The EAGLE head on the quantized kernels (specdec.drafters.quant_head): the fp32 head's step, up to
quantization, in one call; rows of one call equal one-row calls; drafting with it is exact."""

from __future__ import annotations

import copy

import pytest
import torch

from specdec.cache import LeanKVCache
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.quant_head import QuantHead
from specdec.engine import generate
from specdec.train.head import HeadCache, find_head, load_head

TEXT = "Write a short story about a robot who learns to paint, in three paragraphs."


@pytest.fixture(scope="module")
def head(smol):
    return load_head(find_head(smol.name), smol.lean().hidden_size)[0]


@pytest.fixture(scope="module")
def features(smol):
    """(tokens (T,), the quantized target's features (T, d)) over a chat prompt."""
    tokens = smol.encode(TEXT, chat=True)
    kv = LeanKVCache(smol, capacity=len(tokens))
    kv.extend(tokens)
    return torch.tensor(tokens), kv.features[: len(tokens)].float().clone()


def _variant(head, input_norm: bool, bias: bool):
    """The shipped head, or a copy with an input norm and/or q/k/v biases (Qwen2's attention)."""
    head = copy.deepcopy(head)
    g = torch.Generator().manual_seed(0)
    if input_norm:
        head.norm_in = torch.nn.Parameter(1 + 0.1 * torch.randn(head.config["hidden"], generator=g))
    if bias:
        qkv = torch.nn.Linear(head.qkv.in_features, head.qkv.out_features, bias=True)
        with torch.no_grad():
            qkv.weight.copy_(head.qkv.weight)
            qkv.bias.copy_(0.05 * torch.randn(qkv.out_features, generator=g))
        head.qkv = qkv
    return head.eval()


@pytest.mark.parametrize("input_norm,bias", [(False, False), (True, False), (False, True)])
def test_the_quantized_step_is_the_fp32_heads_up_to_quantization(smol, head, features, input_norm, bias):
    tokens, feats = features
    head = _variant(head, input_norm, bias)
    quant = QuantHead(head, smol.lean(), "q8_0")
    n = len(tokens) - 1
    with torch.inference_mode():
        want = head(feats[:n], smol.lean().embed_rows(tokens[1:]), 0, HeadCache(head))  # (n, d)
        got, _ = quant.step(feats[:n], tokens[1:], 0, HeadCache(head))
        out = smol.lean().output_rows(head.vocab_ids)  # the target's output rows, dequantized
        agree = ((got @ out.T).argmax(-1) == (want @ out.T).argmax(-1)).float().mean()
    error = (got - want).norm(dim=-1) / want.norm(dim=-1)
    assert error.median() < 0.05, f"relative error of the predicted features: median {error.median():.3f}"
    assert agree >= 0.8, f"the same greedy token at {agree:.0%} of {n} positions"


def test_one_call_over_many_rows_is_one_call_per_row_at_any_thread_count(smol, head, features):
    """The catch-up over T committed positions equals T one-position steps, bit for bit (the kernels
    are batch-invariant), so the head's cache holds the same keys either way."""
    tokens, feats = features
    quant = QuantHead(head, smol.lean(), "q4_0")
    n = 12
    together, last = quant.step(feats[:n], tokens[1 : n + 1], 0, HeadCache(head))
    cache, rows = HeadCache(head, capacity=4), []  # grown on the way
    for t in range(n):
        h, logits = quant.step(feats[t : t + 1], tokens[t + 1 : t + 2], t, cache)
        rows.append(h)
    assert torch.equal(torch.cat(rows), together)
    assert torch.equal(logits, last)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)  # another thread count: the same bits
        assert torch.equal(quant.step(feats[:n], tokens[1 : n + 1], 0, HeadCache(head))[0], together)
    finally:
        torch.set_num_threads(threads)


def test_the_output_rows_are_the_targets_own_blocks(smol, head):
    """A head that predicts a feature f gets the target's own logits of f over its vocabulary."""
    quant = QuantHead(head, smol.lean(), "q8_0")
    assert quant.qtype == "q8_0" and quant.nbytes > 0
    lean = smol.lean()
    # the logits of the step equal the target's output layer on the step's feature, at the head's ids
    tokens = torch.tensor([5, 6])
    f = torch.randn(2, lean.hidden_size)
    h, logits = quant.step(f, tokens, 0, HeadCache(head))
    assert torch.equal(logits, lean.lm_head(h[-1:])[0, head.vocab_ids])


def test_drafting_with_the_quantized_head_is_exact(smol):
    ids = smol.encode(TEXT, chat=True)
    plain = generate(smol, ids, None, k=0, max_new_tokens=40)
    for drafter in (EagleDrafter(), EagleDrafter(quantize="q4_0", alternatives=1, lookup=True)):
        spec = generate(smol, ids, drafter, k=4, max_new_tokens=40)
        assert drafter.quant is not None  # the target is quantized: the head runs on its kernels
        assert spec.tokens == plain.tokens
        assert spec.stats.drafted > 0


def test_a_bad_quantization_type_is_refused():
    with pytest.raises(ValueError, match="choose one of"):
        EagleDrafter(quantize="q3_x")
