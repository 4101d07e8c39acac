"""`specdec train`: fit a feature-level draft head (specdec.train.head, after EAGLE) to a target on
self-distilled data.

1. prompts: generated here from templates and topics (`training_prompts`), and optionally
   written by the target itself (`sampled_prompts`: it samples a user's turn), never from the
   workloads, so the benchmarks stay unseen;
2. data: the target's own greedy answers to them (transformers' batched `generate`, chat
   template), stored as token ids in `<out>/data.jsonl` (written atomically, reused on a rerun);
3. features: one teacher-forced lean forward per sequence gives every position's feature f_t and
   the target's greedy next token (the label), from the forward the head will draft against (a
   GGUF target at its own precision: the quantized one; its embedding and output rows too);
4. training: at position t the head reads (f_t plus a little noise, e(x_{t+1})) and is trained to
   predict f_{t+1} (smooth L1) and the target's next token from it (cross-entropy over the head's
   vocabulary, weight 0.5: EAGLE (Li et al. 2024) uses 0.1; greedy acceptance depends on the token),
   and, with steps > 1, the same again from its own predicted features for draft steps 2..steps
   (the training-time test of EAGLE-3 / HASS: drafting feeds its predictions back, so training
   does too); AdamW, cosine schedule, one sequence per update;
   a checkpoint after every epoch (`<out>/checkpoint.pt`, atomic) from which a rerun resumes;
5. output: the head (`<cache>/heads/<target>.safetensors` unless --head-out), `<out>/loss.png`
   and `<out>/summary.json` (losses and held-out accuracy per draft step and epoch).
"""

from __future__ import annotations

import itertools
import json
import math
import random
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from specdec.cache import LeanKVCache
from specdec.models.load import Model
from specdec.models.weights import atomic_write
from specdec.train.conversations import dataset_rows
from specdec.train.head import DraftHead, head_file, load_head, save_head

TOPICS = [
    "the ocean",
    "a small village",
    "climate change",
    "machine learning",
    "the Roman Empire",
    "coffee",
    "a lost dog",
    "space travel",
    "friendship",
    "the stock market",
    "volcanoes",
    "a job interview",
    "electric cars",
    "the human heart",
    "a rainy day",
    "chess",
    "photosynthesis",
    "a birthday party",
    "the French Revolution",
    "social media",
    "honey bees",
    "a mountain hike",
    "renewable energy",
    "a haunted house",
    "vaccines",
    "the moon landing",
    "learning a language",
    "a robot",
    "gardening",
    "the internet",
    "a bakery",
    "black holes",
    "democracy",
    "a train journey",
    "sleep",
    "pirates",
    "recycling",
    "music festivals",
    "ancient Egypt",
    "a new smartphone",
]
TEMPLATES = [
    "Write a short blog post about {t}.",
    "Write a poem about {t}.",
    "Tell me a short story involving {t}.",
    "Pretend you are a tour guide and describe {t} to visitors.",
    "Imagine you are a character from a novel who loves {t}. Introduce yourself.",
    "Explain {t} to a ten-year-old.",
    "What are three interesting facts about {t}?",
    "Give me step-by-step reasoning: why does {t} matter to people today?",
    "Write a Python function related to {t}, with a docstring and an example.",
    "Summarize the main ideas someone should know about {t} in a few sentences.",
    "What are the pros and cons of {t}?",
    "Describe the history of {t} briefly.",
    "List five questions a student might ask about {t}, and answer the first one.",
    "Write a persuasive paragraph about {t}.",
    "Solve this: a shop sells items about {t} for 12 dollars each. How much do 7 items cost with a 10% discount?",
    "Extract the key facts from this sentence and list them: '{T} has been studied by many researchers since 1950, "
    "mostly in Europe and Asia.'",
]


def training_prompts(n: int, seed: int = 0) -> list[str]:
    """n distinct prompts (at most len(TOPICS) * len(TEMPLATES)), deterministic for a seed."""
    pool = [tpl.format(t=t, T=t[0].upper() + t[1:]) for tpl, t in itertools.product(TEMPLATES, TOPICS)]
    random.Random(seed).shuffle(pool)
    return pool[:n]


def _batched_generate(target: Model, ids: list[list[int]], pad: int, **kwargs) -> list[list[int]]:
    """transformers' generate over a left-padded batch; each continuation cut after its first EOS."""
    width = max(map(len, ids))
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
    with torch.inference_mode():
        out = target.hf.generate(input_ids=input_ids, attention_mask=mask, pad_token_id=pad, **kwargs)
    result = []
    for seq in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(seq) if t in target.eos_token_ids), len(seq))
        result.append(seq[:cut])
    return result


def _pad_id(target: Model) -> int:
    tok = target.tokenizer
    return tok.pad_token_id if tok.pad_token_id is not None else min(target.eos_token_ids or {0})


