"""`specdec generate`: one generation, streamed, with its stats; --compare also runs plain decoding
and compares speed and tokens."""

from __future__ import annotations

import io
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

from specdec.adaptive import AdaptiveK, VerifyCosts
from specdec.bench.workloads import PACKAGED, load_workload
from specdec.commands import flags
from specdec.commands.common import load_kwargs, recalibrate
from specdec.drafters.factory import REGISTERED, check_options, drafter_from_options, options_for
from specdec.drafters.precision import draft_quantize
from specdec.engine import generate
from specdec.exactness import first_divergence
from specdec.grammar import Grammar, GrammarError
from specdec.models.load import Model, load_model
from specdec.options import GenerationOptions
from specdec.textstream import TextDeltas

COMPARE_RUNS = 3  # --compare times each path this many times, alternately, and reports the medians

# the flag of each grammar kind (specdec.commands.flags.grammar_options)
GRAMMAR_FLAGS = {
    "json_schema": "--json-schema",
    "json_object": "--json-object",
    "regex": "--regex",
    "choice": "--choice",
    "lark": "--grammar",
}


def run(args) -> int:
    """Generate from the prompt (or the --workload row) and print the text, the stats and, with
    --compare, the comparison with plain decoding. -k, --k-max and --max-new-tokens come checked
    by the parser; the rest of the cheap checks run before any model loads."""
    run = GenerationOptions(  # checked here, before any model loads
        k=args.k,
        k_max=args.k_max,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        stop=args.stop,
        logit_bias=tuple(args.logit_bias),
        stop_token_ids=tuple(args.stop_token_ids),
        ignore_eos=args.ignore_eos,
        grammar=args.grammar,
    )
    options = _drafter_options(args)
    if args.workload:
        prompt = workload_prompt(args.workload, args.category, args.row)
    elif args.prompt is None:
        raise ValueError("give a PROMPT or --workload NAME|FILE")
    else:
        prompt = args.prompt
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # transformers' per-load "Loading weights" bars
    recalibrate(args, [args.target])
    target = load_model(args.target, **load_kwargs(args))
    if "draft" in options:
        draft_kwargs = load_kwargs(args, draft=True)
        draft_kwargs["quantize"] = draft_quantize(target, args.draft, draft_kwargs)  # measured where not given
        if args.draft_quantize is None and draft_kwargs["quantize"]:
            print(
                f"# draft requantized to {draft_kwargs['quantize'].upper()} at load, the faster on this machine as "
                "measured (--draft-quantize none keeps its file's precision)",
                file=sys.stderr,
            )
        options["draft"] = load_model(args.draft, **draft_kwargs)
    drafter = drafter_from_options(args.drafter, **options)
    ids = target.encode(prompt, chat=args.chat)
    with _one_line_grammar_errors(args.grammar):
        return _generate(args, target, drafter, ids, run)


def _generate(args, target, drafter, ids: list[int], run: GenerationOptions) -> int:
    """The runs of `specdec generate` once the models are loaded: run holds the generation options
    that the speculative run and --compare's plain one share (like with like). --compare runs
    each path COMPARE_RUNS times, alternately (this one streamed, the others to nowhere), each
    speculative run with a policy of its own (-k auto learns acceptance as it goes)."""
    costs = None
    if args.k == "auto" and drafter is not None:  # -k auto: over this machine's cached verify-cost curve
        costs = VerifyCosts.for_model(target, args.cache_dir)

    def speculative(options: GenerationOptions, stream):
        policy = AdaptiveK(costs.fork(), k_max=args.k_max) if costs is not None else None
        return generate(target, ids, drafter, options, policy=policy, stream=stream)

    def plain(stream):
        return generate(target, ids, None, run, stream=stream)

    def quietly(go):  # like with like: a timed run streams its text as the shown one does, to nowhere
        quiet = TextStreamer(target.tokenizer, args.stop, out=io.StringIO())
        out = go(quiet)
        quiet.finish(out.text)
        return out

    if args.compare:  # warm up both paths so neither pays first-call costs in the timing
        speculative(run.replace(max_new_tokens=4), None)
        generate(target, ids, None, run.replace(max_new_tokens=4))

    draft = getattr(drafter, "draft", None)  # a draft model's drafter: say what precision it runs at
    drafter_text = f"{args.drafter} ({args.draft}, {draft.precision})" if isinstance(draft, Model) else args.drafter
    print(
        f"# target {args.target} ({target.precision}), drafter {drafter_text}, k {args.k}, prompt {len(ids)} tokens",
        file=sys.stderr,
    )
    streamer = TextStreamer(target.tokenizer, args.stop)
    spec = speculative(run, streamer)
    streamer.finish(spec.text)
    print("\n--- speculative" if args.k else "\n--- plain")
    print(spec.stats.summary())
    if args.grammar is not None:  # RunStats.summary() leaves the grammar's forced tokens out
        print(f"grammar ({args.grammar.kind}): {spec.stats.forced} tokens forced, verified as free drafts")
    if args.compare:
        plains, specs = [quietly(plain)], [spec]
        for _ in range(COMPARE_RUNS - 1):
            specs.append(quietly(lambda stream: speculative(run, stream)))
            plains.append(quietly(plain))
        print("--- compare")
        print("\n".join(compare_lines([r.stats for r in plains], [r.stats for r in specs])))
        why = why_line([r.stats for r in plains], [r.stats for r in specs])
        if why:
            print(why)
        print(_identical_line(target, ids, plains[0].tokens, spec.tokens, args.temperature))
    return 0


