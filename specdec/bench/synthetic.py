"""How the gain of a draft grows with the target, on paper: GGUF files with the shapes of larger
Qwen2.5 models and the type mix of a real Q4_K_M file, their weights random (a forward's time does
not depend on the values), timed on this CPU.

For each size: the verify-cost curve V(n) (one forward over n new tokens on a KV cache of `context`
tokens, specdec.bench.measure.measure_costs) and a real draft's step against it, c = draft step / V(1);
then the cost model (Leviathan et al. 2023, with V(k+1) measured instead of assumed equal to V(1))
turns them, with an acceptance rate alpha measured on the real pair, into a predicted decoding
speed-up per draft length: E(k) / (V(k+1)/V(1) + k c), E(k) = (1 - alpha^(k+1)) / (1 - alpha).

    python -m specdec.bench.synthetic --sizes 1.5b,3b,7b --alpha 0.8

The files share the real file's metadata (tokenizer included), so the real 0.5B draft pairs with
them. They are written once to <cache>/synthetic/ (a 7B file is 4.7 GB) and reused.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec.models.weights import atomic_write, cache_dir


@dataclass(frozen=True)
class Shape:
    """A qwen2 model's shape: layers, hidden size d, feed-forward size, query and key/value heads."""

    layers: int
    d: int
    ff: int
    heads: int
    kv_heads: int


# Qwen2.5 configurations (their config.json); the vocabulary is the template file's.
SHAPES = {
    "1.5b": Shape(28, 1536, 8960, 12, 2),
    "3b": Shape(36, 2048, 11008, 16, 2),
    "7b": Shape(28, 3584, 18944, 28, 4),
}
TEMPLATE = "qwen2.5-coder-1.5b"  # whose metadata and per-layer types the synthetic files copy
SCALE = np.float16(2.0**-10).tobytes()  # every block's scale: small, so that no activation overflows


def _types(template) -> tuple[dict[str, str], dict[int, dict[str, str]]]:
    """The template's GGML type names: of its global tensors by name, and per layer of its blocks' by
    the tensor's name within the block."""
    top, layers = {}, {}
    for t in template.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk":
            layers.setdefault(int(parts[1]), {})[".".join(parts[2:])] = t.tensor_type.name
        else:
            top[t.name] = t.tensor_type.name
    return top, layers


def _block_tensors(s: Shape) -> dict[str, tuple[int, int]]:
    """A qwen2 block's tensors: name -> (rows, columns); a vector has 1 row."""
    kv = s.d // s.heads * s.kv_heads
    return {
        "attn_norm.weight": (1, s.d),
        "attn_q.weight": (s.d, s.d),
        "attn_q.bias": (1, s.d),
        "attn_k.weight": (kv, s.d),
        "attn_k.bias": (1, kv),
        "attn_v.weight": (kv, s.d),
        "attn_v.bias": (1, kv),
        "attn_output.weight": (s.d, s.d),
        "ffn_norm.weight": (1, s.d),
        "ffn_gate.weight": (s.ff, s.d),
        "ffn_up.weight": (s.ff, s.d),
        "ffn_down.weight": (s.d, s.ff),
    }


