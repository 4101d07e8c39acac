"""The bench's results file: schema, validation, atomic save and load.

Stages are separate (bench -> results.json -> fit -> report and plots); the report and the plots
read only this file and never run a model. Schema `specdec.bench/1`:

    {
      "schema": "specdec.bench/1",
      "created": "2026-11-29T12:00:00+00:00",
      "environment": {"cpu": str, "gpu": str | null, "threads": int, "python": str, "torch": str,
                      "transformers": str, "platform": str, "git_commit": str | null,
                      "memory_bandwidth_gbs": float},   # measured at the start of the run;
                      # git_commit ends in "-dirty" when specdec's files differ from it
      "settings": {"workload": str, "categories": [str], "limit": int, "max_new_tokens": int,
                   "temperature": float, "ks": [int | "auto"], "quick": bool, "repeats": int, "replay": bool,
                   "interleave": bool},   # a repeat's configs ran together, round by round
                   # (specdec.bench.run.run_all); absent in older files, whose configs ran one after another
      "pairs": [{
        "target": str, "drafter": str, "draft": str | null, "workload": str,
        "dtype": str,                   # the target's precision (Model.precision): "float32", "bfloat16",
                                        # or a GGUF file's matrix types run as they are, "gguf Q4_1+Q8_0"
        "precision": str,               # the same (absent in older files, where "dtype" is a torch dtype)
        "backend": "lean" | "hf",       # how the target's (and a draft model's) forwards ran
        "kernel": str | null,           # which kernels ran the target's products: QuantModel.kernel, e.g.
                                        # "specdec quant, int8 activations (AVX512-VNNI), batch-invariant"
                                        # (GGUF at its own precision; "; <types> dequantized to fp32 at load"
                                        # when some were), gemv's status (lean fp32 on CPU), null otherwise
                                        # (absent in older files)
        "device": str,                  # where they ran: "cpu", "cuda:0" (absent in files before it)
        "draft_dtype": str | null,      # a draft model's precision
        "draft_precision": str | null,  # the same; "draft_kernel": str | null, as "kernel" (absent in older files)
        "products": str | null,         # lean fp32 on CPU: which kernels ran the products (specdec.backends.gemv)
        "memory": {                     # resident memory of the target's load (specdec.bench.memory), MB;
          "rss_before_mb": float, "rss_after_mb": float,   # fields null without /proc; absent in older files
          "rss_growth_mb": float,       # after the load and a warm-up forward, minus before
          "peak_rss_mb": float,         # the process's ru_maxrss so far
          "file_mb": float | null,      # GGUF at its own precision: the file's size,
          "file_resident_mb": float | null,   # its pages mapped in, the rest of the growth,
          "other_mb": float | null,     # and the growth per byte of file
          "growth_per_file_byte": float | null},
        "draft_memory": {as "memory"} | null,   # a draft model's load
        "ratio_noise": float | null,    # timing noise (specdec.bench.run.ratio_noise); null under 2 repeats
                                        # (absent in older files)
        "costs": {                      # medians after warm-up, ms
          "context_tokens": int,        # KV length the curve was measured at
          "verify_ms": {"1": float, "2": float, ...},   # V(n): one target forward over n new tokens
          "draft_ms": {"1": float, ...}, # one drafter proposal of k tokens, by k (drafter 1 token behind)
          "draft_catchup_ms": {"1": float, ...}, # the same, 2 tokens behind (after a fully accepted round)
          "overhead_ms": float,         # per round, outside draft and verify (sampling, bookkeeping)
          "roofline": {"weight_mb": float, "bandwidth_gbs": float, "floor_ms": float,  # specdec.bench.roofline
                       "weights": str,  # what weight_mb is: the model's precision (quantized blocks for
                                        # "gguf ..."; absent in older files)
                       "fraction": {"1": float, ...},   # floor_ms / V(n)
                       "screened_output_layer": bool},  # greedy read the output layer in bf16 (specdec.backends.screen)
          "row_cost": {"kernel": "amx" | "vnni" | "fp32", "macs_per_row": int,  # specdec.bench.rowcost;
                       "peak_gmacs": float,
                       "marginal_ms": float, "peak_ms": float, "fraction": float | null} | null  # null off the
                                        # quantized backend (absent in older files)
        },
        "prompts": [{                   # raw measurements, one per prompt
          "id": str, "category": str, "prompt_tokens": int,
          "plain": RunStats.to_dict() + {"decode_tokens_per_s_repeats": [float]},  # median run's stats
          "runs": {"<k>": RunStats.to_dict() + {"identical": bool | null,   # "<k>": "1", ..., "auto"
                                                  "decode_tokens_per_s_repeats": [float],  # every repeat
                                                  "divergence": null | {"position": int,
                                                   "plain_token": int, "other_token": int,
                                                   "logit_gap": float,
                                                   "logit_ulp": float}}},  # absent in older files
          "replay": {"plain" | "<k>": {"decode_tokens_per_s": float, "rounds": int, "drafted": int,
                     "accepted": int, "tau": float, "mean_k": float}}   # specdec.bench.replay: simulated
                     # speeds; absent when not greedy, for a drafter that reads the target's cache,
                     # with --no-replay, and in older files
        }],
        "peers": [{"name": str, "prompt_id": str, "tokens_per_s": float, "identical": bool | null,
                   "error": str | null,
                   # absent in older files and in failed runs' rows:
                   "decode_tokens_per_s": float | null,   # after the first new token (llama.cpp)
                   "agreement": float | null,   # share of our plain output reproduced before the first difference
                   "weights": str, "same_weights": bool,   # what the peer ran; whether it is what we ran
                   "rss_growth_mb": float | null,   # its load's resident memory (llama.cpp, first prompt)
                   "n_ctx": int | null}],           # llama.cpp's context (its KV cache)
        "configs": [{                   # the fit: one per k, over all prompts
          "k": int | "auto", "alpha": float, "tau": float, "acceptance_per_position": [float],
          "mean_k": float,              # tokens drafted per round, mean over prompts
          "speedup": {"median": float, "min": float, "max": float, "q1": float, "q3": float},
          "identical": [int, int],      # [identical prompts, prompts] (greedy only)
          "predicted": {"textbook": float, "ours": float},
          "error": {"textbook": float, "ours": float},   # median over prompts of (predicted - measured) / measured
          "by_category": {"<category>": {"alpha": float, "tau": float, "speedup": float}},
          "replayed": {"speedup": {as above}, "tau": float,      # when the prompts have "replay"
                       "by_category": {"<category>": {"speedup": float}}}
        }],
        "best_k": {"measured": int, "textbook": int, "ours": int},   # among the fixed k
        "auto": null | {"vs_best_fixed": float, "best_fixed_k": int,   # k = "auto", when run:
                        "worst_category": str, "worst_category_vs_plain": float,
                        "vs_best_fixed_by_category": {"<category>": float},  # over that category's best
                        "replayed": null | {the same fields, from the replayed speed-ups}},
        "peer_summary": [{"name": str, "vs_plain": float, "vs_speculative": float, "identical": [int, int],
                          # absent in older files:
                          "decode_vs_plain": float | null, "agreement": float | null (mean over prompts),
                          "weights": str | null, "same_weights": bool | null, "rss_growth_mb": float | null,
                          "n_ctx": int | null}]
      }]
    }

Speeds are decode-only tokens/s (prefill excluded: it is the same forward in every
configuration); a speed-up is the median over prompts of (speculative / plain) measured in the
same run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from specdec.models.weights import atomic_write

SCHEMA = "specdec.bench/1"

_REQUIRED = {
    "top": ["schema", "created", "environment", "settings", "pairs"],
    "environment": ["cpu", "gpu", "threads", "python", "torch", "transformers", "platform", "git_commit"],
    "settings": ["workload", "categories", "limit", "max_new_tokens", "temperature", "ks", "quick"],
    "pair": ["target", "drafter", "draft", "dtype", "workload", "costs", "prompts", "peers", "configs", "best_k"],
    "costs": ["context_tokens", "verify_ms", "draft_ms", "overhead_ms"],
    "prompt": ["id", "category", "prompt_tokens", "plain", "runs"],
    "config": [
        "k",
        "alpha",
        "tau",
        "acceptance_per_position",
        "speedup",
        "identical",
        "predicted",
        "error",
        "by_category",
    ],
}


def k_order(k: int | str) -> tuple[int, int]:
    """Sort key for draft lengths: the fixed k ascending, then "auto"."""
    return (1, 0) if k == "auto" else (0, int(k))


def validate(results: dict) -> None:
    """Raise ValueError naming the first missing field or wrong schema version."""

    def need(obj: dict, kind: str, where: str) -> None:
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: expected an object, got {type(obj).__name__}")
        for key in _REQUIRED[kind]:
            if key not in obj:
                raise ValueError(f"{where}: missing field {key!r}")

    need(results, "top", "results")
    if results["schema"] != SCHEMA:
        raise ValueError(f"results schema is {results['schema']!r}; this version of specdec reads {SCHEMA!r}")
    need(results["environment"], "environment", "environment")
    need(results["settings"], "settings", "settings")
    for i, pair in enumerate(results["pairs"]):
        need(pair, "pair", f"pairs[{i}]")
        need(pair["costs"], "costs", f"pairs[{i}].costs")
        for j, prompt in enumerate(pair["prompts"]):
            need(prompt, "prompt", f"pairs[{i}].prompts[{j}]")
        for j, config in enumerate(pair["configs"]):
            need(config, "config", f"pairs[{i}].configs[{j}]")


def save(results: dict, path: str | os.PathLike) -> Path:
    """Validate, then write atomically (temporary file, then rename)."""
    validate(results)

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(results, f, indent=1)

    return atomic_write(path, write)


def load(path: str | os.PathLike) -> dict:
    """Read and validate a results file; raises ValueError on a bad one."""
    try:
        results = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read results file {path}: {e}") from e
    validate(results)
    return results
