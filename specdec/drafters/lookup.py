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
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min {min_ngram}, max {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def prepare(self, target: Model) -> None:
        pass

    def propose(self, context: list[int], k: int, sampler: Sampler) -> Draft:
        """Up to k tokens; Draft.match_length is how far back the chosen occurrence matches the
        context's end (at least its n-gram, at most MAX_MATCH)."""
        L = len(context)
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            pattern = context[L - n :]
            for start in range(L - n - 1, -1, -1):  # most recent earlier occurrence first
                if context[start : start + n] == pattern:
                    length = n
                    while (
                        length < MAX_MATCH
                        and start - (length - n) > 0
                        and context[start - (length - n) - 1] == context[L - length - 1]
                    ):
                        length += 1
                    return Draft(continuation(context, start + n, k), match_length=length)
        return Draft([])


def long_lookup(lookup: PromptLookup | None, context: list[int], k: int) -> Draft | None:
    """Prompt lookup's draft of up to k tokens when its match is at least LONG_MATCH tokens long,
    else None (also without a lookup). Free: no model runs."""
    if lookup is None:
        return None
    looked = lookup.propose(context, k, None)
    return looked if looked.tokens and (looked.match_length or 0) >= LONG_MATCH else None
