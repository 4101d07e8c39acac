"""The target's own answers to real conversations' user turns, as draft-head training data
(`specdec train --data sharegpt --answers self`), stored so that a run continues in a later session.

Self-distillation: a draft trained on the target's own outputs learns the distribution it will be
asked to guess (Medusa-2, Cai et al. 2024, regenerates ShareGPT's answers with the target, greedy or
sampled at T 0.7-1; EAGLE (Li et al. 2024) trains on fixed ShareGPT text, and its follow-ups on the
target's answers). Each conversation's user turns are answered in order, turn j with the chat
template's rendering of [system, user_1, own answer_1, ..., user_j] and its generation prompt as
the context; the answers replace the dataset's assistant turns. Many conversations decode at once
(specdec.batch.Batch, continuous batching: a finished turn's next turn, or the next conversation,
joins at the next step), plain decoding, greedy or sampled.

The store (AnswerStore): `<folder>/<target>-<key hash>/key.json` (what the answers depend on) and
`answers.bin`, append-only records of uint32 words, one per finished conversation, written (and
fsynced) as soon as it is done; a rerun with the same key skips what is stored, one with another key
gets another folder. A record cut off by a kill (or any bad record, by its CRC) is cut from the file
with everything after it, and those conversations are answered again.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import struct
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from specdec.batch import Batch
from specdec.decoding import Decoding
from specdec.models.weights import atomic_write
from specdec.options import GenerationOptions
from specdec.train.conversations import (
    SHAREGPT,
    ConversationConfig,
    DataError,
    chat_ids,
    dataset_rows,
    encode,
    selected,
    source_path,
)

ANSWERS = ("sharegpt", "self", "mix")  # --answers: the dataset's, the target's own, or both
FORMAT = 1  # of answers.bin; part of the key
MAGIC = b"SDA1"
HEADER = struct.Struct("<4sII")  # magic, body words, CRC-32 of the body


@dataclass
class Conversation:
    """One conversation being answered: its index in the source file, a CRC of its system and user
    texts (a stored answer is reused only for the same texts), the system message it opens with
    (if any), its user turns, and the target's answers so far (token ids, EOS included)."""

    index: int
    crc: int
    head: list[dict]
    users: list[str]
    answers: list[list[int]] = field(default_factory=list)

    @classmethod
    def of(cls, index: int, messages: list[dict]) -> Conversation:
        head = messages[:1] if messages and messages[0]["role"] == "system" else []
        users = [m["content"] for m in messages if m["role"] == "user"]
        crc = zlib.crc32(json.dumps([head, users]).encode())
        return cls(index, crc, head, users)

    def messages(self, tokenizer) -> list[dict]:
        """The system message, then each answered user turn and the target's answer (decoded, its
        special tokens such as EOS dropped: the template adds its own end of turn)."""
        out = list(self.head)
        for user, answer in zip(self.users, self.answers):
            out.append({"role": "user", "content": user})
            out.append({"role": "assistant", "content": tokenizer.decode(answer, skip_special_tokens=True)})
        return out

    def context(self, tokenizer) -> list[int] | None:
        """Token ids the next turn is answered after: the conversation so far and the next user turn,
        with the generation prompt; None when every user turn is answered."""
        if len(self.answers) == len(self.users):
            return None
        turn = {"role": "user", "content": self.users[len(self.answers)]}
        return chat_ids(tokenizer, self.messages(tokenizer) + [turn], True)


