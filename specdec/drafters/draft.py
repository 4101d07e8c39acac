"""A draft: the tokens a drafter proposes, as a chain or a token tree."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Draft:
    """Up to k proposed token ids, and the distribution each was drawn from.

    probs: (len(tokens), V_draft) float32, or None for a deterministic drafter, which the verifier
    treats as a one-hot distribution on each proposed token.
    confidence: the drafter's probability for each proposed token, when it reports one, else None.
    match_length: for a drafter that copies what followed an earlier occurrence of the context's
    end, how many tokens that occurrence matches (longer matches are accepted more often).
    Both feed the adaptive draft length (specdec.adaptive.policy).
    parents: for a deterministic drafter that offers several candidates per position, the draft
    is a token tree: parents[i] is the index of token i's parent among the tokens, -1 for a child
    of the last committed token, always before i. None: a chain (each token follows the one
    before). The first child of each node, in order, forms the tree's main chain (chain()).
    """

    tokens: list[int]
    probs: torch.Tensor | None = None
    confidence: list[float] | None = None
    match_length: int | None = None
    parents: list[int] | None = None

    def depths(self) -> list[int]:
        """Each token's depth, from 1 (a child of the last committed token)."""
        if self.parents is None:
            return list(range(1, len(self.tokens) + 1))
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def chain(self) -> Draft:
        """The main chain as a chain draft: from the first top-level token, each node's first
        child (the drafter's best guess at each depth)."""
        if self.parents is None:
            return self
        keep, want = [], -1
        for i, p in enumerate(self.parents):
            if p == want:
                keep.append(i)
                want = i
        return Draft([self.tokens[i] for i in keep], match_length=self.match_length)

    def pruned(self, max_depth: int, vocab: int, max_tokens: int | None = None) -> Draft:
        """The tree without tokens deeper than max_depth, ids the target cannot score (outside
        0..vocab-1), and their descendants, then cut to its first max_tokens tokens (a parent
        always comes first, so that is a tree too); indices renumbered."""
        if self.parents is None:
            raise ValueError("pruned() is for tree drafts; cut a chain by slicing its tokens")
        new: dict[int, int] = {-1: -1}
        tokens, parents = [], []
        for i, (t, p, d) in enumerate(zip(self.tokens, self.parents, self.depths())):
            if p in new and d <= max_depth and 0 <= t < vocab and (max_tokens is None or len(tokens) < max_tokens):
                new[i] = len(tokens)
                tokens.append(t)
                parents.append(new[p])
        return Draft(tokens, match_length=self.match_length, parents=parents)

    def grafted(self, chain: list[int], max_tokens: int) -> Draft:
        """The tree with `chain` (another drafter's guess after the same context) added as a path
        from the top: it follows the tree's nodes while they agree, then its remaining tokens hang
        from there as new nodes, after the tree's own. So that the tree keeps to max_tokens, the
        new nodes take the free room, else at most half of it from the tree's last nodes (a tree
        ordered best first loses its least likely leaves). The tree's own nodes keep their order, so
        its main chain stays first (shortened if its tail was given up)."""
        if self.parents is None:
            raise ValueError("grafted() is for tree drafts")
        kids: dict[tuple[int, int], int] = {}
        for i, (t, p) in enumerate(zip(self.tokens, self.parents)):
            kids.setdefault((p, t), i)
        path: list[int] = []
        for t in chain:
            i = kids.get((path[-1] if path else -1, t))
            if i is None:
                break
            path.append(i)
        kept, floor = len(self.tokens), (max_tokens + 1) // 2
        while True:
            while path and path[-1] >= kept:  # the graft point itself would be cut: graft higher up
                path.pop()
            needed = len(chain) - len(path)
            if needed <= max_tokens - kept or kept <= floor:
                break
            kept = max(max_tokens - needed, floor)
        new = chain[len(path) :][: max_tokens - kept]
        if not new:
            return self
        tokens, parents = self.tokens[:kept] + new, self.parents[:kept]
        for j in range(len(new)):
            parents.append(kept + j - 1 if j else (path[-1] if path else -1))
        return Draft(tokens, match_length=self.match_length, parents=parents)
