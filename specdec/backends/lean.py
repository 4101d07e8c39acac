"""The lean decode path: a plain-torch forward for Llama-family models (Llama, SmolLM2, Qwen2)
over a preallocated, position-indexed KV cache, with weights prepacked for the CPU's BLAS.

Why it exists (measurements: docs/lean-backend.md): with transformers on a CPU a forward over a
few new tokens costs several one-token forwards, because MKL's general matrix product re-packs
each weight on every call and its small-M path is far off the memory floor. oneDNN with
the weights reordered once at load (`torch.ops.mkldnn._reorder_linear_weight`, the kernels
inductor's CPU freezing pass uses) reads a weight once for M up to about 16 tokens, so a verify pass
costs about what a one-token step costs, the premise of speculative decoding. q/k/v and gate/up
are fused into one product each; the rest is what decoding needs and nothing more, after
gpt-fast's model.py.

Rollback is moving a counter: the cache rows past it are simply overwritten by the next forward.
Exactness is against plain decoding on the same backend: both use this forward, and it agrees with
transformers' to floating-point rounding (tests/test_lean.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.backends import rows
from specdec.backends.linear import Linear, fused
from specdec.backends.screen import ScreenedHead, screening_pays

SUPPORTED = ("llama", "qwen2")


@dataclass
class BatchItem:
    """One sequence's part of a batched forward (forward_batch): the arguments of LeanModel.forward."""

    ids: torch.Tensor  # (n,) new token ids
    keys: list[torch.Tensor]  # per layer (KVH, capacity, D)
    values: list[torch.Tensor]
    features: torch.Tensor  # (capacity, d * (1 + taps))
    start: int  # cached tokens before the new ones
    keep: int  # logits of the last `keep` new tokens
    tree: tuple[torch.Tensor, torch.Tensor] | None = None  # positions (n,), mask (n, start + n)
    argmax_only: bool = False  # only each row's argmax of the logits is read (greedy)


def weight_bytes(hf: torch.nn.Module) -> int:
    """Bytes of weights one forward of the transformers model `hf` reads: every parameter except
    the input embedding table (a forward gathers only its n rows), which counts when the output
    layer reads it (tied weights). Parameters shared between modules count once."""
    embed = hf.get_input_embeddings().weight
    head = hf.get_output_embeddings()
    tied = head is not None and head.weight.data_ptr() == embed.data_ptr()
    seen, total = set(), 0
    for p in hf.parameters():
        if p.data_ptr() in seen or (p.data_ptr() == embed.data_ptr() and not tied):
            continue
        seen.add(p.data_ptr())
        total += p.numel() * p.element_size()
    return total