class AnswerStore:
    """Stored answers for one key (a dict of what they depend on), in `folder`/<name>-<hash of key>/.

    Record layout in answers.bin: HEADER (b"SDA1", n body words, CRC-32 of the body), then the body,
    n little-endian uint32: [index, text CRC, turns, len_1 .. len_turns, tokens of answer 1, ...].
    4 bytes a token plus 4 (3 + turns) a conversation. Opening reads every complete record and cuts
    the file after the last good one (a record cut off mid-write, or one whose CRC fails), so
    appends always follow a whole record. Raises DataError when the folder's key.json holds another
    key (a hash collision, or an edited file)."""

    def __init__(self, folder: Path, key: dict, name: str = "answers"):
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
        self.folder = Path(folder) / f"{re.sub(r'[^A-Za-z0-9._-]+', '-', name)}-{digest}"
        self.path = self.folder / "answers.bin"
        key_file = self.folder / "key.json"
        if key_file.is_file():
            if json.loads(key_file.read_text()) != key:
                raise DataError(f"{key_file} holds answers for another key; move the folder away to start over")
        else:
            atomic_write(key_file, lambda tmp: Path(tmp).write_text(json.dumps(key, indent=1, sort_keys=True)))
        self.known: dict[int, tuple[int, list[list[int]]]] = {}  # index -> (text CRC, answers)
        self._read()

    def get(self, conv: Conversation) -> list[list[int]] | None:
        """The stored answers of this conversation (same index and texts), or None."""
        crc, answers = self.known.get(conv.index, (None, None))
        return answers if crc == conv.crc else None

    def add(self, conv: Conversation) -> None:
        """Append a finished conversation's answers, flushed to disk before returning."""
        words = [conv.index, conv.crc, len(conv.answers), *map(len, conv.answers), *itertools.chain(*conv.answers)]
        body = np.asarray(words, dtype="<u4").tobytes()
        with open(self.path, "ab") as f:
            f.write(HEADER.pack(MAGIC, len(words), zlib.crc32(body)) + body)
            f.flush()
            os.fsync(f.fileno())
        self.known[conv.index] = (conv.crc, [list(a) for a in conv.answers])

    def _read(self) -> None:
        data = self.path.read_bytes() if self.path.is_file() else b""
        at = 0
        while at + HEADER.size <= len(data):
            magic, n, crc = HEADER.unpack_from(data, at)
            body = data[at + HEADER.size : at + HEADER.size + 4 * n]
            if magic != MAGIC or len(body) != 4 * n or zlib.crc32(body) != crc:
                break
            words = np.frombuffer(body, dtype="<u4").tolist()
            index, text_crc, turns = words[:3]
            ends = list(itertools.accumulate(words[3 : 3 + turns], initial=3 + turns))
            self.known[index] = (text_crc, [words[a:b] for a, b in itertools.pairwise(ends)])
            at += HEADER.size + 4 * n
        if at < len(data):  # a record cut off (killed mid-write) or damaged: cut it and what follows
            with open(self.path, "r+b") as f:
                f.truncate(at)

    def bytes_per_token(self) -> float:
        """Size of answers.bin over the answer tokens it holds (0.0 when empty)."""
        tokens = sum(len(a) for _, answers in self.known.values() for a in answers)
        return self.path.stat().st_size / tokens if tokens else 0.0


def store_key(target, source: str, max_tokens: int, max_new_tokens: int, temperature: float, seed: int) -> dict:
    """What stored answers depend on: the target (name and precision: a GGUF target's quantized
    forward answers differently from its fp32 one), the source file, the token limits, the
    temperature and, when sampling, the seed (greedy answers do not depend on it)."""
    return {
        "format": FORMAT,
        "target": target.name,
        "precision": target.precision,
        "source": SHAREGPT if source == SHAREGPT else str(Path(source).resolve()),
        "max_tokens": max_tokens,
        "max_new_tokens": max_new_tokens,
        "temperature": float(temperature),
        "seed": seed if temperature > 0 else None,
    }


def self_answers(
    target, source: str, out_dir: Path = Path("specdec-train/answers"), config: ConversationConfig | None = None
) -> list[dict]:
    """Up to config.n training rows [{"text", "prompt": [], "answer": ids, "mask": [bool]}] as
    conversation_rows gives (the same conversations, in the same order: specdec.train.conversations.
    selected, with config's exclude and code_only), but with the target's own answers in place of the
    dataset's assistant turns; mask true on the assistant turns' tokens (the target's answers and
    the template's end of turn), the row cut to max_tokens.

    Turn j's answer: plain decoding (k = 0) after Conversation.context, at most
    min(max_new_tokens, max_tokens - context length) tokens, ending at EOS; greedy at temperature 0,
    else sampled with a seed of its own from (seed, conversation index, turn), so an answer depends
    on its context alone, not on the batch it ran in (a resumed run gives an uninterrupted one's
    answers). A conversation ends at its last user turn or when a context reaches max_tokens (or
    the target's context length). Up to `batch` turns decode at once; on a batch-invariant backend
    (the quantized one) a turn continues from its conversation's previous turn's KV cache, so only
    the new user turn is prefilled (the same bits as the whole context's). Answers are stored under
    out_dir (AnswerStore), each conversation as it finishes, and reused on a rerun.

    n, max_tokens, exclude, seed, code_only, temperature, max_new_tokens and batch are config's
    (ConversationConfig; its defaults when None).

    Raises DataError when the target has no chat template, the source cannot be read, or no
    conversation's first turn fits in max_tokens; ValueError for bad settings."""
    c = config or ConversationConfig()
    n, max_tokens, max_new_tokens, batch, temperature = c.n, c.max_tokens, c.max_new_tokens, c.batch, c.temperature
    if not getattr(target.tokenizer, "chat_template", None):
        raise DataError(f"{target.name} has no chat template to render conversations with")
    if n < 1 or max_tokens < 2 or max_new_tokens < 1 or batch < 1 or temperature < 0:
        raise ValueError("need n >= 1, max_tokens >= 2, max_new_tokens >= 1, batch >= 1 and temperature >= 0")
    path = source_path(source)
    limit = min(max_tokens, target.n_ctx)
    todo = list(itertools.islice(_fitting(target.tokenizer, path, c, limit), n))
    if not todo:
        raise DataError(f"{path}: no conversation whose first user turn fits in {limit} tokens")
    key = store_key(target, source, max_tokens, max_new_tokens, temperature, c.seed)
    store = AnswerStore(out_dir, key, target.name)
    pending = []
    for conv in todo:
        stored = store.get(conv)
        if stored is None:
            pending.append(conv)
        else:
            conv.answers = stored
    options = GenerationOptions(k=0, max_new_tokens=max_new_tokens, temperature=temperature)
    _answer(target, pending, options, seed=c.seed, limit=limit, size=batch, store=store, total=len(todo))
    return [row for conv in todo if (row := _row(target.tokenizer, conv, max_tokens)) is not None]


