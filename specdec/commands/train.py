"""`specdec train`: train a feature-level draft head (EAGLE-style) for a target on its own outputs."""

from __future__ import annotations

from specdec.bench.workloads import PACKAGED, load_workload, workload_path
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
