"""The draft head's training objective (step 4 of specdec.train.train): regression toward the next
feature and cross-entropy toward the target's next token, for every draft step of the
training-time test (EAGLE-3 / HASS)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdec.train.head import DraftHead


@dataclass(frozen=True, eq=False)
class HeadLoss:
    """The loss of `head` against one sequence of the target's features.

    embed: the target's input embeddings, token ids (n,) -> (n, d) (its lean forward's embed_rows).
    out_weight: (N, d) fp32, the rows of its output layer for the head's vocabulary of N tokens.
    index: (V,) long, a token id's place in that vocabulary, -1 for the ids outside it.
    ce_weight: the cross-entropy's weight beside the regression. steps: draft steps trained (>= 1),
    step j weighing decay^(j-1).
    """

    head: DraftHead
    embed: Callable[[torch.Tensor], torch.Tensor]
    out_weight: torch.Tensor
    index: torch.Tensor
    ce_weight: float = 0.5
    steps: int = 1
    decay: float = 0.8

    def __call__(self, tokens: torch.Tensor, feats: torch.Tensor, labels: torch.Tensor, noise: float):
        """(total, regression, cross-entropy, accuracy per draft step) on one sequence.

        tokens, labels: (T,); labels are the target's greedy token after each position, -1 where
        it is not trained on. feats: (T, d) or, for a head with taps, (T, (1 + len(taps)) d), whose
        first d columns (the final feature) are the regression target. noise: uniform noise of
        this amplitude, scaled to each block's spread, on the features read (0: none).

        Step j (1..steps) is the head drafting its j-th token from its own earlier predictions
        (DraftHead.unrolled); every step is trained toward the same targets, the next feature and
        the target's token after it. Regression and cross-entropy are step one's (tensors);
        accuracy j (floats) is how often step j's top token is the target's greedy one."""
        d = self.head.config["hidden"]
        x_in = feats[:-1]
        if noise:
            scale = feats.unflatten(-1, (-1, d)).std(dim=(0, 2))  # (1 + taps,): each block's spread
            noisy = ((torch.rand_like(x_in) - 0.5) * 2 * noise).unflatten(-1, (-1, d))
            x_in = x_in + noisy.mul(scale[:, None]).flatten(-2)
        feats = feats[:, :d]
        preds = self.head.unrolled(x_in, self.embed(tokens[1:]).float(), self.steps)  # (T-1, d) each: f_1..f_{T-1}
        # the target's token after position t+1, as a head-vocabulary index (-1: not trained on)
        target_ids = torch.where(labels[1:] >= 0, self.index[labels[1:].clamp(min=0)], -1)
        trained = labels[1:] >= 0  # positions t+1 a row's mask keeps (all of them for answers alone)
        total, first, accs = 0.0, None, []
        for j, pred in enumerate(preds):  # rows before j have no j-step path
            logits = pred[j:] @ self.out_weight.T
            rows = trained[j:]
            reg = F.smooth_l1_loss(pred[j:][rows], feats[1 + j :][rows]) if rows.any() else pred.sum() * 0
            ce = F.cross_entropy(logits, target_ids[j:], ignore_index=-1)
            valid = target_ids[j:] >= 0
            hits = (logits.argmax(-1)[valid] == target_ids[j:][valid]).float()
            accs.append(float(hits.mean()) if valid.any() else 0.0)
            total = total + self.decay**j * (reg + self.ce_weight * ce)
            first = first or (reg, ce)
        return total, *first, accs
