"""`specdec distill`: distill a small draft model (a few of the target's layers) on the target's own outputs."""

from __future__ import annotations

from pathlib import Path

from specdec.commands import flags
from specdec.commands.common import load_kwargs
from specdec.models.load import load_model


def run(args) -> int:
    """Distill the draft and print its held-out agreement with the target, before and after."""
    from transformers.utils import logging as hf_logging

    from specdec.train.distill import DistillConfig, distill

    hf_logging.disable_progress_bar()
    target = load_model(args.target, **load_kwargs(args))
    config = DistillConfig(
        n_layers=args.layers,
        prompts=args.prompts,
        sampled=args.sampled_prompts,
        max_new_tokens=args.max_new_tokens,
        epochs=args.epochs,
        lr=args.lr,
        batch=args.batch,
        draft_out=args.draft_out,
        restart=args.restart,
        cache=args.cache_dir,
    )
    s = distill(target, args.out, config)
    first, last = s["history"][0], s["history"][-1]
    print(
        f"draft of {s['target']} (layers {s['layers']}): held-out agreement with the target "
        f"{first['heldout_acc']:.3f} before training, {last['heldout_acc']:.3f} after; wrote {s['draft']}, "
        f"{args.out / 'loss.png'}; use it with --drafter model --draft {s['draft']}"
    )
    return 0


def add_parser(sub) -> None:
    """The command's parser and flags, on the command line's subparsers."""
    ds = sub.add_parser(
        "distill", help="distill a small draft model (a few of the target's layers) on the target's own outputs"
    )
    flags.training_data_options(ds)
    ds.add_argument("--layers", type=int, default=2, help="decoder layers the draft keeps, evenly spaced (default 2)")
    ds.add_argument("--epochs", type=int, default=4, help="default 4")
    ds.add_argument("--lr", type=float, default=2e-4, help="peak learning rate (default 2e-4)")
    ds.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    ds.add_argument(
        "--out",
        type=Path,
        default=Path("specdec-distill"),
        help="folder for data, checkpoint, loss.png, summary.json (the same --out as `specdec train` reuses its data)",
    )
    ds.add_argument(
        "--draft-out", type=Path, help="folder for the draft (default: <cache>/drafts/<target>-distilled-<L>L)"
    )
    ds.add_argument("--restart", action="store_true", help="ignore a checkpoint in --out and start over")
    flags.loading_options(ds, draft=False, device=False)
