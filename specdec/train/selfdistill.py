"""Self-distilled training data (steps 1-2 of specdec.train.train): prompts generated from templates
and topics (`training_prompts`) and, optionally, written by the target itself (`sampled_prompts`),
never from the workloads, so the benchmarks stay unseen; then the target's own greedy answers to
them (transformers' batched `generate`, chat template), stored as token ids and reused on a rerun.
`specdec train` and `specdec distill` both train on these rows (`training_rows`).
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import torch
from tqdm import tqdm

from specdec.models.load import Model
from specdec.models.weights import atomic_write

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
