"""specdec.models.gguf on the packaged SmolLM2 GGUF (pulled in CI) and, where present, the Qwen2.5-Coder one:
the blocks, un-permuted and dequantized, equal transformers' own conversion bit for bit; the config
matches transformers'; damaged files fail with a message that names them."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch

from specdec.errors import GGUFError
from specdec.models.gguf import hf_config, hf_tokenizer, read_gguf
from specdec.models.registry import REGISTRY
from specdec.models.weights import cache_dir, converted_path

SMOL = REGISTRY["smollm2-135m"]
QWEN = REGISTRY["qwen2.5-coder-0.5b"]
HF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _path(entry):
    path = cache_dir() / "gguf" / entry.gguf_file
    if not path.exists():
        pytest.skip(f"{entry.name} is not pulled: run `specdec models pull {entry.name}`")
    return path


@pytest.fixture(scope="module")
def smol():
    return read_gguf(_path(SMOL))


def test_dequantized_blocks_equal_transformers_conversion(smol):
    from safetensors import safe_open

    folder = converted_path(SMOL.sha256, cache_dir())
    if not (folder / "model.safetensors").exists():
        pytest.skip("no transformers conversion of smollm2-135m in the cache")
    last = smol.metadata("llama.block_count") - 1
    with safe_open(folder / "model.safetensors", "pt") as hf:
        for layer in (0, last):
            for gguf_name, hf_name in HF_NAMES.items():
                t = smol.tensors[f"blk.{layer}.{gguf_name}.weight"]
                want = hf.get_tensor(f"model.layers.{layer}.{hf_name}.weight")
                assert t.shape == tuple(want.shape) and t.data.dtype == torch.uint8, t.name
                assert torch.equal(t.dequantize(), want), t.name
            norm = smol.tensors[f"blk.{layer}.attn_norm.weight"]
            assert norm.qtype == "F32" and torch.equal(
                norm.data, hf.get_tensor(f"model.layers.{layer}.input_layernorm.weight")
            )
        embed = smol.tensors["token_embd.weight"]
        assert embed.qtype == "Q8_0" and torch.equal(embed.dequantize(), hf.get_tensor("model.embed_tokens.weight"))


def _mapped(model, name) -> bool:
    """Whether a matrix's data lies inside the memory map of the file's data section (a copy cannot)."""
    embed = model.tensors["token_embd.weight"].data.data_ptr()  # the first tensor: offset 0 in the data section
    inside = embed <= model.tensors[name].data.data_ptr() < embed + model.file_bytes - model.data_offset
    assert model.mapped(model.tensors[name].data) == inside  # GGUFModel.mapped says the same
    return inside


def test_matrices_are_views_of_the_file_except_unpermuted_qk(smol):
    gate, up = smol.tensors["blk.0.ffn_gate.weight"].data, smol.tensors["blk.0.ffn_up.weight"].data
    assert up.data_ptr() - gate.data_ptr() == gate.numel()  # adjacent in the file, adjacent in memory
    assert _mapped(smol, "blk.0.attn_v.weight") and _mapped(smol, "blk.29.ffn_down.weight")
    assert not _mapped(smol, "blk.0.attn_q.weight") and not _mapped(smol, "blk.0.attn_k.weight")
    assert smol.tensors["blk.0.attn_q.weight"].data.shape == (576, 360)  # 576 / 32 per block * 20 bytes
    assert not smol.mapped(smol.tensors["blk.0.attn_v.weight"].data.clone())


def _config_fields(config):
    keys = (
        "model_type hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads "
        "rms_norm_eps rope_parameters max_position_embeddings vocab_size tie_word_embeddings bos_token_id "
        "eos_token_id pad_token_id"
    ).split()
    return {k: getattr(config, k, None) for k in keys} | {
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    }


def test_config_matches_transformers(smol):
    from transformers import AutoConfig

    start = time.perf_counter()
    config = hf_config(smol)
    assert time.perf_counter() - start < 0.5
    converted = converted_path(SMOL.sha256, cache_dir()) / "config.json"
    if converted.exists():  # what transformers built from this file at its first float32 load
        want = AutoConfig.for_model(**json.loads(converted.read_text()))
    else:
        want = AutoConfig.from_pretrained(smol.path.parent, gguf_file=smol.path.name)
    assert type(config) is type(want)
    assert _config_fields(config) == _config_fields(want)
    assert config.tie_word_embeddings and config.head_dim == 64


def test_qwen2_is_not_permuted_and_keeps_its_types():
    model = read_gguf(_path(QWEN))
    types = {t.qtype for t in model.tensors.values()}
    assert {"Q5_0", "Q8_0", "Q4_K", "Q6_K", "F32"} <= types
    q = model.tensors["blk.0.attn_q.weight"]
    assert _mapped(model, "blk.0.attn_q.weight") and _mapped(model, "blk.0.attn_k.weight")
    assert model.tensors["blk.0.attn_q.bias"].data.dtype == torch.float32
    assert q.dequantize().shape == (896, 896)
    # as AutoConfig.from_pretrained(folder, gguf_file=name) builds it (transformers 5.24; 10 s, so not rerun here)
    assert _config_fields(hf_config(model)) == {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "rms_norm_eps": 9.999999974752427e-07,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "max_position_embeddings": 32768,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "pad_token_id": 151643,
        "head_dim": 64,
    }


def test_tokenizer_is_cached(smol, tmp_path):
    start = time.perf_counter()
    fresh = hf_tokenizer(smol, tmp_path)
    uncached = time.perf_counter() - start
    (folder,) = [p for p in tmp_path.iterdir()]
    assert not folder.name.startswith(".")
    start = time.perf_counter()
    cached = hf_tokenizer(smol, tmp_path)
    assert time.perf_counter() - start < min(1.0, uncached / 3)
    text = "Hello world,  café 123 <|im_start|>user\n"
    assert cached(text)["input_ids"] == fresh(text)["input_ids"]
    assert cached.chat_template == fresh.chat_template and cached.eos_token == fresh.eos_token == "<|im_end|>"


def test_missing_and_not_gguf(tmp_path):
    with pytest.raises(GGUFError, match="no such file"):
        read_gguf(tmp_path / "absent.gguf")
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"<html>not found</html>")
    with pytest.raises(GGUFError, match=f"{bad}: not a GGUF file"):
        read_gguf(bad)
    bad.write_bytes(b"GGUF\x03\x00")
    with pytest.raises(GGUFError, match=f"{bad}: its header is truncated"):
        read_gguf(bad)


def test_truncated_files_name_the_file_and_the_fix(tmp_path):
    path = _path(SMOL)
    whole = tmp_path / path.name
    shutil.copyfile(path, whole)
    size = whole.stat().st_size
    for cut in (size - 1000, 1 << 20):
        with open(whole, "r+b") as f:
            f.truncate(cut)
        with pytest.raises(GGUFError) as info:
            read_gguf(whole)
        message = str(info.value)
        assert message.startswith(str(whole)) and "specdec models pull smollm2-135m" in message
        assert ("header is truncated" if cut == 1 << 20 else "(truncated)") in message


def test_row_length_not_a_multiple_of_the_block(tmp_path):
    path = _path(SMOL)
    header = bytearray(path.read_bytes()[: read_gguf(path).data_offset])
    name = b"token_embd.weight"  # the first tensor: checked before any tensor's data is looked for
    at = header.index(name) + len(name) + 4  # past the name and n_dims: ne0, the row length (576)
    header[at : at + 8] = (577).to_bytes(8, "little")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(header))
    with pytest.raises(GGUFError, match="row length 577 is not a multiple of Q8_0's block 32"):
        read_gguf(bad)