@contextmanager
def _one_line_grammar_errors(grammar: Grammar | None):
    """A GrammarError (llguidance refusing the grammar against the target's tokenizer) as one line
    naming the flag, for main()'s `error:` line."""
    try:
        yield
    except GrammarError as e:
        flag = GRAMMAR_FLAGS[grammar.kind] if grammar is not None else "grammar"
        raise GrammarError(f"{flag}: {' '.join(str(e).split())}") from None


def _identical_line(target, ids, plain_tokens, spec_tokens, temperature: float) -> str:
    """--compare's verdict on the tokens: identical, or where and why they first differ."""
    if temperature > 0:
        return "identical to plain: not expected when sampling (the distribution is the same, not the draws)"
    d = first_divergence(target, ids, plain_tokens, spec_tokens)
    if d is None:
        return "identical to plain greedy: yes"
    return (
        f"identical to plain greedy: NO: first difference at new token {d.position} "
        f"(plain {d.plain_token}, speculative {d.other_token}); the target's top-2 logit "
        f"gap there is {d.logit_gap:.3g}, {d.logit_gap / d.logit_ulp:.3g} ulp of the logits' dtype "
        f"({'a floating-point near-tie' if d.near_tie else 'NOT a near-tie: a bug, please report it'})"
    )


def _drafter_options(args) -> dict:
    """The options of the drafter from its flags (options_for), checked (check_options): raises
    ValueError for a flag given that the drafter does not take (--max-ngram with --drafter suffix)
    or one it needs, naming it. The draft is still a spec here: load it to build."""
    flags = dict(
        draft=args.draft,
        layers=args.layers,
        head=args.head,
        corpus=args.corpus,
        cache=args.cache_dir,
        quantize=None if _loads_a_draft(args.drafter) else args.draft_quantize,  # a draft model's: at its load
        vocab=args.draft_vocab,
        max_ngram=args.max_ngram,
        min_ngram=args.min_ngram,
        min_match=args.min_match,
    )
    given = {o: v for o, v in flags.items() if v is not None and o != "cache"}  # --cache-dir serves all
    check_options(args.drafter, **given)
    return options_for(args.drafter, flags)


def workload_prompt(path: Path, category: str | None, row: int) -> str:
    """The text of row `row` (from 0) of a workload file, within `category` if given."""
    prompts = load_workload(path, [category] if category else None)
    if not 0 <= row < len(prompts):
        raise ValueError(
            f"{path.name} has {len(prompts)} rows{' of category ' + category if category else ''}; "
            f"--row {row} is out of range"
        )
    return prompts[row].text


