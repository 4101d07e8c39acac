"""Text of a growing token sequence, released piece by piece as it becomes final: used by the CLI's
streaming output and the server's streamed deltas."""

from __future__ import annotations


class TextDeltas:
    """Call with the token ids committed in each round; returns the new text that can no longer
    change, holding back an incomplete UTF-8 character at the end and the beginning of a stop
    string (the text from a stop string on is never released). `sent` counts released characters."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = 0

    def __call__(self, tokens: list[int]) -> str:
        self.ids += tokens
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
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
