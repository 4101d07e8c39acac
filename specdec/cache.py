"""A model's KV cache together with the tokens it holds, and rollback; on the transformers path
(DynamicCache) or on the lean path (specdec.backends.lean: preallocated, position-indexed).

One invariant, kept by the engine for the target and by a model drafter for the draft: at the
start of a round the cache holds exactly the committed tokens except the last one (the last is
fed as the first token of the next forward, so that forward yields its k+1 scores). Rollback is
dropping the cache back to a prefix; nothing else about the model changes.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from specdec.backends.lean import BatchItem, tree_layout
from specdec.errors import ContextLengthError
from specdec.models.load import Model


def grown(old: torch.Tensor, capacity: int, keep: int, dim: int) -> torch.Tensor:
    """A copy of `old` with room for `capacity` rows along `dim`, its first `keep` rows copied."""
    shape = list(old.shape)
    shape[dim] = capacity
    new = old.new_empty(shape)
    new.narrow(dim, 0, keep).copy_(old.narrow(dim, 0, keep))
    return new


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def new_cache(model: Model) -> KVCache:
    """An empty KV cache for `model` on its backend (Model.backend: "lean" or "hf")."""
    return LeanKVCache(model) if model.backend == "lean" else KVCache(model)


class KVCache:
    """The KV cache of one sequence on one model (transformers' DynamicCache), and the token ids
    it holds. argmax_only: set it for greedy decoding, where only each row's argmax of the logits
    is read; the lean backend then screens its output layer in bf16 (specdec.backends.screen) and the other
    entries may be approximations. The transformers backend ignores it.

    What a cache can do, declared (callers read these, never probe with hasattr):
    keeps_paths: whether keep_path() keeps a verified token tree's accepted path (else a tree's main
    chain is verified); sliding: its sliding-window layers, which can undo only the last forward.
    """

    argmax_only = False
    keeps_paths = False  # the transformers cache verifies chains only
    sliding: list = []

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
        ids = torch.tensor([tokens], dtype=torch.long, device=self.model.device)  # (1, n)
        out = self.model.hf(input_ids=ids, cache=self.cache, use_cache=True, logits_to_keep=0 if all_logits else 1)
        self.tokens.extend(tokens)
        return out.logits[0]  # (n, V) or (1, V)

    def rollback(self, n_keep: int) -> None:
        """Drop every cached token after the first n_keep. Raises ValueError past the cache."""
        if not 0 <= n_keep <= len(self.tokens):
            raise ValueError(f"cannot roll back to {n_keep} tokens, the cache holds {len(self.tokens)}")
        self._drop(len(self.tokens) - n_keep)
        del self.tokens[n_keep:]

    def _drop(self, n: int) -> None:
        """Forget the last n cached positions' states (the tokens list is the caller's)."""
        if n or (self.sliding and self.tokens):  # crop(0) trims recorded sliding-window layers back to their window
            self.cache.crop(-n)

    def sync(self, context: list[int]) -> list[int]:
        """Roll back to the longest common prefix of the cache and context[:-1]; return the tokens
        of `context` still to feed (at least the last one), so that the next forward scores the
        position after `context`."""
        keep = min(common_prefix(self.tokens, context), len(context) - 1)
        self.rollback(keep)
        return context[keep:]


class LeanKVCache(KVCache):
    """The KV cache of one sequence on the lean path (specdec.backends.lean.LeanModel).

    Keys and values live in per-layer tensors (n_kv_heads, capacity, head_dim), `k` and `v`: views
    of `keys` and `values` (layers, n_kv_heads, capacity, head_dim), so that a kept tree path moves
    in one op for all layers; preallocated and doubled when full, never past the context length.
    `features` (capacity, hidden x (1 + len(taps))) holds each cached position's final-normed hidden
    state, then its hidden states after the decoder layers `taps` (none unless asked for), for a
    feature-level draft head (specdec.train.head). Rollback moves the length back; the rows past it
    are overwritten by the next forward.
    """

    keeps_paths = True  # keep_path(): a verified tree's accepted path moved to consecutive positions
    sliding: list = []  # a sliding window is a mask over the whole cache: any rollback is exact

    def __init__(self, model: Model, capacity: int = 256, taps: tuple[int, ...] = ()):
        self.model, self.lean = model, model.lean()
        self.tokens = []
        lm, capacity = self.lean, min(capacity, model.n_ctx)
        shape = (len(lm.layers), lm.n_kv, capacity, lm.head_dim)
        self.keys = torch.empty(shape, dtype=lm.kv_dtype, device=lm.device)
        self.values = torch.empty_like(self.keys)
        self._views()
        self.taps: tuple[int, ...] = ()
        self.features = torch.empty(capacity, lm.hidden_size, dtype=lm.dtype, device=lm.device)  # final-normed
        self.tap(taps)

    def _views(self) -> None:
        """Per layer (n_kv_heads, capacity, head_dim): views of keys and values."""
        self.k, self.v = list(self.keys.unbind(0)), list(self.values.unbind(0))

    def tap(self, layers) -> None:
        """Keep, from now on, the hidden states after these decoder layers (0-based) beside each
        position's feature. Only on an empty cache (ValueError otherwise, or for a layer the model
        does not have)."""
        layers = tuple(int(i) for i in layers)
        if layers == self.taps:
            return
        if self.tokens:
            raise ValueError("tap() needs an empty cache: call it before the first forward")
        if any(not 0 <= i < len(self.lean.layers) for i in layers):
            raise ValueError(f"taps {layers}: {self.model.name} has decoder layers 0..{len(self.lean.layers) - 1}")
        self.taps = layers
        self.features = self.features.new_empty(self.features.shape[0], self.lean.hidden_size * (1 + len(layers)))

    def extend(self, tokens: list[int], all_logits: bool = True, parents: list[int] | None = None) -> torch.Tensor:
        """As KVCache.extend. With parents, `tokens` is a token tree, not a sequence (see
        specdec.backends.lean.tree_layout: parents[i] is node i's parent, -1 for node 0): every node is
        scored in one forward, seeing the cached tokens and its ancestors, and row i of the logits
        scores the token after node i; call keep_path() next. Raises ContextLengthError past the
        model's context length, ValueError for parents that are not a tree."""
        return extend_batch([self], [tokens], [all_logits], [parents])[0]

    def item(self, tokens: list[int], all_logits: bool = True, parents: list[int] | None = None) -> BatchItem:
        """The forward's arguments that append `tokens` to this cache (growing it first), for
        extend_batch; the tokens count as cached once that forward has run. Errors: extend()."""
        start, end = len(self.tokens), len(self.tokens) + len(tokens)
        if end > self.model.n_ctx:
            raise ContextLengthError(f"{end} tokens exceed {self.model.name}'s context of {self.model.n_ctx}")
        if end > self.features.shape[0]:  # double, never past the context
            capacity = min(max(end, 2 * self.features.shape[0]), self.model.n_ctx)
            self.keys = grown(self.keys, capacity, start, dim=2)
            self.values = grown(self.values, capacity, start, dim=2)
            self._views()
            self.features = grown(self.features, capacity, start, dim=0)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.lean.device)
        tree = None if parents is None else tree_layout(parents, start, self.lean.device)
        keep = len(tokens) if all_logits else 1
        return BatchItem(ids, self.k, self.v, self.features, start, keep, tree=tree, argmax_only=self.argmax_only)

    def keep_path(self, start: int, path: list[int]) -> None:
        """After a tree forward that began at `start` cached tokens: keep the nodes `path` (indices
        into that tree, root first, each the parent of the next) as the sequence's next tokens and
        drop the rest. Their rows move to start, start+1, ... (keys, values, features). Raises
        ValueError for a path that does not start at node 0 and increase within the tree."""
        if (
            not path
            or path[0] != 0
            or any(b <= a for a, b in zip(path, path[1:]))
            or start + path[-1] >= len(self.tokens)
        ):
            raise ValueError(f"path {path} is not a root-first path of the tree at {start}")
        moved = [i for i, node in enumerate(path) if node != i]  # a chain-first path's head is in place already
        if moved:
            src = torch.tensor([path[i] for i in moved], device=self.lean.device) + start
            dst = torch.tensor(moved, device=self.lean.device) + start
            for t in (self.keys, self.values):  # every layer's rows at once
                t.index_copy_(2, dst, t.index_select(2, src))
            self.features.index_copy_(0, dst, self.features.index_select(0, src))
        self.tokens[start:] = [self.tokens[start + i] for i in path]

    def _drop(self, n: int) -> None:
        """Nothing to free: the rows past the length are overwritten by the next forward."""


