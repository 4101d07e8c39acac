"""What an added row of a forward costs, against the arithmetic the CPU can do: the marginal cost of
a verify row.

A forward over n new tokens reads the weights once and does n rows of multiply-adds; once the weight
stream is paid, each added row costs its arithmetic. The bench fits that marginal cost to the
measured curve V(n) (least squares over n = 1..max) and holds it against the time the row's
multiply-adds take at the peak of the product instruction that ran them, measured here: vpdpbusd
(AVX512-VNNI, 64 int8 multiply-adds; with AVX2 alone vpmaddubsw + vpmaddwd, 32) for the quantized
backend's int8 path, 16-lane fp32 fused multiply-adds for its fp32 path
(specdec/backends/csrc/quant/peak.h). A fraction of 1 would be an added row that costs nothing but
its multiply-adds. `specdec kernels` measures the same per GGML type on one matrix
(specdec.bench.kernels).
"""

from __future__ import annotations

from specdec.models.load import Model


def fit_slope(curve: dict[int, float]) -> float:
    """Least-squares slope of y over n for {n: y} (at least two points): ms per added row."""
    if len(curve) < 2:
        raise ValueError("a slope needs V(n) at two or more n")
    ns = list(curve)
    mean_n = sum(ns) / len(ns)
    mean_y = sum(curve.values()) / len(ns)
    return sum((n - mean_n) * (y - mean_y) for n, y in curve.items()) / sum((n - mean_n) ** 2 for n in ns)


def peak_macs_per_s(kernel: str) -> float:
    """Multiply-adds per second of a product kernel's instruction (product_kernel's names) on torch's
    threads: "vnni" vpdpbusd, "avx2" vpmaddubsw + vpmaddwd, "amx" tile products, "fp32" fused
    multiply-adds. Raises RuntimeError for an int8 kernel the build lacks, amx on a CPU without AMX."""
    from specdec.backends.qkernel import kernels

    kind = {"vnni": "int8", "avx2": "int8"}.get(kernel, kernel)  # the C++ peak's name for it
    return max(kernels().peak(kind) for _ in range(3))  # the best of three: another process only slows it


def product_kernel(int8: bool, rows: int) -> str:
    """Which instruction multiplies a forward of up to `rows` rows: "amx" (AMX tiles, sixteen input
    rows at a time, for the 32-weight types and Q4_K; VNNI for the rest), "vnni" (AVX512-VNNI),
    "avx2" (int8 activations with AVX2 alone) or "fp32" (fp32 activations)."""
    from specdec.backends.qkernel import kernels

    if not int8:
        return "fp32"
    if kernels().amx_on() and rows >= kernels().amx_rows():
        return "amx"
    return kernels().int8_kernels()


def row_cost(model: Model, verify_ms: dict[str, float]) -> dict | None:
    """The added row's cost of `model`'s forward, from its V(n) in ms by str(n): {"kernel": "amx",
    "vnni", "avx2" or "fp32" (product_kernel), "macs_per_row" (the multiply-adds of one row through every
    matrix, the output layer included), "peak_gmacs" (G multiply-adds per second at the
    instruction's measured peak),
    "marginal_ms" (fitted), "peak_ms" (the row's multiply-adds at that peak), "fraction" (peak_ms /
    marginal_ms)}. None for a model not run on the quantized backend (transformers', oneDNN's
    products are not ours to hold against a peak) or a curve of one point."""
    if model.gguf is None or model.device.type != "cpu" or len(verify_ms) < 2:
        return None
    lean = model.lean()
    kind = product_kernel(lean.int8, max(int(n) for n in verify_ms))
    peak = peak_macs_per_s(kind)
    marginal = fit_slope({int(n): ms for n, ms in verify_ms.items()})
    macs = lean.macs_per_row()
    peak_ms = macs / peak * 1e3
    return {
        "kernel": kind,
        "macs_per_row": macs,
        "peak_gmacs": peak / 1e9,
        "marginal_ms": marginal,
        "peak_ms": peak_ms,
        "fraction": peak_ms / marginal if marginal > 0 else None,
    }
