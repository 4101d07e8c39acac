"""`specdec loadtest`: concurrent streaming requests at each concurrency level against specdec's
server (one per drafter, started here), vLLM peers, or a running server (--url); prints the table
and, with --out, writes serving.json and README.md."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

from specdec.bench.workloads import load_workload, workload_path
from specdec.commands import flags
from specdec.commands.common import load_kwargs
from specdec.models.load import gguf_file_of, load_model
from specdec.models.weights import cache_dir


def run(args) -> int:
    """Check the flags, drive every server over the levels, print the table, write the files (-k
    comes parsed)."""
    from specdec.bench.serving import PEERS
    from specdec.serve import loadtest

    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    bad = [p for p in peers if p not in PEERS]
    if bad or not levels or min(levels) < 1 or args.limit < 1 or args.max_tokens < 1 or (args.requests or 1) < 1:
        raise ValueError(
            f"--peers takes {', '.join(PEERS)}"
            if bad
            else "--concurrency, --limit, --requests and --max-tokens must be >= 1"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    prompts = load_workload(workload_path(args.workload), limit=args.limit)
    n = args.requests or len(prompts)
    drive = _driver(args, levels)
    if args.url:
        rows = _drive_url(args, prompts, n, drive)
    else:
        rows = _drive_started(args, prompts, n, peers, drive)
    print(loadtest.table(rows))
    if args.out:
        _write(args, rows, len(prompts), n)
    return 0


def _driver(args, levels: list[int]):
    """drive(name, url, model, requests, extra=None): the requests at each level, a line per level
    on stderr; returns the loadtest.Level of each."""
    import asyncio

    from specdec.serve import loadtest

    params = dict(max_tokens=args.max_tokens, temperature=args.temperature)

    def drive(name: str, url: str, model: str, requests, extra=None) -> list[loadtest.Level]:
        out = []
        for c in levels:
            level = asyncio.run(loadtest.run_level(url, model, requests, c, params, extra=extra, api_key=args.api_key))
            s = level.summary()
            print(
                f"# {name}: {c} concurrent, {s['tokens_per_s']:.1f} tokens/s aggregate, "
                f"TTFT p50 {s['ttft_ms']['p50']:.0f} ms, {s['failed']} failed",
                file=sys.stderr,
            )
            out.append(level)
        return out

    return drive


def _drive_url(args, prompts, n: int, drive) -> list:
    """--url: the prompts as chat messages to the running server (its first model unless --model)."""
    from openai import OpenAI

    from specdec.serve import loadtest

    requests = [loadtest.Request(messages=[{"role": "user", "content": p.text}]) for p in prompts]
    requests = [requests[i % len(requests)] for i in range(n)]
    model = args.model or OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key).models.list().data[0].id
    return loadtest.report(args.url, drive(args.url, args.url, model, requests))


def _drive_started(args, prompts, n: int, peers: list[str], drive) -> list:
    """The prompts, encoded by the target's chat template, to a specdec server per --drafter and a
    vLLM server per peer, each started here and stopped after (logs in the temporary folder)."""
    from transformers.utils import logging as hf_logging

    from specdec.bench.serving import specdec_server, vllm_server
    from specdec.models.weights import converted_folder
    from specdec.serve import loadtest

    rows = []
    hf_logging.disable_progress_bar()
    target = load_model(args.target, **load_kwargs(args))
    if target.gguf is None and any(p.startswith("llama-server") for p in peers):  # before any server runs
        raise ValueError(f"--peers llama-server runs a GGUF file: give a GGUF target, not {args.target}")
    draft_gguf = gguf_file_of(args.draft, cache_dir(args.cache_dir), args.pull) if args.draft else None
    if "llama-server-draft" in peers and draft_gguf is None:
        raise ValueError("--peers llama-server-draft runs a draft model's GGUF file: give --draft NAME|FILE.gguf")
    ids = [target.encode(p.text, chat=True) for p in prompts]
    requests = [loadtest.Request(ids=ids[i % len(ids)]) for i in range(n)]
    default = "none,model-lookup" if args.draft else "none,prompt-lookup"
    for drafter in [d.strip() for d in (args.servers if args.servers is not None else default).split(",") if d.strip()]:
        k = 0 if drafter == "none" else args.k
        serve = ["--target", args.target, "--drafter", drafter, "-k", str(k), "--max-tokens", str(args.max_tokens)]
        serve += ["--draft", args.draft] if args.draft else []
        serve += _loading_args(args) + (["--threads", str(args.threads)] if args.threads else [])
        name = "specdec plain" if drafter == "none" else f"specdec {drafter}, k={k}"
        with specdec_server(serve, log=Path(tempfile.gettempdir()) / f"specdec-serve-{drafter}.log") as url:
            rows += loadtest.report(name, drive(name, url, args.target, requests))
    for peer in peers:
        if peer.startswith("llama-server"):
            rows += _drive_llama_server(args, peer, target, requests, drive, draft_gguf)
            continue
        folder = converted_folder(args.target)
        k_peer = args.ngram_k if peer == "vllm-ngram" else 0
        with vllm_server(
            args.vllm_python, folder, args.target, k_peer, log=Path(tempfile.gettempdir()) / f"specdec-{peer}.log"
        ) as url:
            name = f"vLLM ngram k={k_peer}" if k_peer else "vLLM"
            rows += loadtest.report(name, drive(name, url, args.target, requests))
    return rows


def _drive_llama_server(args, peer: str, target, requests, drive, draft_gguf: Path | None) -> list:
    """llama-server (`peer`: plain, its n-gram drafter, or the draft model's file `draft_gguf`
    drafting --peer-k tokens) on the target's GGUF file, with as many slots as the highest
    concurrency level (the target has a GGUF file, the draft peer a draft file: checked before)."""
    from specdec.bench.serving import llama_server
    from specdec.serve import loadtest

    slots = max(int(x) for x in args.concurrency.split(",") if x.strip())
    threads = args.threads or torch.get_num_threads()
    log = Path(tempfile.gettempdir()) / f"specdec-{peer}.log"
    draft = str(draft_gguf) if peer == "llama-server-draft" else None
    with llama_server(peer, str(target.gguf.path), threads, slots, log=log, draft_gguf=draft, k=args.peer_k) as url:
        name = "llama.cpp server" + {
            "llama-server-ngram": " ngram-simple",
            "llama-server-draft": f" draft k={args.peer_k}",
        }.get(peer, "")
        return loadtest.report(name, drive(name, url, args.target, requests))


def _loading_args(args) -> list[str]:
    """The loading options as command-line flags again (for a server the load generator starts)."""
    out = ["--dtype", args.dtype, "--backend", args.backend, "--device", args.device]
    out += ["--quantize", args.quantize] if args.quantize else []
    out += ["--kv-cache", args.kv_cache] if args.kv_cache else []
    out += ["--pull"] if args.pull else []
    out += ["--cache-dir", args.cache_dir] if args.cache_dir else []
    return out


def _write(args, rows: list, n_prompts: int, n: int) -> None:
    """--out: serving.json (the run's environment and rows) and README.md (a results/ entry)."""
    import json

    from specdec.bench.environment import environment
    from specdec.serve import loadtest

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": "specdec " + " ".join(sys.argv[1:]),
        **environment(),
        "target": args.target if not args.url else args.url,
        "workload": str(args.workload),
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
    }
    (out / "serving.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    (out / "README.md").write_text(
        f"# Serving: {args.target}, {args.workload} ({n_prompts} prompts, {n} requests per level), "
        f"{args.max_tokens} tokens, temperature {args.temperature}\n\n{meta['cpu']}, "
        f"{meta['threads']} threads. `{meta['command']}`\n\n{loadtest.table(rows)}\n"
    )


