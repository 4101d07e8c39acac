"""`specdec distill`: a draft cut from the target's layers, trained on the target's outputs."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from specdec import generate
from specdec.cli import main
from specdec.drafters import make_drafter
from specdec.models.load import check_same_tokenizer, load_model
from specdec.train.distill import DistillConfig, distill, spaced_layers, student_from_target
from specdec.train.selfdistill import training_prompts

from .conftest import make_model, make_tokenizer, prompt_ids


def test_spaced_layers():
    assert spaced_layers(30, 2) == [0, 29]
    assert spaced_layers(30, 4) == [0, 10, 19, 29]
    assert spaced_layers(5, 5) == [0, 1, 2, 3, 4]
    assert spaced_layers(30, 1) == [29]
    for bad in (0, 31):
        with pytest.raises(ValueError, match="layers"):
            spaced_layers(30, bad)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_student_with_every_layer_is_the_target_and_with_fewer_is_not(arch):
    target = make_model(arch, seed=2)
    ids = torch.tensor([prompt_ids(10)])
    with torch.no_grad():
        want = target.hf(input_ids=ids).logits
        torch.testing.assert_close(student_from_target(target, [0, 1])(input_ids=ids).logits, want)
        assert not torch.allclose(student_from_target(target, [1])(input_ids=ids).logits, want, atol=1e-3)


def test_distill_trains_writes_a_loadable_draft_and_resumes(tmp_path):
    words = sorted({w for p in training_prompts(24) for w in p.split()})  # a tokenizer that knows the prompts
    target = make_model("llama", seed=1, vocab_size=len(words) + 3, tokenizer=make_tokenizer(words))
    out, dest = tmp_path / "run", tmp_path / "draft"
    config = DistillConfig(n_layers=1, prompts=24, max_new_tokens=12, epochs=3, lr=3e-3, batch=4, draft_out=dest)
    s = distill(target, out, config)
    assert [h["epoch"] for h in s["history"]] == [0, 1, 2, 3] and s["layers"] == [1]
    assert s["history"][-1]["loss"] < s["history"][1]["loss"]  # it learns the target's answers
    for name in ("data.json", "checkpoint.pt", "loss.png", "summary.json"):
        assert (out / name).is_file()
    assert json.loads((out / "summary.json").read_text())["history"] == s["history"]
    assert not list(tmp_path.glob("draft.*"))  # no temporary folder left behind
    resumed = distill(target, out, replace(config, epochs=4))
    assert resumed["history"][:4] == s["history"] and len(resumed["history"]) == 5

    draft = load_model(str(dest))
    assert draft.hf.config.num_hidden_layers == 1
    check_same_tokenizer(target, draft)
    prompt = prompt_ids()
    plain = generate(target, prompt, None, max_new_tokens=20)
    assert generate(target, prompt, make_drafter("model", draft=draft), k=4, max_new_tokens=20).tokens == plain.tokens


def test_distill_cli(model_dir, tmp_path, capsys):
    dest = tmp_path / "d"
    args = [
        "distill",
        "--target",
        str(model_dir),
        "--layers",
        "1",
        "--prompts",
        "4",
        "--max-new-tokens",
        "4",
        "--epochs",
        "1",
        "--batch",
        "2",
        "--out",
        str(tmp_path / "run"),
        "--draft-out",
        str(dest),
    ]
    assert main(args) == 0
    assert "held-out agreement" in capsys.readouterr().out and (dest / "config.json").is_file()
    assert main(["distill", "--target", str(model_dir), "--layers", "3", "--out", str(tmp_path / "r2")]) == 2
    assert "keeps 1..2 of the target's 2 layers, got 3" in capsys.readouterr().err
    assert not (tmp_path / "r2" / "data.json").exists()  # refused before any work
