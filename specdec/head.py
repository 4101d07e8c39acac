"""A feature-level draft head in the manner of EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling
Requires Rethinking Feature Uncertainty"): one small decoder layer that predicts the target's next
feature (its final-normed hidden state, what the output layer reads) from the current feature and
the embedding of the token that follows it, reusing the target's embedding and output layers.

Shapes, for a target with hidden size d: at position t the head reads f_t (the target's feature
after token t) and e(x_{t+1}) (the embedding of the next token), concatenated (2d) and projected
to d by `fc`, then one pre-norm Llama decoder layer (RoPE attention over the earlier positions of
the head's own KV cache, SwiGLU MLP); its output is f^_{t+1}. Drafting applies the target's output
layer to f^_{t+1}, restricted to `vocab_ids` (the N most useful tokens, as FR-Spec and EAGLE-3
do, so a draft step reads N rows of the output layer instead of all), and feeds (f^_{t+1}, e(drafted
token)) back in for the next step.

Files: `save_head` writes safetensors (weights in bf16 to stay small; vocab ids) with the
architecture in its metadata, atomically; `load_head` reads them back in fp32 and checks the
target's hidden size.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .errors import SpecdecError
from .weights import atomic_write


class HeadError(SpecdecError, ValueError):
    """A draft head file that is missing, damaged or made for another target."""


class DraftHead(nn.Module):
    """fc (2d -> d) and one Llama decoder layer; see the module docstring.

    config: hidden (d), heads, kv_heads, head_dim, intermediate, rope_theta, eps, target (name of
    the model it was trained on). vocab_ids: (N,) long, the token ids it can draft.
    """

    def __init__(self, config: dict, vocab_ids: torch.Tensor):
        super().__init__()
        self.config = dict(config)
        d, h, kv, hd, inter = (config[k] for k in ("hidden", "heads", "kv_heads", "head_dim", "intermediate"))
        self.n_heads, self.n_kv, self.head_dim, self.eps = h, kv, hd, config["eps"]
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.norm_in = nn.Parameter(torch.ones(d))
        self.qkv = nn.Linear(d, (h + 2 * kv) * hd, bias=False)
        self.o = nn.Linear(h * hd, d, bias=False)
        self.norm_post = nn.Parameter(torch.ones(d))
        self.gate_up = nn.Linear(d, 2 * inter, bias=False)
        self.down = nn.Linear(inter, d, bias=False)
        self.register_buffer("vocab_ids", vocab_ids.long().clone())
        self.register_buffer("inv_freq", 1.0 / (config["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd)),
                             persistent=False)

    @classmethod
    def for_target(cls, model, vocab_ids: torch.Tensor) -> "DraftHead":
        """A fresh head shaped like the target (a Llama-family specdec Model): its decoder layer
        starts as a copy of the target's last one and fc passes the feature through, a better
        start than random."""
        c, last = model.hf.config, model.hf.model.layers[-1]
        hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta", getattr(c, "rope_theta", 10000.0))
        config = {"hidden": c.hidden_size, "heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads,
                  "head_dim": hd, "intermediate": c.intermediate_size, "rope_theta": float(theta),
                  "eps": float(c.rms_norm_eps), "target": model.name}
        head = cls(config, vocab_ids)
        a, m = last.self_attn, last.mlp
        with torch.no_grad():
            head.qkv.weight.copy_(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]))
            head.o.weight.copy_(a.o_proj.weight)
            head.gate_up.weight.copy_(torch.cat([m.gate_proj.weight, m.up_proj.weight]))
            head.down.weight.copy_(m.down_proj.weight)
            head.norm_in.copy_(last.input_layernorm.weight)
            head.norm_post.copy_(last.post_attention_layernorm.weight)
            d = c.hidden_size
            head.fc.weight.mul_(0.1)
            head.fc.weight[:, d:] += torch.eye(d)
        return head

    def forward(self, features: torch.Tensor, embeds: torch.Tensor, start: int = 0,
                cache: "HeadCache | None" = None) -> torch.Tensor:
        """features, embeds: (T, d) for positions start..start+T-1 -> predicted next features
        (T, d). Without a cache the T positions attend causally among themselves (training);
        with one they also attend to its first `start` positions, and theirs are written to it."""
        T, hd = features.shape[0], self.head_dim
        end = start + T
        x = self.fc(torch.cat([embeds, features], dim=-1))
        pos = torch.arange(start, end, dtype=torch.float32, device=x.device)[:, None] * self.inv_freq[None, :]
        emb = torch.cat([pos, pos], dim=-1)[:, None, :]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        h = F.rms_norm(x, (x.shape[-1],), self.norm_in, self.eps)
        qk, v = self.qkv(h).split(((self.n_heads + self.n_kv) * hd, self.n_kv * hd), dim=-1)
        qk = qk.reshape(T, self.n_heads + self.n_kv, hd)
        half = hd // 2
        qk = qk * cos + torch.cat([-qk[..., half:], qk[..., :half]], dim=-1) * sin
        q, k = qk[:, : self.n_heads].transpose(0, 1), qk[:, self.n_heads:].transpose(0, 1)
        v = v.reshape(T, self.n_kv, hd).transpose(0, 1)
        if cache is None:
            attn = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                                  enable_gqa=self.n_kv != self.n_heads)
        else:
            cache.reserve(end)
            cache.k[:, start:end], cache.v[:, start:end] = k, v
            mask = None if T == 1 else (torch.arange(end, device=x.device)[None, :]
                                        <= torch.arange(start, end, device=x.device)[:, None])
            attn = F.scaled_dot_product_attention(q[None], cache.k[None, :, :end], cache.v[None, :, :end],
                                                  attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)
        x = x + self.o(attn[0].transpose(0, 1).reshape(T, self.n_heads * hd))
        gate, up = self.gate_up(F.rms_norm(x, (x.shape[-1],), self.norm_post, self.eps)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class HeadCache:
    """The head's own keys and values, (n_kv_heads, capacity, head_dim) each, grown on demand; the
    owner tracks how many positions are valid (rollback is forgetting the rest)."""

    def __init__(self, head: DraftHead, capacity: int = 256):
        self.head = head
        self.k = torch.empty(head.n_kv, capacity, head.head_dim)
        self.v = torch.empty_like(self.k)

    def reserve(self, end: int) -> None:
        if end > self.k.shape[1]:
            cap = max(end, 2 * self.k.shape[1])
            for name in ("k", "v"):
                old = getattr(self, name)
                new = old.new_empty(old.shape[0], cap, old.shape[2])
                new[:, : old.shape[1]] = old
                setattr(self, name, new)


def save_head(head: DraftHead, path: str | os.PathLike, meta: dict | None = None) -> Path:
    """Write the head to `path` (.safetensors; weights in bf16), atomically: a temporary file
    renamed when complete. meta: extra JSON-able facts (training data, losses) kept in the file."""
    from safetensors.torch import save_file

    tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
               for k, v in head.state_dict().items()}
    metadata = {"config": json.dumps(head.config), "meta": json.dumps(meta or {})}
    return atomic_write(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))


def load_head(path: str | os.PathLike, hidden_size: int | None = None) -> tuple[DraftHead, dict]:
    """(head in fp32, eval mode; its meta) from a file save_head wrote. Raises HeadError when the
    file is missing or unreadable, or was made for a target of another hidden size."""
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
        raise HeadError(f"{path} was trained for {config.get('target')!r} (hidden size {config['hidden']}), "
                        f"not this target (hidden size {hidden_size}): train one for it with `specdec train`")
    head = DraftHead(config, tensors["vocab_ids"])
    head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()})
    return head.eval(), json.loads(meta.get("meta", "{}"))
