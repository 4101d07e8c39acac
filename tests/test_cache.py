"""The KV cache (specdec.cache): it holds exactly the tokens fed and not rolled back, and what it
scores next is what one fresh forward over those tokens scores, on both backends (transformers'
DynamicCache, with Gemma 3's sliding-window layers, and the lean backend's preallocated cache)."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from specdec import ContextLengthError
from specdec.cache import KVCache, LeanKVCache, common_prefix, grown, new_cache

from .conftest import N_CTX, VOCAB, make_model, prompt_ids, remake

TOL = dict(rtol=1e-5, atol=1e-5)
WINDOW = 8  # conftest's gemma3: a sliding-window layer of 8 tokens, then a full-attention one


@functools.cache
def models() -> dict:
    """The same tiny Llama on both backends, a Qwen2 on the lean one, a Gemma 3 (sliding window) on
    transformers' (the lean backend does not run it)."""
    llama = make_model("llama", seed=11)
    return {
        "lean-llama": llama,
        "hf-llama": remake(llama, backend="hf", lean=None),
        "lean-qwen2": make_model("qwen2", seed=12),
        "hf-gemma3": make_model("gemma3", seed=13),
    }


@pytest.fixture(scope="module", params=["lean-llama", "hf-llama", "lean-qwen2", "hf-gemma3"])
def model(request):
    m = models()[request.param]
    assert m.backend == request.param.split("-")[0]
    return m


def sliding(model) -> bool:
    """transformers' sliding-window layers keep the states they would drop only until the next
    rollback: there a rollback reaches back to the previous rollback at most (the engine's rounds
    feed, then roll back once)."""
    return model.backend == "hf" and bool(new_cache(model).sliding)


def fresh(model, tokens: list[int]) -> torch.Tensor:
    """Logits of one forward over `tokens` on an empty cache."""
    return new_cache(model).extend(tokens)


def test_new_cache_is_the_backends_cache(model):
    kv = new_cache(model)
    assert type(kv) is (LeanKVCache if model.backend == "lean" else KVCache)
    assert kv.tokens == [] and len(kv) == 0
    assert sliding(model) == (model is models()["hf-gemma3"])


def test_extend_scores_every_fed_token_or_only_the_last(model):
    prompt = prompt_ids(10)
    kv = new_cache(model)
    logits = kv.extend(prompt[:6])
    assert logits.shape == (6, model.vocab_size) and kv.tokens == prompt[:6]
    last = kv.extend(prompt[6:], all_logits=False)
    assert last.shape == (1, model.vocab_size) and kv.tokens == prompt
    whole = fresh(model, prompt)
    torch.testing.assert_close(logits, whole[:6], **TOL)
    torch.testing.assert_close(last[0], whole[-1], **TOL)


def test_rollback_keeps_exactly_the_committed_tokens(model):
    prompt, drafted = prompt_ids(14), [5, 9, 13, 17, 21]
    kv = new_cache(model)
    kv.extend(prompt)
    kv.extend(drafted)
    kv.rollback(len(prompt) + 2)  # two drafted tokens accepted
    assert kv.tokens == prompt + drafted[:2] and len(kv) == len(prompt) + 2
    if model.backend == "hf":
        assert kv.cache.get_seq_length() == len(prompt) + 2
    kv.rollback(len(kv))  # to its own length: nothing changes
    assert kv.tokens == prompt + drafted[:2]
    for bad in (-1, len(kv) + 1):
        with pytest.raises(ValueError, match="roll back"):
            kv.rollback(bad)
        assert kv.tokens == prompt + drafted[:2]  # a refused rollback leaves the cache as it was


