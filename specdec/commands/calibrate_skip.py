"""`specdec calibrate-skip`: choose the decoder layers a layer-skip draft keeps, and store them."""

from __future__ import annotations

import sys

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
