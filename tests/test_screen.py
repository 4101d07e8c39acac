"""The bf16-screened output layer: each row's argmax is the fp32 layer's, the tokens that could
be the argmax carry their fp32 logits, and greedy decoding with it is plain fp32 greedy."""

from __future__ import annotations

import pytest
import torch

from specdec import generate
from specdec.backends.screen import ScreenedHead, screening_pays
from specdec.cache import LeanKVCache

from .conftest import make_model, prompt_ids, remake

pytestmark = pytest.mark.skipif(not screening_pays(torch.zeros(1)), reason="oneDNN runs no bf16 products here")


def test_argmax_is_the_fp32_layers_even_at_near_ties():
    g = torch.Generator().manual_seed(0)
    V, d = 3000, 96
    weight = torch.randn(V, d, generator=g) * 0.1
    # rows a bf16 rounding cannot tell apart: near-duplicates of row 7, a few fp32 ulps away
    for i, v in enumerate(range(100, 140)):
        weight[v] = weight[7] * (1 + (i - 20) * 2e-7)
    head = ScreenedHead(weight)
    h = torch.cat([torch.randn(64, d, generator=g) * 3, weight[7:8] * 40 + torch.randn(8, d, generator=g) * 1e-3])
    exact = h @ weight.T  # (n, V)
    logits = head(h)
    top2 = exact.topk(2).values
    clear = top2[:, 0] - top2[:, 1] > 1e-3
    assert clear[:64].all() and not clear[64:].any()
    assert torch.equal(logits.argmax(1)[clear], exact.argmax(1)[clear])
    # at the near-ties every contender was recomputed in fp32, so the pick is an argmax up to rounding
    tied = [7] + list(range(100, 140))
    torch.testing.assert_close(logits[64:, tied], exact[64:, tied], rtol=0, atol=1e-5)
    assert (exact.gather(1, logits.argmax(1)[:, None])[:, 0] >= top2[:, 0] - 1e-5).all()
    off = (logits - exact).abs()
    assert off.max() > 1e-4  # the rest are approximations: the screen did replace the fp32 product
    bound = 2.0**-6 * h.norm(dim=1, keepdim=True) * weight.norm(dim=1) + 2.0**-7 * logits.abs()
    assert (off <= bound).all()


def test_greedy_with_the_screen_is_fp32_greedy():
    target = make_model("llama", seed=1, vocab_size=64)
    lean = target.lean()
    kv = LeanKVCache(target)
    kv.extend(prompt_ids())
    h = kv.features[: len(kv)]
    approximate = (lean.screen(h) - h @ lean.screen.weight.T).abs() > 1e-6
    assert approximate.sum(1).min() > 0  # on this model the screen leaves entries in bf16: the run below tests it
    unscreened = remake(target, lean=None)
    unscreened.lean().screen = None
    prompt = prompt_ids()
    plain = generate(unscreened, prompt, None, max_new_tokens=40).tokens
    assert generate(target, prompt, None, max_new_tokens=40).tokens == plain
    for drafter in ("prompt-lookup", "suffix-tree"):
        assert generate(target, prompt, drafter, k=4, max_new_tokens=40).tokens == plain


def test_sampling_reads_the_full_fp32_layer():
    target = make_model("llama", seed=1)
    calls = []
    screen = target.lean().screen
    target.lean().screen = lambda h: calls.append(h) or screen(h)
    generate(target, prompt_ids(), "prompt-lookup", k=3, max_new_tokens=12, temperature=1.0, seed=0)
    assert calls == []
    generate(target, prompt_ids(), "prompt-lookup", k=3, max_new_tokens=12)
    assert calls  # greedy does use it