def compare_lines(plains: list, specs: list) -> list[str]:
    """--compare's speed lines for each path's runs (RunStats, one or more): the median over its
    runs of tokens per second while decoding (after prefill: what speculation changes) and end to
    end (prefill included), and the ratios of those medians. Raises ValueError for no runs."""
    if not plains or not specs:
        raise ValueError("compare_lines needs at least one run of each path")

    def speed(runs) -> tuple[float, float, str]:
        decoding = statistics.median(s.decode_tokens_per_s for s in runs)
        total = statistics.median(s.tokens_per_s for s in runs)
        prefill = statistics.median(s.prefill_s for s in runs)
        text = f"{decoding:.1f} tokens/s decoding, {total:.1f} end to end "
        text += f"({runs[0].new_tokens} tokens, prefill {prefill * 1e3:.0f} ms)"
        return decoding, total, text

    (pd, pt, plain), (sd, st, spec) = speed(plains), speed(specs)
    runs = f"; medians of {len(plains)} runs each, alternated" if len(plains) > 1 else ""
    return [
        f"plain decoding:  {plain}",
        f"speculative:     {spec}",
        f"speed-up:        {sd / pd:.2f}x decoding, {st / pt:.2f}x end to end (prefill included{runs})",
    ]


def why_line(plains: list, specs: list) -> str | None:
    """The cost model's account of the decoding speed-up (Leviathan et al. 2023, with measured
    costs): a round yields tau tokens (bonus included) for the time of V(k+1)/V(1) plain steps
    verifying plus k*c drafting plus its other work, where a plain step is the plain runs' median
    seconds per token while decoding and each quantity is the speculative runs' pooled mean per
    round; tau over that sum is the predicted speed-up. None without rounds."""
    step = statistics.median((s.total_s - s.prefill_s) / s.new_tokens for s in plains if s.new_tokens)
    rounds = sum(s.rounds for s in specs)
    drafted = sum(s.drafted for s in specs)
    if not rounds or step <= 0:
        return None
    verify = sum(s.verify_s for s in specs) / rounds / step
    draft = sum(s.draft_s for s in specs) / rounds / step
    other = sum(s.other_s for s in specs) / rounds / step
    tau = sum(s.new_tokens for s in specs) / rounds
    k = drafted / rounds
    c = draft / k if k else 0.0
    alpha = sum(s.accepted for s in specs) / drafted if drafted else float("nan")
    return (
        f"why:             a round yields tau {tau:.2f} tokens (k {k:.2f} drafted, alpha {alpha:.2f}) for "
        f"{verify:.2f} plain steps verifying (V(k+1)/V(1)) + {draft:.2f} drafting (k x c, c {c:.2f}) + {other:.2f} "
        f"other: {tau:.2f} / {verify + draft + other:.2f} = {tau / (verify + draft + other):.2f}x decoding"
    )


class TextStreamer:
    """Prints text as tokens arrive, holding back what could still change: an incomplete UTF-8
    character, or the start of a stop string (specdec.textstream). out: default sys.stdout."""

    def __init__(self, tokenizer, stop: list[str], out=None):
        self.deltas, self.out = TextDeltas(tokenizer, stop), out

    def __call__(self, new_tokens: list[int]) -> None:
        """Write the text these new tokens settle."""
        self._write(self.deltas(new_tokens))

    def finish(self, final_text: str) -> None:
        """Write the rest of the final text, and a newline."""
        self._write(final_text[self.deltas.sent :] + "\n")

    def _write(self, piece: str) -> None:
        if piece:
            out = self.out or sys.stdout
            out.write(piece)
            out.flush()


def _loads_a_draft(drafter: str) -> bool:
    """Whether the drafter drafts with a draft model (its --draft-quantize is applied when it loads)."""
    entry = REGISTERED.get(drafter)
    return entry is not None and "draft" in entry.options


def add_parser(sub) -> None:
    """The command's parser and flags, on the command line's subparsers."""
    g = sub.add_parser("generate", help="generate text, speculatively, and print the stats")
    g.add_argument("prompt", nargs="?", help="the prompt text (or use --workload)")
    flags.target_option(g)
    flags.drafter_options(g)
    flags.generation_options(g)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--compare", action="store_true", help="also run plain decoding and compare speed and tokens")
    g.add_argument(
        "--workload",
        type=flags.workload_type,
        help=f"take the prompt from a workload: a packaged one ({', '.join(PACKAGED)}) or a .jsonl file",
    )
    g.add_argument("--category", help="with --workload: only rows of this category")
    g.add_argument("--row", type=int, default=0, help="with --workload: which (filtered) row, from 0")
    flags.loading_options(g)
    flags.draft_vocab_option(g)
    flags.recalibrate_option(g)
