"""`specdec kernels`: the quantized backend's products, one GGML type at a time, against the CPU.

For each type a matrix of random blocks (finite fp16 scales, every other byte random; F32, F16 and
BF16 random values) larger than the last-level cache, laid out as a model's load lays it out
(regrouped sixteen rows at a time for the int8 path; a type without int8 kernels, such as Q5_K,
runs the fp32-activation kernel there too, and its row says so); one product over M input rows is
timed for M = 1, 2, 4, 8, 9, interleaved round by round, the fastest of the rounds kept (another
process only slows a round down). Reported per type: V(1) and the GB/s it streams the weights at,
V(M)/V(1), and an added row's cost (the slope over M) as multiply-adds per second and as a share
of the product instruction's peak measured in the same run (specdec.bench.rowcost). This is the
measurement the kernels are tuned by. Where the AMX tiles are on (they take products of sixteen
rows or more), each type they take is also timed over a prompt chunk's 128 rows with the tiles on
and off.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quantize

from specdec.batch import PREFILL_CHUNK
from specdec.bench.rowcost import fit_slope, peak_macs_per_s, product_kernel

# where each block type the kernels multiply keeps its fp16 fields in a block (ggml-common.h); sizes from gguf
FP16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q5_K": (0, 2), "IQ4_NL": (0,), "IQ4_XS": (0,),
}  # fmt: skip
FLOATS = ("F32", "F16", "BF16")  # every element a value: F32 is what a type without kernels is multiplied as


def block_size(qtype: str) -> tuple[int, int]:
    """(elements, bytes) of one block of `qtype` (gguf's GGML_QUANT_SIZES)."""
    return GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]


DEFAULT_TYPES = ("Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_0")  # what the registry's files hold
ROWS = (1, 2, 4, 8, 9)