def sampled_prompts(target: Model, n: int, seed: int = 0, batch: int = 32, max_tokens: int = 48) -> list[str]:
    """Up to n distinct user requests written by the target itself: the chat template's user turn
    is opened and the target samples what a user says (temperature 1, top-p 0.95), which gives
    prompts far more varied than templates. Needs a chat template; [] without one."""
    tok = target.tokenizer
    if n <= 0 or not getattr(tok, "chat_template", None):
        return []
    marker = "\u2063"
    opening = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False).split(marker)[0]
    start = list(tok(opening, add_special_tokens=False)["input_ids"])
    torch.manual_seed(seed)
    found: dict[str, None] = {}
    with tqdm(total=n, desc="sampled prompts", unit="prompt") as bar:
        for _ in range(4 * (n // batch + 1)):
            for seq in _batched_generate(
                target,
                [start] * batch,
                _pad_id(target),
                do_sample=True,
                temperature=1.0,
                top_p=0.95,
                max_new_tokens=max_tokens,
            ):
                text = tok.decode(seq, skip_special_tokens=True).strip()
                if len(text) >= 12 and text not in found and len(found) < n:
                    found[text] = None
                    bar.update()
            if len(found) >= n:
                break
    return list(found)


def self_distilled_data(
    target: Model, prompts: list[str], max_new_tokens: int, path: Path, batch: int = 16
) -> list[dict]:
    """[{"text", "prompt": ids, "answer": ids}] of the target's greedy answers (EOS included when
    reached). Answers already in `path` for the same target and length are reused; the rest are
    generated, and the file is rewritten (atomically) with all of them."""
    key = {"max_new_tokens": max_new_tokens, "target": target.name}
    known: dict[str, dict] = {}
    if path.is_file():
        stored = json.loads(path.read_text())
        if stored.get("key") == key:
            known = {row["text"]: row for row in stored["rows"]}
    chat = bool(getattr(target.tokenizer, "chat_template", None))  # the chat template when the model has one
    todo = [p for p in dict.fromkeys(prompts) if p not in known]
    for i in tqdm(range(0, len(todo), batch), desc="self-distilled answers", unit="batch"):
        texts = todo[i : i + batch]
        ids = [target.encode(p, chat=chat) for p in texts]
        answers = _batched_generate(target, ids, _pad_id(target), do_sample=False, max_new_tokens=max_new_tokens)
        for text, x, answer in zip(texts, ids, answers):
            known[text] = {"text": text, "prompt": x, "answer": answer}
    if todo or not path.is_file():
        atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps({"key": key, "rows": list(known.values())})))
    return [known[p] for p in dict.fromkeys(prompts)]


def training_rows(
    target: Model, out: Path, prompts: int, sampled: int, max_new_tokens: int, batch: int = 16, seed: int = 0
) -> list[dict]:
    """Steps 1-2: `prompts` template prompts plus `sampled` target-written ones (stored in
    out/sampled_prompts.json), and the target's greedy answers (out/data.json); both reused on a
    rerun in the same folder. `specdec distill` trains on the same rows."""
    out.mkdir(parents=True, exist_ok=True)
    texts = training_prompts(prompts, seed)
    if sampled:
        path = out / "sampled_prompts.json"
        stored = json.loads(path.read_text()) if path.is_file() else []
        if len(stored) < sampled:
            stored = sampled_prompts(target, sampled, seed)
            atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(stored)))
        texts += stored[:sampled]
    return self_distilled_data(target, texts, max_new_tokens, out / "data.json", batch)


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