def add_parser(sub) -> None:
    """The command's parser and flags, on the command line's subparsers."""
    lt = sub.add_parser(
        "loadtest",
        help="concurrent streaming requests through the openai client: aggregate tokens/s, TTFT, TPOT, "
        "against specdec's server and peers (vLLM), or a running server (--url)",
    )
    lt.add_argument("--url", help="a running OpenAI-compatible server to drive (default: start specdec's)")
    lt.add_argument("--model", help="the model id to send with --url (default: the server's first)")
    lt.add_argument(
        "--target", default="smollm2-135m", help="the model specdec serves, and whose tokenizer encodes the prompts"
    )
    lt.add_argument("--workload", default="spec-bench", help="packaged name or .jsonl path (default spec-bench)")
    lt.add_argument("--limit", type=int, default=1, help="prompts per category (default 1)")
    lt.add_argument(
        "--requests", type=int, help="requests per level, the prompts cycled in file order (default: one per prompt)"
    )
    lt.add_argument("--concurrency", default="1,8", help="comma-separated levels (default 1,8)")
    lt.add_argument("--max-tokens", type=int, default=128, help="max_tokens of each request (default 128)")
    lt.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    lt.add_argument(
        "--drafter",
        dest="servers",  # not `drafter`: the CLI's default for generate and serve would fill it
        help="specdec's drafters, comma-separated, one server each (default none,prompt-lookup, with --draft "
        "none,model-lookup; none: plain)",
    )
    lt.add_argument(
        "--draft", help="a draft model (same kinds of spec as --target) for specdec's servers and llama-server-draft"
    )
    lt.add_argument("-k", type=flags.k_type, default="auto", help="specdec's draft length (default auto)")
    lt.add_argument(
        "--peers",
        default="",
        help="comma-separated: vllm, vllm-ngram (vLLM's server, --vllm-python), llama-server, llama-server-ngram, "
        "llama-server-draft (llama.cpp's server on the target's GGUF file, the last with --draft's drafting "
        "--peer-k tokens: `bash scripts/llama_server.sh`)",
    )
    lt.add_argument("--peer-k", type=flags.at_least(1), default=4, help="llama-server-draft's draft length (default 4)")
    flags.vllm_python_option(lt)
    lt.add_argument("--ngram-k", type=int, default=4, help="vllm-ngram's draft length (default 4)")
    lt.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY", "none"), help="sent as the bearer key")
    lt.add_argument("--out", help="folder for serving.json and README.md (a results/ entry)")
    lt.add_argument("--threads", type=int, help="torch threads of specdec's server (default: torch's choice)")
    flags.loading_options(lt, draft=False)
