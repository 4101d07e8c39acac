"""Integration on the real, packaged SmolLM2-135M (pulled by `specdec models pull smollm2-135m`,
which .ci/run does first)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdec import first_divergence, generate, load_model, make_drafter
from specdec.weights import cache_dir, is_pulled

WORKLOAD = Path(__file__).resolve().parents[2] / "shared" / "workloads" / "spec_bench_dev.jsonl"
FALLBACK = ("Summarize: The committee met on Tuesday. The committee approved the budget. "
            "The committee will meet again on Tuesday to approve the budget for the next year.")


@pytest.fixture(scope="module")
def smollm2():
    if not is_pulled("smollm2-135m", cache_dir()):
        pytest.skip("smollm2-135m is not pulled: run `specdec models pull smollm2-135m`")
    return load_model("smollm2-135m")


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


def test_shipped_draft_head_is_exact_and_drafts_well(smollm2):
    """The head that ships in specdec/data/heads (trained by `specdec train`) drafts for the real
    target: greedy output identical to plain greedy, and most drafted tokens accepted."""
    from specdec.drafters.eagle import PACKAGED

    if not (PACKAGED / "smollm2-135m.safetensors").is_file():
        pytest.skip("no shipped head for smollm2-135m")
    ids = smollm2.encode("Write a short blog post about a trip to the mountains.", chat=True)
    plain = generate(smollm2, ids, max_new_tokens=48)
    spec = generate(smollm2, ids, make_drafter("eagle", head=PACKAGED / "smollm2-135m.safetensors"), k=4,
                    max_new_tokens=48)
    assert spec.tokens == plain.tokens, first_divergence(smollm2, ids, plain.tokens, spec.tokens)
    assert spec.stats.tau > 1.5  # a head that drafted junk would give about 1
