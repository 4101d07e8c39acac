"""`specdec bench`: sweep k over a workload for each pair and write results.json, report.md and the plots."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from specdec.bench.config import QUICK_CATEGORIES, BenchConfig, Pair
from specdec.bench.workloads import PACKAGED, Prompt, default_workload, load_workload
from specdec.commands import flags
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


def add_parser(sub) -> None:
    """The command's parser and flags, on the command line's subparsers."""
    b = sub.add_parser(
        "bench", help="sweep k over a workload: exactness, acceptance, costs, speed-up, cost model, peers"
    )
    b.add_argument(
        "--pair",
        action="append",
        type=Pair.parse,
        metavar="TARGET[:DRAFTER[:DRAFT]]",
        help="repeatable; default smollm2-135m:prompt-lookup",
    )
    b.add_argument(
        "--workload",
        type=flags.workload_type,
        help=f"a packaged workload ({', '.join(PACKAGED)}; default spec-bench) or a .jsonl of "
        "Spec-Bench or HumanEval rows",
    )
    b.add_argument("--categories", help="comma-separated categories to keep")
    b.add_argument("--limit", type=int, help="prompts per category (default 2; --quick: 1)")
    b.add_argument(
        "--k",
        dest="ks",
        type=flags.k_list,
        help="comma-separated draft lengths, `auto` included (default auto,1,2,3,4,6,8; --quick: auto,1,2,4)",
    )
    b.add_argument("--max-new-tokens", type=int, help="default 128; --quick: 48")
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument(
        "--peers",
        default=flags.default_peers(),
        help="comma-separated: hf, hf-lookup, hf-assisted (model pairs), llama-cpp, llama-cpp-lookup "
        "(need `pip install -e .[llama]`), llama-server, llama-server-draft (model pairs), llama-server-ngram, "
        "llama-server-ngram-mod (need `bash scripts/llama_server.sh`), or none (default: hf,hf-lookup, "
        "llama-cpp,llama-cpp-lookup where llama-cpp-python is installed, and llama-server,llama-server-draft,"
        "llama-server-ngram where llama-server is built)",
    )
    b.add_argument("--peer-k", type=int, default=4, help="draft length the peers use (default 4)")
    b.add_argument(
        "--quick", action="store_true", help="5 categories x 1 prompt, k auto,1,2,4, 48 tokens: 2-3 minutes on 2 cores"
    )
    b.add_argument(
        "--out", type=Path, default=Path("specdec-bench"), help="folder for results.json, report.md and plots"
    )
    b.add_argument(
        "--repeats", type=int, default=1, help="runs of each prompt per config; its median run counts (default 1)"
    )
    b.add_argument(
        "--no-interleave",
        dest="interleave",
        action="store_false",
        help="run each prompt's configs one after another, not together round by round",
    )
    b.add_argument(
        "--no-replay",
        dest="replay",
        action="store_false",
        help="skip replaying each config on the plain output under the measured costs (specdec.bench.replay)",
    )
    b.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    flags.loading_options(b)
    flags.draft_vocab_option(b)
    flags.recalibrate_option(b)