def _loss(
    head: DraftHead,
    embed,
    out_weight,
    index,
    tokens,
    feats,
    labels,
    noise: float,
    ce_weight: float,
    steps: int = 1,
    decay: float = 0.8,
):
    """(total, regression, cross-entropy, accuracy per draft step) on one sequence.

    embed: the target's input embeddings, token ids (n,) -> (n, d) (its lean forward's embed_rows);
    out_weight: (N, d) fp32, the rows of its output layer for the head's vocabulary.

    Step j (1..steps) is the head drafting its j-th token from its own earlier predictions
    (DraftHead.unrolled, the training-time test of EAGLE-3 / HASS); every step is trained toward
    the same targets, the next feature and the target's token after it, and weighs decay^(j-1).
    Regression and cross-entropy are step one's; accuracy j is how often step j's top token is the
    target's greedy one. feats: (T, d) or, for a head with taps, (T, (1 + len(taps)) d), whose
    first d columns (the final feature) are the regression target; the noise is scaled to each
    block's spread."""
    d = head.config["hidden"]
    x_in = feats[:-1]
    if noise:
        scale = feats.unflatten(-1, (-1, d)).std(dim=(0, 2))  # (1 + taps,): each block's spread
        x_in = x_in + ((torch.rand_like(x_in) - 0.5) * 2 * noise).unflatten(-1, (-1, d)).mul(scale[:, None]).flatten(-2)
    feats = feats[:, :d]
    preds = head.unrolled(x_in, embed(tokens[1:]).float(), steps)  # (T-1, d) each: predicted f_1..f_{T-1}
    # the target's token after position t+1, as a head-vocabulary index (-1: not trained on)
    target_ids = torch.where(labels[1:] >= 0, index[labels[1:].clamp(min=0)], -1)
    trained = labels[1:] >= 0  # positions t+1 a row's mask keeps (all of them for answers alone)
    total, first, accs = 0.0, None, []
    for j, pred in enumerate(preds):  # rows before j have no j-step path
        logits = pred[j:] @ out_weight.T
        rows = trained[j:]
        reg = F.smooth_l1_loss(pred[j:][rows], feats[1 + j :][rows]) if rows.any() else pred.sum() * 0
        ce = F.cross_entropy(logits, target_ids[j:], ignore_index=-1)
        valid = target_ids[j:] >= 0
        accs.append(float((logits.argmax(-1)[valid] == target_ids[j:][valid]).float().mean()) if valid.any() else 0.0)
        total = total + decay**j * (reg + ce_weight * ce)
        first = first or (reg, ce)
    return total, *first, accs


