"""The host a bench run ran on, for its results file: hardware, versions and the code's commit."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch


def environment() -> dict:
    """Hardware and versions, for the results file (results.Environment, memory bandwidth aside)."""
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = git_commit(Path(__file__).resolve().parent)
    return {
        "cpu": f"{cpu}, {os.cpu_count()} cores",
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "git_commit": commit,
    }


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
