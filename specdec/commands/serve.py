"""`specdec serve`: load the models and run the OpenAI-compatible HTTP server until Ctrl-C."""

from __future__ import annotations

import os
import sys

import torch

from specdec.commands import flags
from specdec.commands.common import k_arg, load_kwargs, recalibrate
from specdec.drafters.factory import DRAFTERS, check_options, options_for
from specdec.drafters.precision import draft_quantize
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
    draft = None
    if args.draft:
        draft_kwargs = load_kwargs(args, draft=True)
        draft_kwargs["quantize"] = draft_quantize(target, args.draft, draft_kwargs)  # measured where not given
        draft = load_model(args.draft, **draft_kwargs)
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


def add_parser(sub) -> None:
    """The command's parser and flags, on the command line's subparsers."""
    sv = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /metrics"
    )
    flags.target_option(sv)
    sv.add_argument(
        "--drafter",
        choices=[*sorted(DRAFTERS), "none"],
        help="default drafter of a request that names none (default: model-lookup with --draft, else prompt-lookup)",
    )
    sv.add_argument("--draft", help="draft model for the model drafter (same kinds of spec as --target)")
    sv.add_argument(  # checked by the command, not here: a bad -k is one `error:` line (tests/test_serve.py)
        "-k",
        default="auto",
        help="default draft length per round: auto (default, chosen every round), "
        "or a fixed number; 0 = plain decoding",
    )
    sv.add_argument("--max-ngram", type=int, default=3, help="prompt-lookup: longest n-gram to match (default 3)")
    sv.add_argument("--min-ngram", type=int, default=1, help="prompt-lookup: shortest n-gram to match (default 1)")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    sv.add_argument("--port", type=int, default=8000, help="default 8000")
    sv.add_argument(
        "--max-queue", type=int, default=64, help="requests that may wait beyond the batch; past it: 429 (default 64)"
    )
    sv.add_argument("--max-tokens", type=int, default=256, help="default max_tokens of a request (default 256)")
    sv.add_argument(
        "--max-batch", type=int, default=64, help="sequences decoded at once in one continuous batch (default 64)"
    )
    sv.add_argument(
        "--prefill-chunk",
        type=int,
        default=128,
        help="prompt tokens a batch step may feed while prompts wait (chunked prefill; default 128)",
    )
    sv.add_argument(
        "--prefill-ratio",
        type=int,
        default=16,
        help="or this many per decoding sequence where that is more, so that a burst of prompts is not held back by "
        "the decoders' rows (default 16; 0: --prefill-chunk alone)",
    )
    sv.add_argument("--served-model-name", help="the model id clients send (default: the --target spec)")
    sv.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    sv.add_argument(
        "--api-key",
        default=os.environ.get("SPECDEC_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/ requests, else 401 (default: $SPECDEC_API_KEY, else none)",
    )
    flags.loading_options(sv)
    flags.recalibrate_option(sv)