def test_rollback_then_extend_equals_a_single_extend(model):
    prompt, drafted, again = prompt_ids(14), [5, 9, 13, 17, 21], [6, 10, 14, 18]
    kv = new_cache(model)
    kv.extend(prompt)
    kv.extend(drafted)
    kv.rollback(len(prompt) + 2)
    got = kv.extend(again)
    once = new_cache(model)
    want = once.extend(prompt + drafted[:2] + again)[-len(again) :]
    assert kv.tokens == once.tokens
    torch.testing.assert_close(got, want, **TOL)
    # and the two caches go on alike: nothing of the dropped tokens is left behind
    torch.testing.assert_close(kv.extend([7, 8]), once.extend([7, 8]), **TOL)
    if model.backend == "lean":
        n = len(kv)
        torch.testing.assert_close(kv.features[:n], once.features[:n], **TOL)


def test_any_run_of_extends_and_rollbacks_scores_as_one_fresh_forward(model):
    """Random blocks fed and random rollbacks (the deepest ones included: to 0 tokens), checked
    after every step against an independent record of the tokens and a fresh forward over them."""
    rng = random.Random(0)
    kv, expected, floor, longest = new_cache(model), [], 0, 0
    for _ in range(40):
        if expected and rng.random() < 0.4:
            keep = rng.randint(floor if sliding(model) else 0, len(expected))
            kv.rollback(keep)
            del expected[keep:]
            floor = keep
        else:
            block = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 6))]
            if len(expected) + len(block) > N_CTX:
                continue
            logits = kv.extend(block)
            expected += block
            longest = max(longest, len(expected))
            torch.testing.assert_close(logits, fresh(model, expected)[-len(block) :], **TOL)
        assert kv.tokens == expected and len(kv) == len(expected)
        if model.backend == "hf" and not sliding(model):
            assert kv.cache.get_seq_length() == len(expected)
    assert longest > 2 * WINDOW  # the sliding window was passed


def test_sliding_window_layers_roll_back_a_whole_round_past_the_window():
    """Gemma 3's sliding-window layers drop states older than the window; a round that fed more
    than the window and is rolled back to its start must still score as a fresh forward."""
    model = models()["hf-gemma3"]
    prompt = prompt_ids(20)
    kv = new_cache(model)
    kv.extend(prompt)
    block = list(range(10, 10 + 2 * WINDOW))
    kv.extend(block)
    kv.rollback(len(prompt))
    torch.testing.assert_close(kv.extend([5, 6]), fresh(model, prompt + [5, 6])[-2:], **TOL)
    assert max(layer.keys.shape[-2] for layer in kv.sliding) > WINDOW  # kept for a rollback ...
    kv.rollback(len(kv))
    assert max(layer.keys.shape[-2] for layer in kv.sliding) == WINDOW - 1  # ... until the next one trims them


def test_sync_rolls_back_to_the_common_prefix_and_feeds_the_rest(model):
    prompt = prompt_ids(12)
    kv = new_cache(model)
    assert kv.sync(prompt) == prompt  # empty: everything is fed
    kv.extend(prompt[:-1])
    assert kv.sync(prompt) == prompt[-1:] and kv.tokens == prompt[:-1]  # the cache's invariant: all but the last
    kv.extend(prompt[-1:] + [30, 31])
    context = prompt + [30, 40, 41]  # agrees with the cache up to 30, then differs
    feed = kv.sync(context)
    assert feed == [40, 41] and kv.tokens == prompt + [30]
    torch.testing.assert_close(kv.extend(feed), fresh(model, context)[-2:], **TOL)
    assert kv.sync(context) == context[-1:] and kv.tokens == context[:-1]  # the whole context cached: feed the last


def test_context_length_error_past_n_ctx_and_not_at_it():
    model = models()["lean-llama"]
    kv = LeanKVCache(model, capacity=8)
    kv.extend(prompt_ids(N_CTX - 3))
    with pytest.raises(ContextLengthError, match=f"{N_CTX + 1} tokens exceed .*context of {N_CTX}"):
        kv.extend([5, 6, 7, 8])
    assert len(kv) == N_CTX - 3  # a refused forward leaves the cache as it was
    last = kv.extend([5, 6, 7])  # exactly the context: allowed
    assert len(kv) == N_CTX and kv.features.shape[0] == N_CTX  # grown to the context, not past it
    torch.testing.assert_close(last, fresh(model, kv.tokens)[-3:], **TOL)
    with pytest.raises(ContextLengthError):
        kv.extend([9])
    kv.rollback(N_CTX - 1)
    kv.extend([9])  # room again after a rollback