def unsupported_reason(hf) -> str | None:
    """Why the lean forward cannot run this transformers model, or None when it can."""
    c = hf.config
    if c.model_type not in SUPPORTED:
        return f"architecture {c.model_type!r} (the lean path runs {', '.join(SUPPORTED)})"
    rope = getattr(c, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        return f"rope type {rope.get('rope_type')!r}"
    if getattr(c, "use_sliding_window", False):
        return "sliding-window attention"
    if getattr(c, "hidden_act", "silu") != "silu":
        return f"activation {c.hidden_act!r}"
    if getattr(c, "pretraining_tp", 1) != 1:
        return "pretraining_tp > 1"
    return None


def attention_shape(config) -> tuple[int, float]:
    """(head_dim, rope theta) of a transformers Llama-family config."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", getattr(config, "rope_theta", 10000.0))
    return head_dim, float(theta)


def rope_inv_freq(theta: float, head_dim: int, device=None) -> torch.Tensor:
    """RoPE's inverse frequencies (head_dim / 2,), fp32, as transformers' default rope computes them."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))


def rope(
    inv_freq: torch.Tensor, start: int, end: int, dtype: torch.dtype, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin for positions start..end-1 (or the given positions, (n,) ints), each
    (n, 1, head_dim), in dtype."""
    if positions is None:
        positions = torch.arange(start, end, device=inv_freq.device)
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021) in the rotate-half layout of transformers.
    x: (n, heads, head_dim); cos, sin: (n, 1, head_dim)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def causal_mask(start: int, n: int, device=None) -> torch.Tensor | None:
    """(n, start+n) bool: new position i (at start+i) sees keys 0..start+i; None for n = 1 (it sees all)."""
    if n == 1:
        return None
    return torch.arange(start + n, device=device)[None, :] <= torch.arange(start, start + n, device=device)[:, None]


def tree_layout(parents: list[int], start: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and attention mask of a token tree appended after `start` cached tokens
    (tree attention as in SpecInfer, Miao et al. 2024, and Medusa).

    parents: (n,) the index of each node's parent among the nodes, -1 for the root (node 0, whose
    parent is the last cached token); a parent comes before its children. Returns positions (n,)
    = start + depth, and mask (n, start+n) bool: a node sees the cached tokens, its ancestors and
    itself. Raises ValueError when parents is not such a tree."""
    n = len(parents)
    if n == 0 or parents[0] != -1 or any(not 0 <= p < i for i, p in enumerate(parents) if i):
        raise ValueError(f"parents must describe a tree in topological order rooted at node 0, got {parents}")
    depth = [0] * n
    seen = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            depth[i] = depth[p] + 1
            seen[i] = seen[p]
        seen[i, i] = True
    mask = torch.cat((torch.ones(n, start, dtype=torch.bool), seen), dim=1).to(device)
    return torch.tensor(depth, device=device) + start, mask


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start: int,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of n new positions start..start+n-1 over a cache holding 0..start-1.

    q: (n, heads, head_dim); k, v: (n, kv_heads, head_dim), written into k_cache, v_cache
    (kv_heads, capacity >= start+n, head_dim) at rows start..start+n-1; mask: causal_mask(start, n)
    (computed once per forward by the caller). Grouped-query heads are shared. Returns
    (n, heads * head_dim)."""
    n, heads, head_dim = q.shape
    end = start + n
    k_cache[:, start:end] = k.transpose(0, 1)
    v_cache[:, start:end] = v.transpose(0, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k_cache[None, :, :end],
        v_cache[None, :, :end],
        attn_mask=mask,
        enable_gqa=k.shape[1] != heads,
    )  # (1, heads, n, head_dim)
    return out[0].transpose(0, 1).reshape(n, heads * head_dim)


class _Layer:
    def __init__(self, layer):
        a, m = layer.self_attn, layer.mlp
        self.qkv = fused(a.q_proj, a.k_proj, a.v_proj)
        self.o = fused(a.o_proj)
        self.gate_up = fused(m.gate_proj, m.up_proj)
        self.down = fused(m.down_proj)
        self.norm_in = layer.input_layernorm.weight.detach()
        self.norm_post = layer.post_attention_layernorm.weight.detach()


class LeanModel:
    """The weights of a transformers Llama/Qwen2 model, laid out for decoding one sequence.

    Built from (and sharing the embedding and norms of) a loaded `PreTrainedModel`; the projection
    weights are copies, reordered for oneDNN on CPU (memory: about one more copy of the model's
    linear layers). Raises ValueError naming what is unsupported (see unsupported_reason); use the
    transformers backend for such models.
    """

    batch_invariant = False  # oneDNN picks kernels by the number of rows: the last bits may differ
    row_tile: int | None = None  # input rows per pass over the weights (None: not a tiled kernel)

    def __init__(self, hf):
        reason = unsupported_reason(hf)
        if reason:
            raise ValueError(f"the lean backend cannot run this model: {reason}; use backend='hf'")
        c = hf.config
        self.n_heads, self.n_kv = c.num_attention_heads, c.num_key_value_heads
        self.head_dim, theta = attention_shape(c)
        self.eps = c.rms_norm_eps
        self.hidden_size = c.hidden_size
        self.dtype, self.device = hf.dtype, hf.device
        self.kv_dtype = self.dtype  # the KV cache's
        self.inv_freq = rope_inv_freq(theta, self.head_dim, self.device)
        with torch.no_grad():
            self.embed = hf.get_input_embeddings().weight.detach()
            self.layers = [_Layer(layer) for layer in hf.model.layers]
            self.norm = hf.model.norm.weight.detach()
            out = hf.get_output_embeddings()
            self.output_weight = out.weight.detach()  # (V, d), the transformers model's own
            self.lm_head = Linear(self.output_weight)
            # greedy steps read the output layer in bf16 and recompute only the possible argmaxes
            # (specdec.backends.screen)
            self.screen = ScreenedHead(out.weight.detach()) if out.bias is None and screening_pays(out.weight) else None
        self.rows: dict[int, int] = {}  # forward n new tokens as rows[n] rows (specdec.backends.rows); absent: n
        if self.device.type == "cpu" and weight_bytes(hf) >= rows.TUNE_MIN_BYTES:
            self.rows = rows.tune_rows(self)

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of token ids (n,): (n, hidden) in the model's dtype."""
        return self.embed[ids]

    def output_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (n,) of the output layer's weight: (n, hidden) fp32 (a draft head's vocabulary)."""
        return self.output_weight[ids].float()

    def subset(self, kept: list[int]) -> LeanModel:
        """The same model running only the decoder layers `kept` (layer-skip self-speculation,
        specdec.drafters.layerskip); shares every weight with this one."""
        view = copy.copy(self)
        view.layers = [self.layers[i] for i in kept]
        return view

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm (Zhang & Sennrich 2019), one fused op; statistics in fp32 for low precisions."""
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    def forward_batch(self, requests: list[BatchItem], taps: tuple[int, ...] = ()) -> list[torch.Tensor]:
        """Several sequences' forwards (each a BatchItem of forward's arguments), one after another:
        this backend has no batched kernels; specdec.backends.quant.QuantModel.forward_batch runs
        them as one. Returns each one's logits, as forward."""
        return [self._run(r, taps) for r in requests]

    def forward(
        self,
        ids: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        features: torch.Tensor,
        start: int,
        keep: int,
        tree: tuple[torch.Tensor, torch.Tensor] | None = None,
        taps: tuple[int, ...] = (),
    ) -> torch.Tensor:
        """Run ids (n,) at positions start..start+n-1 over a cache holding positions 0..start-1.

        keys, values: per layer (n_kv_heads, capacity >= start+n, head_dim); features: (capacity,
        hidden x (1 + len(taps))). Rows start..start+n-1 are written: keys, values, and in
        features the final-normed hidden states (what the output layer reads; a feature-level
        draft head, specdec.train.head, reads them too), followed by the hidden states after each
        decoder layer in `taps` (0-based; EAGLE-3's low and middle features). tree: (positions,
        mask) of tree_layout() when ids are a token tree rather than a sequence. Returns logits
        (keep, V) for the last `keep` positions (n for all of them). A sequence of n is run as
        rows[n] rows where that table (specdec.backends.rows) says it is faster. forward_batch
        takes a BatchItem's argmax_only too: logits whose argmax per row is exact but whose other
        entries may be bf16 approximations (the output layer screened in bf16,
        specdec.backends.screen; for greedy decoding)."""
        return self._run(BatchItem(ids, keys, values, features, start, keep, tree=tree), taps)

    @torch.inference_mode()
    def _run(self, item: BatchItem, taps: tuple[int, ...]) -> torch.Tensor:
        """forward() of one BatchItem."""
        ids, features, start, tree = item.ids, item.features, item.start, item.tree
        n, hd = ids.shape[0], self.head_dim
        real = n
        if tree is None and self.rows.get(n, n) > n and start + self.rows[n] <= features.shape[0]:
            n = self.rows[n]  # a faster kernel: filler rows after the real ones, outputs discarded
            ids = torch.cat((ids, ids[-1:].expand(n - real)))
        positions, mask = tree if tree is not None else (None, causal_mask(start, n, self.device))
        cos, sin = rope(self.inv_freq, start, start + n, self.dtype, positions)
        h = F.embedding(ids, self.embed)  # (n, d)
        q_size, kv_size = self.n_heads * hd, self.n_kv * hd
        d = h.shape[-1]
        for i, (layer, k_cache, v_cache) in enumerate(zip(self.layers, item.keys, item.values)):
            qk, v = layer.qkv(self.rms_norm(h, layer.norm_in)).split((q_size + kv_size, kv_size), dim=-1)
            qk = rotate(qk.reshape(n, self.n_heads + self.n_kv, hd), cos, sin)  # q and k heads in one go
            q_heads, k_heads = qk[:, : self.n_heads], qk[:, self.n_heads :]
            attn = cached_attention(
                q_heads, k_heads, v.view(n, self.n_kv, hd), k_cache, v_cache, start=start, mask=mask
            )
            h = h + layer.o(attn)
            gate, up = layer.gate_up(self.rms_norm(h, layer.norm_post)).chunk(2, dim=-1)
            h = h + layer.down(F.silu(gate) * up)
            if i in taps:
                column = d * (1 + taps.index(i))
                features[start : start + n, column : column + d] = h
        h = self.rms_norm(h, self.norm)
        features[start : start + n, :d] = h
        head = self.screen if item.argmax_only and self.screen is not None else self.lm_head
        return head(h[real - item.keep : real])
