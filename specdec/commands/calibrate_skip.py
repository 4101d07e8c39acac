"""`specdec calibrate-skip`: choose the decoder layers a layer-skip draft keeps, and store them."""

from __future__ import annotations

import sys

from specdec.commands import flags
from specdec.commands.common import load_kwargs
from specdec.models.load import load_model


def run(args) -> int:
    """Calibrate on the target, store the choice, print it and its estimated speed-up."""
    from transformers.utils import logging as hf_logging

    from specdec.train.calibrate import CalibrateConfig, calibrate_skip, save_skip_layers

    hf_logging.disable_progress_bar()
    target = load_model(args.target, **load_kwargs(args))
    config = CalibrateConfig(
        k=args.k,
        max_new_tokens=args.max_new_tokens,
        beam=args.beam,
        max_keep=args.max_keep,
        verify_ratio=args.verify_ratio,
    )
    res = calibrate_skip(target, config, progress=lambda line: print(line, file=sys.stderr))
    path = save_skip_layers(res, args.cache_dir)
    print(f"keep {len(res['layers'])} of {res['n_layers']} layers: {','.join(map(str, res['layers']))}")
    print(
        f"tau {res['tau']:.2f} at k {res['k']}, draft cost {res['draft_cost']:.2f}, verify ratio "
        f"{res['verify_ratio']:.2f}, estimated speed-up {res['est_speedup']:.2f}x; wrote {path}"
    )
    return 0


def add_parser(sub) -> None:
    """The command's parser and flags, on the command line's subparsers."""
    cs = sub.add_parser("calibrate-skip", help="choose the decoder layers a layer-skip draft keeps, and store them")
    flags.target_option(cs)
    cs.add_argument("-k", type=int, default=4, help="draft length the speed-up estimate assumes (default 4)")
    cs.add_argument("--max-new-tokens", type=int, default=32, help="greedy tokens per calibration prompt (default 32)")
    cs.add_argument("--max-keep", type=int, help="keep at most this many layers (default: all but one)")
    cs.add_argument("--beam", type=int, default=4, help="layers re-tried per step after the first; 0 = all (default 4)")
    cs.add_argument("--verify-ratio", type=float, help="cost of verifying k+1 tokens over one (default: timed)")
    flags.loading_options(cs, draft=False, device=False)