def extend_batch(
    caches: list[KVCache],
    blocks: list[list[int]],
    all_logits: list[bool] | None = None,
    parents: list[list[int] | None] | None = None,
) -> list[torch.Tensor]:
    """KVCache.extend of several sequences of one model: cache i appended blocks[i] (a token tree
    where parents[i] is given). On a backend with a batched forward (the quantized one) every
    block runs in ONE forward, each over its own cache; elsewhere one forward per cache. Either way
    cache i gets the logits and states its extend alone would give, to the bit (the kernels are
    batch-invariant). Returns each cache's logits, as extend. Errors: extend()'s; a cache that
    raises leaves the others untouched (every block is checked before any forward runs)."""
    n = len(caches)
    all_logits = [True] * n if all_logits is None else all_logits
    parents = [None] * n if parents is None else parents
    if not all(isinstance(c, LeanKVCache) for c in caches):  # transformers: one forward per cache
        return [c.extend(b, a) for c, b, a in zip(caches, blocks, all_logits)]
    items = [c.item(b, a, p) for c, b, a, p in zip(caches, blocks, all_logits, parents)]
    taps = {c.taps for c in caches}
    if len(taps) > 1:
        raise ValueError(f"the caches of one batched forward must tap the same layers, got {sorted(taps)}")
    out = caches[0].lean.forward_batch(items, taps.pop())
    for c, b in zip(caches, blocks):
        c.tokens.extend(b)
    return out
