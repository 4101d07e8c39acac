"""`specdec kernels`: the quantized backend's products, one GGML type at a time, against the CPU.

For each type a matrix of random blocks (finite fp16 scales, every other byte random) larger than
the last-level cache, laid out as a model's load lays it out (regrouped sixteen rows at a time for
the int8 path); one product over M input rows is timed for M = 1, 2, 4, 8, 9, interleaved round
by round, the fastest of the rounds kept (another process only slows a round down). Reported per
type: V(1) and the GB/s it streams the weights at, V(M)/V(1), and an added row's cost (the slope
over M) as multiply-adds per second and as a share of the product instruction's peak measured in
the same run (specdec.bench.rowcost). This is the measurement the kernels are tuned by.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from specdec.bench.rowcost import fit_slope, peak_macs_per_s, product_kernel

# where each type the kernels multiply keeps its fp16 fields in a block (ggml-common.h); sizes from gguf
FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}


def block_size(qtype: str) -> tuple[int, int]:
    """(elements, bytes) of one block of `qtype` (gguf's GGML_QUANT_SIZES)."""
    return GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]


DEFAULT_TYPES = ("Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_0")  # what the registry's files hold
ROWS = (1, 2, 4, 8, 9)


def random_matrix(qtype: str, rows: int, K: int, seed: int = 0) -> torch.Tensor:
    """(rows, K / block * bytes) uint8 blocks of `qtype`: random bytes, fp16 fields finite (|x| < 0.02)."""
    block, nbytes = block_size(qtype)
    g = np.random.default_rng(seed)
    raw = g.integers(0, 256, (rows, K // block, nbytes), dtype=np.uint8)
    for at in FP16_FIELDS[qtype]:
        raw[..., at : at + 2] = g.uniform(-0.02, 0.02, (rows, K // block, 1)).astype(np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))


def measure(qtype: str, K: int = 1536, megabytes: int | None = None, rounds: int = 9, int8: bool = True) -> dict:
    """One type's row: {"type", "rows", "K", "mb", "v1_ms", "gbs", "ratio": {M: V(M)/V(1)},
    "marginal_ms", "gmacs"} (gmacs: G multiply-adds per second of an added row). megabytes: the
    matrix's size, by default four times the last-level cache (at least 64 MB)."""
    from specdec.backends.qkernel import TYPES, kernels
    from specdec.bench.roofline import last_level_cache_bytes

    k = kernels()
    block, nbytes = block_size(qtype)
    size = megabytes or max(64, 4 * last_level_cache_bytes() // 2**20)
    rows = max(16, int(size * 2**20 / (K // block * nbytes)) // 16 * 16)
    raw = random_matrix(qtype, rows, K)
    part, kind = raw, TYPES[qtype]
    regrouped = k.repack(raw, kind, K) if int8 else None
    if regrouped is not None:  # as a model's load lays it out
        part, kind = regrouped
    inputs = {m: torch.randn(m, K, generator=torch.Generator().manual_seed(m)) for m in ROWS}
    best = {m: float("inf") for m in ROWS}
    for _ in range(rounds):
        for m in ROWS:
            start = time.perf_counter()
            k.matmul(inputs[m], [part], [kind], None, int8)
            best[m] = min(best[m], time.perf_counter() - start)
    ms = {m: t * 1e3 for m, t in best.items()}
    marginal = fit_slope(ms)
    return {
        "type": qtype,
        "rows": rows,
        "K": K,
        "mb": part.numel() / 1e6,
        "v1_ms": ms[1],
        "gbs": part.numel() / best[1] / 1e9,
        "ratio": {m: ms[m] / ms[1] for m in ROWS},
        "marginal_ms": marginal,
        "gmacs": rows * K / (marginal * 1e-3) / 1e9 if marginal > 0 else float("inf"),
    }


def run(types=DEFAULT_TYPES, K: int = 1536, megabytes: int | None = None, int8: bool | None = None) -> dict:
    """Every type's row and the peak: {"kernel": "amx", "vnni" or "fp32", "threads", "peak_gmacs",
    "peak_one_thread_gmacs", "types": [...]}. The peak on one thread beside torch's threads' says how
    much arithmetic the threads add: far less than their count where they share a core's units
    (SMT siblings, as many cloud vCPUs are). int8: None for the int8 path where the CPU has VNNI.
    Raises ValueError for a type the kernels lack."""
    from specdec.backends.qkernel import kernels

    unknown = [t for t in types if t not in FP16_FIELDS]
    if unknown:
        raise ValueError(f"no kernel for {', '.join(unknown)}: choose from {', '.join(FP16_FIELDS)}")
    if int8 is None:
        int8 = kernels().int8_available()
    kind = product_kernel(int8, max(ROWS))
    peak = peak_macs_per_s(kind) / 1e9
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = peak_macs_per_s(kind) / 1e9
    finally:
        torch.set_num_threads(threads)
    rows = [measure(t, K, megabytes, int8=int8) for t in types]
    for r in rows:
        r["fraction"] = r["gmacs"] / peak
    return {"kernel": kind, "threads": threads, "peak_gmacs": peak, "peak_one_thread_gmacs": one, "types": rows}


def table(result: dict) -> str:
    """The result as a markdown table, with a line naming the peak."""
    one = result["peak_one_thread_gmacs"]
    lines = [
        f"{result['kernel']} kernels, {result['threads']} threads; the product instruction's peak: "
        f"{result['peak_gmacs']:.0f} G multiply-adds/s ({one:.0f} G on one thread: "
        f"{result['peak_gmacs'] / one:.2f}x with {result['threads']})",
        "",
        "| type | matrix | V(1) ms | GB/s at M = 1 | "
        + " | ".join(f"V({m})/V(1)" for m in ROWS[1:])
        + " | added row: G multiply-adds/s | of peak |",
        "|---|---|---:|---:|" + "---:|" * (len(ROWS) - 1) + "---:|---:|",
    ]
    for r in result["types"]:
        lines.append(
            f"| {r['type']} | {r['rows']} x {r['K']}, {r['mb']:.0f} MB | {r['v1_ms']:.2f} | {r['gbs']:.1f} | "
            + " | ".join(f"{r['ratio'][m]:.2f}" for m in ROWS[1:])
            + f" | {r['gmacs']:.0f} | {r['fraction']:.0%} |"
        )
    return "\n".join(lines)
