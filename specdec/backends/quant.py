"""The quantized decode path: a Llama/Qwen2 forward over GGUF weights kept in their 4-8 bit blocks,
every op batch-invariant.

Decoding on a CPU is bound by reading the weights. A GGUF file's blocks (Q4_1, Q4_K, ...) are 4-7x
fewer bytes than their fp32 dequantization, so this forward multiplies them directly with
specdec's kernels (specdec/backends/csrc/quant.cpp), decoding each block in registers, with int8
activations where the CPU has AVX2 or AVX512-VNNI. Every op of
the forward (products, RMSNorm, rotary embedding, attention, SwiGLU, the output layer) gives row i
of an n-row call the bits of a one-row call, for any n and any thread count; so one forward over
k+1 tokens equals k+1 one-token forwards bit for bit, and greedy speculative decoding equals plain
greedy decoding by construction, for every drafter, k and token tree (docs/quantized.md).

It has the interface of specdec.backends.lean.LeanModel (forward, subset, the cache's shapes), so
the engine, the KV cache and rollback are the same. Tensors of a GGML type the kernels do not
handle are dequantized to fp32 at load, said once on stderr, and run through the same kernels.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from types import SimpleNamespace

import torch

from specdec.backends.arch import ARCHS, plan
from specdec.backends.lean import BatchItem
from specdec.backends.qscreen import ScreenedHead

SUPPORTED = tuple(ARCHS)
# The KV cache's dtypes, the default first: fp16 halves the bytes attention reads (measured in
# docs/quantized.md); every element widens to fp32 exactly, so the forward stays batch-invariant.
KV_DTYPES = (torch.float16, torch.float32)


class QuantLinear:
    """y = x W^T + b for W the row-wise concatenation of GGUF matrices (`parts`, each a
    specdec.models.gguf.QTensor with K columns) and b the concatenation of their biases (fp32 or
    None). x: (n, K) fp32 -> (n, sum of rows). No copy of the weights is made, except of parts
    dequantized to fp32 because the kernels do not handle their type, and, with int8 activations
    (`int8`) and `repack`, of the quantized parts of a matrix whose parts' rows all come in
    sixteens, regrouped sixteen rows at a time for the faster kernels (F32 parts go a row at a
    time). mapped(tensor) says whether a part lies in a file's memory map; the pages of a
    regrouped part that does are released. `raw` keeps the parts as given (for dequantize_rows)."""

    def __init__(
        self,
        parts,
        biases=None,
        fallback: set[str] | None = None,
        int8: bool = False,
        repack: bool = True,
        mapped: Callable[[torch.Tensor], bool] | None = None,
    ):
        from specdec.backends.qkernel import TYPES, kernels

        self.kernels = kernels()
        self.matmul = self.kernels.matmul
        self.int8 = int8

        self.data, self.types = [], []
        for p in parts:
            if p.qtype in TYPES:
                self.data.append(p.data)
                self.types.append(TYPES[p.qtype])
            else:
                if fallback is not None:
                    fallback.add(p.qtype)
                self.data.append(p.dequantize().float().contiguous().view(torch.uint8))
                self.types.append(TYPES["F32"])
        self.raw, self.raw_types = list(self.data), list(self.types)
        self.in_features = parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in parts)
        if int8 and repack and all(p.shape[0] % 16 == 0 for p in parts):
            for i, t in enumerate(self.types):
                regrouped = self.kernels.repack(self.data[i], t, self.in_features)
                if regrouped is None:  # F32 goes a row at a time
                    continue
                self.data[i], self.types[i] = regrouped
                if mapped is not None and mapped(self.raw[i]):  # its file pages: no longer read
                    self.kernels.release(self.raw[i])
        self.bias = None
        if biases is not None and any(b is not None for b in biases):
            self.bias = torch.cat(
                [b if b is not None else torch.zeros(p.shape[0]) for p, b in zip(parts, biases)]
            ).float()
        self.nbytes = sum(d.numel() for d in self.data)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.data, self.types, self.bias, self.int8)

    def select(self, ids: torch.Tensor) -> QuantLinear:
        """Rows `ids` (n,) of this one-part matrix as a QuantLinear of their own (their blocks copied
        from the raw part, in its type; these activations); no bias. Raises ValueError for a matrix
        of several parts."""
        from specdec.backends.qkernel import TYPES

        if len(self.raw) != 1:
            raise ValueError("select() takes rows of a one-part matrix (an output layer)")
        names = {v: k for k, v in TYPES.items()}
        rows = self.raw[0].index_select(0, ids.long().cpu())
        part = SimpleNamespace(qtype=names[self.raw_types[0]], shape=(len(rows), self.in_features), data=rows)
        return QuantLinear([part], int8=self.int8)  # part: the fields QuantLinear reads of a QTensor


def layer_weights(
    norm_in, norm_post, qkv: QuantLinear, o: QuantLinear, gate_up: QuantLinear, down: QuantLinear, **arch
):
    """The kernels' Layer (one decoder layer's weights for `layers` and `head_step`): the norms'
    weights (d,) fp32 (norm_in empty: no input norm, as an EAGLE-1 head's layer) and the four
    products; `arch`: the Layer's keywords for what differs from Llama's layer (q_norm, k_norm,
    attn_out_norm, ffn_out_norm, rope, window, gelu, scale, residual; quant/layers.h)."""
    return qkv.kernels.Layer(
        norm_in=norm_in,
        norm_post=norm_post,
        qkv=qkv.data,
        qkv_types=qkv.types,
        qkv_bias=qkv.bias,
        o=o.data,
        o_types=o.types,
        gate_up=gate_up.data,
        gate_up_types=gate_up.types,
        down=down.data,
        down_types=down.types,
        **arch,
    )


class OutputRows:
    """The rows `ids` (n,) of an output layer (a QuantLinear), as an output layer of width V:
    x (m, d) -> (m, V) logits, -inf outside ids. Reads n rows' blocks instead of V."""

    def __init__(self, full: QuantLinear, ids: torch.Tensor, V: int):
        self.ids, self.V = ids.long().cpu(), V
        self.rows = full.select(self.ids)
        self.raw, self.raw_types = full.raw, full.raw_types  # dequantize_rows reads the whole layer's
        self.in_features, self.out_features, self.nbytes = full.in_features, len(self.ids), self.rows.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_full((x.shape[0], self.V), float("-inf")).index_copy_(1, self.ids, self.rows(x))


class _Layer:
    """Decoder layer i of a GGUF file's tensors t, as its Plan says (specdec.backends.arch), for the kernels."""

    def __init__(self, t: dict, i: int, plan, fallback: set[str], int8: bool, mapped):
        arch = plan.arch

        def get(name):
            return t[f"blk.{i}.{name}"]

        def vector(name):
            return get(name).data.float().contiguous() if f"blk.{i}.{name}" in t else torch.empty(0)

        def linear(names, biases=None):
            return QuantLinear([get(f"{n}.weight") for n in names], biases, fallback, int8, mapped=mapped)

        if arch.fused:  # Phi-3: attn_qkv holds q, k and v; ffn_up holds the gate then the up projection
            self.qkv, self.gate_up = linear(["attn_qkv"]), linear(["ffn_up"])
        else:
            biases = [
                t[f"blk.{i}.{n}.bias"].data if f"blk.{i}.{n}.bias" in t else None
                for n in ("attn_q", "attn_k", "attn_v")
            ]
            self.qkv = linear(["attn_q", "attn_k", "attn_v"], biases)
            self.gate_up = linear(["ffn_gate", "ffn_up"])
        self.o, self.down = linear(["attn_output"]), linear(["ffn_down"])
        self.norm_in, self.norm_post = vector("attn_norm.weight"), vector("ffn_norm.weight")
        self.weights = layer_weights(
            self.norm_in, self.norm_post, self.qkv, self.o, self.gate_up, self.down,
            q_norm=vector("attn_q_norm.weight"), k_norm=vector("attn_k_norm.weight"),
            attn_out_norm=vector("post_attention_norm.weight"), ffn_out_norm=vector("post_ffw_norm.weight"),
            rope=plan.layer_rope[i], window=plan.layer_window[i], gelu=arch.gelu, scale=plan.attn_scale,
            residual=plan.residual_scale,
        )  # fmt: skip


class QuantModel:
    """A GGUF model (specdec.models.gguf.GGUFModel) of an architecture in specdec.backends.arch.ARCHS,
    laid out for the batch-invariant quantized forward as its description says (`plan`; `config`,
    the transformers config, is not read). Memory: the weights are the memory-mapped file's blocks,
    except interleaved q and k rows (un-permuted) and, with VNNI's int8 activations, the quantized
    matrices regrouped sixteen rows at a time (their file pages released). activations: "int8" rounds
    each input row of a product to int8 per block and multiplies with integer dot products
    (AVX512-VNNI or AVX2; as llama.cpp does), "fp32" multiplies fp32 inputs with the dequantized
    weights (the --dtype float32 model's logits up to rounding), "auto" int8 where the CPU has either.
    kv_dtype: the KV cache's, one of KV_DTYPES (None: the first, fp16). Raises GGUFError (a
    ValueError) for a file its architecture's description does not fully read (specdec.backends.arch.plan),
    ValueError for int8 asked of a CPU without AVX2 or another kv_dtype."""

    dtype = torch.float32
    device = torch.device("cpu")
    batch_invariant = True  # a row's bits never depend on the other rows of its forward
    screen = None  # no bf16 screen (specdec.backends.screen); a Q8_0 output layer has its own (greedy_head)

    def __init__(self, gguf, config=None, activations: str = "auto", kv_dtype: torch.dtype | None = None):
        from specdec.backends.qkernel import kernels

        self.plan = plan(gguf)  # the architecture's description applied to this file; refuses what it cannot run
        self.kernels = kernels()
        if activations not in ("auto", "int8", "fp32"):
            raise ValueError(f"activations must be 'auto', 'int8' or 'fp32', not {activations!r}")
        if activations == "int8" and not self.kernels.int8_available():
            raise ValueError("int8 activations need a CPU with AVX2 or AVX512-VNNI; use activations='fp32'")
        self.int8 = activations == "int8" or (activations == "auto" and self.kernels.int8_available())
        self.row_tile = self.kernels.row_tile()  # input rows per pass over the weights: a further tile reads them again
        if kv_dtype not in (None, *KV_DTYPES):
            raise ValueError(f"kv_dtype must be torch.float16 or torch.float32, not {kv_dtype!r}")
        self.kv_dtype = kv_dtype or KV_DTYPES[0]  # keys and values are rounded to it as they are written
        self.rows: dict[int, int] = {}  # never padded: a forward's cost is its own (specdec.backends.rows)
        p = self.plan
        self.n_heads, self.n_kv, self.hidden_size, self.head_dim, self.eps = (
            p.n_heads,
            p.n_kv,
            p.hidden,
            p.head_dim,
            p.eps,
        )
        self.inv_freq = p.ropes[0]  # the global layers' rotary frequencies
        t = gguf.tensors
        fallback: set[str] = set()
        self.embed_tensor = t["token_embd.weight"]
        self.layers = [_Layer(t, i, p, fallback, self.int8, gguf.mapped) for i in range(p.n_layers)]
        self.norm = t["output_norm.weight"].data.float().contiguous()
        self.lm_head = QuantLinear(
            [t.get("output.weight", self.embed_tensor)], None, fallback, self.int8, mapped=gguf.mapped
        )
        # the input embedding: rows gathered (embed_rows, a head's step), never multiplied
        self.embedding = QuantLinear([self.embed_tensor], None, fallback, repack=False)
        self.vocab_size = self.embed_tensor.shape[0]
        if fallback:
            print(
                f"{gguf.path.name}: GGML types {', '.join(sorted(fallback))} are dequantized to fp32 at load "
                f"(specdec's kernels multiply {', '.join(_kernel_types())} in their blocks)",
                file=sys.stderr,
            )
        self.fallback = sorted(fallback)

    @property
    def greedy_head(self) -> ScreenedHead | None:
        """The output layer's 4-bit screen for one-row greedy forwards (specdec.backends.qscreen), built
        at first use; None where it does not apply (not a Q8_0 QuantLinear, e.g. a draft's vocabulary
        cut; fp32 activations; a negative logit scale)."""
        applies = isinstance(self.lm_head, QuantLinear) and self.plan.logit_scale > 0
        return ScreenedHead.of(self.lm_head) if applies else None

    @property
    def kernel(self) -> str:
        """What multiplies the matrices, for the bench's results."""
        isa = {"vnni": "AVX512-VNNI", "avx2": "AVX2"}.get(self.kernels.int8_kernels())
        activations = f"int8 activations ({isa})" if self.int8 else "fp32 activations"
        kv = "fp16" if self.kv_dtype == torch.float16 else "fp32"
        return f"specdec quant, {activations}, {kv} KV cache, batch-invariant"

    def embed_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of token ids (n,): (n, hidden) fp32, dequantized from the file and
        times the architecture's embedding scale (Gemma's sqrt(d), Granite's multiplier)."""
        rows = self.kernels.dequantize_rows(self.embedding.raw[0], self.embedding.raw_types[0], self.hidden_size, ids)
        return rows if self.plan.embed_scale == 1.0 else rows.mul_(self.plan.embed_scale)

    def output_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (n,) of the output layer's weight, dequantized: (n, hidden) fp32 (a draft head's
        vocabulary)."""
        return self.kernels.dequantize_rows(self.lm_head.raw[0], self.lm_head.raw_types[0], self.hidden_size, ids)

    def macs_per_row(self) -> int:
        """Multiply-adds one row (one token) of a forward does in the matrices, the output layer
        included: the sum of their rows times columns."""
        matrices = [m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        return sum(m.out_features * m.in_features for m in matrices + [self.lm_head])

    def weight_bytes(self) -> int:
        """Bytes of weights one forward reads: every matrix in its blocks, the output layer included,
        the embedding table not (a forward gathers only its n rows), except when it is the output layer."""
        layers = sum(m.nbytes for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down))
        return layers + self.lm_head.nbytes

    def subset(self, kept: list[int]) -> QuantModel:
        """The same model running only the decoder layers `kept` (layer-skip self-speculation); shares
        every weight with this one."""
        view = copy.copy(self)
        view.layers = [self.layers[i] for i in kept]
        return view

    def with_output_rows(self, ids: torch.Tensor) -> QuantModel:
        """The same model with an output layer of only the rows `ids` (n,) (a draft's vocabulary,
        specdec.drafters.vocab): logits keep their width V, -inf outside ids; those rows' blocks are
        copied, every other weight is shared."""
        view = copy.copy(self)
        view.lm_head = OutputRows(self.lm_head, ids, self.vocab_size)
        return view

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
        """As specdec.backends.lean.LeanModel.forward (same arguments, same cache layout), with
        batch-invariant ops: row i of the returned logits (keep, V) has the bits the same token
        would get from a forward over fewer or more new tokens. It is forward_batch over one request
        (whose BatchItem.argmax_only, with keep 1, makes the row's argmax, the first on ties, and its
        entry the full output layer's bits, the other entries approximations: greedy_head)."""
        return self.forward_batch([BatchItem(ids, keys, values, features, start, keep, tree=tree)], taps)[0]

    @torch.inference_mode()
    def forward_batch(self, requests: list[BatchItem], taps: tuple[int, ...] = ()) -> list[torch.Tensor]:
        """Several requests' new tokens in one forward (continuous batching): each BatchItem is one
        request's arguments of `forward` (its own KV cache, start and tree); taps as in `forward`,
        written to each request's features. The products run over every request's rows at once,
        the attention of each request over its own cache. Returns each request's logits (keep, V),
        with the bits a forward of it alone would give, whatever else is in the batch (the kernels
        are batch-invariant). Raises ValueError for an empty batch."""
        if not requests:
            raise ValueError("forward_batch needs at least one request")
        k = self.kernels
        layout = [
            r.tree if r.tree is not None else (torch.arange(r.start, r.start + len(r.ids)), None) for r in requests
        ]  # positions (n,) and mask (n, start + n), or None: causal, which the kernels follow without a mask
        positions = _cat([positions for positions, _ in layout])
        ropes = [k.rope_table(positions, inv_freq) for inv_freq in self.plan.ropes]  # shared by the layers
        if self.plan.rope_scale != 1.0:  # Phi-3's long-rope attention factor: cos and sin scaled, elementwise
            ropes = [table.mul_(self.plan.rope_scale) for table in ropes]
        windows = [_window_mask(r.start, pos, mask, self.plan.window) for r, (pos, mask) in zip(requests, layout)]
        h = self.embed_rows(_cat([r.ids for r in requests]))  # (rows, d)
        counts = [len(r.ids) for r in requests]
        h = k.layers(
            h=h,
            stack=[layer.weights for layer in self.layers],
            keys=[r.keys for r in requests],
            values=[r.values for r in requests],
            starts=[r.start for r in requests],
            counts=counts,
            ropes=ropes,
            masks=[mask for _, mask in layout],
            windows=windows,
            H=self.n_heads,
            eps=self.eps,
            int8=self.int8,
            taps=list(taps),
            features=[r.features for r in requests],
        )
        h = k.rms_norm(h, self.norm, self.eps)
        d, kept, offset = h.shape[1], [], 0
        for r, n in zip(requests, counts):
            r.features[r.start : r.start + n, :d] = h[offset : offset + n]
            kept.append(h[offset + n - r.keep : offset + n])
            offset += n
        logits = self._output_layer(kept, [r.argmax_only for r in requests])
        if self.plan.logit_scale != 1.0:  # Granite: elementwise, so each row keeps its bits
            logits.mul_(self.plan.logit_scale)
        return list(logits.split([r.keep for r in requests]))

    def _output_layer(self, kept: list[torch.Tensor], argmax_only: list[bool]) -> torch.Tensor:
        """The logits (sum of rows, V) of each request's kept rows (n_i, d): through greedy_head for a
        request that reads only the argmax of one row (a decode step: the screen reads fewer bytes,
        which pays while one row leaves the product bound by memory; several rows share the full
        layer's bytes), else the full output layer. Per request, so its logits never depend on the
        rest of the batch."""
        screened = [a and len(h) == 1 for h, a in zip(kept, argmax_only)]
        head = self.greedy_head if any(screened) else None
        if head is None or all(screened):
            return (head or self.lm_head)(_cat(kept))
        return torch.cat([(head if s else self.lm_head)(h) for h, s in zip(kept, screened)])


def _window_mask(start: int, positions: torch.Tensor, mask: torch.Tensor | None, window: int) -> torch.Tensor | None:
    """The mask (n, start + n) of a sliding-window layer for one request's new rows at `positions` (n,)
    over its cache, whose first `start` keys sit at positions 0..start-1: what `mask` (None: causal)
    lets a row see, less every key `window` or more positions behind it (llama.cpp's standard sliding
    window). None when it hides nothing more (no window, or no row that far from position 0)."""
    if not window or int(positions.max()) < window:
        return None
    n = len(positions)
    key_positions = torch.cat([torch.arange(start), positions])
    seen = mask if mask is not None else torch.ones(n, start + n, dtype=torch.bool).tril(start)
    return seen & (positions[:, None] - key_positions[None, :] < window)


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat, without its copy for the one request of a plain forward (the decode loop's case)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _kernel_types() -> list[str]:
    from specdec.backends.qkernel import TYPES

    return [name for name in TYPES if name != "F32"]
