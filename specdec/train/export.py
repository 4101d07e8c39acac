"""Export a draft head as an EAGLE-1 checkpoint that vLLM and SGLang load as a speculative model.

EAGLE-1 (Li et al. 2024; the layout of SafeAILab/EAGLE's `cnets.py`) is what a specdec head is when
it has no taps and no input norm (`DraftHead.config["input_norm"]` false, as `DraftHead.for_target`
makes them): `fc` over cat(embedding of the next token, the target's final-normed feature), then
one Llama decoder layer whose first RMSNorm is skipped, its output fed to the target's output
layer. The checkpoint is a Hugging Face folder:

- `config.json`: a one-layer Llama config with the head's sizes and the target's vocabulary;
  `architectures` is `["LlamaForCausalLM"]` for vLLM (which names the class
  `EagleLlamaForCausalLM` itself) or `["LlamaForCausalLMEagle"]` for SGLang.
- `model.safetensors`: `fc.weight` (d, 2d), `layers.0.self_attn.{q,k,v,o}_proj.weight`,
  `layers.0.post_attention_layernorm.weight`, `layers.0.mlp.{gate,up,down}_proj.weight`, in
  bf16. No embedding and no output layer: both engines share the target's. SGLang's `fc` has a
  bias, so its export carries a zero `fc.bias`.
- A head with q/k/v biases (`qkv_bias`, a Qwen2 target's) also carries
  `layers.0.self_attn.{q,k,v}_proj.bias` and a zero `layers.0.self_attn.o_proj.bias`, with
  `"attention_bias": true` in config.json: the Llama layer of vLLM (EagleLlamaForCausalLM, the EAGLE-1
  class vLLM loads for a Qwen2 target too: it has no Qwen2 one) and of SGLang (LlamaForCausalLMEagle,
  as for a "llamafied" Qwen2) then has biases on q, k, v and o, all four loaded; the zero o bias
  makes it Qwen2's layer exactly. Without attention_bias both engines would build bias-free
  projections (and SGLang's loader skips a ".bias" its model lacks without a word), so the export
  always sets it for such a head; it never drops a bias.
- `token_map.pt` (SGLang only): the head's draft vocabulary (FR-Spec, Zhao et al. 2025), for
  `--speculative-token-map`. vLLM's EAGLE-1 drafts over the whole vocabulary instead.

Heads with taps (EAGLE-3-like fusion of low and middle layers) or an input norm have no EAGLE-1
equivalent, and EAGLE-3's decoder layer (attention over cat(embedding, feature), 2d wide) is not
ours either: `export_head` refuses them with ExportError.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdec.errors import SpecdecError
from specdec.models.weights import atomic_write
from specdec.train.head import DraftHead

ENGINES = ("vllm", "sglang")
ARCHITECTURES = {"vllm": "LlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}


class ExportError(SpecdecError, ValueError):
    """A head that has no EAGLE-1 form, or an export request that cannot be met."""


def eagle_config(head: DraftHead, target_config, engine: str = "vllm", meta: dict | None = None) -> dict:
    """The config.json of the exported head: a one-layer Llama config with the head's sizes (hidden,
    heads, kv_heads, head_dim, intermediate, rope_theta, eps) and target_config's vocabulary size,
    context length and special token ids (target_config: the target's transformers config).
    meta: facts about the head (its training data) kept under "specdec"."""
    c = head.config
    return {
        "architectures": [ARCHITECTURES[engine]],
        "model_type": "llama",
        "hidden_size": c["hidden"],
        "intermediate_size": c["intermediate"],
        "num_attention_heads": c["heads"],
        "num_key_value_heads": c["kv_heads"],
        "head_dim": c["head_dim"],
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": c["eps"],
        "rope_theta": c["rope_theta"],
        "rope_scaling": None,
        "attention_bias": head.qkv.bias is not None,  # q, k, v and o; o's bias is written as zeros
        "mlp_bias": False,
        "vocab_size": int(target_config.vocab_size),
        "max_position_embeddings": int(target_config.max_position_embeddings),
        "bos_token_id": target_config.bos_token_id,
        "eos_token_id": target_config.eos_token_id,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "specdec": {"target": c.get("target"), "draft_vocab": int(head.vocab_ids.numel()), **(meta or {})},
    }


def eagle_weights(head: DraftHead, engine: str = "vllm") -> dict[str, torch.Tensor]:
    """The head's weights under EAGLE-1's names (see the module docstring), bf16, contiguous; with
    the q/k/v biases and a zero o_proj.bias for a head that has them (qkv_bias). Raises ExportError
    for a head with taps or an input norm."""
    if head.taps:
        raise ExportError(
            f"this head reads the target's layers {list(head.taps)} (--taps): EAGLE-1 reads the final feature "
            "only, and EAGLE-3's layer is not specdec's; train one without --taps to export it"
        )
    if head.norm_in is not None:
        raise ExportError(
            "this head normalises fc's output before attention, which EAGLE-1 does not: it was made before "
            "export-head existed; train it again with `specdec train` (heads it makes now have EAGLE-1's layout)"
        )
    hd, h, kv = head.head_dim, head.n_heads, head.n_kv
    q, k, v = head.qkv.weight.split((h * hd, kv * hd, kv * hd))
    gate, up = head.gate_up.weight.chunk(2)
    weights = {
        "fc.weight": head.fc.weight,
        "layers.0.self_attn.q_proj.weight": q,
        "layers.0.self_attn.k_proj.weight": k,
        "layers.0.self_attn.v_proj.weight": v,
        "layers.0.self_attn.o_proj.weight": head.o.weight,
        "layers.0.post_attention_layernorm.weight": head.norm_post,
        "layers.0.mlp.gate_proj.weight": gate,
        "layers.0.mlp.up_proj.weight": up,
        "layers.0.mlp.down_proj.weight": head.down.weight,
    }
    weights.update(_attention_biases(head))
    if engine == "sglang":  # SGLang's fc is an nn.Linear with a bias; left unloaded it would be garbage
        weights["fc.bias"] = torch.zeros(head.fc.weight.shape[0])
    return {name: w.detach().to(torch.bfloat16).contiguous() for name, w in weights.items()}


def _attention_biases(head: DraftHead) -> dict[str, torch.Tensor]:
    """{layers.0.self_attn.{q,k,v}_proj.bias: the head's, o_proj.bias: zeros (d,)} for a head with
    q/k/v biases (config.json's attention_bias gives the engines' Llama layer all four); {} without."""
    if head.qkv.bias is None:
        return {}
    hd, h, kv = head.head_dim, head.n_heads, head.n_kv
    q, k, v = head.qkv.bias.split((h * hd, kv * hd, kv * hd))
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    biases = (q, k, v, torch.zeros(head.o.weight.shape[0]))
    return {f"layers.0.self_attn.{name}.bias": b for name, b in zip(names, biases)}


def export_head(
    head: DraftHead, target_config, out: str | Path, engine: str = "vllm", meta: dict | None = None
) -> Path:
    """Write `head` (an unpacked DraftHead) to the folder `out` as an EAGLE-1 checkpoint for
    `engine` ("vllm" or "sglang"): model.safetensors, then config.json (and token_map.pt for
    SGLang), each written atomically, config.json last, so a folder with a config holds complete
    weights. Returns out. Raises ExportError for an unknown engine or a head with no EAGLE-1 form.

    vLLM: `speculative_config={"method": "eagle", "model": out, "num_speculative_tokens": k}`.
    SGLang: `--speculative-algorithm EAGLE --speculative-draft-model-path out
    --speculative-token-map out/token_map.pt`.
    """
    from safetensors.torch import save_file

    if engine not in ENGINES:
        raise ExportError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    out = Path(out)
    weights = eagle_weights(head, engine)
    config = eagle_config(head, target_config, engine, meta)
    atomic_write(out / "model.safetensors", lambda tmp: save_file(weights, tmp, metadata={"format": "pt"}))
    if engine == "sglang":
        atomic_write(out / "token_map.pt", lambda tmp: torch.save(head.vocab_ids.clone(), tmp))
    atomic_write(out / "config.json", lambda tmp: Path(tmp).write_text(json.dumps(config, indent=2) + "\n"))
    return out