def _fitting(tokenizer, path: Path, config: ConversationConfig, limit: int):
    """selected()'s conversations (config's exclude, seed and code_only) with a user turn whose
    first context renders in under `limit` tokens."""
    for index, _, messages in selected(path, config.exclude, config.seed, config.code_only):
        conv = Conversation.of(index, messages)
        try:
            context = conv.context(tokenizer)
        except Exception:  # the template's own checks (jinja raise_exception)
            continue
        if context is not None and len(context) < limit:
            yield conv


def _answer(target, pending: list, options: GenerationOptions, seed: int, limit: int, size: int, store, total: int):
    """Answer every turn of the pending conversations, `size` turns decoding at once; each
    conversation stored as it finishes. tqdm shows conversations done of `total` and tokens/s."""
    tokenizer, queue, batch = target.tokenizer, iter(pending), Batch(target)
    bar = tqdm(total=total, initial=total - len(pending), desc="target's answers", unit="conv")
    t0, made = time.perf_counter(), [0]
    caches: dict[int, object] = {}  # a conversation's KV cache from its previous turn (batch-invariant backends)

    def start(conv: Conversation | None) -> None:  # its next turn joins the batch, or it is done
        while conv is not None:
            context = conv.context(tokenizer)
            if context is not None and len(context) < limit:
                turn = len(conv.answers)
                opts = options.replace(
                    max_new_tokens=min(options.max_new_tokens, limit - len(context)),
                    seed=zlib.crc32(f"{seed}:{conv.index}:{turn}".encode()),
                )
                seq = Decoding(target, context, None, opts, cache=caches.pop(conv.index, None))
                batch.add(seq, on_finish=lambda s, g, c=conv: answered(c, g.tokens, s.kv))
                return
            caches.pop(conv.index, None)  # done: its cache is freed
            store.add(conv)
            bar.update()
            conv = next(queue, None)  # its slot goes to the next conversation

    def answered(conv: Conversation, tokens: list[int], kv) -> None:
        if batch.invariant:  # its next turn starts from this turn's cache: the same bits as a fresh prefill
            caches[conv.index] = kv
        conv.answers.append(list(tokens))
        made[0] += len(tokens)
        bar.set_postfix(tok_s=f"{made[0] / (time.perf_counter() - t0):.1f}")
        start(conv)

    for conv in itertools.islice(queue, size):
        start(conv)
    batch.run()
    bar.close()


def _row(tokenizer, conv: Conversation, max_tokens: int) -> dict | None:
    """conversation_rows' row of a conversation with the target's answers (None: nothing trainable)."""
    messages = conv.messages(tokenizer)
    encoded = encode(tokenizer, messages, max_tokens) if conv.answers else None
    if encoded is None:
        return None
    text = "\n".join(m["content"] for m in messages)
    return {"text": text[:200], "prompt": [], "answer": encoded[0], "mask": encoded[1]}


def conversation_data(
    target, data: str, out_dir: Path, answers: str = "sharegpt", config: ConversationConfig | None = None
) -> tuple[list[dict], dict]:
    """The rows specdec train learns from real conversations, and their description for the summary:
    answers "sharegpt" (the dataset's assistant turns, dataset_rows), "self" (the target's own,
    self_answers, stored in out_dir) or "mix" (both: each conversation twice); config: which
    conversations and how answered (ConversationConfig; its defaults when None). Raises ValueError
    for another `answers`, DataError as those two do."""
    if answers not in ANSWERS:
        raise ValueError(f"answers must be one of {', '.join(ANSWERS)}, got {answers!r}")
    c = config or ConversationConfig()
    if answers == "sharegpt":
        return dataset_rows(target, data, c)
    rows = dataset_rows(target, data, c)[0] if answers == "mix" else []
    rows += self_answers(target, data, out_dir, c)
    source = {"data": data, "answers": answers, "code_only": c.code_only, "conversations": len(rows)}
    return rows, source | {
        "max_tokens": c.max_tokens,
        "answer_temperature": c.temperature,
        "answer_tokens": c.max_new_tokens,
    }
