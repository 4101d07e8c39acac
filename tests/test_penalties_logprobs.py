"""Penalties and logprobs: applied and reported at every position of a verified block exactly as
plain decoding applies and reports them, for every drafter and k."""

from __future__ import annotations

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from specdec.drafters.model import ModelDrafter
from specdec.engine import generate
from specdec.models.quantize import quantize_model
from specdec.sampling import Penalties

from .conftest import make_model, prompt_ids, remake


def _quant(seed: int = 3):
    fp32 = make_model("llama", seed=seed)
    return remake(fp32, hf=None, lean=None, gguf=quantize_model(fp32.hf, "q8_0", "tiny"), config=fp32.hf.config)


def test_penalties_match_their_definitions():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=g) * 4
    prompt, output, draft = [5, 6, 7], [8, 8, 9, 5], [9, 11]
    got = Penalties(0.7, 0.4, 1.3).apply(logits, prompt, output, draft)
    for i in range(3):
        history = output + draft[:i]
        want = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + history]), logits[i : i + 1].clone())[0]
        for t in set(history):
            want[t] -= 0.7 * history.count(t) + 0.4
        assert torch.allclose(got[i], want), i
    assert torch.equal(Penalties().apply(logits, prompt, output, draft), logits)  # neutral: untouched
    with pytest.raises(ValueError, match="repetition_penalty"):
        Penalties(repetition=0)


def _drafter(name: str):
    """A registry name, or "model": the target's own fp32 weights as a draft model (most accepted)."""
    return ModelDrafter(make_model("llama", seed=3)) if name == "model" else name


@pytest.mark.parametrize("drafter", ["prompt-lookup", "suffix", "random", "model"])
@pytest.mark.parametrize("k", [1, 3, "auto"])
def test_a_penalised_run_equals_plain_decoding_with_the_penalty(drafter, k):
    target = _quant()
    prompt = prompt_ids(20)
    penalties = Penalties(frequency=0.6, presence=0.2, repetition=1.1)
    plain = generate(target, prompt, k=0, max_new_tokens=24, penalties=penalties)
    assert plain.tokens != generate(target, prompt, k=0, max_new_tokens=24).tokens  # the penalty bites
    got = generate(target, prompt, _drafter(drafter), k=k, max_new_tokens=24, penalties=penalties)
    assert got.tokens == plain.tokens


@pytest.mark.parametrize("drafter,k", [("prompt-lookup", 4), ("suffix", "auto"), ("model", 3)])
def test_logprobs_equal_plain_decodings_to_the_bit(drafter, k):
    target = _quant()
    prompt = prompt_ids(20)
    plain = generate(target, prompt, k=0, max_new_tokens=20, logprobs=5)
    got = generate(target, prompt, _drafter(drafter), k=k, max_new_tokens=20, logprobs=5)
    assert got.stats.accepted > 0  # some positions came from a verified block
    assert got.tokens == plain.tokens
    assert got.logprobs == plain.logprobs  # floats compared exactly
    assert [t.token for t in got.logprobs] == got.tokens
    assert all(len(t.top) == 5 and t.top[0][1] >= t.logprob for t in got.logprobs)
    assert generate(target, prompt, k=0, max_new_tokens=3).logprobs is None


def test_logprobs_are_the_targets_log_softmax():
    target = make_model("llama", seed=5)
    prompt = prompt_ids(12)
    gen = generate(target, prompt, k=0, max_new_tokens=8, logprobs=2, temperature=0.7, seed=1)
    with torch.no_grad():
        logits = target.hf(torch.tensor([prompt + gen.tokens])).logits[0, len(prompt) - 1 : -1].double()
    # by hand, in float64: log p(t) = logit(t) - log sum exp(logits), and the two largest
    want = logits - logits.exp().sum(-1, keepdim=True).log()
    got = torch.tensor([t.logprob for t in gen.logprobs], dtype=torch.float64)
    assert torch.allclose(got, want[torch.arange(len(gen.tokens)), torch.tensor(gen.tokens)], atol=1e-4)
    for t, row in zip(gen.logprobs, want):
        assert [i for i, _ in t.top] == row.topk(2).indices.tolist()  # the two most likely, most likely first
        assert [v for _, v in t.top] == pytest.approx(row.topk(2).values.tolist(), abs=1e-4)
    assert [t.token for t in gen.logprobs] == gen.tokens  # the sampled tokens, at temperature 0.7
