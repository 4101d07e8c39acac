"""QuantModel.forward_batch: several requests' new tokens in one forward, each request with its own
KV cache, start and tree. Every request's logits and cache rows have the bits of its forward alone,
whatever else is in the batch (the kernels are batch-invariant; attention is per request)."""

from __future__ import annotations

import pytest
import torch

from specdec.backends.lean import tree_layout
from specdec.backends.quant import BatchItem, QuantModel
from specdec.cache import LeanKVCache
from specdec.models.load import load_model
from specdec.models.quantize import quantize_model
from specdec.models.registry import REGISTRY
from specdec.models.weights import cache_dir, is_pulled

from .conftest import make_model, prompt_ids, remake


def _item(cache: LeanKVCache, tokens: list[int], keep: int, parents: list[int] | None = None) -> BatchItem:
    """The BatchItem that appends `tokens` (a tree when parents are given) to `cache`."""
    start = len(cache.tokens)
    tree = None if parents is None else tree_layout(parents, start)
    return BatchItem(torch.tensor(tokens), cache.k, cache.v, cache.features, start, keep, tree)


def _check(model, prompts: list[list[int]], steps: list[tuple[list[int], list[int] | None]]) -> None:
    """Prefill each prompt in its own cache, twice; then one batched forward of `steps` (tokens and
    parents per request) against each request's forward alone: logits, keys, values and features."""
    lean = model.lean()
    assert isinstance(lean, QuantModel)
    taps = (0, 1)  # EAGLE's feature taps after layers 0 and 1: written per request too
    batch = [LeanKVCache(model, capacity=96, taps=taps) for _ in prompts]
    alone = [LeanKVCache(model, capacity=96, taps=taps) for _ in prompts]
    for b, a, p in zip(batch, alone, prompts):
        b.extend(p)
        a.extend(p)
    items = [_item(c, tokens, len(tokens), parents) for c, (tokens, parents) in zip(batch, steps)]
    torch.set_num_threads(2)
    got = lean.forward_batch(items, taps)
    torch.set_num_threads(1)  # the solo forwards on another thread count
    for r, (c, (tokens, parents)) in enumerate(zip(alone, steps)):
        item = _item(c, tokens, len(tokens), parents)
        want = lean.forward(item.ids, c.k, c.v, c.features, item.start, item.keep, item.tree, taps=taps)
        assert got[r].shape == (len(tokens), lean.vocab_size)
        assert torch.equal(got[r], want), r
        end = item.start + len(tokens)
        assert all(torch.equal(x[:, :end], y[:, :end]) for x, y in zip(batch[r].k + batch[r].v, c.k + c.v)), r
        assert batch[r].features.shape[1] == 3 * lean.hidden_size  # the final norm's and the two taps'
        assert torch.equal(batch[r].features[:end], c.features[:end]), r


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_batched_forward_gives_each_request_its_solo_bits_tiny(arch):
    fp32 = make_model(arch, seed=3)
    quant = remake(fp32, hf=None, lean=None, gguf=quantize_model(fp32.hf, "q8_0", "tiny"), config=fp32.hf.config)
    prompts = [prompt_ids(5), prompt_ids(23)[3:], prompt_ids(12)]
    steps = [([7], None), ([9, 4, 4, 11, 2], None), ([5, 6, 8, 3], [-1, 0, 0, 1])]  # one token, a block, a tree
    _check(quant, prompts, steps)
    _check(quant, prompts[:1], steps[:1])  # a batch of one is a plain forward
    with pytest.raises(ValueError, match="at least one"):
        quant.lean().forward_batch([])


def test_a_prompt_chunk_beside_many_one_token_requests_keeps_each_requests_solo_bits():
    # attention's work is shared out by cost: the chunk's rows are cut into runs, the one-row
    # requests gathered, neither of which may change a row's bits
    fp32 = make_model("llama", seed=5, heads=1, kv_heads=1)  # head size 64: the AVX-512 kernel
    quant = remake(fp32, hf=None, lean=None, gguf=quantize_model(fp32.hf, "q8_0", "tiny"), config=fp32.hf.config)
    prompts = [prompt_ids(4 + i)[i:] for i in range(9)] + [prompt_ids(3)]
    steps = [([11 + i], None) for i in range(9)] + [(prompt_ids(60)[:50], None)]
    _check(quant, prompts, steps)
    # the chunk's rows, cut into runs the same way in both forwards above, against one token at a time
    lean, chunk = quant.lean(), steps[-1][0]
    block, single = (LeanKVCache(quant, capacity=96) for _ in range(2))
    block.extend(prompts[-1])
    single.extend(prompts[-1])
    start = len(prompts[-1])
    torch.set_num_threads(2)
    rows = lean.forward(torch.tensor(chunk), block.k, block.v, block.features, start, len(chunk), None)
    for i, token in enumerate(chunk):
        one = lean.forward(torch.tensor([token]), single.k, single.v, single.features, start + i, 1, None)
        assert torch.equal(rows[i : i + 1], one), i


def test_a_batched_forward_gives_each_request_its_solo_bits_smollm2():
    spec = REGISTRY["smollm2-135m"]
    if not is_pulled(spec.name, cache_dir()):
        pytest.skip(f"{spec.name} is not pulled: run `specdec models pull {spec.name}`")
    model = load_model(spec.name)
    prompts = [model.encode(text, chat=True) for text in ("Name three colours.", "Count to ten: one, two,", "Hi")]
    steps = [([504, 260, 1083], None), ([28], None), ([30, 2377, 253, 216, 28], [-1, 0, 1, 1, 3])]
    _check(model, prompts, steps)


def test_one_token_requests_grouped_by_key_head_have_the_bits_of_a_block_row_smollm2():
    # eight one-token requests in one forward: an attention task takes a key head's three query heads together (the
    # group's keys and values read once). The same position as the second row of a two-row block alone, on two
    # threads, goes a query head a task: the logits and the cache rows must have the same bits.
    spec = REGISTRY["smollm2-135m"]
    if not is_pulled(spec.name, cache_dir()):
        pytest.skip(f"{spec.name} is not pulled: run `specdec models pull {spec.name}`")
    model = load_model(spec.name)
    lean = model.lean()
    texts = ["Name three colours.", "Count to ten: one, two,", "Hi", "Why is the sky blue?", "2 + 2 =", "Say yes.",
             "Write a haiku about rain.", "Translate 'cat' to French."]  # fmt: skip
    prompts = [model.encode(text, chat=True) for text in texts]
    torch.set_num_threads(2)
    batch = [LeanKVCache(model, capacity=96) for _ in prompts]
    for c, p in zip(batch, prompts):
        c.extend(p)
    got = lean.forward_batch([_item(c, [28 + i], 1) for i, c in enumerate(batch)])
    for i, p in enumerate(prompts):
        alone = LeanKVCache(model, capacity=96)
        alone.extend(p[:-1])
        item = _item(alone, [p[-1], 28 + i], 2)
        want = lean.forward(item.ids, alone.k, alone.v, alone.features, item.start, item.keep, item.tree)
        assert torch.equal(got[i][0], want[1]), i
        end = len(p) + 1
        assert all(torch.equal(x[:, :end], y[:, :end]) for x, y in zip(batch[i].k + batch[i].v, alone.k + alone.v)), i
