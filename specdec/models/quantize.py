"""Quantizing a transformers Llama/Qwen2 model at load into GGUF blocks, for the quantized backend.

A Hugging Face model (safetensors) has no GGUF file; `--quantize q8_0` (or q4_0, q4_1, q5_0, q5_1)
quantizes its matrices with gguf-py's reference quantizers (llama.cpp's formats, bit for bit) and
lays them out under llama.cpp's tensor names, so specdec.backends.quant runs them as it runs a
GGUF file. K-quants (Q4_K, Q6_K) are not offered: gguf-py has no quantizer for them; they run when
they come in a GGUF file.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from specdec.models.gguf import GGUFModel, QTensor

QUANTIZE = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")

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
    kind = gguf.GGMLQuantizationType[qtype.upper()]
    tensors: dict[str, QTensor] = {}
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    for key, value in state.items():
        target = _gguf_name(key)
        if target is None:
            continue
        if value.dim() == 1:
            tensors[target] = QTensor(target, "F32", tuple(value.shape), value.float().contiguous())
            continue
        rows, cols = value.shape
        if cols % 32:
            raise ValueError(f"{name}: {key} has rows of {cols}, not a multiple of {qtype}'s block of 32")
        blocks = gguf.quants.quantize(value.float().cpu().numpy(), kind)  # (rows, row_bytes) uint8
        tensors[target] = QTensor(target, kind.name, (rows, cols), torch.from_numpy(np.ascontiguousarray(blocks)))
    if "output.weight" in tensors and hf.config.tie_word_embeddings:
        del tensors["output.weight"]  # tied: the embedding's blocks serve as the output layer
    size = sum(t.data.numel() * t.data.element_size() for t in tensors.values())
    return GGUFModel(Path(name), arch, tensors, size)


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
