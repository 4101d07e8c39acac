"""specdec's batch-invariant CPU kernels for GGUF weights (specdec/backends/csrc/quant.cpp and the
headers of csrc/quant/ it includes, one concern each), compiled at first use.

The module's functions: `matmul(x, parts, types, bias=None, int8=False)` (x (M, K) fp32 times the
stacked quantized parts, each (N_p, row_bytes) uint8 of a GGML type id; returns (M, sum N_p); int8:
round the activations to int8 per block and multiply with integer dot products, as llama.cpp does,
where `int8_available()`: `int8_kernels()` says "vnni" or "avx2"), `dequantize_rows(w, type, K, ids)`,
`rms_norm(x, w, eps)`, `swiglu(gate_up)`, `rope_table(positions, inv_freq)`,
`rope(x, positions, inv_freq)` (in place), `attention(q, k_cache, v_cache, start, mask, scale)`,
`repack(rows, type, K)` (rows regrouped sixteen at a time for the int8 path, with their type id; None
for the types it takes a row at a time: outside INT8_TYPES, Q5_K, IQ4_NL and IQ4_XS on VNNI,
and every type in builds without int8 kernels), `peak(kind)` (multiply-adds
per second of the int8 or fp32 product instruction), `release(t)` (a memory-mapped tensor's pages), and
`Layer(...)` with `layers(...)` (the Llama/Qwen2 decoder stack over one or more requests' new
tokens). Each output is reduced in one fixed order by one thread, so row i of an n-row call has the
bits of a one-row call (quant.cpp says how).

Built with torch's C++ extension loader (a C++ compiler and ninja, once per machine, cached under
~/.cache/torch_extensions) for the machine it runs on (-march=native); -ffp-contract=off keeps
the compiler from fusing multiply-adds differently in different places. A home directory shared by
machines with different CPUs wants TORCH_EXTENSIONS_DIR set per machine.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from specdec.errors import KernelBuildError

SOURCE = Path(__file__).parent / "csrc" / "quant.cpp"
HEADERS = sorted((Path(__file__).parent / "csrc" / "quant").glob("*.h"))  # included by SOURCE, one header a concern

# GGML type ids (ggml.h) the kernels multiply in their blocks; other types are dequantized to fp32 at load.
TYPES = {
    "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12,
    "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23, "BF16": 30,
}  # fmt: skip
# Those the int8 path multiplies with int8 activations (regrouped sixteen rows at a time where repack says, else a row
# at a time; HALVES_TYPES' row-at-a-time kernels are the same AVX2 code in every int8 build, csrc/quant/int8_halves.h);
# the others run the fp32-activation kernel there too (csrc/quant/common.h, has_int8_kernel).
INT8_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K", "Q5_K", "IQ4_XS", "IQ4_NL")
HALVES_TYPES = ("Q5_K", "IQ4_XS", "IQ4_NL")

_module = None


def cpu_field(name: str) -> str:
    """The first CPU's field `name` in /proc/cpuinfo ("model name", "flags"), stripped; "" where there is none."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lines if line.split(":", 1)[0].strip() == name), "")


def source_digest() -> str:
    """16 hex digits of the kernels' sources (quant.cpp and its headers): what a timing of them depends on."""
    return hashlib.sha256(b"".join(p.read_bytes() for p in [SOURCE, *HEADERS])).hexdigest()[:16]


def kernels():
    """The compiled module, built at the first call (about a minute, once per machine). Raises
    KernelBuildError, with the compiler's first error line and what to do, when it cannot be built."""
    global _module
    if _module is None:
        try:
            from torch.utils.cpp_extension import load

            from specdec.backends.gemv import _ninja_on_path

            _ninja_on_path()
            # torch's loader rebuilds when the sources or the flags change: the headers' digest is a flag
            _module = load(
                "specdec_quant",
                [str(SOURCE)],
                extra_cflags=[
                    "-O3",
                    "-march=native",
                    "-ffp-contract=off",
                    "-fopenmp",
                    f"-DSPECDEC_HEADERS={source_digest()}",
                ],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except Exception as e:
            raise KernelBuildError(
                f"specdec's quantized kernels could not be built ({str(e).splitlines()[0][:300]}). They need a C++ "
                "compiler (g++ or clang++) and ninja; or run the dequantized weights with --dtype float32."
            ) from None
    return _module
