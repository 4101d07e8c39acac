"""Structured output: a grammar (a JSON schema, any JSON object, a regex, a list of choices or a Lark
grammar) that the generated text must follow, through llguidance (Microsoft's constrained-decoding
library, a backend of llama.cpp, vLLM and SGLang; why it and not xgrammar, measured:
docs/structured-output.md).

A Grammar is the request (what to follow); a Constraint is one generation's state (an llguidance
matcher over the target's tokenizer). The target's verifier (specdec.scoring) masks each row of a
verified block by the state after that row's prefix: the committed tokens, then the drafted tokens
before it, consumed while the grammar allows them and rolled back once the verdict is known, so
that a rejected draft leaves no trace and every row is what plain constrained decoding sees.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass

import numpy as np
import torch

KINDS = ("json_schema", "json_object", "regex", "choice", "lark")
# JSON as Python's json.dumps writes it ({"a": 1, "b": [2, 3]}): whitespace fixed, so that the
# grammar forces every key and separator (free drafts), in the style models write
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {(vocab, eos): LLTokenizer}


class GrammarError(ValueError):
    """A grammar llguidance cannot compile, or one that admits no text."""


@dataclass(frozen=True)
class Grammar:
    """What the output must follow. kind: one of KINDS; source: the JSON schema's text, the regex,
    the choices as a JSON list of strings, or the Lark grammar ("" for json_object). Build one with
    the class methods. Raises GrammarError for an unknown kind or a source that is not text."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}; known: {', '.join(KINDS)}")
        if not isinstance(self.source, str):
            raise GrammarError(f"a {self.kind} grammar's source must be text, got {type(self.source).__name__}")

    @classmethod
    def json_schema(cls, schema: dict | str) -> Grammar:
        """Output a JSON value valid under this JSON Schema (a dict, or its JSON text), written as
        json.dumps writes it (JSON_STYLE). Raises GrammarError for text that is not JSON."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema is an object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema, sort_keys=True))

    @classmethod
    def json_object(cls) -> Grammar:
        """Output any JSON object (OpenAI's response_format {"type": "json_object"})."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Output text matching the whole regex (llguidance's syntax, Rust's regex crate)."""
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: list[str]) -> Grammar:
        """Output exactly one of these strings. Raises GrammarError for an empty list or a non-string."""
        if not choices or not all(isinstance(c, str) for c in choices):
            raise GrammarError(f"choice needs a non-empty list of strings, got {choices!r}")
        return cls("choice", json.dumps(list(choices)))

    @classmethod
    def lark(cls, grammar: str) -> Grammar:
        """Output text of this Lark grammar (llguidance's Lark dialect; `start` is the top rule)."""
        return cls("lark", grammar)

    def spec(self) -> str:
        """The grammar in llguidance's form. Raises GrammarError where llguidance cannot parse it."""
        from llguidance import LLMatcher, grammar_from

        try:
            if self.kind == "json_schema":
                return LLMatcher.grammar_from_json_schema(json.loads(self.source), overrides=JSON_STYLE)
            if self.kind == "json_object":
                return LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_STYLE)
            if self.kind == "regex":
                return LLMatcher.grammar_from_regex(self.source)
            if self.kind == "choice":
                return grammar_from("choice", self.source)
            return LLMatcher.grammar_from_lark(self.source)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"cannot read the {self.kind} grammar: {e}") from None


def tokenizer_info(model):
    """llguidance's view of model's tokenizer over its logits' width, with the model's end tokens as
    EOS; built once per tokenizer (about 1-3 s) and kept while the tokenizer lives."""
    import llguidance.hf

    per = _TOKENIZERS.setdefault(model.tokenizer, {})
    key = (model.vocab_size, tuple(sorted(model.eos_token_ids)))
    if key not in per:
        per[key] = llguidance.hf.from_tokenizer(
            model.tokenizer, n_vocab=model.vocab_size, eos_token=list(key[1]) or None
        )
    return per[key]


