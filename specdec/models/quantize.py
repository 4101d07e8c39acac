"""Quantizing a transformers Llama/Qwen2 model at load into GGUF blocks, for the quantized backend.

A Hugging Face model (safetensors) has no GGUF file; `--quantize q8_0` (or q4_0, q4_1, q5_0, q5_1)
quantizes its matrices with gguf-py's reference quantizers (llama.cpp's formats, bit for bit) and
lays them out under llama.cpp's tensor names, so specdec.backends.quant runs them as it runs a
GGUF file. `--quantize q4_k` uses our own Q4_K quantizer (gguf-py has none): llama.cpp's block
layout, with each sub-block's scale and minimum taken from its range (llama.cpp searches for
better ones, so its Q4_K files are a little more accurate); matrices whose rows are not a multiple
of 256 take Q4_1 instead.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from specdec.models.gguf import GGUFModel, QTensor

QUANTIZE = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k")

_NAMES = {  # transformers' name within a decoder layer -> llama.cpp's
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def quantize_model(hf: torch.nn.Module, qtype: str, name: str) -> GGUFModel:
    """The matrices of a transformers Llama/Qwen2 model `hf` quantized to `qtype` (one of QUANTIZE),
    its vectors kept in fp32, as a GGUFModel with llama.cpp's tensor names (no file behind it:
    `path` is `name`). Raises ValueError for another architecture or qtype, or a matrix whose row
    length is not a multiple of the block size (32)."""
    if qtype not in QUANTIZE:
        raise ValueError(f"--quantize {qtype!r}: choose one of {', '.join(QUANTIZE)}")
    arch = hf.config.model_type
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"{name}: --quantize runs llama and qwen2 models, not {arch!r}; run it with --dtype float32")
    tensors: dict[str, QTensor] = {}
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    for key, value in state.items():
        target = _gguf_name(key)
        if target is None:
            continue
        if value.dim() == 1:
            # a copy: the loaded model's tensors can be views of its memory-mapped file, and one kept view
            # keeps every page of the file that quantizing read resident
            tensors[target] = QTensor(target, "F32", tuple(value.shape), value.to(torch.float32, copy=True))
            continue
        tensors[target] = quantize_matrix(value, qtype, target, f"{name}: {key}")
    if "output.weight" in tensors and hf.config.tie_word_embeddings:
        del tensors["output.weight"]  # tied: the embedding's blocks serve as the output layer
    size = sum(t.data.numel() * t.data.element_size() for t in tensors.values())
    return GGUFModel(Path(name), arch, tensors, size, _metadata(hf.config, arch, name))


def _metadata(c, arch: str, name: str) -> dict:
    """The `<arch>.` metadata llama.cpp's converter would write for config c (specdec.backends.arch reads
    it). Raises ValueError for a rope scaling the quantized forward does not take from a config."""
    rope = getattr(c, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"{name}: --quantize runs models with the default rope, not {rope['rope_type']!r}")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    values = {
        "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size,
        "block_count": c.num_hidden_layers,
        "feed_forward_length": c.intermediate_size,
        "attention.head_count": c.num_attention_heads,
        "attention.head_count_kv": c.num_key_value_heads,
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "attention.layer_norm_rms_epsilon": float(c.rms_norm_eps),
        "rope.freq_base": float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
    }
    return {f"{arch}.{key}": value for key, value in values.items()}


def quantize_matrix(weight: torch.Tensor, qtype: str, name: str, what: str | None = None) -> QTensor:
    """A matrix (rows, cols) quantized to `qtype` (one of QUANTIZE; q4_k takes Q4_1 where cols is
    not a multiple of 256) as a QTensor named `name`. Raises ValueError for another qtype or cols
    not a multiple of the block size (32), naming the matrix as `what` (default: name)."""
    if qtype not in QUANTIZE:
        raise ValueError(f"{qtype!r} is not a quantization type: choose one of {', '.join(QUANTIZE)}")
    rows, cols = weight.shape
    if cols % 32:
        raise ValueError(f"{what or name} has rows of {cols}, not a multiple of {qtype}'s block of 32")
    kind = gguf.GGMLQuantizationType[qtype.upper()]
    weights = weight.detach().float().cpu().numpy()
    if kind == gguf.GGMLQuantizationType.Q4_K and cols % 256 == 0:
        return QTensor(name, "Q4_K", (rows, cols), torch.from_numpy(quantize_q4_k(weights)))
    this = gguf.GGMLQuantizationType.Q4_1 if kind == gguf.GGMLQuantizationType.Q4_K else kind
    blocks = gguf.quants.quantize(weights, this)  # (rows, row_bytes) uint8
    return QTensor(name, this.name, (rows, cols), torch.from_numpy(np.ascontiguousarray(blocks)))


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """float32 (rows, K), K a multiple of 256 -> (rows, K / 256 * 144) uint8 in llama.cpp's Q4_K
    layout (ggml-common.h block_q4_K): per 256 weights, fp16 d and dmin, eight sub-blocks of 32 with
    a 6-bit scale a and minimum e each (packed as get_scale_min_k4 reads them), and 4-bit q, so that
    w = d * a * q - dmin * e. A sub-block's scale and minimum come from its range (min(w, 0) to
    max(w)); q is the nearest level."""
    rows, K = w.shape
    sub = w.reshape(rows, K // 256, 8, 32).astype(np.float32)
    low = np.minimum(sub.min(-1), 0.0)  # (rows, S, 8)
    scale, minimum = (sub.max(-1) - low) / 15.0, -low
    d = (scale.max(-1) / 63.0).astype(np.float16)  # (rows, S)
    dmin = (minimum.max(-1) / 63.0).astype(np.float16)
    df, dminf = d.astype(np.float32)[..., None], dmin.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(df > 0, np.clip(np.rint(scale / df), 0, 63), 0).astype(np.uint8)
        e = np.where(dminf > 0, np.clip(np.rint(minimum / dminf), 0, 63), 0).astype(np.uint8)
        step = (df * a)[..., None]  # the sub-block's dequantized scale and minimum, as the kernels compute them
        offset = (dminf * e)[..., None]
        q = np.where(step > 0, np.clip(np.rint((sub + offset) / step), 0, 15), 0).astype(np.uint8)
    out = np.zeros((rows, K // 256, 144), np.uint8)
    out[..., 0:2] = d[..., None].view(np.uint8)
    out[..., 2:4] = dmin[..., None].view(np.uint8)
    sc = out[..., 4:16]
    sc[..., 0:4] = a[..., :4] | ((a[..., 4:] >> 4) << 6)
    sc[..., 4:8] = e[..., :4] | ((e[..., 4:] >> 4) << 6)
    sc[..., 8:12] = (a[..., 4:] & 15) | ((e[..., 4:] & 15) << 4)
    # 32 bytes per pair of sub-blocks: sub-block 2i in the low nibbles, 2i + 1 in the high ones
    pairs = q.reshape(rows, K // 256, 4, 2, 32)
    out[..., 16:] = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(rows, K // 256, 128)
    return out.reshape(rows, K // 256 * 144)


def _gguf_name(key: str) -> str | None:
    if key == "model.embed_tokens.weight":
        return "token_embd.weight"
    if key == "lm_head.weight":
        return "output.weight"
    if key == "model.norm.weight":
        return "output_norm.weight"
    parts = key.split(".")
    if len(parts) > 3 and parts[:2] == ["model", "layers"]:
        inner = _NAMES.get(".".join(parts[3:]))
        return None if inner is None else f"blk.{parts[2]}.{inner}"
    return None