def random_matrix(qtype: str, rows: int, K: int, seed: int = 0) -> torch.Tensor:
    """(rows, K / block * bytes) uint8 blocks of `qtype`: random bytes, fp16 fields finite (|x| < 0.02);
    F32, F16 and BF16: such values."""
    block, nbytes = block_size(qtype)
    g = np.random.default_rng(seed)
    if qtype in FLOATS:
        values = g.uniform(-0.02, 0.02, (rows, K)).astype(np.float32)
        return torch.from_numpy(np.ascontiguousarray(quantize(values, GGMLQuantizationType[qtype])).view(np.uint8))
    raw = g.integers(0, 256, (rows, K // block, nbytes), dtype=np.uint8)
    for at in FP16_FIELDS[qtype]:
        raw[..., at : at + 2] = g.uniform(-0.02, 0.02, (rows, K // block, 1)).astype(np.float16).view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))


def _matrix(qtype: str, K: int, megabytes: int, int8: bool) -> tuple[torch.Tensor, int, int]:
    """(part, its type id, rows): a random matrix of about `megabytes` MB of `qtype`, laid out as a
    model's load lays it out (regrouped sixteen rows at a time for the int8 path)."""
    from specdec.backends.qkernel import TYPES, kernels

    block, nbytes = block_size(qtype)
    rows = max(16, int(megabytes * 2**20 / (K // block * nbytes)) // 16 * 16)
    raw = random_matrix(qtype, rows, K)
    part, kind = raw, TYPES[qtype]
    regrouped = kernels().repack(raw, kind, K) if int8 else None
    if regrouped is not None:
        part, kind = regrouped
    return part, kind, rows


def measure(qtype: str, K: int = 1536, megabytes: int | None = None, rounds: int = 9, int8: bool = True) -> dict:
    """One type's row: {"type", "rows", "K", "mb", "v1_ms", "gbs", "ratio": {M: V(M)/V(1)},
    "marginal_ms", "gmacs", "int8"} (gmacs: G multiply-adds per second of an added row; int8: whether
    its activations were int8, false for a type without int8 kernels). megabytes: the matrix's size,
    by default four times the last-level cache (at least 64 MB)."""
    from specdec.backends.qkernel import INT8_TYPES, kernels
    from specdec.bench.roofline import last_level_cache_bytes

    k = kernels()
    size = megabytes or max(64, 4 * last_level_cache_bytes() // 2**20)
    part, kind, rows = _matrix(qtype, K, size, int8)
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
        "int8": int8 and qtype in INT8_TYPES,
    }


PROMPT_ROWS = PREFILL_CHUNK  # a prompt chunk's rows: the tiles run them sixteen at a time


def tile_types() -> list[str]:
    """The GGML types whose products the AMX tiles take (kernels().amx_takes); empty in a build
    without them."""
    from specdec.backends.qkernel import TYPES, kernels

    return [t for t, i in TYPES.items() if kernels().amx_takes(i)]


def measure_tiles(qtype: str, K: int = 1536, megabytes: int = 32, rounds: int = 9) -> dict:
    """A prompt chunk's product (PROMPT_ROWS input rows) of `qtype` with the AMX tiles on and off,
    interleaved round by round, the fastest round of each kept: {"type", "rows", "tiles_ms",
    "vnni_ms"}. A 32 MB matrix by default: at this many rows the product is bound by arithmetic.
    Raises RuntimeError where the tiles cannot run (no AMX here), ValueError for a type they do not
    take."""
    from specdec.backends.qkernel import kernels

    k = kernels()
    if not k.amx_available():
        raise RuntimeError("no AMX tiles here (amx_int8 absent, or Linux refused the tile state)")
    if qtype not in tile_types():
        raise ValueError(f"the AMX tiles do not take {qtype}: they take {', '.join(tile_types())}")
    part, kind, _ = _matrix(qtype, K, megabytes, True)
    x = torch.randn(PROMPT_ROWS, K, generator=torch.Generator().manual_seed(0))
    best = {True: float("inf"), False: float("inf")}
    was = k.use_amx(True)
    try:
        for _ in range(rounds):
            for on in (True, False):
                k.use_amx(on)
                start = time.perf_counter()
                k.matmul(x, [part], [kind], None, True)
                best[on] = min(best[on], time.perf_counter() - start)
    finally:
        k.use_amx(was)
    return {"type": qtype, "rows": PROMPT_ROWS, "tiles_ms": best[True] * 1e3, "vnni_ms": best[False] * 1e3}


def run(types=DEFAULT_TYPES, K: int = 1536, megabytes: int | None = None, int8: bool | None = None) -> dict:
    """Every type's row and the peak: {"kernel": "amx", "vnni", "avx2" or "fp32", "threads", "peak_gmacs",
    "peak_one_thread_gmacs", "types": [...], "tiles": [measure_tiles of each type the AMX tiles
    take, where they are on; else empty]}. The peak on one thread beside torch's threads' says how
    much arithmetic the threads add: far less than their count where they share a core's units
    (SMT siblings, as many cloud vCPUs are). int8: None for the int8 path where the build has one (AVX2 or VNNI).
    Raises ValueError for a type the kernels lack."""
    from specdec.backends.qkernel import kernels

    timed = [*FP16_FIELDS, *FLOATS]
    unknown = [t for t in types if t not in timed]
    if unknown:
        raise ValueError(f"no kernel for {', '.join(unknown)}: choose from {', '.join(timed)}")
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
    tile_mb = min(32, megabytes) if megabytes else 32
    tiles = [measure_tiles(t, K, tile_mb) for t in types if t in tile_types()] if int8 and kernels().amx_on() else []
    return {
        "kernel": kind,
        "threads": threads,
        "peak_gmacs": peak,
        "peak_one_thread_gmacs": one,
        "types": rows,
        "tiles": tiles,
    }


def table(result: dict) -> str:
    """The result as a markdown table, with a line naming the peak, and the tiles' prompt-chunk
    times where they ran."""
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
        fp32 = result["kernel"] != "fp32" and not r.get("int8", True)  # no int8 kernel for the type
        name = f"{r['type']} (fp32 kernel)" if fp32 else r["type"]
        lines.append(
            f"| {name} | {r['rows']} x {r['K']}, {r['mb']:.0f} MB | {r['v1_ms']:.2f} | {r['gbs']:.1f} | "
            + " | ".join(f"{r['ratio'][m]:.2f}" for m in ROWS[1:])
            + f" | {r['gmacs']:.0f} | {r['fraction']:.0%} |"
        )
    if result.get("tiles"):
        rows = result["tiles"][0]["rows"]
        lines += ["", f"AMX tiles (products of 16 rows or more; the rows above ran on VNNI), {rows} input rows:"]
        lines += [
            f"- {t['type']}: {t['tiles_ms']:.2f} ms on tiles, {t['vnni_ms']:.2f} on VNNI "
            f"({t['vnni_ms'] / t['tiles_ms']:.2f}x)"
            for t in result["tiles"]
        ]
    return "\n".join(lines)
