"""Resident memory of the bench's process: what loading a model costs in RAM, beside its speed.

Read from /proc (Linux) and `resource`, no dependency. The resident set size (RSS) counts every page
the process has mapped and touched: its heap, and the pages of memory-mapped files it has read. A
GGUF model run at its own precision keeps its weights as a memory map of the file, so they count once
a forward has read them (hence `footprint` measures after a warm-up forward), except the matrices it
regroups at load: copies on the heap, their file pages released. The peak (ru_maxrss) is
the process's since it started: the interpreter, torch and the bench's bandwidth probe included.
"""

from __future__ import annotations

import gc
import os
import resource
import sys
from pathlib import Path

MB = 1e6


def rss_bytes() -> int | None:
    """The process's resident set size now (VmRSS of /proc/self/status); None where there is no /proc."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def peak_rss_bytes(seen: int | None = None) -> int:
    """The process's peak resident set size so far: ru_maxrss (kB on Linux, bytes on macOS), or a
    resident set size `seen` earlier (rss_bytes()) where that is more: Linux computes ru_maxrss from
    approximate per-CPU counters, which can lag the exact VmRSS by some pages."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max(peak if sys.platform == "darwin" else peak * 1024, seen or 0)


def mapped_rss_bytes(path: str | os.PathLike) -> int | None:
    """Bytes of `path` resident in this process's mappings of it (the Rss of its entries in
    /proc/self/smaps, summed): how much of a memory-mapped file the process has touched. None where
    there is no smaps; 0 when the file is not mapped."""
    target = str(Path(path).resolve())
    total, inside = 0, False
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=5)
                if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):  # a mapping's header line
                    inside = len(head) == 6 and head[5].rstrip("\n") == target
                elif inside and head[0] == "Rss:":
                    total += int(head[1]) * 1024
    except (OSError, ValueError):
        return None
    return total


def footprint(before: int | None, gguf=None) -> dict:
    """The memory a model's load cost, measured now (after the load and a warm-up forward): `before` is
    rss_bytes() from just before the load. For a GGUF model (specdec.models.gguf.GGUFModel, run at
    its own precision) also the file's size, the part of it resident (its mapped pages), the rest of
    the growth (other_mb: the tokenizer, the backend's own copies, kernels and libraries used for the
    first time) and the RSS growth per byte of file. Sizes in MB (1e6 bytes); fields None where /proc
    is not there to read."""
    gc.collect()
    after = rss_bytes()
    growth = after - before if after is not None and before is not None else None
    out = {
        "rss_before_mb": _mb(before),
        "rss_after_mb": _mb(after),
        "rss_growth_mb": _mb(growth),
        "peak_rss_mb": _mb(peak_rss_bytes(after)),
        "file_mb": None,
        "file_resident_mb": None,
        "other_mb": None,
        "growth_per_file_byte": None,
    }
    if gguf is not None:
        out["file_mb"] = _mb(gguf.file_bytes)
        resident = mapped_rss_bytes(gguf.path)
        out["file_resident_mb"] = _mb(resident)
        out["other_mb"] = _mb(growth - resident) if growth is not None and resident is not None else None
        out["growth_per_file_byte"] = growth / gguf.file_bytes if growth is not None and gguf.file_bytes else None
    return out


def _mb(n: int | None) -> float | None:
    return None if n is None else n / MB
