"""`specdec bench`: sweep k over a workload for each pair and write results.json, report.md and the plots."""

from __future__ import annotations

import sys

import torch

from specdec.bench.config import QUICK_CATEGORIES, BenchConfig, Pair
from specdec.bench.workloads import Prompt, default_workload, load_workload
from specdec.commands.common import DTYPES, load_kwargs, recalibrate

KS = ["auto", 1, 2, 3, 4, 6, 8]  # --k's default
QUICK_KS = ["auto", 1, 2, 4]  # with --quick


def run(args) -> int:
    """Run the bench (--k comes parsed into a list of draft lengths), print the report, write the files."""
    from transformers.utils import logging as hf_logging

    from specdec.bench import results
    from specdec.bench.plot import plot_results
    from specdec.bench.report import markdown_report
    from specdec.bench.run import run_bench

    hf_logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    config, prompts = _config(args)
    recalibrate(args, [p.target for p in config.pairs])
    print(
        f"# bench: {len(config.pairs)} pair(s), {len(prompts)} prompts of {config.workload}, k {list(config.ks)}, "
        f"{config.max_new_tokens} new tokens, temperature {config.temperature}",
        file=sys.stderr,
    )
    res = run_bench(config, prompts)
    path = results.save(res, args.out / "results.json")
    report = markdown_report(res)
    (args.out / "report.md").write_text(report)
    pngs = plot_results(res, args.out)
    print(report)
    print(f"wrote {path}, {args.out / 'report.md'} and {len(pngs)} plots in {args.out}", file=sys.stderr)
    return 0


def _config(args) -> tuple[BenchConfig, list[Prompt]]:
    """The bench's config from the parsed arguments (their defaults filled in, --quick's smaller),
    and the workload's prompts it selects. Raises what load_workload raises for a bad workload."""
    ks = args.ks or list(QUICK_KS if args.quick else KS)
    workload = args.workload or default_workload()
    categories = (
        args.categories.split(",")
        if args.categories
        else (QUICK_CATEGORIES if args.quick and workload.name.startswith("spec_bench") else None)
    )
    limit = args.limit or (1 if args.quick else 2)
    config = BenchConfig(
        pairs=tuple(args.pair or [Pair("smollm2-135m")]),
        workload=workload.name,
        ks=tuple(ks),
        max_new_tokens=args.max_new_tokens or (48 if args.quick else 128),
        temperature=args.temperature,
        peers=() if args.peers in ("", "none") else tuple(args.peers.split(",")),
        peer_k=args.peer_k,
        repeats=args.repeats,
        replay=args.replay,
        interleave=args.interleave,
        quick=args.quick,
        limit=limit,
        load=load_kwargs(args),
        draft_dtype=DTYPES[args.draft_dtype or args.dtype],
        draft_quantize=args.draft_quantize,
        draft_vocab=args.draft_vocab,
    )
    return config, load_workload(workload, categories, limit)
