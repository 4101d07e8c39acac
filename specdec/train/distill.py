"""`specdec distill`: a small draft model distilled from the target on the target's own outputs
(DistillSpec, Zhou et al. 2024: training the draft on the target's generations is what lifts its
acceptance most).

The student is the target's own architecture cut to a few of its decoder layers (evenly spaced,
first and last included), initialised from those layers and sharing the target's embedding,
final norm and output layer; so it has the target's tokenizer by construction, and before any
training it is a layer-skip draft (specdec.drafters.layerskip). The embedding and output layer
stay frozen; the kept layers and the final norm are trained with cross-entropy against the
target's greedy next token at every answer position of the self-distilled data
(specdec.train.selfdistill.training_rows: the target's greedy answers to generated prompts, never the
workloads), which is exactly the choice greedy verification accepts.

AdamW with a cosine schedule over padded batches; a checkpoint of the trained weights after every
epoch (`<out>/checkpoint.pt`, atomic) from which a rerun resumes; `<out>/loss.png` and
`<out>/summary.json` with the held-out next-token agreement with the target per epoch (epoch 0:
before training). The draft is written as a Hugging Face folder, atomically, to
`<cache>/drafts/<target>-distilled-<L>L` unless --draft-out; use it with
`--drafter model --draft <folder>`.
"""

from __future__ import annotations

import copy
import json
import math
import random
import re
import shutil
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specdec.models.load import Model
from specdec.models.weights import atomic_write, cache_dir
from specdec.train.plot import plot_loss
from specdec.train.selfdistill import training_rows


def spaced_layers(n_layers: int, n: int) -> list[int]:
    """n layer indices of 0..n_layers-1, evenly spaced, the first and the last included.
    Raises ValueError unless 1 <= n <= n_layers."""
    if not 1 <= n <= n_layers:
        raise ValueError(f"the draft keeps 1..{n_layers} of the target's {n_layers} layers, got {n}")
    if n == 1:
        return [n_layers - 1]
    return sorted({round(i * (n_layers - 1) / (n - 1)) for i in range(n)})


def student_from_target(target: Model, layers: list[int]) -> torch.nn.Module:
    """A transformers model of the target's class with only the decoder layers `layers` (indices
    into the target's), initialised from them; embedding, norms and output layer copied. fp32.
    With every layer kept it computes exactly what the target computes."""
    from transformers import AutoModelForCausalLM

    hf = target.hf
    config = copy.deepcopy(hf.config)
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in layers]
    student = AutoModelForCausalLM.from_config(config).float()
    source = hf.state_dict()
    mapped = {}
    for key in student.state_dict():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.*)", key)
        mapped[key] = source[f"model.layers.{layers[int(m[1])]}.{m[2]}" if m else key].float()
    student.load_state_dict(mapped)
    return student.eval()


def draft_folder(target_name: str, n_layers: int, cache=None) -> Path:
    """Where `specdec distill` writes a target's draft: <cache>/drafts/<name>-distilled-<L>L."""
    return cache_dir(cache) / "drafts" / f"{target_name.replace('/', '--')}-distilled-{n_layers}L"


