"""The host a bench run ran on, for its results file: hardware, versions and the code's commit."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

from specdec.adaptive.costs import processor
from specdec.backends.qkernel import cpu_field


def environment() -> dict:
    """Hardware and versions, for the results file (results.Environment, memory bandwidth aside)."""
    import transformers

    cpu, isa = processor(torch.device("cpu")), instruction_set(set(cpu_field("flags").split()))
    commit = git_commit(Path(__file__).resolve().parent)
    return {
        "cpu": f"{cpu}{f' ({isa})' if isa else ''}, {os.cpu_count()} cores",
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "git_commit": commit,
    }


def instruction_set(flags: set[str]) -> str:
    """The widest of the instruction sets the kernels dispatch on that /proc/cpuinfo's flags name
    ("AMX", "AVX-512 VNNI", "AVX2"; "" for none): CPUs that one name covers (a VM's "AMD EPYC") differ
    by it."""
    if "amx_int8" in flags:
        return "AMX"
    if "avx512_vnni" in flags:
        return "AVX-512 VNNI"
    return "AVX2" if "avx2" in flags else ""


def git_commit(folder: Path) -> str | None:
    """The commit checked out where `folder` lies, with "-dirty" appended when files under `folder`
    differ from it, changed or new and not ignored (a bench run on uncommitted code says so); None
    outside a git checkout."""
    try:
        run = lambda *args: subprocess.run(["git", *args], capture_output=True, text=True, cwd=folder)  # noqa: E731
        head = run("rev-parse", "HEAD").stdout.strip()
        if not head:
            return None
        changed = run("status", "--porcelain", "--", ".").stdout.strip()
        return head + ("-dirty" if changed else "")
    except OSError:
        return None
