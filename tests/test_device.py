"""The same engine on every device torch sees here: the CPU always, a CUDA GPU where one is present
(these tests are how a GPU machine checks it; on a CPU-only machine the "cuda" cases are absent).

On each device: the lean forward agrees with transformers' forward there, speculative greedy output
(chain, tree, model, feature-level drafters) is that device's plain greedy output, sampling with a
seed repeats itself, and the bench runs unchanged, recording where it ran.
"""

from __future__ import annotations

import json

import pytest
import torch

from specdec import generate
from specdec.bench import results
from specdec.bench.config import BenchConfig, Pair
from specdec.bench.run import run_bench
from specdec.bench.workloads import load_workload
from specdec.cache import KVCache, LeanKVCache
from specdec.cli import main
from specdec.drafters import EagleDrafter, make_drafter
from specdec.models.load import Model, load_model, resolve_device
from specdec.train.head import DraftHead

from .conftest import make_model, prompt_ids, remake

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def on(model: Model, device: str) -> Model:
    """A fresh test model moved to `device` (its weights move; its lean form is rebuilt there)."""
    return remake(model, hf=model.hf.to(device), lean=None)


@pytest.fixture(scope="module", params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lean_forward_matches_transformers_on_the_device(device, arch):
    lean = on(make_model(arch, seed=1), device)
    assert lean.backend == "lean" and lean.device.type == device
    hf = remake(lean, backend="hf", lean=None)
    prompt = prompt_ids(20)
    a, b = LeanKVCache(lean, capacity=8), KVCache(hf)
    for chunk in (prompt[:9], prompt[9:10], prompt[10:]):
        la, lb = a.extend(chunk), b.extend(chunk)
        assert la.device.type == device
        torch.testing.assert_close(la, lb, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # lean and transformers backends
def test_speculation_on_the_device_is_its_plain_greedy(device, arch):
    target = on(make_model(arch, seed=1), device)
    prompt = prompt_ids(16)
    plain = generate(target, prompt, None, max_new_tokens=32)
    assert plain.stats.new_tokens == 32
    drafters = {
        "prompt-lookup": make_drafter("prompt-lookup"),
        "suffix-tree": make_drafter("suffix-tree"),
        "model": make_drafter("model", draft=on(make_model("llama", seed=7), device)),
    }
    if target.backend == "lean":
        torch.manual_seed(0)
        head = DraftHead.for_target(target, torch.arange(3, 50))  # untrained: its drafts are often wrong
        drafters["eagle-tree"] = EagleDrafter(head, alternatives=1, lookup=True)
    for name, drafter in drafters.items():
        for k in (3, "auto"):
            out = generate(target, prompt, drafter, k=k, max_new_tokens=32)
            assert out.tokens == plain.tokens, (device, arch, name, k)
            assert out.stats.verify_s > 0 and out.stats.rounds > 0


def test_sampling_on_the_device_repeats_with_a_seed(device):
    target = on(make_model("llama", seed=1), device)
    draft = make_drafter("model", draft=on(make_model("llama", seed=7), device))
    run = lambda: generate(target, prompt_ids(), draft, k=3, max_new_tokens=24, temperature=1.0, top_p=0.9, seed=5)  # noqa: E731
    a, b = run(), run()
    assert a.tokens == b.tokens and a.stats.drafted > 0
    assert all(0 <= t < target.vocab_size for t in a.tokens)


def test_bench_runs_on_the_device_and_records_it(device, model_dir, tmp_path):
    workload = tmp_path / "mini.jsonl"
    rows = [
        {"question_id": i, "category": cat, "turns": [" ".join(f"w{(5 * i + j) % 50 + 3}" for j in range(10)) * 2]}
        for i, cat in enumerate(["qa", "summarization"])
    ]
    workload.write_text("\n".join(json.dumps(r) for r in rows))
    prompts = load_workload(workload, limit=1)
    config = BenchConfig(
        (Pair(str(model_dir)),), workload.name, ("auto", 2), 10, peers=("hf",), progress=False, load={"device": device}
    )
    res = run_bench(config, prompts)
    results.validate(res)
    pair = res["pairs"][0]
    assert pair["device"].startswith(device) and res["environment"]["memory_bandwidth_gbs"] > 0
    assert all(c["identical"] == [2, 2] for c in pair["configs"])
    assert pair["peer_summary"][0]["identical"] == [2, 2]
    assert all(v > 0 for v in pair["costs"]["verify_ms"].values())


def test_load_model_puts_the_weights_on_the_device(device, model_dir):
    model = load_model(str(model_dir), device=device)
    assert model.device.type == device and model.lean().embed.device.type == device
    assert model.device == resolve_device(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present")
def test_asking_for_a_gpu_without_one_is_a_clear_error(model_dir, capsys):
    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        load_model(str(model_dir), device="cuda")
    assert main(["generate", "w3 w4", "--target", str(model_dir), "--device", "cuda", "--max-new-tokens", "2"]) == 2
    assert "use --device cpu" in capsys.readouterr().err
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device"):
        resolve_device("tpu7")
