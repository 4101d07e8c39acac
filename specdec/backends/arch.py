"""The GGUF architectures the quantized backend runs, one small description each, and the reading of a
file's metadata and tensor list against its description (`plan`).

Each description says how a decoder layer differs from Llama's (pre-norm attention and SwiGLU, rotary
embedding, residuals), following llama.cpp's GGUF semantics (its `src/models/<arch>.cpp` and the
converter's `conversion/*.py`): which norms and where, the activation, q/k norms, the rope layout,
multipliers, the sliding-window pattern. The one forward (specdec.backends.quant) and the C++ layer
step (quant/layers.h) follow it; nothing else is architecture-specific.

A file is refused, naming the tensor or key, when it holds anything its description does not read: a
tensor no step uses (like Llama 3's `rope_freqs` before it was read), or a metadata key that changes
the maths (a rope scaling type, soft-capping, a partial rotary dimension) that is not handled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdec.backends.lean import rope_inv_freq
from specdec.errors import GGUFError


@dataclass(frozen=True)
class Arch:
    """How one GGUF architecture's decoder layer differs from Llama's.

    rope_interleaved: the converter permuted q/k rows for ggml's interleaved ("NORM") rotary layout;
    they are read back in rotate-half order (llama, granite, smollm3). pre_norms: RMSNorm before
    attention (attn_norm) and the feed-forward (ffn_norm); post_norms: RMSNorm of each block's output
    before its residual add (post_attention_norm, post_ffw_norm). qk_norm: attn_q_norm/attn_k_norm
    before the rotation, "head": (D,) a head at a time, "whole": over the whole projection. gelu: GELU-tanh gate
    instead of SiLU. embed_sqrt_d: embeddings times sqrt(d) (Gemma). window_pattern: with a sliding
    window, layer i is local unless i % pattern == pattern - 1 (0: no window read). no_rope_every:
    layer i has no rotary embedding when (i + 1) % it == 0 (SmolLM3). fused: attn_qkv holds q, k, v
    and ffn_up holds gate then up (Phi-3). qkv_bias: q, k and v may have biases (Qwen2).
    multipliers: Granite's embedding, attention, residual and logit scales. freq_factors: a
    rope_freqs tensor may divide the angles (Llama 3's rope scaling). long_rope: Phi-3's long and
    short rope factors and its attention factor, which scales cos and sin. keys: the `<arch>.` metadata
    keys read beyond the common ones."""

    name: str
    rope_interleaved: bool = False
    pre_norms: bool = True
    post_norms: bool = False
    qk_norm: str = ""
    gelu: bool = False
    embed_sqrt_d: bool = False
    window_pattern: int = 0
    no_rope_every: int = 0
    fused: bool = False
    qkv_bias: bool = False
    multipliers: bool = False
    freq_factors: bool = False
    long_rope: bool = False
    keys: frozenset[str] = frozenset()


_SCALES = frozenset({"embedding_scale", "residual_scale", "attention.scale", "logit_scale"})
_WINDOW = frozenset({"attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base_swa"})

ARCHS: dict[str, Arch] = {
    a.name: a
    for a in [
        Arch("llama", rope_interleaved=True, freq_factors=True, keys=frozenset({"attention.scale"})),
        Arch("qwen2", qkv_bias=True),
        Arch("qwen3", qk_norm="head"),
        Arch("gemma3", post_norms=True, qk_norm="head", gelu=True, embed_sqrt_d=True, window_pattern=6, keys=_WINDOW),
        Arch("granite", rope_interleaved=True, freq_factors=True, multipliers=True, keys=_SCALES),
        Arch("olmo2", pre_norms=False, post_norms=True, qk_norm="whole"),
        Arch("smollm3", rope_interleaved=True, no_rope_every=4),
        Arch(
            "phi3", fused=True, long_rope=True, keys=frozenset({"attention.sliding_window", "rope.scaling.attn_factor"})
        ),  # llama.cpp ignores Phi-3's window
    ]
}

# Keys every architecture reads (or that say nothing the forward needs: the training context, the
# fine-tune flag, the width of a key or value head when it equals head_dim, which is checked).
_COMMON = frozenset(
    {
        "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
        "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
        "attention.key_length", "attention.value_length", "rope.dimension_count", "rope.freq_base",
        "rope.scaling.type", "rope.scaling.factor", "rope.scaling.original_context_length",
        "rope.scaling.finetuned", "expert_count", "expert_used_count",
    }
)  # fmt: skip


@dataclass
class Plan:
    """One file's decoder as the forward runs it: shapes, per-layer choices, multipliers.

    ropes: the rotary frequency sets (D/2,) fp32 (inv_freq, frequency factors and linear scaling
    applied); layer_rope[i]: the index of layer i's set, -1 for none; layer_window[i]: layer i attends
    over the last `window` positions only. attn_scale: the q.k scale (0: 1/sqrt(D)); embed_scale,
    residual_scale: multipliers of the embeddings and of each block's output; logit_scale: the logits
    are multiplied by it (Granite's 1 / logit_scale); rope_scale: the rotation's cos and sin are (Phi-3's
    long-rope attention factor)."""

    arch: Arch
    n_layers: int
    hidden: int
    n_heads: int
    n_kv: int
    head_dim: int
    eps: float
    ropes: list[torch.Tensor]
    layer_rope: list[int]
    layer_window: list[bool]
    window: int = 0
    attn_scale: float = 0.0
    embed_scale: float = 1.0
    residual_scale: float = 1.0
    logit_scale: float = 1.0
    rope_scale: float = 1.0


def plan(gguf) -> Plan:
    """The Plan of a read GGUF file (specdec.models.gguf.GGUFModel). Raises GGUFError naming the file
    and the reason for an architecture not in ARCHS, a metadata key of the architecture that its
    description does not read, a value the forward does not handle (a rope scaling type other than
    none or linear, soft-capping, a partial rotary dimension, experts), a missing tensor, or a tensor
    no step reads."""
    arch = ARCHS.get(gguf.arch)
    if arch is None:
        raise GGUFError(
            f"{gguf.path.name}: architecture {gguf.arch!r} is not run by specdec's quantized backend, which runs "
            f"{', '.join(ARCHS)}; run it on transformers with --dtype float32"
        )
    prefix = f"{arch.name}."
    unknown = sorted(k for k in gguf.fields if k.startswith(prefix) and k[len(prefix) :] not in _COMMON | arch.keys)
    if unknown:
        raise GGUFError(
            f"{gguf.path.name}: metadata key {unknown[0]!r} changes what specdec's {arch.name} forward "
            "would compute, and it does not read it; the file is refused rather than run wrongly"
        )

    def key(name, default=None):
        value = gguf.fields.get(prefix + name, default)
        if value is None:
            raise GGUFError(f"{gguf.path.name}: the GGUF metadata has no {prefix + name!r}; not a complete model")
        return value

    for name in ("expert_count", "expert_used_count"):
        if key(name, 0):
            raise GGUFError(f"{gguf.path.name}: {prefix + name} = {key(name)}: mixture-of-experts files are not run")
    hidden, n_heads = int(key("embedding_length")), int(key("attention.head_count"))
    n_kv = int(key("attention.head_count_kv", n_heads))
    head_dim = int(key("attention.key_length", hidden // n_heads))
    for name in ("attention.value_length", "rope.dimension_count"):
        if int(key(name, head_dim)) != head_dim:
            raise GGUFError(
                f"{gguf.path.name}: {prefix + name} = {key(name)} differs from the head width "
                f"{head_dim}; specdec rotates and attends over whole heads only"
            )
    n_layers = int(key("block_count"))
    eps = float(key("attention.layer_norm_rms_epsilon"))
    p = Plan(arch, n_layers, hidden, n_heads, n_kv, head_dim, eps=eps, ropes=[], layer_rope=[], layer_window=[])
    _rope_and_window(gguf, p, key)
    if arch.embed_sqrt_d:
        p.embed_scale = math.sqrt(hidden)
    if arch.multipliers:
        p.embed_scale = float(key("embedding_scale", 1.0))
        p.residual_scale = float(key("residual_scale", 1.0))
        p.attn_scale = float(key("attention.scale", 0.0))
        p.logit_scale = 1.0 / float(key("logit_scale", 1.0))
    elif arch.name == "llama":
        p.attn_scale = float(key("attention.scale", 0.0))
    elif arch.name == "gemma3" and n_layers == 62:  # llama.cpp: Gemma 3 27B scales q by 1/sqrt(d / heads)
        p.attn_scale = 1.0 / math.sqrt(hidden / n_heads)
    _check_tensors(gguf, p)
    return p


def _rope_and_window(gguf, p: Plan, key) -> None:
    """The rotary frequency sets and which layers take which, and the sliding window, into p."""
    arch, D = p.arch, p.head_dim
    scaling = key("rope.scaling.type", "none")
    factor = float(key("rope.scaling.factor", 1.0))
    if scaling not in ("none", "linear") or (scaling == "none" and factor != 1.0):
        raise GGUFError(
            f"{gguf.path.name}: rope scaling {scaling!r} (factor {factor}) is not handled by specdec's "
            "forward (it handles none, linear and Llama 3's rope_freqs); the file is refused"
        )
    scale = 1.0 / factor if scaling == "linear" else 1.0
    base = float(key("rope.freq_base", 10000.0))
    inv = rope_inv_freq(base, D)  # fp32, as transformers computes it (and specdec did before any factor)
    factors = _frequency_factors(gguf, p, key)
    if factors is not None:
        inv = inv / factors.float()
    p.ropes = [inv * scale if scale != 1.0 else inv]
    p.layer_rope = [0] * p.n_layers
    if arch.no_rope_every:
        p.layer_rope = [-1 if (i + 1) % arch.no_rope_every == 0 else 0 for i in range(p.n_layers)]
    p.layer_window = [False] * p.n_layers
    window = int(key("attention.sliding_window", 0))
    if arch.window_pattern and window > 0:
        pattern = key("attention.sliding_window_pattern", arch.window_pattern)
        local = (
            [bool(x) for x in pattern]
            if isinstance(pattern, list)
            else [int(pattern) == 0 or i % int(pattern) < int(pattern) - 1 for i in range(p.n_layers)]
        )
        if len(local) != p.n_layers:
            raise GGUFError(f"{gguf.path.name}: the sliding-window pattern has {len(local)} layers, not {p.n_layers}")
        p.window, p.layer_window = window, local
        local_base = float(key("rope.freq_base_swa", 10000.0))  # local layers: their own base, never scaled
        p.ropes.append(rope_inv_freq(local_base, D))
        p.layer_rope = [1 if w else r for w, r in zip(local, p.layer_rope)]


def _layer_shapes(arch: Arch, p: Plan, ffn: int) -> dict[str, tuple[int, ...]]:
    """Tensor name (after `blk.i.`) -> shape (torch order) of a layer of arch; optional ones end in '?'."""
    d, q, kv = p.hidden, p.n_heads * p.head_dim, p.n_kv * p.head_dim
    shapes = {"attn_output.weight": (d, q), "ffn_down.weight": (d, ffn)}
    if arch.fused:
        shapes |= {"attn_qkv.weight": (q + 2 * kv, d), "ffn_up.weight": (2 * ffn, d)}
    else:
        shapes |= {"attn_q.weight": (q, d), "attn_k.weight": (kv, d), "attn_v.weight": (kv, d)}
        shapes |= {"ffn_gate.weight": (ffn, d), "ffn_up.weight": (ffn, d)}
    if arch.pre_norms:
        shapes |= {"attn_norm.weight": (d,), "ffn_norm.weight": (d,)}
    if arch.post_norms:
        shapes |= {"post_attention_norm.weight": (d,), "post_ffw_norm.weight": (d,)}
    if arch.qk_norm:
        whole = arch.qk_norm == "whole"
        shapes |= {
            "attn_q_norm.weight": (q if whole else p.head_dim,),
            "attn_k_norm.weight": (kv if whole else p.head_dim,),
        }
    if arch.qkv_bias:
        shapes |= {"attn_q.bias?": (q,), "attn_k.bias?": (kv,), "attn_v.bias?": (kv,)}
    return shapes


def _frequency_factors(gguf, p: Plan, key) -> torch.Tensor | None:
    """The factors (D/2,) that divide the rotary frequencies, or None: Llama 3's rope_freqs, or Phi-3's
    long-rope factors, the long ones where the file's context exceeds its original one (as llama.cpp
    picks them for a full context), with their attention factor into p.rope_scale. A factor tensor of
    another shape, or on an architecture that does not read it, is refused."""
    names = ["rope_freqs.weight"] if p.arch.freq_factors else []
    names += ["rope_factors_long.weight", "rope_factors_short.weight"] if p.arch.long_rope else []
    for name in names:
        if name in gguf.tensors and tuple(gguf.tensors[name].shape) != (p.head_dim // 2,):
            shape = tuple(gguf.tensors[name].shape)
            raise GGUFError(f"{gguf.path.name}: tensor {name!r} has shape {shape}, not ({p.head_dim // 2},)")
    if "rope_freqs.weight" in names and "rope_freqs.weight" in gguf.tensors:
        return gguf.tensors["rope_freqs.weight"].data
    if p.arch.long_rope and "rope_factors_long.weight" in gguf.tensors:
        context = int(key("context_length"))
        long = context > int(key("rope.scaling.original_context_length", context))
        p.rope_scale = float(key("rope.scaling.attn_factor", 1.0))
        return gguf.tensors[f"rope_factors_{'long' if long else 'short'}.weight"].data
    return None


def _check_tensors(gguf, p: Plan) -> None:
    """Raises GGUFError for a tensor p's forward reads that is missing or of another shape, or for a
    tensor no step reads."""
    arch, name = p.arch, gguf.path.name
    vocab = gguf.tensors["token_embd.weight"].shape[0] if "token_embd.weight" in gguf.tensors else 0
    shapes = {
        "token_embd.weight": (vocab, p.hidden),
        "output_norm.weight": (p.hidden,),
        "output.weight?": (vocab, p.hidden),
    }
    layer = _layer_shapes(arch, p, int(gguf.metadata(f"{arch.name}.feed_forward_length")))
    for i in range(p.n_layers):
        shapes |= {f"blk.{i}.{n}": shape for n, shape in layer.items()}
    for key, shape in shapes.items():
        t = gguf.tensors.get(key.rstrip("?"))
        if t is None and not key.endswith("?"):
            raise GGUFError(f"{name} has no tensor {key!r}: not a complete {arch.name} model file")
        if t is not None and tuple(t.shape) != shape:
            raise GGUFError(f"{name}: tensor {t.name!r} has shape {tuple(t.shape)}, not {shape} as the metadata says")
    expected = {key.rstrip("?") for key in shapes} | ({"rope_freqs.weight"} if arch.freq_factors else set())
    expected |= {"rope_factors_long.weight", "rope_factors_short.weight"} if arch.long_rope else set()
    extra = sorted(set(gguf.tensors) - expected)
    if extra:
        raise GGUFError(
            f"{name}: tensor {extra[0]!r} is not read by specdec's {arch.name} forward; "
            "the file is refused rather than run without it"
        )
