"""`specdec bench`: sweep k over a workload for each pair and write results.json, report.md and the plots."""

from __future__ import annotations

import sys

import torch

from specdec.bench.run import Pair
from specdec.bench.workloads import default_workload, load_workload
from specdec.commands.common import DTYPES, load_kwargs, recalibrate

KS = ["auto", 1, 2, 3, 4, 6, 8]  # --k's default
QUICK_KS = ["auto", 1, 2, 4]  # with --quick


def run(args) -> int:
    """Run the bench (--k comes parsed into a list of draft lengths), print the report, write the files."""
    from transformers.utils import logging as hf_logging

    from specdec.bench import results
    from specdec.bench.plot import plot_results
    from specdec.bench.report import markdown_report
    from specdec.bench.run import QUICK_CATEGORIES, run_bench

    hf_logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    ks = args.ks or list(QUICK_KS if args.quick else KS)
    workload = args.workload or default_workload()
    categories = (
        args.categories.split(",")
        if args.categories
        else (QUICK_CATEGORIES if args.quick and workload.name.startswith("spec_bench") else None)
    )
    limit = args.limit or (1 if args.quick else 2)
    max_new = args.max_new_tokens or (48 if args.quick else 128)
    peers = [] if args.peers in ("", "none") else args.peers.split(",")
    prompts = load_workload(workload, categories, limit)
    pairs = args.pair or [Pair("smollm2-135m")]
    recalibrate(args, [p.target for p in pairs])
    print(
        f"# bench: {len(pairs)} pair(s), {len(prompts)} prompts of {workload.name}, k {ks}, "
        f"{max_new} new tokens, temperature {args.temperature}",
        file=sys.stderr,
    )
    res = run_bench(
        pairs,
        prompts,
        workload.name,
        ks,
        max_new,
        args.temperature,
        peers,
        args.quick,
        args.peer_k,
        categories,
        limit,
        repeats=args.repeats,
        replay=args.replay,
        interleave=args.interleave,
        draft_dtype=DTYPES[args.draft_dtype or args.dtype],
        draft_quantize=args.draft_quantize,
        draft_vocab=args.draft_vocab,
        **load_kwargs(args),
    )
    path = results.save(res, args.out / "results.json")
    report = markdown_report(res)
    (args.out / "report.md").write_text(report)
    pngs = plot_results(res, args.out)
    print(report)
    print(f"wrote {path}, {args.out / 'report.md'} and {len(pngs)} plots in {args.out}", file=sys.stderr)
    return 0
