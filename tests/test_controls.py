"""The other sampling controls: logit_bias and min_p change the target's distribution at every
position of a verified block exactly as plain decoding applies them; stop_token_ids and ignore_eos
change where a generation ends, the same for every drafter and k."""

from __future__ import annotations

import pytest
import torch

from specdec.drafters.model import ModelDrafter
from specdec.engine import generate
from specdec.models.quantize import quantize_model
from specdec.sampling import SamplingParams, processed_probs

from .conftest import make_model, prompt_ids, remake


def _quant(seed: int = 3):
    fp32 = make_model("llama", seed=seed)
    return remake(fp32, hf=None, lean=None, gguf=quantize_model(fp32.hf, "q8_0", "tiny"), config=fp32.hf.config)


def _drafter(name: str):
    return ModelDrafter(make_model("llama", seed=3)) if name == "model" else name


def test_min_p_keeps_the_tokens_within_its_factor_of_the_most_likely():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.14, 0.06], [0.25, 0.25, 0.25, 0.25]]))
    probs = processed_probs(logits, SamplingParams(temperature=1.0, min_p=0.25))
    # row 0: floor 0.125 keeps 0.5, 0.3, 0.14 (renormalised); row 1: all equal, all kept
    assert torch.allclose(probs[0], torch.tensor([0.5, 0.3, 0.14, 0.0]) / 0.94)
    assert torch.allclose(probs[1], torch.full((4,), 0.25))
    hot = processed_probs(logits[:1], SamplingParams(temperature=4.0, min_p=0.25))  # read after temperature
    assert (hot > 0).all()
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(temperature=1.0, min_p=1.5)


@pytest.mark.parametrize("drafter,k", [("prompt-lookup", 3), ("suffix", "auto"), ("model", 2), ("model", "auto")])
def test_a_biased_run_equals_plain_decoding_with_the_bias(drafter, k):
    target = _quant()
    prompt = prompt_ids(20)
    free = generate(target, prompt, k=0, max_new_tokens=24).tokens
    banned = max(set(free), key=free.count)  # the most frequent token, pushed out
    bias = {banned: -100.0, (banned + 1) % target.vocab_size: 2.5}
    plain = generate(target, prompt, k=0, max_new_tokens=24, logit_bias=bias)
    assert banned not in plain.tokens and plain.tokens != free  # the bias bites
    got = generate(target, prompt, _drafter(drafter), k=k, max_new_tokens=24, logit_bias=bias)
    assert got.tokens == plain.tokens
    if drafter == "model":
        assert got.stats.accepted > 0  # positions came from verified blocks


def test_a_bias_outside_the_vocabulary_is_refused():
    target = _quant()
    with pytest.raises(ValueError, match="logit_bias: token id .* outside"):
        generate(target, prompt_ids(), k=0, max_new_tokens=2, logit_bias={target.vocab_size: 1.0})


@pytest.mark.parametrize("drafter,k", [(None, 0), ("prompt-lookup", 4), ("model", 3)])
def test_stop_token_ids_end_the_generation_at_the_first_one(drafter, k):
    target = _quant()
    prompt = prompt_ids(20)
    free = generate(target, prompt, k=0, max_new_tokens=30).tokens
    stop_id = free[7]
    got = generate(
        target, prompt, _drafter(drafter) if drafter else None, k=k, max_new_tokens=30, stop_token_ids=[stop_id]
    )
    first = free.index(stop_id)
    assert got.tokens == free[: first + 1] and got.stats.stop_reason == "stop"


@pytest.mark.parametrize("drafter,k", [(None, 0), ("prompt-lookup", 4)])
def test_ignore_eos_runs_past_the_end_token_to_the_budget(drafter, k):
    fp32 = make_model("llama", seed=3)
    free = generate(fp32, prompt_ids(20), k=0, max_new_tokens=30).tokens
    ends = remake(fp32, eos_token_ids=frozenset({free[5]}))  # a model whose end token comes early
    stopped = generate(ends, prompt_ids(20), drafter, k=k, max_new_tokens=30)
    assert stopped.tokens == free[: free.index(free[5]) + 1] and stopped.stats.stop_reason == "eos"
    going = generate(ends, prompt_ids(20), drafter, k=k, max_new_tokens=30, ignore_eos=True)
    assert going.tokens == free and going.stats.stop_reason == "length"
