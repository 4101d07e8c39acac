"""One- and two-row fp32 matrix products on CPU, compiled at first use (specdec/backends/csrc/gemv.cpp).

A plain decoding step multiplies one row by each weight, a one-token verify two rows: matrix-vector
products, bound by how fast memory delivers the weights. oneDNN's fp32 kernels (specdec.backends.lean's
default) read the weights well below memory speed at one and two rows; a loop that reads each
weight row once, front to back, gets closer to it, and so shortens a one-token step (GB/s and
step times: docs/lean-backend.md). From three rows on oneDNN's blocked kernels are faster (this
loop, which re-reads the input rows for every weight row, is bound by loads there) and
specdec.backends.lean uses them.

The kernel is built with torch's C++ extension loader (a C++ compiler and ninja, once per machine;
cached under ~/.cache/torch_extensions) for the machine it runs on (-march=native). Where it cannot
be built, or with SPECDEC_GEMV=0 in the environment, `kernel()` returns None and specdec.backends.lean runs
every product through oneDNN; `status()` says which and why. The build is for this CPU: a home
directory shared by machines with different CPUs wants TORCH_EXTENSIONS_DIR set per machine.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

MAX_ROWS = 2  # products with more rows than this go to oneDNN
SOURCE = Path(__file__).parent / "csrc" / "gemv.cpp"

_kernel = None
_status = "not built yet"


def kernel():
    """The compiled module (its `gemv(x, parts, bias)`: x (1 or 2, K) fp32; parts, a list of
    contiguous fp32 weights (N_p, K); bias (sum N_p,) or None; returns (rows, sum N_p)), or None
    where it cannot be used (see status()). Built at the first call, once per process."""
    global _kernel, _status
    if _kernel is None and _status == "not built yet":
        if os.environ.get("SPECDEC_GEMV", "1") == "0":
            _status = "off (SPECDEC_GEMV=0): oneDNN for every product"
        else:
            try:
                from torch.utils.cpp_extension import load

                _ninja_on_path()
                _kernel = load("specdec_gemv", [str(SOURCE)], extra_cflags=["-O3", "-march=native"], verbose=False)
                _status = f"specdec gemv for 1-{MAX_ROWS} rows, oneDNN for more"
            except Exception as e:  # no compiler, no ninja, an unsupported target: fall back, say why
                _status = (
                    f"oneDNN for every product (the gemv kernel could not be built: {str(e).splitlines()[0][:200]})"
                )
    return _kernel


def _ninja_on_path() -> None:
    """torch's loader runs `ninja` from PATH; the pinned ninja package puts it beside the venv's
    python, which is not on PATH when specdec runs as .venv/bin/specdec without activating it."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def status() -> str:
    """Which kernels run fp32 products on CPU, in words (for bench's results and report)."""
    return _status


def usable(weight: torch.Tensor) -> bool:
    """Whether products with this weight can use the kernel: fp32, on the CPU, and the kernel built."""
    return weight.dtype == torch.float32 and weight.device.type == "cpu" and kernel() is not None
