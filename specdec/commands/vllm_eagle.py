"""`specdec vllm-eagle`: a draft head exported as EAGLE-1 run in vLLM beside specdec's eagle drafter."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from specdec.bench.workloads import MT_BENCH, load_workload, workload_path
from specdec.commands import flags
from specdec.commands.common import head_path
from specdec.models.load import load_model
from specdec.models.registry import REGISTRY


def run(args) -> int:
    """Compare outputs and acceptance of both engines, print the page, write it with --out."""
    import json

    from transformers.utils import logging as hf_logging

    from specdec.bench import vllm_eagle
    from specdec.bench.environment import environment
    from specdec.bench.loading import encode_prompt
    from specdec.models.weights import converted_folder

    if args.k < 1:
        raise ValueError(f"-k must be at least 1 (vLLM's num_speculative_tokens), got {args.k}")
    if args.target in REGISTRY:
        folder = converted_folder(args.target, args.cache_dir)  # vLLM's CPU backend runs no GGUF blocks
    elif (Path(args.target) / "config.json").is_file():
        folder = Path(args.target)
    else:
        raise ValueError(f"vllm-eagle runs a registry model or a local Hugging Face folder; got {args.target!r}")
    hf_logging.disable_progress_bar()
    target = load_model(args.target, dtype=torch.float32, cache=args.cache_dir)
    head = head_path(target, args)
    workload = workload_path(args.workload)
    prompts = load_workload(workload, args.categories.split(","), args.limit)
    ids = [encode_prompt(target, p) for p in prompts]
    result = vllm_eagle.compare(
        target,
        folder,
        head,
        ids,
        args.vllm_python,
        k=args.k,
        max_new_tokens=args.max_new_tokens,
    )
    env = environment()
    page = vllm_eagle.report(result, env["cpu"], f"{workload.name} ({args.categories})", args.target)
    print(page)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"command": "specdec " + " ".join(sys.argv[1:]), "target": args.target, **env}
        (args.out / "compare.json").write_text(json.dumps({**meta, **result}, indent=1) + "\n")
        (args.out / "README.md").write_text(page)
    return 0


def add_parser(sub) -> None:
    """The command's parser and flags, on the command line's subparsers."""
    ve = sub.add_parser(
        "vllm-eagle",
        help="run a draft head exported as EAGLE-1 in vLLM beside specdec's eagle drafter: outputs and acceptance",
    )
    ve.add_argument(
        "--target", default="smollm2-135m", help="a registry name or Hugging Face folder (default: smollm2-135m)"
    )
    ve.add_argument("--head", type=Path, help="a head file (default: the target's, from `specdec train` or shipped)")
    ve.add_argument("--workload", default="spec-bench", help="packaged name or .jsonl path (default spec-bench)")
    ve.add_argument(
        "--categories", default=",".join(MT_BENCH), help="comma-separated (default: the 8 MT-bench categories)"
    )
    ve.add_argument("--limit", type=int, default=1, help="prompts per category (default 1)")
    ve.add_argument("-k", type=int, default=4, help="draft tokens per round, in both engines (default 4)")
    ve.add_argument("--max-new-tokens", type=int, default=128, help="default 128")
    flags.vllm_python_option(ve)
    ve.add_argument("--out", type=Path, help="folder for compare.json and README.md (a results/ entry)")
    ve.add_argument("--cache-dir")
