"""Text of a growing token sequence, decoded incrementally and released piece by piece as it becomes
final: used by the CLI's streaming output, the server's streamed deltas and the stop-string check."""

from __future__ import annotations

from collections.abc import Sequence

CONTEXT = 8  # tokens before the new ones that are decoded again with them


class IncrementalText:
    """tokenizer.decode(ids, skip_special_tokens=True) of a growing list of token ids, in time per
    call that does not grow with the list (the incremental detokenization of vLLM and Hugging Face's
    streamers): the new tokens are decoded together with the CONTEXT tokens before them (more where
    those decode to nothing, special tokens skipped), and their text is what that adds to the
    context's own text. The text so far is kept up to the last token that completed a character;
    while a character is split across tokens (an emoji in byte-level BPE) the window reaches back to
    there. Where the context's text changes with what follows it, the whole list is decoded
    instead, so the result is always the full decode's."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.stable = 0  # ids[:stable] decode to self.text, which ends with a complete character
        self.text = ""
        self.start, self.head = 0, ""  # the context ids[start:stable] and its text

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def peek(self, tokens: Sequence[int] = ()) -> str:
        """The text of the ids with `tokens` appended, without appending them."""
        tail = self._decode(self.ids[self.start :] + list(tokens))
        if tail.startswith(self.head):
            return self.text + tail[len(self.head) :]
        return self._decode(self.ids + list(tokens))

    def add(self, tokens: Sequence[int]) -> str:
        """Append `tokens`; returns the text of all the ids."""
        text = self.peek(tokens)
        self.ids += tokens
        if not text.endswith("\ufffd"):  # the last character is complete: later tokens cannot change it
            self.text, self.stable = text, len(self.ids)
            self.start, self.head = self.stable, ""
            while self.start > 0 and (not self.head or self.stable - self.start < CONTEXT):
                self.start = max(0, self.start - CONTEXT)  # context with some text: a decoder joins to it
                self.head = self._decode(self.ids[self.start : self.stable])
        return text


class TextDeltas:
    """Call with the token ids committed in each round; returns the new text that can no longer
    change, holding back an incomplete UTF-8 character at the end and the beginning of a stop
    string (the text from a stop string on is never released). `sent` counts released characters."""

    def __init__(self, tokenizer, stop: list[str]):
        self.text, self.stop = IncrementalText(tokenizer), [s for s in stop if s]
        self.sent = 0

    def __call__(self, tokens: list[int]) -> str:
        text = self.text.add(tokens)
        safe = len(text.rstrip("\ufffd"))
        for s in self.stop:
            hit = text.find(s)
            safe = min(safe, hit if hit >= 0 else held_back(text, s))
        piece = text[self.sent : safe] if safe > self.sent else ""
        self.sent += len(piece)
        return piece


def held_back(text: str, stop: str) -> int:
    """Where the longest suffix of text that is a proper prefix of stop begins (len(text) if none)."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return len(text) - n
    return len(text)
