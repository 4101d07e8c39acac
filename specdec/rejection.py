"""The rejection rule: which drafted tokens to keep, and the one token the target adds
(Leviathan et al. 2023, Chen et al. 2023; greedy: the longest prefix the target's argmax agrees with).

Words, as in vLLM's rejection sampler:
- accepted tokens: the longest prefix of the draft the verifier keeps;
- recovered token: drawn by the target at the first rejected position (greedy: the target's
  argmax there; sampling: a draw from max(0, p - q) renormalised);
- bonus token: drawn from the target's (k+1)-th distribution when all k drafted tokens are accepted.

Each round therefore adds n_accepted + 1 tokens. Both functions are pure: no model, no state,
randomness only from the generator passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.sampling import argmax_rows


@dataclass(frozen=True)
class Verdict:
    """n_accepted: how many drafted tokens were kept (0..k); token: the recovered token
    (bonus=False) or the bonus token (bonus=True)."""

    n_accepted: int
    token: int
    bonus: bool


def verify_greedy(draft_tokens: list[int], target_logits: torch.Tensor) -> Verdict:
    """Greedy verification: keep drafted tokens while they equal the target's argmax.

    draft_tokens: k ids. target_logits: (k+1, V), row i scoring the position of draft token i
    (row k the position after the last). The output equals plain greedy decoding of the target
    whenever these logits equal the one-token-at-a-time logits.
    """
    if target_logits.shape[0] != len(draft_tokens) + 1:
        raise ValueError(f"need k+1 = {len(draft_tokens) + 1} target rows, got {target_logits.shape[0]}")
    n = 0
    while True:  # a row's argmax only up to the first rejection: the rows after it are never read
        choice = argmax_rows(target_logits[n])[0]
        if n == len(draft_tokens) or draft_tokens[n] != choice:
            return Verdict(n, choice, n == len(draft_tokens))
        n += 1


def verify_sampling(
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> Verdict:
    """Speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023).

    draft_tokens: k ids. draft_probs: q, (k, V), the distribution each drafted token was drawn
    from; None for a deterministic drafter (prompt lookup), which is a one-hot q. target_probs:
    p, (k+1, V), already processed by the same temperature / top-k / top-p as q.

    Drafted token x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first
    rejection the recovered token is drawn from max(0, p_i - q_i) renormalised; when all k are
    accepted the bonus token is drawn from p_k. The kept tokens are then distributed exactly as
    tokens drawn from p one at a time.

    Raises ValueError when the shapes do not agree.
    """
    k = len(draft_tokens)
    if target_probs.shape[0] != k + 1:
        raise ValueError(f"need k+1 = {k + 1} target rows, got {target_probs.shape[0]}")
    if draft_probs is not None and draft_probs.shape != (k, target_probs.shape[1]):
        raise ValueError(f"draft probs must be (k, V) = {(k, target_probs.shape[1])}, got {tuple(draft_probs.shape)}")
    if k:
        idx = torch.tensor(draft_tokens)[:, None]  # (k, 1)
        p = target_probs[:-1].gather(1, idx)[:, 0]  # (k,) p_i(x_i)
        q = draft_probs.gather(1, idx)[:, 0] if draft_probs is not None else torch.ones(k)
        r = torch.rand(k, generator=generator)
        # r < p/q without dividing: q = 0 with p > 0 accepts, p = 0 always rejects.
        accepted = (r * q < p).tolist()
        for i, ok in enumerate(accepted):
            if not ok:
                if draft_probs is not None:
                    residual = (target_probs[i] - draft_probs[i]).clamp(min=0)
                else:  # one-hot q: p with the drafted token removed
                    residual = target_probs[i].clone()
                    residual[draft_tokens[i]] = 0
                if residual.sum() <= 0:  # p <= q everywhere only up to rounding: fall back to p
                    residual = target_probs[i]
                token = torch.multinomial(residual / residual.sum(), 1, generator=generator)
                return Verdict(i, int(token), False)
    token = torch.multinomial(target_probs[k], 1, generator=generator)
    return Verdict(k, int(token), True)


def verify_tree_greedy(
    tree_tokens: list[int], parents: list[int], target_logits: torch.Tensor
) -> tuple[Verdict, list[int]]:
    """Greedy verification of a token tree (SpecInfer, Miao et al. 2024; Medusa's typical tree):
    follow the target's argmax from the root while some child of the current node holds it.

    tree_tokens: n node ids, node 0 the last committed token (the root), the others drafted;
    parents: (n,) each node's parent index, -1 for the root (specdec.backends.lean.tree_layout);
    target_logits: (n, V), row i scoring the token after node i. Returns the verdict (n_accepted =
    drafted nodes kept, one per depth; bonus=True when the path ends at a leaf) and the kept
    path, root first. Plain greedy decoding would produce exactly the path's tokens and then the
    verdict's token, whenever these logits equal the one-token-at-a-time ones.
    """
    if target_logits.shape[0] != len(tree_tokens) or len(parents) != len(tree_tokens):
        raise ValueError(
            f"need one parent and one target row per node ({len(tree_tokens)}), "
            f"got {len(parents)} parents and {target_logits.shape[0]} rows"
        )
    choice = argmax_rows(target_logits)  # (n,)
    children: dict[int, dict[int, int]] = {}
    for i, p in enumerate(parents):
        if i:
            children.setdefault(p, {}).setdefault(tree_tokens[i], i)  # a duplicate sibling never wins
    path = [0]
    while (nxt := children.get(path[-1], {}).get(choice[path[-1]])) is not None:
        path.append(nxt)
    return Verdict(len(path) - 1, choice[path[-1]], path[-1] not in children), path
