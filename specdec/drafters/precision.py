"""A draft model's precision, chosen by measurement: its GGUF file's own, or requantized to Q4_0.

A draft must cost little ([docs/drafters.md](../../docs/drafters.md)). Requantized at load to Q4_0
(specdec.models.quantize), a draft step reads fewer bytes and runs simpler kernels, and its guesses
move a little; which pays depends on the machine and the pair, so `draft_quantize` measures it, once
per target, draft file and machine:
- c, the cost ratio: the draft's one-token greedy step over the target's, timed alternately (medians);
- a, the agreement: how often the draft's greedy token is the target's, teacher-forced on the
  target's greedy answers (ANSWER_TOKENS each) to PROMPTS of the package's calibration prompts;
and keeps the precision whose textbook speed-up (Leviathan et al. 2023: (1 - a^(k+1)) / ((1 - a)
(k c + 1)), at its best k in 1..K_MAX) is the higher. The decision and its measurements are cached
as JSON under `<specdec cache>/draft-precision/`, keyed by the target's verify-cost key
(specdec.adaptive.costs.cache_key: its file, the kernels, the processor, the thread count) and the
draft file's name and size. A draft's precision changes the speed only, never the output.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time
from importlib import resources
from pathlib import Path

from specdec.cache import new_cache
from specdec.models.load import Model, gguf_file_of, load_model
from specdec.models.weights import atomic_write, cache_dir

SCHEMA = 1
CANDIDATES = (None, "q4_0")  # None: the file's own precision
PROMPTS = 6  # calibration prompts answered by the target (every other one of its 12)
ANSWER_TOKENS = 32
STEPS = 15  # timed one-token steps per model
K_MAX = 8


def textbook_speedup(a: float, c: float, k_max: int = K_MAX) -> float:
    """The best over k = 1..k_max of (1 - a^(k+1)) / ((1 - a)(k c + 1)): tokens per round over a
    round's cost in target steps, a verify counted as one step (Leviathan et al. 2023)."""
    tokens = (lambda k: k + 1) if a >= 1 else (lambda k: (1 - a ** (k + 1)) / (1 - a))
    return max(tokens(k) / (k * c + 1) for k in range(1, k_max + 1))


def draft_quantize(target: Model, draft: str, load_kwargs: dict, log=sys.stderr) -> str | None:
    """The GGUF type to requantize the draft model `draft` (a spec for load_model) to at its load, or
    None for its file's own precision: load_kwargs' "quantize" when given ("none": None), else the
    measured choice (module docstring), cached. Choices are made only for a GGUF draft run at its own
    precision on the CPU's quantized backend beside a quantized target; otherwise None. The first
    choice on a machine loads both candidates and runs the target for about ten seconds. Raises what
    load_model raises (with load_kwargs' pull_missing, a registry draft is pulled here)."""
    given = load_kwargs.get("quantize")
    if given is not None:
        return None if given == "none" else given
    source = gguf_file_of(draft, cache_dir(load_kwargs.get("cache")), load_kwargs.get("pull_missing", False))
    if (
        source is None
        or target.gguf is None
        or load_kwargs.get("dtype") is not None
        or load_kwargs.get("backend", "auto") == "hf"
        or str(load_kwargs.get("device", "cpu")) not in ("cpu", "auto")
        or target.device.type != "cpu"
    ):
        return None
    from specdec.adaptive.costs import cache_key

    key = {"schema": SCHEMA, "target": cache_key(target), "draft": source.name, "draft_bytes": source.stat().st_size}
    path = _cache_file(key, load_kwargs.get("cache"))
    try:
        saved = json.loads(path.read_text())
        if saved.get("key") == key:
            return saved["chosen"]
    except (OSError, ValueError, KeyError):
        pass
    models = {q: load_model(draft, **{**load_kwargs, "quantize": q}) for q in CANDIDATES}
    if any(m.gguf is None for m in models.values()):
        return None  # the file's own precision fell back to fp32: nothing to choose between
    measured = measure(target, models)
    chosen = max(measured, key=lambda q: measured[q]["speedup"])
    measured = {q or "own": m for q, m in measured.items()}
    out = {"schema": SCHEMA, "key": key, "chosen": chosen, "measured": measured}
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(out, indent=1)))
    print(f"# {draft}: {_summary(measured, chosen)} (measured once on this machine, cached)", file=log)
    return chosen


def measure(target: Model, drafts: dict) -> dict:
    """{quantize: {"c", "a", "speedup"}} of each draft model in `drafts` ({quantize: Model}, None: the
    file's own precision): see the module docstring."""
    rows = resources.files("specdec").joinpath("data/calibration_prompts.jsonl").read_text().splitlines()
    texts = [json.loads(row)["text"] for row in rows if row.strip()][::2][:PROMPTS]
    chat = bool(getattr(target.tokenizer, "chat_template", None))
    answered = [(ids, _greedy(target, ids, ANSWER_TOKENS)) for ids in (target.encode(t, chat=chat) for t in texts)]
    agree = {}
    for q, model in drafts.items():
        hits = total = 0
        for ids, answer in answered:
            kv = new_cache(model)
            kv.extend(ids[:-1], all_logits=False)
            guesses = kv.extend([ids[-1], *answer[:-1]], all_logits=True).argmax(-1).tolist()
            hits += sum(g == t for g, t in zip(guesses, answer))
            total += len(answer)
        agree[q] = hits / max(total, 1)
    ms = _step_ms({"target": target, **drafts}, answered[0][0])
    costs = {q: ms[q] / ms["target"] for q in drafts}
    return {q: {"c": costs[q], "a": agree[q], "speedup": textbook_speedup(agree[q], costs[q])} for q in drafts}


def _greedy(model: Model, ids: list[int], n: int) -> list[int]:
    """The n tokens of greedy decoding after ids (a batch-invariant cache: plain decoding's tokens,
    end of sequence not stopped at)."""
    kv = new_cache(model)
    kv.argmax_only = True
    kv.extend(ids[:-1], all_logits=False)
    out, token = [], ids[-1]
    for _ in range(n):
        token = int(kv.extend([token], all_logits=False)[-1].argmax())
        out.append(token)
    return out


def _step_ms(models: dict, ids: list[int]) -> dict:
    """Median ms of a greedy one-token step of each model at the context `ids`, the models
    alternating so that a slow spell of the host falls on all of them."""
    caches = {}
    for name, model in models.items():
        kv = new_cache(model)
        kv.argmax_only = True
        kv.extend(ids[:-1], all_logits=False)
        caches[name] = kv
    times: dict = {name: [] for name in models}
    for step in range(STEPS + 2):
        for name, kv in caches.items():
            start = time.perf_counter()
            kv.extend([ids[-1]], all_logits=False)
            elapsed = time.perf_counter() - start
            kv.rollback(len(ids) - 1)
            if step >= 2:  # two warm-up steps
                times[name].append(elapsed * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def _summary(measured: dict, chosen: str | None) -> str:
    """One line: the choice and what each candidate measured ({"own" or a type: measure()'s})."""
    name = lambda q: "its own precision" if q in (None, "own") else q.upper()  # noqa: E731
    parts = [f"{name(q)} c {m['c']:.2f}, a {m['a']:.2f}, {m['speedup']:.2f}x" for q, m in measured.items()]
    return f"draft at {name(chosen)} ({'; '.join(parts)}: textbook speed-up)"


def _cache_file(key: dict, cache) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir(cache) / "draft-precision" / f"{Path(key['draft']).stem[:64]}-{digest}.json"
