"""What several commands share: the dtypes of --dtype, load_model's arguments from the loading
flags, --recalibrate, the draft length's text (-k) and a target's draft head."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from specdec.adaptive.costs import forget
from specdec.options import parse_k

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def k_arg(text: str) -> int | str:
    """A draft length from the command line: `auto` or a whole number >= 0 (specdec.options.parse_k,
    whose ValueError is the message the command line shows)."""
    return parse_k(text)


def load_kwargs(args, draft: bool = False) -> dict:
    """load_model's keyword arguments from the loading options; draft=True: the draft's dtype and
    quantization."""
    dtype = (getattr(args, "draft_dtype", None) if draft else None) or args.dtype
    return dict(
        dtype=DTYPES[dtype],
        pull_missing=args.pull,
        cache=args.cache_dir,
        backend=args.backend,
        device=getattr(args, "device", "cpu"),
        quantize=getattr(args, "draft_quantize", None) if draft else getattr(args, "quantize", None),
        kv_dtype=getattr(torch, args.kv_cache) if getattr(args, "kv_cache", None) else None,
    )


def recalibrate(args, targets: list[str]) -> None:
    """With --recalibrate, drop the targets' cached verify-cost curves (the first k-auto run times them
    again), saying which."""
    if getattr(args, "recalibrate", False):
        for name in dict.fromkeys(targets):
            gone = forget(name, args.cache_dir)
            print(f"# {name}: {len(gone)} cached verify-cost curve(s) dropped, to be timed again", file=sys.stderr)


def head_path(target, args) -> Path:
    """--head, else the target's trained or shipped head. Raises HeadError when it has none."""
    from specdec.train.head import HeadError, find_head

    path = args.head or find_head(target.name, args.cache_dir)
    if path is None:
        raise HeadError(f"no draft head for {target.name}: train one with `specdec train --target {args.target}`")
    return Path(path)
