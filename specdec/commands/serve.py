"""`specdec serve`: load the models and run the OpenAI-compatible HTTP server until Ctrl-C."""

from __future__ import annotations

import sys

import torch

from specdec.commands.common import k_arg, load_kwargs, recalibrate
from specdec.drafters.factory import check_options, options_for
from specdec.models.load import load_model


def run(args) -> int:
    """Check the flags (before loading anything), load the target (and draft), serve."""
    from transformers.utils import logging as hf_logging

    from specdec.serve.app import create_app, run_server
    from specdec.serve.config import ServeConfig

    k = k_arg(args.k)
    if args.max_queue < 1 or args.max_tokens < 0:
        raise ValueError("--max-queue must be >= 1 and --max-tokens >= 0")
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    if args.drafter != "none":  # the model drafter needs --draft; the others take no flag to check
        check_options(args.drafter, **options_for(args.drafter, {"draft": args.draft}))
    hf_logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    recalibrate(args, [args.target])
    target = load_model(args.target, **load_kwargs(args))
    draft = load_model(args.draft, **load_kwargs(args, draft=True)) if args.draft else None
    config = ServeConfig(
        drafter=args.drafter,
        k=k,
        model_name=args.served_model_name,
        max_queue=args.max_queue,
        max_tokens=args.max_tokens,
        max_ngram=args.max_ngram,
        min_ngram=args.min_ngram,
        cache=args.cache_dir,
        head_quantize=args.draft_quantize,  # a draft model's was applied at its load; this is the heads'
        api_key=args.api_key,
        max_batch=args.max_batch,
        prefill_chunk=args.prefill_chunk,
        prefill_ratio=args.prefill_ratio,
    )
    app = create_app(target, config, draft=draft)
    print(
        f"# serving {args.served_model_name or args.target} at http://{args.host}:{args.port}/v1 "
        f"(drafter {args.drafter}, k {k}); Ctrl-C stops",
        file=sys.stderr,
    )
    run_server(app, args.host, args.port)
    return 0
