"""The memory roofline of a decode step: a forward over a few tokens must read every weight once,
so on a CPU it can be no faster than (bytes of weights) / (memory bandwidth). The bench reports
that floor beside the measured V(n), and the fraction of it reached.

The bytes are those the forward actually reads: a GGUF model run at its own precision reads its
quantized blocks (specdec.backends.quant.QuantModel.weight_bytes), a transformers or lean model its
parameters in their dtype (a greedy lean forward its output layer in bf16 where screened).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from specdec.backends.lean import weight_bytes
from specdec.models.load import Model, synchronize


def last_level_cache_bytes() -> int:
    """The largest CPU cache Linux reports (/sys/devices/system/cpu/cpu0/cache), in bytes; 0 if none."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()  # e.g. "32768K"
        except OSError:
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        if text.rstrip("KMG").isdigit():
            sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=0)


def memory_bandwidth_gbs(
    device: torch.device = torch.device("cpu"), size_mb: int | None = None, repeats: int = 5
) -> float:
    """Read bandwidth in GB/s of `device`'s memory: the median time to sum a size_mb fp32 tensor, by
    default 256 MB or four times the CPU's last-level cache if that is larger (some VMs report
    hundreds of MB), so that memory, not a cache, delivers it (on a GPU, 256 MB: larger than its L2),
    with torch's current thread count on the CPU."""
    if size_mb is None:
        size_mb = 256 if device.type != "cpu" else max(256, 4 * last_level_cache_bytes() // 2**20)
    x = torch.ones(size_mb * 2**20 // 4, device=device)
    x.sum()  # first touch
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        x.sum()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return x.numel() * 4 / statistics.median(times) / 1e9


def forward_bytes(model: Model, greedy: bool = False, rows: int = 1) -> tuple[int, bool]:
    """(bytes of weights one forward of `model` over `rows` new tokens reads, whether its output layer
    is read screened). A GGUF model run at its own precision: its quantized blocks as they lie in the
    file (never its fp32 dequantization, which is not loaded). greedy: the forward is a greedy one,
    which reads a lean model's output layer in bf16 where it is screened (specdec.backends.screen),
    and, over one row, a GGUF model's Q8_0 output layer through its 4-bit screen
    (specdec.backends.qscreen; the few rows it recomputes exactly are not counted)."""
    if model.gguf is not None:
        quant = model.lean()
        head = quant.greedy_head if greedy and rows == 1 else None
        if head is None:
            return quant.weight_bytes(), False
        return quant.weight_bytes() - quant.lm_head.nbytes + head.nbytes, True
    screen = model.lean().screen if greedy and model.backend == "lean" else None
    return weight_bytes(model.hf) - (screen.saved_bytes if screen is not None else 0), screen is not None


def roofline(model: Model, forward_ms: dict[str, float], bandwidth_gbs: float, greedy: bool = False) -> dict:
    """The floor of one forward and the fraction of it reached.

    forward_ms: measured ms of one forward over n new tokens, by str(n) (the bench's verify_ms).
    greedy: the forwards were greedy ones (see forward_bytes). Returns {"weight_mb", "weights",
    "bandwidth_gbs", "floor_ms", "fraction": {n: floor(n) / forward_ms[n]}, "screened_output_layer"}
    for a one-token forward (1.0 would be reading the weights at full bandwidth and nothing else;
    floor(n) is the floor of a forward over n tokens, which reads the same weights unless a one-token
    forward screens its output layer); "weights" says what the bytes are: the model's precision
    (Model.precision), e.g. "gguf Q4_1+Q8_0" or "float32"."""
    nbytes, screened = forward_bytes(model, greedy)
    floor_ms = nbytes / (bandwidth_gbs * 1e9) * 1e3
    wider_ms = forward_bytes(model, greedy, rows=2)[0] / (bandwidth_gbs * 1e9) * 1e3
    return {
        "weight_mb": nbytes / 1e6,
        "weights": model.precision,
        "bandwidth_gbs": bandwidth_gbs,
        "floor_ms": floor_ms,
        "fraction": {n: (floor_ms if n == "1" else wider_ms) / ms for n, ms in forward_ms.items() if ms > 0},
        "screened_output_layer": screened,
    }
