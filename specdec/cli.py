"""The `specdec` command line: the dispatch to specdec.commands, one module per command, each with
its parser and flags (add_parser(sub)) beside its run(args) -> int; flag groups and argparse types
several commands share are specdec.commands.flags'."""

from __future__ import annotations

import argparse
import os
import sys

from specdec.commands import (
    bench,
    calibrate_skip,
    distill,
    export_head,
    generate,
    kernels,
    loadtest,
    models,
    plot,
    report,
    serve,
    train,
    vllm_eagle,
)
from specdec.commands.common import k_arg
from specdec.commands.generate import TextStreamer, compare_lines, workload_prompt
from specdec.errors import SpecdecError

__all__ = ["TextStreamer", "compare_lines", "k_arg", "main", "workload_prompt"]  # the names tests import

COMMANDS = {  # name -> its module: add_parser(sub) and run(args)
    "generate": generate,
    "bench": bench,
    "serve": serve,
    "loadtest": loadtest,
    "calibrate-skip": calibrate_skip,
    "train": train,
    "distill": distill,
    "export-head": export_head,
    "vllm-eagle": vllm_eagle,
    "plot": plot,
    "kernels": kernels,
    "report": report,
    "models": models,
}


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run its command. Returns the exit status: 2 with one `error:`
    line for a SpecdecError or ValueError (argparse exits 2 itself, with the usage, for a bad flag)."""
    args = _parser().parse_args(argv)
    if getattr(args, "drafter", "") is None:  # generate, serve: the draft model with lookup when one is given
        args.drafter = "model-lookup" if getattr(args, "draft", None) else "prompt-lookup"
    try:
        return COMMANDS[args.command].run(args)
    except (SpecdecError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


# ---- the parser: each command's flags are its module's (add_parser) ---------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec", description="Exact speculative decoding for causal LMs.")
    p.add_argument("--version", action="version", version=f"specdec {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS.values():
        module.add_parser(sub)
    return p


def _version() -> str:
    """The installed package's version (importlib.metadata), or "unknown" when run from a bare tree."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specdec")
    except PackageNotFoundError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
