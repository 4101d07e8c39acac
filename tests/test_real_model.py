"""Integration on the real, packaged SmolLM2-135M (pulled by `specdec models pull smollm2-135m`,
which .ci/run does first), dequantized to fp32: the lean fp32 path (tests/test_quant.py runs the
GGUF blocks themselves)."""

from __future__ import annotations

import json

import pytest
import torch

from specdec import first_divergence, generate, load_model, make_drafter
from specdec.bench.workloads import workload_path
from specdec.models.weights import cache_dir, is_pulled

WORKLOAD = workload_path("spec-bench")
FALLBACK = (
    "Summarize: The committee met on Tuesday. The committee approved the budget. "
    "The committee will meet again on Tuesday to approve the budget for the next year."
)


@pytest.fixture(scope="module")
def smollm2():
    if not is_pulled("smollm2-135m", cache_dir()):
        pytest.skip("smollm2-135m is not pulled: run `specdec models pull smollm2-135m`")
    return load_model("smollm2-135m", dtype=torch.float32)


def test_prompt_lookup_greedy_equals_plain_greedy(smollm2):
    if WORKLOAD.exists():
        rows = [json.loads(line) for line in WORKLOAD.read_text().splitlines()]
        text = next(r for r in rows if r["category"] == "summarization")["turns"][0]
    else:
        text = FALLBACK
    ids = smollm2.encode(text, chat=True)
    plain = generate(smollm2, ids, max_new_tokens=48)
    spec = generate(smollm2, ids, make_drafter("prompt-lookup"), k=4, max_new_tokens=48)
    assert len(plain.tokens) > 10
    assert spec.tokens == plain.tokens, first_divergence(smollm2, ids, plain.tokens, spec.tokens)
    assert spec.stats.drafted > 0 and spec.stats.rounds < plain.stats.rounds


def test_eagle_head_drafting_on_the_real_model_is_exact(smollm2):
    """The feature-level drafter on the real target's features (an untrained head: exactness
    must not depend on the head being any good): greedy output identical to plain greedy."""
    from specdec.train.head import DraftHead

    torch.manual_seed(0)
    head = DraftHead.for_target(smollm2, torch.arange(8192))
    ids = smollm2.encode("Write a short blog post about a trip to the mountains.", chat=True)
    plain = generate(smollm2, ids, max_new_tokens=32)
    spec = generate(smollm2, ids, make_drafter("eagle", head=head), k=4, max_new_tokens=32)
    assert spec.tokens == plain.tokens, first_divergence(smollm2, ids, plain.tokens, spec.tokens)
    assert spec.stats.drafted > 0


def test_the_shipped_head_is_trained_and_its_drafters_are_exact(smollm2):
    """The head that ships for SmolLM2 (specdec/data/heads) loads, keeps greedy output identical
    with both head drafters, and is trained: an untrained head gets almost no draft accepted."""
    from specdec.train.head import PACKAGED, load_head

    path = PACKAGED / "smollm2-135m.safetensors"
    head, meta = load_head(path, smollm2.lean().hidden_size)
    assert meta["target"] == "smollm2-135m" and meta["steps"] >= 1
    ids = smollm2.encode("Write a short blog post about a trip to the mountains.", chat=True)
    plain = generate(smollm2, ids, max_new_tokens=48)
    for name in ("eagle", "eagle-tree"):
        spec = generate(smollm2, ids, make_drafter(name, head=path), k=4, max_new_tokens=48)
        assert spec.tokens == plain.tokens, first_divergence(smollm2, ids, plain.tokens, spec.tokens)
        assert spec.stats.accepted >= 0.25 * spec.stats.rounds, (name, spec.stats)
