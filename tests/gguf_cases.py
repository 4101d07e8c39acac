"""Tiny random GGUF files of every architecture specdec.backends.arch describes (gguf's writer, Q8_0
blocks), shared by the tests that read them (test_arch, test_synthetic)."""

from __future__ import annotations

import gguf
import numpy as np

from specdec.backends.arch import ARCHS

D_MODEL, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, WINDOW = 64, 4, 2, 16, 128, 4, 8
VOCAB = 64  # make_byte_tokenizer's size


def _layer_tensors(a, i: int) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape (torch order) of layer i of architecture a."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    t = {"attn_output.weight": (D_MODEL, q), "ffn_down.weight": (D_MODEL, FFN)}
    if a.fused:
        t |= {"attn_qkv.weight": (q + 2 * kv, D_MODEL), "ffn_up.weight": (2 * FFN, D_MODEL)}
    else:
        t |= {"attn_q.weight": (q, D_MODEL), "attn_k.weight": (kv, D_MODEL), "attn_v.weight": (kv, D_MODEL)}
        t |= {"ffn_gate.weight": (FFN, D_MODEL), "ffn_up.weight": (FFN, D_MODEL)}
    if a.qkv_bias:
        t |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
    if a.pre_norms:
        t |= {"attn_norm.weight": (D_MODEL,), "ffn_norm.weight": (D_MODEL,)}
    if a.post_norms:
        t |= {"post_attention_norm.weight": (D_MODEL,), "post_ffw_norm.weight": (D_MODEL,)}
    if a.qk_norm:  # OLMo 2 normalises the whole projection, the others a head at a time
        t |= {"attn_q_norm.weight": (q if a.qk_norm == "whole" else HEAD_DIM,)}
        t |= {"attn_k_norm.weight": (kv if a.qk_norm == "whole" else HEAD_DIM,)}
    return {f"blk.{i}.{name}": shape for name, shape in t.items()}


def write_tiny(path, arch: str, seed: int = 0, keys: dict | None = None, extra: dict | None = None):
    """A random GGUF file of `arch` (4 layers, d 64, 4 heads of 16, 2 key heads, vocabulary 64): Q8_0
    matrices, fp32 vectors; keys: more `<arch>.` metadata (name -> value); extra: more tensors (name ->
    fp32 array). Returns the path."""
    a = ARCHS[arch]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(D_MODEL)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    if a.window_pattern:
        w.add_sliding_window(WINDOW)
        w.add_uint32(f"{arch}.attention.sliding_window_pattern", 2)  # local, global, local, global
    if a.multipliers:
        for name, value in (
            ("embedding_scale", 4.0),
            ("residual_scale", 0.5),
            ("attention.scale", 0.2),
            ("logit_scale", 2.0),
        ):
            w.add_float32(f"{arch}.{name}", value)
    for name, value in (keys or {}).items():
        (w.add_float32 if isinstance(value, float) else w.add_string)(f"{arch}.{name}", value)
    tensors = {"token_embd.weight": (VOCAB, D_MODEL), "output_norm.weight": (D_MODEL,)}
    for i in range(LAYERS):
        tensors |= _layer_tensors(a, i)
    for name, shape in tensors.items():
        scale = 3.0 if "attn_q." in name or "attn_k." in name or "attn_qkv" in name else 1.0  # positions matter
        x = (rng.standard_normal(shape) * scale / np.sqrt(shape[-1])).astype(np.float32)
        if len(shape) == 1:
            w.add_tensor(name, (1.0 + 0.1 * x) if "norm" in name else x)
        else:
            w.add_tensor(
                name, gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0
            )
    for name, x in (extra or {}).items():
        w.add_tensor(name, np.asarray(x, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