def _batches(rows: list[dict], size: int, pad: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(input_ids, attention_mask, labels), each (B, T) right-padded; labels are the next token
    at answer positions and -100 elsewhere (transformers shifts them by one)."""
    out = []
    for i in range(0, len(rows), size):
        group = rows[i : i + size]
        width = max(len(r["prompt"]) + len(r["answer"]) for r in group)
        ids = torch.full((len(group), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        labels = torch.full_like(ids, -100)
        for j, r in enumerate(group):
            seq = r["prompt"] + r["answer"]
            ids[j, : len(seq)] = torch.tensor(seq)
            mask[j, : len(seq)] = 1
            labels[j, len(r["prompt"]) : len(seq)] = torch.tensor(r["answer"])
        out.append((ids, mask, labels))
    return out


def _loss_and_agreement(student, batch) -> tuple[torch.Tensor, float, int]:
    """(mean cross-entropy, answer positions where the student's argmax is the target's token,
    answer positions)."""
    ids, mask, labels = batch
    logits = student(input_ids=ids, attention_mask=mask).logits[:, :-1]
    gold = labels[:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), gold.reshape(-1), ignore_index=-100)
    valid = gold != -100
    return loss, float((logits.argmax(-1)[valid] == gold[valid]).sum()), int(valid.sum())


@dataclass(frozen=True)
class DistillConfig:
    """What `specdec distill` is asked for; distill checks it.

    n_layers: the target's layers the draft keeps (1..the target's, spaced_layers). prompts (>= 2)
    and sampled: template and target-written prompts of the self-distilled data, answered up to
    max_new_tokens tokens each (specdec.train.selfdistill.training_rows). epochs (>= 1) of AdamW at
    learning rate lr over batches of `batch` sequences (>= 1); seed: of every random choice;
    restart: ignore a checkpoint in the output folder. draft_out: the folder the draft is written
    to (default: draft_folder's, in the cache folder `cache`, None for specdec's)."""

    n_layers: int = 2
    prompts: int = 320
    sampled: int = 0
    max_new_tokens: int = 128
    epochs: int = 4
    lr: float = 2e-4
    batch: int = 8
    seed: int = 0
    restart: bool = False
    draft_out: Path | None = None
    cache: Path | str | None = None


def distill(target: Model, out: Path, config: DistillConfig | None = None) -> dict:
    """Distill a draft of config.n_layers of the target's layers (module docstring) as `config`
    says (DistillConfig; its defaults when None), writing into the folder `out`; returns the
    summary dict (also out/summary.json), its "draft" the folder written.

    Raises ValueError on bad settings (layers outside 1..the target's, prompts < 2, epochs < 1,
    batch < 1)."""
    c = config or DistillConfig()
    if c.prompts < 2 or c.epochs < 1 or c.batch < 1:
        raise ValueError(f"need prompts >= 2, epochs >= 1 and batch >= 1, got {c.prompts}, {c.epochs}, {c.batch}")
    layers = spaced_layers(target.hf.config.num_hidden_layers, c.n_layers)
    torch.manual_seed(c.seed)
    rows = training_rows(target, out, c.prompts, c.sampled, c.max_new_tokens, seed=c.seed)
    rows = [r for r in rows if r["answer"]]
    held = max(1, len(rows) // 20)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    valid = _batches(rows[:held], c.batch, pad)
    train_rows = rows[held:]

    student = student_from_target(target, layers)
    for p in (student.get_input_embeddings().weight, student.get_output_embeddings().weight):
        p.requires_grad_(False)  # shared with the target; tied in most small models
    params = [p for p in student.parameters() if p.requires_grad]
    names = [n for n, p in student.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=c.lr, weight_decay=0.0)
    steps = c.epochs * math.ceil(len(train_rows) / c.batch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    ckpt = out / "checkpoint.pt"
    history = [] if c.restart else _resume(ckpt, student, opt, sched, layers, names)
    if not history:
        history.append({"epoch": 0, "loss": None, "heldout_acc": _agreement(student, valid), "seconds": 0.0})
    order = random.Random(c.seed + len(history))
    for epoch in range(history[-1]["epoch"], c.epochs):
        start = time.perf_counter()
        order.shuffle(train_rows)
        batches = _batches(train_rows, c.batch, pad)
        loss = _train_epoch(student, params, opt, sched, batches, desc=f"epoch {epoch + 1}/{c.epochs}")
        acc = _agreement(student, valid)
        history.append({"epoch": epoch + 1, "loss": loss, "heldout_acc": acc, "seconds": time.perf_counter() - start})
        print(f"epoch {epoch + 1}: loss {loss:.4f}, held-out agreement with the target {acc:.3f}")
        trained = {k: v for k, v in student.state_dict().items() if k in set(names)}
        state = {"trained": trained, "names": names, "opt": opt.state_dict(), "sched": sched.state_dict()}
        atomic_write(ckpt, partial(torch.save, state | {"history": history, "layers": layers}))

    dest = Path(c.draft_out) if c.draft_out else draft_folder(target.name, len(layers), c.cache)
    _save_folder(student, target.tokenizer, dest)
    return _summary(target, out, c, layers=layers, rows=rows, history=history, dest=dest)


def _resume(ckpt: Path, student, opt, sched, layers: list[int], names: list[str]) -> list[dict]:
    """The history of the checkpoint `ckpt`, its trained weights, optimizer and schedule loaded,
    when it is one of the same layers and trained parameters; else []."""
    if not ckpt.is_file():
        return []
    state = torch.load(ckpt, weights_only=False)
    if state["layers"] != layers or state["names"] != names:
        return []
    student.load_state_dict(state["trained"], strict=False)
    opt.load_state_dict(state["opt"])
    sched.load_state_dict(state["sched"])
    print(f"resuming from {ckpt} after epoch {state['history'][-1]['epoch']}")
    return state["history"]


def _agreement(student, batches) -> float:
    """The share of the batches' answer positions where the student's argmax is the target's token."""
    student.eval()
    with torch.no_grad():
        hits = [_loss_and_agreement(student, b)[1:] for b in batches]
    return sum(h for h, _ in hits) / max(1, sum(n for _, n in hits))


def _train_epoch(student, params: list, opt, sched, batches: list, desc: str) -> float:
    """One update per batch (gradients of `params` clipped to norm 1); returns the mean loss."""
    student.train()
    total, n = 0.0, 0
    bar = tqdm(batches, desc=desc, unit="batch")
    for b in bar:
        loss, _, _ = _loss_and_agreement(student, b)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        total, n = total + float(loss.detach()), n + 1
        bar.set_postfix(loss=f"{total / n:.3f}")
    return total / n


def _summary(target: Model, out: Path, config: DistillConfig, layers: list[int], rows, history, dest: Path) -> dict:
    """The run's summary, also written to out/summary.json, and its loss curve (out/loss.png)."""
    summary = {
        "target": target.name,
        "layers": layers,
        "prompts": config.prompts,
        "sampled_prompts": config.sampled,
        "sequences": len(rows),
        "answer_tokens": sum(len(r["answer"]) for r in rows),
        "max_new_tokens": config.max_new_tokens,
        "epochs": config.epochs,
        "history": history,
        "draft": str(dest),
    }
    atomic_write(out / "summary.json", lambda tmp: Path(tmp).write_text(json.dumps(summary, indent=1)))
    plot_loss(
        history[1:] or history,
        out / "loss.png",
        "cross-entropy vs the target's token",
        "held-out agreement with the target",
    )
    return summary


def _save_folder(student, tokenizer, dest: Path) -> None:
    """save_pretrained into a sibling temporary folder, then swap it in: never a half-written draft."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = dest.with_name(dest.name + ".tmp"), dest.with_name(dest.name + ".old")
    for stale in (tmp, old):
        shutil.rmtree(stale, ignore_errors=True)
    student.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if dest.exists():
        dest.rename(old)
    tmp.rename(dest)
    shutil.rmtree(old, ignore_errors=True)
