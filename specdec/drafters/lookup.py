"""Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; transformers'
`prompt_lookup_num_tokens`): find the last n tokens earlier in the context and propose what
followed them there. No model, no probabilities."""

from __future__ import annotations

from specdec.drafters.base import Drafter
from specdec.drafters.draft import Draft
from specdec.models.load import Model
from specdec.sampling import Sampler

MAX_MATCH = 32  # how far back a match's length is measured
# A match at least this long (tokens) is usually copied on (extraction, repeated code): a model or
# head drafter with lookup then proposes lookup's draft alone, for free.
LONG_MATCH = 6


def continuation(context: list[int], at: int, k: int) -> list[int]:
    """k tokens from context[at:], and where those run out, the draft's own tokens again: an
    occurrence d tokens back predicts that the text repeats with period d (LZ77's overlapping
    copy), so a loop of d < k tokens is drafted k tokens deep, not d (a model looping on one
    token gets k-token drafts, as from the suffix automaton's continuation)."""
    out: list[int] = []
    for i in range(at, at + k):
        out.append(context[i] if i < len(context) else out[i - len(context)])
    return out


class PromptLookup(Drafter):
    """n-gram match over prompt + output so far.

    Tries the longest n-gram first (max_ngram down to min_ngram) and, for each n, the most recent
    earlier occurrence first; proposes the up to k tokens that followed it, continued periodically
    where they run into the end of the context (see continuation). Raises ValueError unless
    1 <= min_ngram <= max_ngram.

    Each n-gram's most recent occurrence is kept in a table, so a proposal costs the same at any
    context length: a context that extends the last one (a generation's tokens) adds only its new
    n-grams; any other context is indexed afresh.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min {min_ngram}, max {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._seen: list[int] = []  # the context indexed
        self._latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram)]  # per n: n-gram -> latest start

    def prepare(self, target: Model) -> None:
        pass

    def fork(self) -> PromptLookup:
        """The same lookup with a table of its own (Drafter.fork)."""
        return PromptLookup(self.max_ngram, self.min_ngram)

    def propose(self, context: list[int], k: int, sampler: Sampler) -> Draft:
        """Up to k tokens; Draft.match_length is how far back the chosen occurrence matches the
        context's end (at least its n-gram, at most MAX_MATCH)."""
        L = len(context)
        self._index(context)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            start = self._latest[n - 1].get(tuple(context[L - n :]))
            if start is not None:  # the most recent earlier occurrence, followed by a token
                length = n
                while (
                    length < MAX_MATCH
                    and start - (length - n) > 0
                    and context[start - (length - n) - 1] == context[L - length - 1]
                ):
                    length += 1
                return Draft(continuation(context, start + n, k), match_length=length)
        return Draft([])

    def _index(self, context: list[int]) -> None:
        """Make _latest[n - 1] map every n-gram starting at s <= len(context) - n - 1 (one that a
        token follows, not the context's own end) to its latest such s."""
        L, done = len(context), len(self._seen)
        if L < done or context[:done] != self._seen:  # not the indexed context grown: afresh
            self._latest, self._seen, done = [{} for _ in range(self.max_ngram)], [], 0
        for n, latest in enumerate(self._latest, 1):
            for s in range(max(0, done - n), L - n):
                latest[tuple(context[s : s + n])] = s
        self._seen += context[done:]


def long_lookup(lookup: PromptLookup | None, context: list[int], k: int) -> Draft | None:
    """Prompt lookup's draft of up to k tokens when its match is at least LONG_MATCH tokens long,
    else None (also without a lookup). Free: no model runs."""
    if lookup is None:
        return None
    looked = lookup.propose(context, k, None)
    return looked if looked.tokens and (looked.match_length or 0) >= LONG_MATCH else None