def train_head(
    target: Model,
    out: Path,
    prompts: int = 320,
    max_new_tokens: int = 128,
    epochs: int = 12,
    sampled: int = 0,
    lr: float = 1e-3,
    vocab: int = 8192,
    noise: float = 0.1,
    ce_weight: float = 0.5,
    steps: int = 3,
    head_out: Path | None = None,
    batch: int = 16,
    seed: int = 0,
    restart: bool = False,
    cache=None,
    taps: list[int] | None = None,
    data: str | None = None,
    conversations: int = 2000,
    max_tokens: int = 512,
    exclude: tuple[str, ...] = (),
    init: Path | None = None,
    answers: str = "sharegpt",
    answer_temperature: float = 0.0,
    answer_tokens: int = 256,
    code_only: bool = False,
    conversation_data=None,
) -> dict:
    """Run steps 1-5 of the module docstring; returns the summary dict (also in out/summary.json).

    data: instead of steps 1-2, real conversations (specdec.train.conversations): "sharegpt" or a
    JSON / JSONL file; up to `conversations` of them, cut to max_tokens each, trained on their
    assistant turns, skipping any that contains one of the `exclude` texts (`specdec train` passes
    every packaged benchmark prompt). The source goes into the head's metadata.
    answers: with data, whose assistant turns: "sharegpt" (the dataset's), "self" (the target's own
    answers to its user turns, up to answer_tokens each, greedy at answer_temperature 0, else
    sampled: Medusa-2's self-distillation, stored in out/answers/ and reused on a rerun) or "mix"
    (both); those two need `conversation_data`, specdec.answers.conversation_data (passed in: it
    runs the batched engine, a layer above training). code_only: only conversations whose user turns contain code
    (specdec.train.conversations.has_code).

    taps: decoder layers (0-based) whose hidden states the head's first step also reads (EAGLE-3's
    fused low / middle / high features; DraftHead.default_taps gives EAGLE-3's choice); None or []
    for the final feature alone.

    init: a head file to start from instead of a fresh head (fine-tuning, e.g. the shipped head on
    the features of the forward it drafts against); its vocabulary and taps are kept (vocab and
    taps are then ignored).

    Raises ValueError for a target the lean backend cannot run, or bad arguments; HeadError for an
    init head made for another target."""
    if target.backend != "lean":
        raise ValueError("specdec train reads the target's features through the lean backend: a Llama or Qwen2 target")
    if prompts < 2 or epochs < 1 or steps < 1 or not 0 < vocab <= target.vocab_size:
        raise ValueError(f"need prompts >= 2, epochs >= 1, steps >= 1 and 0 < vocab <= {target.vocab_size}")
    start = load_head(init, target.lean().hidden_size)[0] if init is not None else None  # fine-tuned: its taps
    taps = sorted(set(taps or [])) if start is None else list(start.taps)
    LeanKVCache(target, capacity=1, taps=tuple(taps))  # refuses a layer the target lacks, before the answers
    torch.manual_seed(seed)
    if data is not None and answers == "sharegpt":
        rows, source = dataset_rows(target, data, conversations, max_tokens, exclude, seed, code_only)
    elif data is not None:
        if conversation_data is None:
            raise ValueError(f"answers={answers!r} needs conversation_data (specdec.answers.conversation_data)")
        rows, source = conversation_data(
            target,
            data,
            out / "answers",
            answers,
            conversations,
            max_tokens,
            exclude,
            seed,
            temperature=answer_temperature,
            max_new_tokens=answer_tokens,
            batch=batch,
            code_only=code_only,
        )
    elif answers != "sharegpt" or code_only:
        raise ValueError(f"answers={answers!r} or code_only needs data (the conversations whose user turns to use)")
    else:
        rows = training_rows(target, out, prompts, sampled, max_new_tokens, batch, seed)
        source = {"data": "self-distilled", "prompts": prompts, "sampled_prompts": sampled}
    data = features_and_labels(target, rows, tuple(taps))
    shuffled = random.Random(seed).sample(data, len(data))  # held out: 5% of template and sampled prompts alike
    held = max(1, len(data) // 20)
    train, valid = shuffled[held:], shuffled[:held]
    vocab_ids = choose_vocab(train, target.vocab_size, vocab) if start is None else start.vocab_ids
    index = torch.full((target.vocab_size,), -1, dtype=torch.long)
    index[vocab_ids] = torch.arange(len(vocab_ids))
    lean = target.lean()  # the forward the head drafts against: a GGUF target's quantized one at its own precision
    embed = lean.embed_rows  # token ids (n,) -> (n, d): a quantized embedding's rows dequantized
    out_weight = lean.output_rows(vocab_ids)  # (N, d) fp32: the rows drafting multiplies, never a whole fp32 model

    head = DraftHead.for_target(target, vocab_ids, taps) if start is None else start
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    updates = epochs * len(train)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, updates) / updates)))
    history: list[dict] = []
    ckpt = out / "checkpoint.pt"
    if ckpt.is_file() and not restart:
        state = torch.load(ckpt, weights_only=False)
        if (
            state["config"] == head.config
            and torch.equal(state["vocab_ids"], vocab_ids)
            and state.get("steps") == steps
        ):
            head.load_state_dict(state["head"])
            opt.load_state_dict(state["opt"])
            sched.load_state_dict(state["sched"])
            history = state["history"]
            print(f"resuming from {ckpt} after epoch {len(history)}")
    order = random.Random(seed)
    for epoch in range(len(history), epochs):
        head.train()
        start, sums, acc_sums = time.perf_counter(), [0.0, 0.0, 0.0], [0.0] * steps
        perm = list(range(len(train)))
        order.shuffle(perm)
        bar = tqdm(perm, desc=f"epoch {epoch + 1}/{epochs}", unit="seq")
        for i in bar:
            total, reg, ce, accs = _loss(head, embed, out_weight, index, *train[i], noise, ce_weight, steps)
            opt.zero_grad()
            total.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            sched.step()
            for j, v in enumerate((total, reg, ce)):
                sums[j] += float(v.detach())
            acc_sums = [a + b for a, b in zip(acc_sums, accs)]
            bar.set_postfix(
                loss=f"{sums[0] / (bar.n + 1):.3f}", acc=" ".join(f"{a / (bar.n + 1):.2f}" for a in acc_sums)
            )
        head.eval()
        with torch.no_grad():
            scores = [_loss(head, embed, out_weight, index, *s, 0.0, ce_weight, steps)[3] for s in valid]
        v_accs = [sum(a[j] for a in scores) / len(scores) for j in range(steps)]
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
        state = {
            "head": head.state_dict(),
            "opt": opt.state_dict(),
            "sched": sched.state_dict(),
            "history": history,
            "config": head.config,
            "vocab_ids": vocab_ids,
            "steps": steps,
        }
        atomic_write(ckpt, partial(torch.save, state))

    dest = head_out or head_file(target.name, cache)
    summary = {
        "target": target.name,
        **source,
        "sequences": len(data),
        "positions": sum(int((labels >= 0).sum()) for _, _, labels in data),
        "max_new_tokens": max_new_tokens,
        "epochs": epochs,
        "steps": steps,
        "vocab": len(vocab_ids),
        "init": str(init) if init is not None else None,
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


def plot_loss(history: list[dict], path: Path, loss_label: str, acc_label: str) -> None:
    """loss.png: history's "loss" per epoch and its "heldout_acc" on a second axis, one line per
    draft step where entries have "heldout_acc_by_step" (atomic write)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    epochs = [h["epoch"] for h in history]
    ax.plot(epochs, [h["loss"] for h in history], marker="o", label="training loss")
    ax.set_xlabel("epoch")
    ax.set_ylabel(loss_label)
    ax2 = ax.twinx()
    by_step = [h.get("heldout_acc_by_step") or [h["heldout_acc"]] for h in history]
    for j in range(min(map(len, by_step))):  # one line per draft step where the history has them
        ax2.plot(
            epochs,
            [a[j] for a in by_step],
            color=f"C{j + 1}",
            marker="s",
            label=acc_label if j == 0 else f"draft step {j + 1}",
        )
    ax2.set_ylabel("accuracy")
    fig.legend(loc="upper center", ncol=2, fontsize=8)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)