class Constraint:
    """One generation's grammar state over `model`'s vocabulary (an llguidance matcher).

    Raises GrammarError for a grammar llguidance cannot compile or one that admits no text (its
    first mask allows nothing but an end token while it cannot end there).
    """

    def __init__(self, grammar: Grammar, model):
        from llguidance import LLMatcher

        self.vocab = model.vocab_size
        self.matcher = LLMatcher(tokenizer_info(model), grammar.spec(), log_level=0)
        self._check()
        self.words = np.zeros((1, (self.vocab + 31) // 32), dtype=np.int32)
        self.pending = 0  # drafted tokens consumed by the last mask() and not yet settled
        allowed = self._allowed()
        eos = set(model.eos_token_ids)
        if not self.matcher.is_accepting() and all(int(t) in eos for t in np.flatnonzero(allowed)):
            raise GrammarError(f"the {grammar.kind} grammar admits no text")

    def _check(self) -> None:
        if self.matcher.is_error():
            raise GrammarError(f"grammar error: {self.matcher.get_error()}")

    def _fill(self) -> None:
        """The next position's mask into self.words (bit t of the words: token t allowed)."""
        import llguidance.numpy

        llguidance.numpy.fill_next_token_bitmask(self.matcher, self.words, 0)

    def _allows(self, token: int) -> bool:
        """Whether the filled mask allows `token` (one bit read)."""
        return bool((int(self.words[0, token >> 5]) >> (token & 31)) & 1)

    def _allowed(self, fill: bool = True) -> np.ndarray:
        """(vocab,) bool: the tokens the grammar allows next (the mask filled first unless fill=False)."""
        if fill:
            self._fill()
        return np.unpackbits(self.words[0].view(np.uint8), bitorder="little")[: self.vocab].astype(bool)

    def forced(self) -> list[int]:
        """The tokens the grammar allows only one way from here (llguidance's fast-forward tokens):
        they need no drafter."""
        return list(self.matcher.compute_ff_tokens())

    def mask(self, logits: torch.Tensor, draft: list[int], greedy: bool) -> torch.Tensor:
        """Logits (n, V), n <= len(draft) + 1, row i scoring the position after draft[:i]: each row
        up to the first drafted token the grammar forbids (the rows read) with the tokens its state
        forbids set to -inf (float32 on the CPU; a new tensor where any row
        changes). Consumes draft tokens while the grammar allows them (settle() rolls them back).
        greedy: only each row's argmax is read, so a row whose argmax the grammar allows is left as
        it is (its masked argmax is the same token)."""
        rows = logits.detach().float().cpu()
        out = None
        for i in range(rows.shape[0]):
            self._fill()
            if not (greedy and self._allows(int(rows[i].numpy().argmax()))):
                if out is None:
                    out = rows.clone()
                out[i] = _masked(rows[i], self._allowed(fill=False))
            if i >= len(draft) or not self._allows(draft[i]) or not self.matcher.consume_token(draft[i]):
                break  # the rows after a forbidden draft token are never read
            self.pending += 1
        self._check()
        return rows if out is None else out  # rows after the loop stopped are never read

    def settle(self, n_accepted: int, token: int) -> None:
        """The round's verdict: keep n_accepted of the drafted tokens mask() consumed, then the
        target's token. Raises GrammarError if the grammar refuses that token (a bug upstream)."""
        if self.pending > n_accepted:
            self.matcher.rollback(self.pending - n_accepted)
        self.pending = 0
        if not self.matcher.consume_token(token):
            raise GrammarError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """Whether the grammar has ended (only an end token may follow, and it came)."""
        return self.matcher.is_stopped()


def _masked(row: torch.Tensor, allowed: np.ndarray) -> torch.Tensor:
    """row (V,) with -inf where `allowed` (V,) is False: the few allowed values written into a row
    of -inf, or numpy's select where most are allowed (both cheaper than a boolean index)."""
    if int(allowed.sum()) * 8 < allowed.size:
        keep = torch.from_numpy(np.flatnonzero(allowed))
        out = torch.full_like(row, float("-inf"))
        out[keep] = row[keep]
        return out
    return torch.from_numpy(np.where(allowed, row.numpy(), np.float32(-np.inf)))
