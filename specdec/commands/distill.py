"""`specdec distill`: distill a small draft model (a few of the target's layers) on the target's own outputs."""

from __future__ import annotations

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
