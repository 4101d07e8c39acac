"""The bench's records, as results.json holds them (specdec.bench.results): a prompt's (its runs
by config, checked against plain decoding) and a pair's (what ran, the raw measurements, their fit)."""

from __future__ import annotations

from specdec.backends import gemv
from specdec.bench.config import BenchConfig, Pair
from specdec.bench.fit import fit, ratio_noise
from specdec.bench.loading import Models
from specdec.bench.measure import median_run
from specdec.bench.results import PairRecord, parse
from specdec.bench.workloads import Prompt
from specdec.engine import Generation
from specdec.exactness import first_divergence
from specdec.models.load import Model


def prompt_record(
    target: Model, prompt: Prompt, ids: list[int], timed: dict[str, list[Generation]], config: BenchConfig
) -> tuple[dict, list[int]]:
    """A prompt's record (results.PromptRecord, its replay still None) from its generations by config
    (measure.run_configs), each config's by its median run, and plain decoding's output tokens. When
    greedy, every repeat of every k is checked token for token against plain decoding (the first that
    differs gives the divergence)."""
    plain = median_run(timed["plain"])
    runs = {}
    for k in config.ks:
        spec = median_run(timed[str(k)])
        d = {**spec.stats.to_dict(), "decode_tokens_per_s_repeats": _speeds(timed[str(k)])}
        d["identical"], d["divergence"] = None, None
        if config.greedy:
            odd = next((g for g in timed[str(k)] if g.tokens != plain.tokens), spec)
            div = first_divergence(target, ids, plain.tokens, odd.tokens)
            d["identical"], d["divergence"] = div is None, None if div is None else vars(div)
        runs[str(k)] = d
    record = {
        "id": prompt.id,
        "category": prompt.category,
        "prompt_tokens": len(ids),
        "plain": {**plain.stats.to_dict(), "decode_tokens_per_s_repeats": _speeds(timed["plain"])},
        "runs": runs,
        "replay": None,
    }
    return record, plain.tokens


def _speeds(generations: list[Generation]) -> list[float]:
    """Each generation's decode tokens/s, in the order run."""
    return [g.stats.decode_tokens_per_s for g in generations]


def pair_record(
    pair: Pair,
    config: BenchConfig,
    models: Models,
    *,
    draft_precision: str | None,
    costs: dict,
    records: list[dict],
    peer_rows: list[dict],
) -> PairRecord:
    """The typed record of a pair: what ran (precision, kernels, memory), the raw measurements (costs,
    the prompts' records, the peers' rows), and their fit (fit.fit). Raises ValueError naming the
    field that does not fit the schema."""
    target, draft_model = models.target, models.draft_model
    raw = {
        "target": pair.target,
        "drafter": pair.drafter,
        "draft": pair.draft,
        "workload": config.workload,
        "precision": target.precision,
        "draft_precision": draft_precision,
        "draft_vocab": config.draft_vocab,
        "backend": target.backend,
        "device": str(target.device),
        "kernel": kernel(target),
        "draft_kernel": kernel(draft_model),
        "products": kernel(target) if target.gguf is None else None,  # gemv's status, the fp32 lean path's
        "memory": models.memory,
        "draft_memory": models.draft_memory,
        "padded_rows": _padded_rows(target),
        "draft_padded_rows": _padded_rows(draft_model),
        "ratio_noise": ratio_noise(records),
        "costs": costs,
        "prompts": records,
        "peers": peer_rows,
    }
    return parse(PairRecord, {**raw, **fit(raw, config.ks)}, f"bench {pair.target} / {pair.drafter}")


def kernel(model: Model | None) -> str | None:
    """Which kernels ran a model's products, for the results: specdec's batch-invariant quantized
    kernels for a GGUF model run at its own precision (naming GGML types dequantized to fp32 at load,
    if any), gemv's status (specdec.backends.gemv) for the lean backend in fp32 on the CPU, else None
    (transformers' forward, bf16, a GPU: not ours to describe)."""
    if model is None:
        return None
    if model.gguf is not None:
        lean = model.lean()
        return lean.kernel + (f"; {', '.join(lean.fallback)} dequantized to fp32 at load" if lean.fallback else "")
    if model.backend == "lean" and model.device.type == "cpu" and model.precision == "float32":
        return gemv.status()
    return None


def _padded_rows(model: Model | None) -> dict[str, int] | None:
    """The lean backend's row table of a model (specdec.backends.rows): {n: rows a forward of n runs as}."""
    if model is None or model.backend != "lean":
        return None
    return {str(n): m for n, m in model.lean().rows.items()}