def _data(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of GGML type `kind` for a rows x cols matrix (uint8, (rows, bytes a row)), their
    scales set to SCALE; F32 vectors are ones (norms) or zeros (biases: `kind` F32Z)."""
    import gguf

    if kind in ("F32", "F32Z"):
        return (np.ones if kind == "F32" else np.zeros)((rows, cols), dtype=np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    per_block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // per_block, block_bytes), dtype=np.uint8)
    scale = np.frombuffer(SCALE, dtype=np.uint8)
    if kind == "Q6_K":  # d is the block's last field
        blocks[..., -2:] = scale
    elif kind in ("Q4_K", "Q5_K", "Q2_K"):  # d and dmin lead
        blocks[..., 0:2] = scale
        blocks[..., 2:4] = scale
    elif kind in ("Q8_0", "Q4_0", "Q5_0"):
        blocks[..., 0:2] = scale
    else:
        raise ValueError(f"no synthetic blocks of type {kind}")
    return blocks.reshape(rows, -1)


def synthetic_file(size: str, cache=None) -> Path:
    """The synthetic GGUF file of Qwen2.5 size `size` (a key of SHAPES) in <cache>/synthetic/, written
    by write_synthetic from the pulled TEMPLATE at the first call. Raises ValueError for an unknown
    size, or when TEMPLATE is not pulled (`specdec models pull qwen2.5-coder-1.5b`)."""
    from specdec.models.registry import REGISTRY
    from specdec.models.weights import gguf_path, is_pulled

    if size not in SHAPES:
        raise ValueError(f"unknown size {size!r}; known: {', '.join(SHAPES)}")
    path = cache_dir(cache) / "synthetic" / f"qwen2.5-{size}-synthetic-q4_k_m.gguf"
    if not path.is_file():
        if not is_pulled(TEMPLATE, cache_dir(cache)):
            raise ValueError(f"the synthetic files copy {TEMPLATE}'s metadata: `specdec models pull {TEMPLATE}` first")
        path.parent.mkdir(parents=True, exist_ok=True)
        write_synthetic(path, gguf_path(REGISTRY[TEMPLATE], cache_dir(cache)), SHAPES[size])
    return path


def write_synthetic(path: Path, template: Path, shape: Shape) -> Path:
    """Write a qwen2 GGUF file of this shape at `path` (atomically): the template's metadata (its
    tokenizer included) with the shape's sizes, each layer's GGML types those of the template's layer
    at the same relative depth, the template's vocabulary and global types (no output layer where it
    ties it to the embeddings), random blocks with small scales. Returns the path."""
    import gguf

    reader = gguf.GGUFReader(str(template))
    s, vocab = shape, _vocab(reader)
    top, layer_types = _types(reader)
    arch = "qwen2"
    hyper = {
        f"{arch}.block_count": s.layers,
        f"{arch}.embedding_length": s.d,
        f"{arch}.feed_forward_length": s.ff,
        f"{arch}.attention.head_count": s.heads,
        f"{arch}.attention.head_count_kv": s.kv_heads,
        f"{arch}.attention.key_length": s.d // s.heads,
        f"{arch}.attention.value_length": s.d // s.heads,
    }
    tensors = [("token_embd.weight", (vocab, s.d), top["token_embd.weight"])]
    for i in range(s.layers):
        like = layer_types[min(len(layer_types) - 1, round(i * len(layer_types) / s.layers))]
        for name, size in _block_tensors(s).items():
            kind = like[name] if size[0] > 1 else ("F32Z" if name.endswith("bias") else "F32")
            tensors.append((f"blk.{i}.{name}", size, kind))
    tensors.append(("output_norm.weight", (1, s.d), "F32"))
    if "output.weight" in top:
        tensors.append(("output.weight", (vocab, s.d), top["output.weight"]))

    def write(tmp: Path) -> None:
        writer = gguf.GGUFWriter(str(tmp), arch=arch)
        for key, field in reader.fields.items():
            if key.startswith("GGUF.") or key == "general.architecture":
                continue
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, hyper.get(key, field.contents()), vtype, sub_type=sub)
        rng = np.random.default_rng(0)
        for name, (rows, cols), kind in tensors:
            data = _data(kind, rows, cols, rng)
            raw = None if kind.startswith("F32") else gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, data if raw else data.reshape(cols) if rows == 1 else data, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    return atomic_write(path, write)


def _vocab(template) -> int:
    for t in template.tensors:
        if t.name == "token_embd.weight":
            return int(t.shape[1])
    raise ValueError("the template has no token_embd.weight")


def predicted_speedup(alpha: float, k: int, verify_ratio: float, c: float) -> float:
    """E(k) / (verify_ratio + k c): the decoding speed-up of drafts of k tokens accepted at rate
    alpha each, a verify of k+1 tokens costing verify_ratio = V(k+1)/V(1) plain steps and a draft
    step c plain steps (Leviathan et al. 2023, Section 3.4, with V(k+1) measured)."""
    tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (verify_ratio + k * c)


def main(argv: list[str] | None = None) -> int:
    """Time each size's verify-cost curve and the draft's step on it; print the table."""
    import torch

    from specdec.bench.measure import measure_costs
    from specdec.drafters import ModelDrafter
    from specdec.models.load import load_model

    p = argparse.ArgumentParser(prog="python -m specdec.bench.synthetic", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1.5b,3b,7b", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b", help="the draft model whose step c is timed")
    p.add_argument("--alpha", type=float, default=0.8, help="acceptance rate measured on the real pair")
    p.add_argument("--k-max", type=int, default=8)
    p.add_argument("--context", type=int, default=256, help="KV cache length the costs are timed at")
    p.add_argument("--cache-dir")
    args = p.parse_args(argv)
    draft = load_model(args.draft, cache=args.cache_dir)
    print(f"# {torch.get_num_threads()} threads; alpha {args.alpha}; draft {args.draft}", file=sys.stderr)
    print(f"| target | V(1) ms | V(k+1)/V(1), k = 1..{args.k_max} | c | predicted speed-up by k | best |")
    print("|---|---:|---|---:|---|---:|")
    for size in args.sizes.split(","):
        target = load_model(str(synthetic_file(size, args.cache_dir)), cache=args.cache_dir)
        drafter = ModelDrafter(draft, window=None)
        context = draft.encode("def f(x):\n    return x + 1\n" * 200)[: args.context]
        costs = measure_costs(target, drafter, context, list(range(1, args.k_max + 1)), repeats=5)
        v = {int(n): ms for n, ms in costs["verify_ms"].items()}
        c = (costs["draft_ms"][str(args.k_max)] - costs["draft_ms"]["1"]) / (args.k_max - 1) / v[1]
        ratios = [v[k + 1] / v[1] for k in range(1, args.k_max + 1)]
        gains = [predicted_speedup(args.alpha, k, r, c) for k, r in zip(range(1, args.k_max + 1), ratios)]
        best = max(range(len(gains)), key=gains.__getitem__)
        print(
            f"| Qwen2.5-{size} shape, {target.precision} | {v[1]:.0f} | {' '.join(f'{r:.2f}' for r in ratios)} | "
            f"{c:.2f} | {' '.join(f'{g:.2f}' for g in gains)} | k = {best + 1}: {gains[best]:.2f}x |",
            flush=True,
        )
        del target
    return 0


if __name__ == "__main__":
    sys.exit(main())
