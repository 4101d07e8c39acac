"""The lean decode path (specdec.backends.lean) against transformers' own forward on the same weights."""

from __future__ import annotations

import pytest
import torch

from specdec import ContextLengthError, generate
from specdec.backends.rows import choose_rows
from specdec.cache import KVCache, LeanKVCache, new_cache
from specdec.models.load import Model
from specdec.models.skip import skip_view

from .conftest import N_CTX, make_model, prompt_ids, remake

TOL = dict(rtol=1e-4, atol=1e-4)


def with_bias(model: Model) -> Model:
    """Give every q/k/v projection a nonzero bias (Qwen2's layout), so the fused bias is tested."""
    torch.manual_seed(3)
    for layer in model.hf.model.layers:
        for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
            if proj.bias is not None:
                with torch.no_grad():
                    proj.bias.normal_(0, 0.5)
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request):
    """The same weights on both backends: (lean Model, transformers Model)."""
    model = with_bias(make_model(request.param, seed=4))
    assert model.backend == "lean"
    return model, remake(model, backend="hf", lean=None)


def test_lean_logits_match_transformers_through_extend_and_rollback(pair):
    lean, hf = pair
    a, b = LeanKVCache(lean, capacity=8), KVCache(hf)  # capacity 8: the cache must grow twice
    prompt = prompt_ids(20)
    torch.testing.assert_close(a.extend(prompt), b.extend(prompt), **TOL)
    for keep, block in [(15, [4, 8, 15, 16]), (19, [23]), (12, list(range(30, 50)))]:
        a.rollback(keep)
        b.rollback(keep)
        assert a.tokens == b.tokens
        torch.testing.assert_close(a.extend(block), b.extend(block), **TOL)
        torch.testing.assert_close(a.extend([7], all_logits=False), b.extend([7], all_logits=False), **TOL)


def test_qwen2_bias_is_used():
    model = make_model("qwen2", seed=4)
    before = new_cache(model).extend(prompt_ids())
    biased = with_bias(make_model("qwen2", seed=4))
    assert not torch.allclose(new_cache(biased).extend(prompt_ids()), before, **TOL)


def test_lean_greedy_equals_transformers_greedy(pair):
    lean, hf = pair
    prompt = prompt_ids()
    a = generate(lean, prompt, k=0, max_new_tokens=40).tokens
    assert a == generate(hf, prompt, k=0, max_new_tokens=40).tokens
    for drafter in ("prompt-lookup", "suffix"):  # and speculation on the lean path is plain greedy
        assert generate(lean, prompt, drafter, k=4, max_new_tokens=40).tokens == a


def test_layer_skip_view_runs_the_lean_subset(pair):
    lean, hf = pair
    view_lean, view_hf = skip_view(lean, [1]), skip_view(hf, [1])
    assert view_lean.backend == "lean" and view_lean.lean().layers == [lean.lean().layers[1]]
    prompt = prompt_ids()
    torch.testing.assert_close(new_cache(view_lean).extend(prompt), new_cache(view_hf).extend(prompt), **TOL)


def test_rollback_and_context_errors(pair):
    lean, _ = pair
    kv = new_cache(lean)
    kv.extend(prompt_ids())
    with pytest.raises(ValueError, match="roll back"):
        kv.rollback(len(kv) + 1)
    with pytest.raises(ContextLengthError, match="context"):
        kv.extend([5] * N_CTX)
    assert len(kv) == len(prompt_ids())  # a refused forward leaves the cache as it was


def test_backend_choice():
    gemma = make_model("gemma3")
    assert gemma.backend == "hf"  # auto falls back where the lean forward cannot run the model
    with pytest.raises(ValueError, match="lean backend cannot run"):
        Model(gemma.hf, gemma.tokenizer, "g", backend="lean")
    with pytest.raises(ValueError, match="backend must be one of"):
        Model(gemma.hf, gemma.tokenizer, "g", backend="fast")


def test_weight_bytes_counts_what_a_forward_reads():
    from specdec.backends.lean import weight_bytes
    from specdec.bench.roofline import roofline

    model = make_model("llama")
    hf = model.hf
    everything = sum(p.numel() * 4 for p in hf.parameters())
    embed = hf.get_input_embeddings().weight.numel() * 4
    assert weight_bytes(model.hf) == everything - embed  # untied: the embedding table is only gathered
    tied = make_model("llama")
    tied.hf.lm_head.weight = tied.hf.get_input_embeddings().weight
    assert weight_bytes(tied.hf) == everything - embed  # tied: read once, by the output layer
    roof = roofline(model, {"1": 2.0, "4": 4.0}, bandwidth_gbs=1.0)
    assert roof["floor_ms"] == pytest.approx((everything - embed) / 1e6)
    assert roof["fraction"]["1"] == pytest.approx(2 * roof["fraction"]["4"])


def test_padded_rows_give_the_unpadded_results(pair):
    """With a row table (specdec.backends.rows) a short forward runs more rows, filler after the real
    tokens: the real rows' logits, the cache, and greedy output stay those of transformers."""
    lean, hf = pair
    padded = remake(lean, lean=None)
    padded.lean().rows = {1: 4, 2: 4, 3: 7}
    a, b = LeanKVCache(padded, capacity=8), KVCache(hf)
    prompt = prompt_ids(20)
    torch.testing.assert_close(a.extend(prompt), b.extend(prompt), **TOL)
    for keep, block in [(18, [4, 8]), (20, [23]), (21, [5, 6, 7]), (24, [9])]:
        a.rollback(keep)
        b.rollback(keep)
        assert a.tokens == b.tokens
        torch.testing.assert_close(a.extend(block), b.extend(block), **TOL)
        torch.testing.assert_close(a.extend([7], all_logits=False), b.extend([7], all_logits=False), **TOL)
    a.rollback(20)
    b.rollback(20)
    a.features[20:] = float("nan")
    torch.testing.assert_close(a.extend([3]), b.extend([3]), **TOL)
    assert not a.features[20:24].isnan().any() and a.features[24:].isnan().all()  # ran as 4 rows
    cap = a.features.shape[0]  # now: 2 rows from the end, where 4 rows would not fit
    fill = list(range(40, 40 + cap - 2 - len(a)))
    torch.testing.assert_close(a.extend(fill), b.extend(fill), **TOL)
    a.features[cap - 2 :] = float("nan")
    torch.testing.assert_close(a.extend([3]), b.extend([3]), **TOL)
    assert a.features.shape[0] == cap and not a.features[cap - 2].isnan().any() and a.features[cap - 1].isnan().all()
    assert (
        generate(padded, prompt, k=0, max_new_tokens=30).tokens == generate(hf, prompt, k=0, max_new_tokens=30).tokens
    )


def test_row_table_pads_only_where_a_longer_forward_clearly_pays():
    ms = {1: 10.0, 2: 13.0, 3: 9.5, 4: 7.0, 5: 7.2, 6: 12.0}
    assert choose_rows(ms, gain=0.15) == {1: 4, 2: 4, 3: 4}  # 4 rows: the fastest from 1 to 4
    assert choose_rows(ms, gain=0.3) == {1: 4, 2: 4}  # 3 -> 4 saves 26%, 1 -> 4 30%
    assert choose_rows({1: 10.0, 2: 9.0, 3: 11.0}, gain=0.15) == {}  # 10% is not a clear gain
