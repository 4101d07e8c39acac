"""`specdec train`: fit a feature-level draft head (specdec.train.head, after EAGLE) to a target on
self-distilled data.

1. prompts (specdec.train.selfdistill): generated from templates and topics (`training_prompts`),
   and optionally written by the target itself (`sampled_prompts`: it samples a user's turn),
   never from the workloads, so the benchmarks stay unseen; or real conversations
   (TrainConfig.data, specdec.train.conversations);
2. data: the target's own greedy answers to them (transformers' batched `generate`, chat
   template), stored as token ids in `<out>/data.json` (written atomically, reused on a rerun);
3. features: one teacher-forced lean forward per sequence gives every position's feature f_t and
   the target's greedy next token (the label), from the forward the head will draft against (a
   GGUF target at its own precision: the quantized one; its embedding and output rows too);
4. training (the loss: specdec.train.loss): at position t the head reads (f_t plus a little
   noise, e(x_{t+1})) and is trained to predict f_{t+1} (smooth L1) and the target's next token
   from it (cross-entropy over the head's vocabulary, weight 0.5: EAGLE (Li et al. 2024) uses
   0.1; greedy acceptance depends on the token), and, with steps > 1, the same again from its
   own predicted features for draft steps 2..steps (the training-time test of EAGLE-3 / HASS:
   drafting feeds its predictions back, so training does too); AdamW, cosine schedule, one sequence per update;
   a checkpoint after every epoch (`<out>/checkpoint.pt`, atomic) from which a rerun resumes;
5. output: the head (`<cache>/heads/<target>.safetensors` unless --head-out), `<out>/loss.png`
   and `<out>/summary.json` (losses and held-out accuracy per draft step and epoch).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from specdec.cache import LeanKVCache
from specdec.models.load import Model
from specdec.models.weights import atomic_write
from specdec.train.conversations import ConversationConfig, dataset_rows
from specdec.train.head import DraftHead, head_file, load_head, save_head
from specdec.train.loss import HeadLoss
from specdec.train.plot import plot_loss
from specdec.train.selfdistill import training_rows


@dataclass(frozen=True)
class TrainConfig:
    """What `specdec train` is asked for; train_head checks it.

    Self-distilled data (steps 1-2): prompts template prompts (>= 2) plus sampled ones the target
    writes, answered greedily up to max_new_tokens each, `batch` at a time.

    Real conversations instead (data: "sharegpt" or a JSON / JSONL file, specdec.train.conversations):
    up to `conversations` of them, cut to max_tokens tokens each, trained on their assistant turns,
    skipping any that contains one of the `exclude` texts (`specdec train` passes every packaged
    benchmark prompt); code_only: only those whose user turns contain code. answers: whose
    assistant turns: "sharegpt" (the dataset's), "self" (the target's own answers to its user
    turns, up to answer_tokens each, greedy at answer_temperature 0, else sampled: Medusa-2's
    self-distillation, stored in out/answers/ and reused on a rerun) or "mix" (both).

    Training (step 4): epochs (>= 1) of AdamW at learning rate lr, cosine schedule; vocab: the
    head's vocabulary size (0 < vocab <= the target's); noise: amplitude of the uniform noise on
    the features read; ce_weight: the cross-entropy's weight; steps: draft steps trained (>= 1, the
    training-time test); taps: decoder layers (0-based) whose hidden states the head's first step
    also reads (EAGLE-3's fused features; DraftHead.default_taps gives EAGLE-3's choice), () for
    the final feature alone; init: a head file to start from instead of a fresh head (fine-tuning;
    its vocabulary and taps are kept, vocab and taps ignored); seed: of every random choice;
    restart: ignore a checkpoint in the output folder.

    Output (step 5): head_out, the head file (default: `<cache>/heads/<target>.safetensors`, cache
    None for specdec's cache folder)."""

    prompts: int = 320
    sampled: int = 0
    max_new_tokens: int = 128
    batch: int = 16
    data: str | None = None
    conversations: int = 2000
    max_tokens: int = 512
    exclude: tuple[str, ...] = ()
    code_only: bool = False
    answers: str = "sharegpt"
    answer_temperature: float = 0.0
    answer_tokens: int = 256
    epochs: int = 12
    lr: float = 1e-3
    vocab: int = 8192
    noise: float = 0.1
    ce_weight: float = 0.5
    steps: int = 3
    taps: tuple[int, ...] = ()
    init: Path | None = None
    seed: int = 0
    restart: bool = False
    head_out: Path | None = None
    cache: Path | str | None = None


def features_and_labels(
    target: Model, rows: list[dict], taps: tuple[int, ...] = ()
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per sequence (tokens (T,), features (T, d (1 + len(taps))) fp32: the final-normed hidden
    state, then those after the decoder layers `taps`; labels (T,): the target's greedy token
    after each position, -1 where a row's "mask" is false (a conversation's user turns: no
    training there)), from one lean forward each: the forward the head drafts against, so a GGUF
    target at its own precision gives its quantized forward's features (batch-invariant: those a
    drafting forward computes, bit for bit) and its greedy tokens."""
    out = []
    for row in tqdm(rows, desc="target features", unit="seq"):
        tokens = row["prompt"] + row["answer"]
        kv = LeanKVCache(target, capacity=len(tokens), taps=taps)
        labels = kv.extend(tokens).argmax(-1)
        if "mask" in row:
            labels = torch.where(torch.tensor(row["mask"]), labels, -1)
        out.append((torch.tensor(tokens), kv.features[: len(tokens)].float().clone(), labels))
    return out


def choose_vocab(data, vocab_size: int, n: int) -> torch.Tensor:
    """The n token ids the head may draft: those the target emits most in the data, then the
    lowest ids not chosen yet (BPE gives frequent merges low ids)."""
    counts = torch.zeros(vocab_size)
    for _, _, labels in data:
        counts += torch.bincount(labels[labels >= 0], minlength=vocab_size)[:vocab_size].float()
    seen = [int(i) for i in counts.argsort(descending=True) if counts[i] > 0][:n]
    chosen = set(seen)
    rest = [i for i in range(vocab_size) if i not in chosen][: n - len(seen)]
    return torch.tensor(sorted(seen + rest))


def train_head(target: Model, out: Path, config: TrainConfig | None = None, conversation_data=None) -> dict:
    """Run steps 1-5 of the module docstring as `config` says (TrainConfig; its defaults when None),
    writing into the folder `out`; returns the summary dict (also in out/summary.json).

    conversation_data: specdec.answers.conversation_data, needed for config.answers "self" or
    "mix" (passed in: it runs the batched engine, a layer above training).

    Raises:
        ValueError: a target the lean backend cannot run, bad settings, a tap layer the target
            lacks, or answers "self" / "mix" without conversation_data.
        HeadError: an init head made for another target.
        DataError: conversations that cannot be read (specdec.train.conversations)."""
    config = config or TrainConfig()
    _check(target, config)
    start = load_head(config.init, target.lean().hidden_size)[0] if config.init is not None else None
    taps = sorted(set(config.taps)) if start is None else list(start.taps)  # fine-tuned: its taps
    LeanKVCache(target, capacity=1, taps=tuple(taps))  # refuses a layer the target lacks, before the answers
    torch.manual_seed(config.seed)
    rows, source = _rows(target, out, config, conversation_data)
    data = features_and_labels(target, rows, tuple(taps))
    shuffled = random.Random(config.seed).sample(data, len(data))  # held out: 5% of template and sampled prompts alike
    held = max(1, len(data) // 20)
    train, valid = shuffled[held:], shuffled[:held]
    vocab_ids = choose_vocab(train, target.vocab_size, config.vocab) if start is None else start.vocab_ids
    index = torch.full((target.vocab_size,), -1, dtype=torch.long)
    index[vocab_ids] = torch.arange(len(vocab_ids))
    lean = target.lean()  # the forward the head drafts against: a GGUF target's quantized one at its own precision
    embed = lean.embed_rows  # token ids (n,) -> (n, d): a quantized embedding's rows dequantized
    out_weight = lean.output_rows(vocab_ids)  # (N, d) fp32: the rows drafting multiplies, never a whole fp32 model
    head = DraftHead.for_target(target, vocab_ids, taps) if start is None else start
    loss = HeadLoss(head, embed, out_weight, index, ce_weight=config.ce_weight, steps=config.steps)
    history = _fit(loss, train, valid, vocab_ids, config, out / "checkpoint.pt")

    dest = config.head_out or head_file(target.name, config.cache)
    summary = {
        "target": target.name,
        **source,
        "sequences": len(data),
        "positions": sum(int((labels >= 0).sum()) for _, _, labels in data),
        "max_new_tokens": config.max_new_tokens,
        "epochs": config.epochs,
        "steps": config.steps,
        "vocab": len(vocab_ids),
        "init": str(config.init) if config.init is not None else None,
        "taps": taps,
        "history": history,
        "head": str(dest),
    }
    save_head(head, dest, meta={k: v for k, v in summary.items() if k != "head"})
    atomic_write(out / "summary.json", lambda tmp: Path(tmp).write_text(json.dumps(summary, indent=1)))
    plot_loss(
        history, out / "loss.png", "loss (smooth L1 + w x CE, steps x 0.8^(j-1))", "held-out accuracy, draft step 1"
    )
    return summary


def _check(target: Model, config: TrainConfig) -> None:
    """Raises ValueError for a target the lean backend cannot run or settings out of range."""
    if target.backend != "lean":
        raise ValueError("specdec train reads the target's features through the lean backend: a Llama or Qwen2 target")
    c = config
    if c.prompts < 2 or c.epochs < 1 or c.steps < 1 or not 0 < c.vocab <= target.vocab_size:
        raise ValueError(f"need prompts >= 2, epochs >= 1, steps >= 1 and 0 < vocab <= {target.vocab_size}")


def _rows(target: Model, out: Path, config: TrainConfig, conversation_data) -> tuple[list[dict], dict]:
    """Steps 1-2: the training rows and their description for the summary: config.data's
    conversations, else the self-distilled rows (specdec.train.selfdistill). Raises ValueError
    for answers or code_only without data, and for answers "self" / "mix" without
    conversation_data."""
    c = config
    conversations = ConversationConfig(
        n=c.conversations,
        max_tokens=c.max_tokens,
        exclude=c.exclude,
        seed=c.seed,
        code_only=c.code_only,
        temperature=c.answer_temperature,
        max_new_tokens=c.answer_tokens,
        batch=c.batch,
    )
    if c.data is not None and c.answers == "sharegpt":
        return dataset_rows(target, c.data, conversations)
    if c.data is not None:
        if conversation_data is None:
            raise ValueError(f"answers={c.answers!r} needs conversation_data (specdec.answers.conversation_data)")
        return conversation_data(target, c.data, out / "answers", c.answers, conversations)
    if c.answers != "sharegpt" or c.code_only:
        raise ValueError(f"answers={c.answers!r} or code_only needs data (the conversations whose user turns to use)")
    rows = training_rows(target, out, c.prompts, c.sampled, c.max_new_tokens, batch=c.batch, seed=c.seed)
    return rows, {"data": "self-distilled", "prompts": c.prompts, "sampled_prompts": c.sampled}


def _fit(loss: HeadLoss, train: list, valid: list, vocab_ids: torch.Tensor, config: TrainConfig, ckpt: Path):
    """Step 4: the epochs left after the checkpoint `ckpt` (unless config.restart), each followed
    by the held-out accuracy and a checkpoint; returns the history, one dict per epoch."""
    opt = torch.optim.AdamW(loss.head.parameters(), lr=config.lr, weight_decay=0.0)
    updates = config.epochs * len(train)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, updates) / updates)))
    history = [] if config.restart else _resume(ckpt, loss, opt, sched, vocab_ids)
    order = random.Random(config.seed)
    for epoch in range(len(history), config.epochs):
        start = time.perf_counter()
        desc = f"epoch {epoch + 1}/{config.epochs}"
        sums, acc_sums = _train_epoch(loss, opt, sched, train, order, desc=desc, noise=config.noise)
        loss.head.eval()
        with torch.no_grad():
            scores = [loss(*s, 0.0)[3] for s in valid]
        v_accs = [sum(a[j] for a in scores) / len(scores) for j in range(loss.steps)]
        n = len(train)
        history.append(
            {
                "epoch": epoch + 1,
                "loss": sums[0] / n,
                "regression": sums[1] / n,
                "ce": sums[2] / n,
                "train_acc": acc_sums[0] / n,
                "heldout_acc": v_accs[0],
                "heldout_acc_by_step": v_accs,
                "seconds": time.perf_counter() - start,
            }
        )
        print(
            f"epoch {epoch + 1}: loss {sums[0] / n:.4f}, step-one accuracy train {acc_sums[0] / n:.3f}, "
            f"held-out by draft step {' '.join(f'{a:.3f}' for a in v_accs)}"
        )
        state = {"head": loss.head.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
        state |= {"history": history, "config": loss.head.config, "vocab_ids": vocab_ids, "steps": loss.steps}
        atomic_write(ckpt, partial(torch.save, state))
    return history


def _resume(ckpt: Path, loss: HeadLoss, opt, sched, vocab_ids: torch.Tensor) -> list[dict]:
    """The history of the checkpoint `ckpt`, its head, optimizer and schedule loaded, when it is
    one of the same head, vocabulary and draft steps; else []."""
    if not ckpt.is_file():
        return []
    state = torch.load(ckpt, weights_only=False)
    same = state["config"] == loss.head.config and torch.equal(state["vocab_ids"], vocab_ids)
    if not (same and state.get("steps") == loss.steps):
        return []
    loss.head.load_state_dict(state["head"])
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    print(f"resuming from {ckpt} after epoch {len(state['history'])}")
    return state["history"]


def _train_epoch(loss: HeadLoss, opt, sched, train: list, order: random.Random, desc: str, noise: float):
    """One pass over `train` in an order drawn from `order`, one update per sequence; returns the
    sums over it of (total, regression, cross-entropy) and of each draft step's accuracy."""
    loss.head.train()
    sums, acc_sums = [0.0, 0.0, 0.0], [0.0] * loss.steps
    perm = list(range(len(train)))
    order.shuffle(perm)
    bar = tqdm(perm, desc=desc, unit="seq")
    for i in bar:
        total, reg, ce, accs = loss(*train[i], noise)
        opt.zero_grad()
        total.backward()
        torch.nn.utils.clip_grad_norm_(loss.head.parameters(), 1.0)
        opt.step()
        sched.step()
        for j, v in enumerate((total, reg, ce)):
            sums[j] += float(v.detach())
        acc_sums = [a + b for a, b in zip(acc_sums, accs)]
        bar.set_postfix(loss=f"{sums[0] / (bar.n + 1):.3f}", acc=" ".join(f"{a / (bar.n + 1):.2f}" for a in acc_sums))
    return sums, acc_sums
