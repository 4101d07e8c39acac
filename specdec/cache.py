"""A model's KV cache together with the tokens it holds, and rollback; on the transformers path
(DynamicCache) or on the lean path (specdec.lean: preallocated, position-indexed).

One invariant, kept by the engine for the target and by a model drafter for the draft: at the
start of a round the cache holds exactly the committed tokens except the last one (the last is
fed as the first token of the next forward, so that forward yields its k+1 scores). Rollback is
dropping the cache back to a prefix; nothing else about the model changes.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from .errors import ContextLengthError
from .models import Model


def new_cache(model: Model) -> "KVCache":
    """An empty KV cache for `model` on its backend (Model.backend: "lean" or "hf")."""
    return LeanKVCache(model) if model.backend == "lean" else KVCache(model)


class KVCache:
    """The KV cache of one sequence on one model (transformers' DynamicCache), and the token ids
    it holds."""

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
        if drop < 0 or n_keep < 0:
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


class LeanKVCache(KVCache):
    """The KV cache of one sequence on the lean path (specdec.lean.LeanModel).

    Keys and values live in per-layer tensors (n_kv_heads, capacity, head_dim), preallocated and
    doubled when full, never past the context length; `features` (capacity, hidden) holds each
    cached position's final-normed hidden state, for a feature-level draft head (specdec.head).
    Rollback moves the length back; the rows past it are overwritten by the next forward.
    """

    def __init__(self, model: Model, capacity: int = 256):
        self.model, self.lean = model, model.lean()
        self.tokens = []
        self.k: list[torch.Tensor] = []  # per layer (n_kv_heads, capacity, head_dim)
        self.v: list[torch.Tensor] = []
        self.features: torch.Tensor | None = None  # (capacity, hidden): final-normed hidden states
        self._grow(min(capacity, model.n_ctx))

    def _grow(self, capacity: int) -> None:
        lm, n = self.lean, len(self.tokens)

        def grown(old: torch.Tensor | None) -> torch.Tensor:
            new = torch.empty((lm.n_kv, capacity, lm.head_dim), dtype=lm.dtype, device=lm.device)
            if old is not None:
                new[:, :n] = old[:, :n]
            return new

        self.k = [grown(self.k[i] if self.k else None) for i in range(len(lm.layers))]
        self.v = [grown(self.v[i] if self.v else None) for i in range(len(lm.layers))]
        features = torch.empty((capacity, lm.hidden_size), dtype=lm.dtype, device=lm.device)
        if self.features is not None:
            features[:n] = self.features[:n]
        self.features = features

    def extend(self, tokens: list[int], all_logits: bool = True) -> torch.Tensor:
        """As KVCache.extend. Raises ContextLengthError past the model's context length."""
        start, end = len(self.tokens), len(self.tokens) + len(tokens)
        if end > self.model.n_ctx:
            raise ContextLengthError(f"{end} tokens exceed {self.model.name}'s context of {self.model.n_ctx}")
        if end > self.k[0].shape[1]:
            self._grow(min(max(end, 2 * self.k[0].shape[1]), self.model.n_ctx))
        ids = torch.tensor(tokens, dtype=torch.long, device=self.lean.device)
        logits = self.lean.forward(ids, self.k, self.v, start, len(tokens) if all_logits else 1, self.features)
        self.tokens.extend(tokens)
        return logits

    def rollback(self, n_keep: int) -> None:
        """Drop every cached token after the first n_keep (moves the length; nothing is copied)."""
        if not 0 <= n_keep <= len(self.tokens):
            raise ValueError(f"cannot roll back to {n_keep} tokens, the cache holds {len(self.tokens)}")
        del self.tokens[n_keep:]