def test_grown_keeps_the_first_rows_along_the_given_dimension():
    old = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3)
    new = grown(old, 9, keep=4, dim=1)
    assert new.shape == (2, 9, 3) and new.dtype == old.dtype
    assert torch.equal(new[:, :4], old[:, :4])
    rows = grown(old[0], 7, keep=5, dim=0)
    assert rows.shape == (7, 3) and torch.equal(rows[:5], old[0])


def test_lean_cache_doubles_its_capacity_and_stops_at_the_context():
    kv = LeanKVCache(models()["lean-llama"], capacity=8)
    sizes = []
    for n in (5, 4, 10, 30, 40):  # 5, 9, 19, 49, 89 tokens
        kv.extend(list(range(3, 3 + n)))
        sizes.append(kv.features.shape[0])
        assert all(t.shape[1] == sizes[-1] for t in (*kv.k, *kv.v))
    assert sizes == [8, 16, 32, 64, N_CTX]
    assert LeanKVCache(models()["lean-llama"]).features.shape[0] == N_CTX  # default 256, capped at the context


def test_common_prefix():
    assert common_prefix([], [1, 2]) == 0
    assert common_prefix([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix([1, 2, 3], [1, 2]) == 2 and common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([1, 2, 3], [1, 5, 3]) == 1
    assert common_prefix([4, 2], [1, 2]) == 0


# a token tree after the cached tokens: node 0 (the last committed token) -> 1 -> 3 -> 5, 0 -> 2 -> 4, 3 -> 6
PARENTS = [-1, 0, 0, 1, 2, 3, 3]


@pytest.mark.parametrize("path", [[0], [0, 1], [0, 2, 4], [0, 1, 3, 6]])
def test_keep_path_leaves_the_cache_holding_the_path_alone(path):
    model = models()["lean-qwen2"]
    prompt = prompt_ids(14)
    tree = [prompt[-1], 40, 41, 42, 43, 44, 45]
    kv = LeanKVCache(model, capacity=16)  # the tree forward grows it
    kv.extend(prompt[:-1])
    kv.extend(tree, parents=PARENTS)
    assert kv.tokens == prompt[:-1] + tree  # until keep_path, the nodes in order
    kv.keep_path(len(prompt) - 1, path)
    committed = prompt[:-1] + [tree[i] for i in path]
    assert kv.tokens == committed
    once = LeanKVCache(model)
    once.extend(committed)
    n = len(kv)
    torch.testing.assert_close(kv.features[:n], once.features[:n], **TOL)
    # a second round (another tree, then a rollback of part of it) goes on as from the fresh cache
    start = len(kv)
    second = kv.extend([20, 21, 22], parents=[-1, 0, 0])
    torch.testing.assert_close(second[[0, 1]], once.extend([20, 21]), **TOL)
    kv.keep_path(start, [0, 2])
    kv.rollback(start + 1)
    once.rollback(start + 1)
    assert kv.tokens == once.tokens == committed + [20]
    torch.testing.assert_close(kv.extend([23, 24]), once.extend([23, 24]), **TOL)


@pytest.mark.parametrize("bad", [[], [1], [0, 0], [0, 3, 1], [0, 7]])
def test_keep_path_refuses_a_path_that_is_not_root_first_in_the_tree(bad):
    kv = LeanKVCache(models()["lean-qwen2"])
    kv.extend(prompt_ids(6))
    kv.extend(list(range(10, 17)), parents=PARENTS)
    before = list(kv.tokens)
    with pytest.raises(ValueError, match="root-first path"):
        kv.keep_path(6, bad)
    assert kv.tokens == before
