"""first_divergence: where two greedy runs part, and whether the target's top-2 logits there are a
floating-point near-tie at the logits' precision."""

from __future__ import annotations

import pytest
import torch

from specdec import generate
from specdec.bench.report import _divergences
from specdec.exactness import Divergence, first_divergence, ulp

from .conftest import make_model, prompt_ids, remake


def test_ulp_is_the_spacing_of_the_dtype():
    assert ulp(1.0, torch.float32) == 2.0**-23 and ulp(-3.0, torch.float32) == 2.0**-22
    assert ulp(20.0, torch.bfloat16) == 0.125 and ulp(0.0, torch.bfloat16) == 2.0**-7
    assert torch.tensor(20.0 + ulp(20.0, torch.bfloat16), dtype=torch.bfloat16).item() > 20.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_divergence_reports_the_gap_in_ulp(dtype):
    target = make_model("llama", seed=1)
    target = remake(target, hf=target.hf.to(dtype), lean=None)
    prompt = prompt_ids()
    plain = generate(target, prompt, None, max_new_tokens=8).tokens
    assert first_divergence(target, prompt, plain, list(plain)) is None
    other = plain[:5] + [(plain[5] + 1) % target.vocab_size] + plain[6:]
    d = first_divergence(target, prompt, plain, other)
    assert (d.position, d.plain_token, d.other_token) == (5, plain[5], other[5])
    with torch.no_grad():
        logits = target.hf(input_ids=torch.tensor([prompt + plain[:5]])).logits[0, -1].float()
    top = logits.topk(2).values
    assert d.logit_gap == pytest.approx(float(top[0] - top[1]), abs=1e-5)
    assert d.logit_ulp == ulp(float(top[0]), dtype)
    assert d.near_tie == (d.logit_gap <= 4 * d.logit_ulp)
    assert Divergence(0, 1, 2, logit_gap=4 * d.logit_ulp, logit_ulp=d.logit_ulp).near_tie
    assert not Divergence(0, 1, 2, logit_gap=4.5 * d.logit_ulp, logit_ulp=d.logit_ulp).near_tie
    shorter = first_divergence(target, prompt, plain, plain[:3])  # one run stopped early
    assert (shorter.position, shorter.other_token) == (3, None)


def test_report_says_whether_a_divergence_is_a_near_tie():
    tie = Divergence(4, 10, 11, logit_gap=0.125, logit_ulp=0.125)
    far = Divergence(2, 10, 12, logit_gap=3.0, logit_ulp=2.0**-19)
    pair = {
        "prompts": [
            {
                "id": "p",
                "runs": {
                    "2": {"identical": False, "divergence": vars(tie)},
                    "4": {"identical": False, "divergence": vars(far)},
                },
            }
        ]
    }
    lines = _divergences(pair)
    assert "= 1 ulp of the logits' dtype: a floating-point near-tie" in lines[2]
    assert "ulp of the logits' dtype" in lines[3] and "near-tie" not in lines[3]
