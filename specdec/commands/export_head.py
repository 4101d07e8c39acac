"""`specdec export-head`: write a draft head as an EAGLE-1 checkpoint for vLLM or SGLang."""

from __future__ import annotations

from pathlib import Path

from specdec.commands import flags
from specdec.commands.common import head_path, load_kwargs
from specdec.models.load import load_model
from specdec.train.export import ENGINES


def run(args) -> int:
    """Export the head (--head, else the target's) and print how the engine loads it."""
    from specdec.train.export import export_head
    from specdec.train.head import load_head

    target = load_model(args.target, **load_kwargs(args))
    path = head_path(target, args)
    head, meta = load_head(path, hidden_size=target.config.hidden_size)
    export_head(head, target.config, args.out, engine=args.engine, meta={"head": str(path), **meta})
    how = (
        f'speculative_config={{"method": "eagle", "model": "{args.out}", "num_speculative_tokens": 4}}'
        if args.engine == "vllm"
        else f"--speculative-algorithm EAGLE --speculative-draft-model-path {args.out} "
        f"--speculative-token-map {args.out / 'token_map.pt'}"
    )
    print(f"wrote {args.out} (EAGLE-1, for {args.engine}) from {path}; load it with {how}")
    return 0


def add_parser(sub) -> None:
    """The command's parser and flags, on the command line's subparsers."""
    ex = sub.add_parser("export-head", help="write a draft head as an EAGLE-1 checkpoint for vLLM or SGLang")
    ex.add_argument(
        "--target", default="smollm2-135m", help="the head's target: registry name, folder, .gguf file or hub id"
    )
    ex.add_argument("--head", type=Path, help="a head file (default: the target's, from `specdec train` or shipped)")
    ex.add_argument("--out", type=Path, required=True, help="folder for config.json and model.safetensors")
    ex.add_argument("--engine", choices=ENGINES, default="vllm", help="the engine that will load it (default vllm)")
    flags.loading_options(ex, draft=False, device=False)
