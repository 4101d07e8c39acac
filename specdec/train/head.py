"""A feature-level draft head in the manner of EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling
Requires Rethinking Feature Uncertainty"): one small decoder layer that predicts the target's next
feature (its final-normed hidden state, what the output layer reads) from the current feature and
the embedding of the token that follows it, reusing the target's embedding and output layers.

Shapes, for a target with hidden size d: at position t the head reads f_t (the target's feature
after token t) and e(x_{t+1}) (the embedding of the next token), concatenated (2d) and projected
to d by `fc`, then one Llama decoder layer (RoPE attention over the earlier positions of the head's
own KV cache, SwiGLU MLP; q, k and v with biases for a target whose attention has them, as
Qwen2's does: config qkv_bias) that, as EAGLE-1's does, attends over fc's output without normalising it
first (config input_norm; specdec.train.export writes such heads for vLLM and SGLang); its output
is f^_{t+1}. Drafting applies the target's output layer to f^_{t+1}, restricted to `vocab_ids`
(the N most useful tokens, as FR-Spec and EAGLE-3 do, so a draft step reads N rows of the output
layer instead of all), and feeds (f^_{t+1}, e(drafted token)) back in for the next step.

Files: `save_head` writes safetensors (weights in bf16 to stay small; vocab ids) with the
architecture in its metadata, atomically; `load_head` reads them back in fp32 and checks the
target's hidden size.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec.backends.lean import attention_shape, cached_attention, causal_mask, rope, rope_inv_freq, rotate
from specdec.backends.linear import Linear
from specdec.cache import grown
from specdec.errors import SpecdecError
from specdec.models.weights import atomic_write, cache_dir

PACKAGED = Path(__file__).resolve().parents[1] / "data" / "heads"  # heads that ship with specdec


class HeadError(SpecdecError, ValueError):
    """A draft head file that is missing, damaged or made for another target."""


class DraftHead(nn.Module):
    """fc (2d -> d) and one Llama decoder layer; see the module docstring.

    config: hidden (d), heads, kv_heads, head_dim, intermediate, rope_theta, eps, target (name of
    the model it was trained on), taps (decoder layers whose outputs the first step also reads;
    absent or [] for none), input_norm (whether the layer RMS-normalises fc's output before
    attention; EAGLE-1 and vLLM's EagleLlamaForCausalLM do not, so heads made by `for_target` do not;
    absent means true, as in heads made before it existed), qkv_bias (whether q, k and v have biases,
    as Qwen2's attention does: `qkv.bias`, ((heads + 2 kv_heads) head_dim,), q's then k's then v's,
    added after the product; absent means false, as in heads made before it existed). vocab_ids:
    (N,) long, the token ids it can draft.
    """

    def __init__(self, config: dict, vocab_ids: torch.Tensor):
        super().__init__()
        self.config = dict(config)
        d, h, kv, hd, inter = (config[k] for k in ("hidden", "heads", "kv_heads", "head_dim", "intermediate"))
        self.n_heads, self.n_kv, self.head_dim, self.eps = h, kv, hd, config["eps"]
        self.taps = tuple(config.get("taps") or ())
        self.fuse = nn.Linear((1 + len(self.taps)) * d, d, bias=False) if self.taps else None
        self.fc = nn.Linear(2 * d, d, bias=False)
        # EAGLE-1's layer reads fc's output as it is; heads made before export-head normalised it first
        self.norm_in = nn.Parameter(torch.ones(d)) if config.get("input_norm", True) else None
        self.qkv = nn.Linear(d, (h + 2 * kv) * hd, bias=bool(config.get("qkv_bias", False)))
        self.o = nn.Linear(h * hd, d, bias=False)
        self.norm_post = nn.Parameter(torch.ones(d))
        self.gate_up = nn.Linear(d, 2 * inter, bias=False)
        self.down = nn.Linear(inter, d, bias=False)
        self.register_buffer("vocab_ids", vocab_ids.long().clone())
        self.register_buffer("inv_freq", rope_inv_freq(config["rope_theta"], hd), persistent=False)

    @staticmethod
    def default_taps(n_layers: int) -> list[int]:
        """EAGLE-3's low and middle layers for a target of n_layers decoder layers: [2, n // 2]
        (0-based; SmolLM2-135M, 30 layers: [2, 15])."""
        return sorted({min(2, n_layers - 1), n_layers // 2})

    @classmethod
    def for_target(cls, model, vocab_ids: torch.Tensor, taps: list[int] | None = None) -> DraftHead:
        """A fresh head shaped like the target (a Llama-family specdec Model): its decoder layer
        starts as a copy of the target's last one (last_layer_weights: the GGUF file's tensors,
        dequantized, for a quantized target, whose fp32 transformers model is never loaded; the copied
        input norm folded into q, k and v, their biases, added after the product, copied as they
        are, with qkv_bias set where the target has them, as Qwen2 does; o and down at zero, so the
        layer starts by adding nothing) and fc passes the feature through, a better start than
        random. taps: decoder layers (0-based) whose outputs the first step also reads (default
        none); fuse starts by passing the final feature through and ignoring them."""
        c, w = model.config, last_layer_weights(model)
        hd, theta = attention_shape(c)
        config = {
            "hidden": c.hidden_size,
            "heads": c.num_attention_heads,
            "kv_heads": c.num_key_value_heads,
            "head_dim": hd,
            "intermediate": c.intermediate_size,
            "rope_theta": theta,
            "eps": float(c.rms_norm_eps),
            "target": model.name,
            "taps": list(taps or []),
            "input_norm": False,
            **({"qkv_bias": True} if w["qkv_bias"] is not None else {}),  # absent: the files of Llama heads unchanged
        }
        head = cls(config, vocab_ids)
        with torch.no_grad():
            head.qkv.weight.copy_(w["qkv"])
            if head.qkv.bias is not None:
                head.qkv.bias.copy_(w["qkv_bias"])
            head.gate_up.weight.copy_(w["gate_up"])
            head.down.weight.copy_(w["down"])
            head.norm_post.copy_(w["norm_post"])
            # EAGLE-1's layer attends over fc's output unnormalised: fold the copied layer's input norm,
            # over the typical size of a feature (the final norm's weights' RMS; features are final-normed),
            # into q, k and v (their columns: the biases are added after the product and stay as they are);
            # and start its residual branches at zero (the copied ones write at the scale of the target's
            # residual stream, far larger than a feature's), so the head starts as fc
            head.qkv.weight.mul_(w["norm_in"] / w["final_norm"].pow(2).mean().sqrt())
            head.o.weight.zero_()
            head.down.weight.zero_()
            d = c.hidden_size
            head.fc.weight.mul_(0.1)
            head.fc.weight[:, d:] += torch.eye(d)
            if head.fuse is not None:
                head.fuse.weight.zero_()
                head.fuse.weight[:, :d] = torch.eye(d)
        return head

    def packed(self, device: torch.device | None = None) -> DraftHead:
        """A copy for drafting, on `device` (default: where this head is), whose projections run as
        specdec.backends.lean.Linear (weights reordered once for oneDNN on CPU; one draft step's products are
        memory-bound, and MKL's path for a single row reads them several times slower), biases
        kept (`qkv.bias`: a plain tensor, or None). Inference only: no gradients."""
        packed = copy.deepcopy(self).eval().to(device)
        for name in ("fuse", "fc", "qkv", "o", "gate_up", "down"):
            module = getattr(packed, name)
            if module is None:
                continue
            bias = None if module.bias is None else module.bias.detach()
            delattr(packed, name)  # a module attribute: replaced by a plain callable
            setattr(packed, name, Linear(module.weight.detach(), bias))
        return packed

    def fused(self, features: torch.Tensor) -> torch.Tensor:
        """(T, d) input features: the target's (T, (1 + len(taps)) d) features fused by `fuse`
        (the tapped layers' hidden states RMS-normalised first), or (T, d) ones as they are (the
        final feature alone, or the head's own prediction)."""
        d = self.config["hidden"]
        if features.shape[-1] == d:
            return features
        if self.fuse is None or features.shape[-1] != d * (1 + len(self.taps)):
            raise HeadError(
                f"features of width {features.shape[-1]} for a head of hidden size {d} and taps "
                f"{list(self.taps)}: the target's cache must keep those layers (LeanKVCache(taps=...))"
            )
        parts = features.unflatten(-1, (1 + len(self.taps), d))
        normed = torch.cat([parts[..., :1, :], F.rms_norm(parts[..., 1:, :], (d,), eps=self.eps)], dim=-2)
        return self.fuse(normed.flatten(-2))

    def _project(self, features: torch.Tensor, embeds: torch.Tensor, start: int):
        """x (T, d) after fc; q (T, heads, head_dim), k and v (T, kv_heads, head_dim) after RoPE
        at positions start..start+T-1."""
        T, hd = features.shape[0], self.head_dim
        x = self.fc(torch.cat([embeds, self.fused(features)], dim=-1))
        cos, sin = rope(self.inv_freq, start, start + T, x.dtype)
        normed = x if self.norm_in is None else F.rms_norm(x, (x.shape[-1],), self.norm_in, self.eps)
        qk, v = self.qkv(normed).split(((self.n_heads + self.n_kv) * hd, self.n_kv * hd), dim=-1)
        qk = rotate(qk.reshape(T, self.n_heads + self.n_kv, hd), cos, sin)
        return x, qk[:, : self.n_heads], qk[:, self.n_heads :], v.reshape(T, self.n_kv, hd)

    def _finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual stream x (T, d) after attention's output attn (T, heads * head_dim)
        and the MLP."""
        x = x + self.o(attn)
        gate, up = self.gate_up(F.rms_norm(x, (x.shape[-1],), self.norm_post, self.eps)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)

    def forward(
        self, features: torch.Tensor, embeds: torch.Tensor, start: int = 0, cache: HeadCache | None = None
    ) -> torch.Tensor:
        """features, embeds: (T, d) for positions start..start+T-1 -> predicted next features
        (T, d). Without a cache the T positions attend causally among themselves (training);
        with one they also attend to its first `start` positions, and theirs are written to it."""
        T = features.shape[0]
        x, q, k, v = self._project(features, embeds, start)
        if cache is None:  # training: differentiable, no cache
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                k.transpose(0, 1)[None],
                v.transpose(0, 1)[None],
                is_causal=True,
                enable_gqa=self.n_kv != self.n_heads,
            )[0]
            attn = attn.transpose(0, 1).reshape(T, self.n_heads * self.head_dim)
        else:
            cache.reserve(start, start + T)
            attn = cached_attention(q, k, v, cache.k, cache.v, start, mask=causal_mask(start, T, x.device))
        return self._finish(x, attn)

    def unrolled(self, features: torch.Tensor, embeds: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """What drafting predicts `steps` tokens deep from every position at once, differentiably:
        the "training-time test" of EAGLE-3 (Li et al. 2025) and HASS (Zhang et al. 2024), which
        trains the head on its own predicted features instead of only on the target's.

        features, embeds: (T, d) (features (T, (1 + len(taps)) d) with taps), the target's true
        features and the next tokens' embeddings at positions 0..T-1. Returns `steps` tensors
        (T, d). out[0] is forward(features, embeds). out[j][t] is draft step j+1 when the last
        true feature is at position t-j: its input is (out[j-1][t-1], embeds[t]), and it attends
        to step one's keys at positions <= t-j and to the keys of steps 2..j+1 on its own path
        (positions t-j+1..t), exactly what drafting with a HeadCache sees. Rows t < j have no
        such path; callers ignore them.
        """
        T, hd, rep = features.shape[0], self.head_dim, self.n_heads // self.n_kv
        scale = hd**-0.5

        def down(x: torch.Tensor, m: int) -> torch.Tensor:  # row t <- row t - m, zeros on top
            return torch.cat([x.new_zeros((m,) + x.shape[1:]), x[: T - m]]) if m else x

        outs, keys, values, feats = [], [], [], features
        for j in range(steps):
            x, q, k, v = self._project(feats, embeds, 0)
            keys.append(k.repeat_interleave(rep, dim=1))
            values.append(v.repeat_interleave(rep, dim=1))
            scores = torch.einsum("thd,shd->hts", q, keys[0]) * scale  # (heads, T, T) vs step one
            visible = torch.ones(T, T, dtype=torch.bool, device=x.device).tril(-j)
            scores = scores.masked_fill(~visible, float("-inf"))
            path = [down(keys[i], j - i) for i in range(1, j + 1)]  # step i+1's key at t - (j - i)
            own = [(q * key).sum(-1).T[..., None] * scale for key in path]  # (heads, T, 1) each
            p = torch.cat([scores, *own], dim=-1).softmax(-1)
            attn = torch.einsum("hts,shd->thd", p[..., :T], values[0])
            for i in range(1, j + 1):
                attn = attn + p[..., T + i - 1].T[..., None] * down(values[i], j - i)
            outs.append(self._finish(x, attn.reshape(T, self.n_heads * hd)))
            feats = down(outs[-1], 1)
        return outs


class HeadCache:
    """The head's own keys and values, (n_kv_heads, capacity, head_dim) each, grown on demand; the
    owner tracks how many positions are valid (rollback is forgetting the rest)."""

    def __init__(self, head: DraftHead, capacity: int = 256):
        self.head = head
        self.k = torch.empty(head.n_kv, capacity, head.head_dim, device=head.inv_freq.device)
        self.v = torch.empty_like(self.k)

    def reserve(self, start: int, end: int) -> None:
        """Room for positions up to end; the first `start` are kept when it grows (doubling)."""
        if end > self.k.shape[1]:
            capacity = max(end, 2 * self.k.shape[1])
            self.k, self.v = grown(self.k, capacity, start, dim=1), grown(self.v, capacity, start, dim=1)


def last_layer_weights(model) -> dict[str, torch.Tensor | None]:
    """The weights DraftHead.for_target starts from, fp32, from the target's last decoder layer:
    qkv ((heads + 2 kv_heads) head_dim, d; q's rows, then k's, then v's), qkv_bias (the same rows'
    biases, zeros for a part without one; None where q, k and v have none, as in Llama), gate_up
    (2 intermediate, d), down (d, intermediate), norm_in and norm_post (d,) (its RMSNorms' weights)
    and final_norm (d,) (the model's final norm). From the GGUF tensors, dequantized, for a model run
    at its GGUF precision (`model.gguf`: its transformers model is never loaded), else from the
    transformers model. Raises ValueError naming a tensor the GGUF model lacks."""
    if model.gguf is not None:
        return _gguf_last_layer(model.gguf, model.config.num_hidden_layers - 1)
    last, hf = model.hf.model.layers[-1], model.hf
    a, m = last.self_attn, last.mlp
    return _layer_weights(
        [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight],
        [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias],
        [m.gate_proj.weight, m.up_proj.weight],
        m.down_proj.weight,
        norm_in=last.input_layernorm.weight,
        norm_post=last.post_attention_layernorm.weight,
        final_norm=hf.model.norm.weight,
    )


def _gguf_last_layer(gguf, i: int) -> dict[str, torch.Tensor | None]:
    """last_layer_weights of decoder layer i of a GGUF model (specdec.models.gguf.GGUFModel, or
    specdec.models.quantize's), in llama.cpp's tensor names; its q and k rows are in transformers'
    order already (read_gguf un-permutes them)."""

    def get(name: str, required: bool = True) -> torch.Tensor | None:
        tensor = gguf.tensors.get(name)
        if tensor is None and required:
            raise ValueError(f"the GGUF model has no tensor {name}: not a complete Llama/Qwen2 model")
        return None if tensor is None else tensor.dequantize()

    blk = f"blk.{i}"
    return _layer_weights(
        [get(f"{blk}.attn_{p}.weight") for p in "qkv"],
        [get(f"{blk}.attn_{p}.bias", required=False) for p in "qkv"],
        [get(f"{blk}.ffn_gate.weight"), get(f"{blk}.ffn_up.weight")],
        get(f"{blk}.ffn_down.weight"),
        norm_in=get(f"{blk}.attn_norm.weight"),
        norm_post=get(f"{blk}.ffn_norm.weight"),
        final_norm=get("output_norm.weight"),
    )


def _layer_weights(qkv, biases, gate_up, down, norm_in, norm_post, final_norm) -> dict[str, torch.Tensor | None]:
    """last_layer_weights' dict from the parts (tensors; biases: q's, k's, v's, each None or (rows,))."""

    def f32(t: torch.Tensor) -> torch.Tensor:
        return t.detach().float()

    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([f32(b) if b is not None else torch.zeros(w.shape[0]) for w, b in zip(qkv, biases)])
    return {
        "qkv": torch.cat([f32(w) for w in qkv]),
        "qkv_bias": bias,
        "gate_up": torch.cat([f32(w) for w in gate_up]),
        "down": f32(down),
        "norm_in": f32(norm_in),
        "norm_post": f32(norm_post),
        "final_norm": f32(final_norm),
    }


def head_file(target_name: str, cache: str | os.PathLike | None = None) -> Path:
    """Where `specdec train` writes the head of a target: <cache>/heads/<name>.safetensors."""
    return cache_dir(cache) / "heads" / f"{target_name.replace('/', '--')}.safetensors"


def find_head(target_name: str, cache: str | os.PathLike | None = None) -> Path | None:
    """The head a target drafts with: the trained one (head_file) if it exists, else one shipped
    in the package (specdec/data/heads), else None."""
    shipped = PACKAGED / head_file(target_name).name
    return next((p for p in (head_file(target_name, cache), shipped) if p.is_file()), None)


def save_head(head: DraftHead, path: str | os.PathLike, meta: dict | None = None) -> Path:
    """Write the head to `path` (.safetensors; weights in bf16), atomically: a temporary file
    renamed when complete. meta: extra JSON-able facts (training data, losses) kept in the file."""
    from safetensors.torch import save_file

    tensors = {
        k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in head.state_dict().items()
    }
    metadata = {"config": json.dumps(head.config), "meta": json.dumps(meta or {})}
    return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def load_head(path: str | os.PathLike, hidden_size: int | None = None) -> tuple[DraftHead, dict]:
    """(head in fp32, eval mode; its meta) from a file save_head wrote (one without qkv_bias in its
    config, as every head made before it existed: a head without q/k/v biases). Raises HeadError
    when the file is missing or unreadable, holds other tensors than its config describes, or was
    made for a target of another hidden size."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise HeadError(f"no draft head at {path}: train one with `specdec train --target MODEL`")
    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        config = json.loads(meta["config"])
    except Exception as e:  # safetensors raises several types on a damaged file
        raise HeadError(f"{path} is not a readable draft head ({e}); train it again with `specdec train`") from None
    if hidden_size is not None and config["hidden"] != hidden_size:
        raise HeadError(
            f"{path} was trained for {config.get('target')!r} (hidden size {config['hidden']}), "
            f"not this target (hidden size {hidden_size}): train one for it with `specdec train`"
        )
    head = DraftHead(config, tensors["vocab_ids"])
    try:
        head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()})
    except RuntimeError as e:  # tensors missing, extra or misshapen for its config (qkv_bias without qkv.bias)
        raise HeadError(f"{path} does not hold the weights its config describes ({e}); train it again") from None
    return head.eval(), json.loads(meta.get("meta", "{}"))
