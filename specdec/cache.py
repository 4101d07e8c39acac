"""A model's KV cache together with the tokens it holds, and rollback.

One invariant, kept by the engine for the target and by a model drafter for the draft: at the
start of a round the cache holds exactly the committed tokens except the last one (the last is
fed as the first token of the next forward, so that forward yields its k+1 scores). Rollback is
cropping the cache back to a prefix; nothing else about the model changes.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from .models import Model


class KVCache:
    """The KV cache of one sequence on one model, and the token ids it holds."""

    def __init__(self, model: Model):
        self.model = model
        self.tokens: list[int] = []
        self.cache = DynamicCache(config=model.hf.config)
        # Sliding-window layers (Gemma 3, Mistral) drop old states once the window is full, which
        # would make rollback impossible; recording keeps them until the next crop trims them.
        self.sliding = [layer for layer in self.cache.layers if getattr(layer, "is_sliding", False)]
        for layer in self.sliding:
            layer.activate_past_recording()

    def __len__(self) -> int:
        return len(self.tokens)

    @torch.inference_mode()
    def extend(self, tokens: list[int], all_logits: bool = True) -> torch.Tensor:
        """Run the model over `tokens`, appended after the cached ones, in one forward.

        Returns logits of shape (len(tokens), V) when all_logits, else (1, V) for the last token
        only (cheaper: the output layer runs on one row). Row i scores the token after tokens[i].
        """
        ids = torch.tensor([tokens], dtype=torch.long)  # (1, n)
        out = self.model.hf(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=0 if all_logits else 1)
        self.tokens.extend(tokens)
        return out.logits[0]  # (n, V) or (1, V)

    def rollback(self, n_keep: int) -> None:
        """Drop every cached token after the first n_keep."""
        drop = len(self.tokens) - n_keep
        if drop < 0:
            raise ValueError(f"cannot roll back to {n_keep} tokens, the cache holds {len(self.tokens)}")
        if drop or (self.sliding and self.tokens):  # crop(0) trims recorded sliding-window layers back to their window
            self.cache.crop(-drop)
        del self.tokens[n_keep:]

    def sync(self, context: list[int]) -> list[int]:
        """Roll back to the longest common prefix of the cache and context[:-1]; return the tokens
        of `context` still to feed (at least the last one), so that the next forward scores the
        position after `context`."""
        keep = 0
        limit = min(len(self.tokens), len(context) - 1)
        while keep < limit and self.tokens[keep] == context[keep]:
            keep += 1
        self.rollback(keep)
        return context[keep:]
