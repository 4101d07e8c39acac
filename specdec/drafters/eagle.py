"""Drafting with a feature-level head over the target's own features (EAGLE, Li et al. 2024);
the head is specdec.train.head.DraftHead, trained by `specdec train`."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable

import torch

from specdec.backends.linear import Linear
from specdec.backends.quant import QuantModel
from specdec.cache import common_prefix
from specdec.drafters.base import Drafter
from specdec.drafters.draft import Draft
from specdec.drafters.lookup import LONG_MATCH, PromptLookup, long_lookup
from specdec.drafters.quant_head import HEAD_QUANTIZE, QuantHead
from specdec.drafters.vocab import draft_vocab
from specdec.models.load import Model
from specdec.models.quantize import QUANTIZE
from specdec.sampling import Sampler
from specdec.train.head import DraftHead, HeadCache, HeadError, find_head, head_file, load_head


class EagleDrafter(Drafter):
    """Drafts token by token with a DraftHead that reads the target's features.

    head: a DraftHead, a path to a head file, or None for the target's stored head (head.find_head).
    The target must run on the lean backend, whose KV cache keeps every position's feature; the
    engine hands that cache over with attach(kv) after creating it. Each proposal first feeds the
    head the committed positions it has not seen (their true features), then drafts: greedy
    tokens, or sampled ones with their probabilities (zero outside the head's vocabulary).

    alternatives (greedy only): also offer, at each depth, the head's next `alternatives` best
    tokens as leaves beside the main chain's token, a token tree (Draft.parents) that the engine
    verifies in one forward (the static trees of EAGLE and Medusa, cut to one branch per depth);
    a draft of k tokens is then about k / (1 + alternatives) deep. 0: a chain. lookup (greedy
    only): graft prompt lookup's draft onto that tree as a branch (Draft.grafted, as the suffix
    tree drafter does): the head and lookup are right on different tokens (the head on fluent
    text, lookup on text the context repeats), and the target keeps whichever path it agrees with.
    When lookup's match is at least LONG_MATCH tokens long, its draft alone is proposed (a long
    match is usually copied on: extraction, repeated code) and the head is not run.

    quantize: against a target on the quantized backend the head runs on the target's kernels
    (specdec.drafters.quant_head.QuantHead: its matrices quantized at load to this GGUF type,
    default q8_0; its output rows the target's own blocks; one call a step); against an fp32 or
    bf16 target it runs in fp32 through torch and quantize is not used. Only the speed and the
    acceptance depend on it, never the output.

    vocab: draft over the `vocab` most frequent tokens (specdec.drafters.vocab) instead of the
    vocabulary the head was trained with (its file's vocab_ids).

    prepare() raises ValueError for a target on the transformers backend, HeadError for a missing
    head or one trained for another target.
    """

    incremental = True
    reads_target_cache = True

    LONG_MATCH = LONG_MATCH  # lookup match length (tokens) from which lookup's draft is proposed alone

    def __init__(
        self,
        head: DraftHead | str | os.PathLike | None = None,
        cache=None,
        alternatives: int = 0,
        lookup: bool = False,
        quantize: str | None = None,
        vocab: int | None = None,
    ):
        if alternatives < 0:
            raise ValueError(f"alternatives must be >= 0, got {alternatives}")
        if quantize is not None and quantize not in QUANTIZE:
            raise ValueError(f"quantize {quantize!r}: choose one of {', '.join(QUANTIZE)}")
        self.spec, self.cache, self.alternatives, self.quantize = head, cache, alternatives, quantize
        self.vocab = vocab
        self.lookup = PromptLookup() if lookup else None
        self.head: DraftHead | None = None
        self._target: Model | None = None
        self.kv = None  # the target's LeanKVCache
        self.hcache: HeadCache | None = None
        self.seen: list[int] = []  # the tokens behind the head cache's valid positions

    def prepare(self, target: Model) -> None:
        if target.backend != "lean":
            raise ValueError(
                "the eagle drafter reads the target's features, which only the lean backend keeps: "
                "run a Llama or Qwen2 target with backend 'auto' or 'lean'"
            )
        if self._target is not target:
            if isinstance(self.spec, DraftHead):
                head = self.spec
            else:
                path = self.spec or find_head(target.name, self.cache)
                if path is None:
                    raise HeadError(
                        f"no draft head for {target.name}: train one with `specdec train --target "
                        f"{target.name}` (it writes {head_file(target.name, self.cache)}), or pass a head file"
                    )
                head, _ = load_head(path, target.lean().hidden_size)
            if self.vocab is not None:  # the head drafts over the vocab most frequent tokens instead of its own
                head = copy.deepcopy(head)
                head.vocab_ids = draft_vocab(target, self.vocab, self.cache)
            lean = target.lean()
            if isinstance(lean, QuantModel):  # the target's kernels, one call a step (QuantHead)
                self.head, self.quant = head, QuantHead(head.eval(), lean, self.quantize or HEAD_QUANTIZE)
            else:
                self.head, self.quant = head.packed(target.device), None  # projections reordered for oneDNN
                weight = lean.output_rows(head.vocab_ids.cpu()).to(target.device)
                self.out = Linear(weight.contiguous())  # the output layer's rows the head may draft, (N, d)
            self.ids = head.vocab_ids.cpu()  # (N,) the token id of each of the head's logits
            self.embed_rows = lean.embed_rows  # (n,) ids -> (n, d)
            self.target_vocab = target.vocab_size  # the width of a sampled draft token's probabilities
            self._target = target
        self.hcache = HeadCache(self.head)
        self.seen = []

    @property
    def precision(self) -> str | None:
        """What the head's matrices run in once prepared ("gguf Q8_0 head", "float32 head"), else None."""
        if self.head is None:
            return None
        return f"gguf {self.quant.qtype.upper()} head" if self.quant is not None else "float32 head"

    def attach(self, kv) -> None:
        """The target's KV cache of this generation (its `features` are read at each proposal); asks
        it to keep the hidden states of the layers the head taps (EAGLE-3), before its first forward."""
        self.kv = kv
        if self.head is not None and self.head.taps:
            kv.tap(self.head.taps)

    def long_match(self, context: list[int]) -> int | None:
        """The length of lookup's match when propose() would propose it alone (at least
        LONG_MATCH tokens; greedy decoding), else None. Free (no model runs): k="auto" reads it
        before deciding to draft at all (AdaptiveK.plan)."""
        looked = long_lookup(self.lookup, context, 1)
        return looked.match_length if looked is not None else None

    @torch.inference_mode()
    def prefill(self, prompt: list[int]) -> None:
        """The head's cache over the prompt's positions but the last one it reads (the first proposal
        runs that one), from the target's features of its prefill."""
        super().prefill(prompt)
        n = len(prompt)
        if self.kv is None or self.head is None or n < 3 or len(self.kv) < n - 1:
            return
        self._step(self.head.fused(self.kv.features[: n - 2].float()), prompt[1 : n - 1], 0)
        self.seen = list(prompt[: n - 1])

    @torch.inference_mode()
    def propose(
        self, context: list[int], k: int, sampler: Sampler, keep_going: Callable[[int, float], bool] | None = None
    ) -> Draft:
        """Up to k tokens after context; keep_going as in ModelDrafter.propose."""
        n = len(context)
        if self.kv is None or self.head is None:
            raise ValueError("call prepare(target) and attach(kv) before propose()")
        if k <= 0 or n < 2 or len(self.kv) < n - 1:
            return Draft([])
        tree = (self.alternatives > 0 or self.lookup is not None) and sampler.params.greedy
        if tree and self.lookup is not None:
            looked = self.lookup.propose(context, k, sampler)
            if looked.tokens and (looked.match_length or 0) >= LONG_MATCH:
                return looked  # text the context repeats: its copy is the better guess, all k of it
        # head position t reads (f_t, e(x_{t+1})); it is valid while x_0..x_{t+1} are unchanged
        start = max(0, min(common_prefix(self.seen, context) - 1, n - 2))  # re-run at least the last position
        feats = self.head.fused(self.kv.features[start : n - 1].float())
        pred, sub = self._step(feats, context[start + 1 : n], start)  # pred (1, d): the feature at n - 1
        self.seen = list(context)
        ids = self.ids
        tokens, probs, confidence, parents, main = [], [], [], [], -1
        for i in range(k):  # a depth per step; a tree reaches k tokens in about k / (1 + alternatives)
            j, p = sampler.choose(sub)  # sub (N,): logits over the head's vocabulary; the rest have probability 0
            token = int(ids[j])
            if tree:  # the main chain's token first (Draft.chain), then its siblings, best first
                others = [int(ids[a]) for a in sub.topk(self.alternatives + 1).indices.tolist() if a != j]
                others = others[: min(self.alternatives, k - len(tokens) - 1)]
                parent, main = main, len(tokens)
                tokens += [token] + others
                parents += [parent] * (1 + len(others))
            else:
                tokens.append(token)
            if p is not None:
                probs.append(p.new_zeros(self.target_vocab).index_copy_(0, ids, p))
            if keep_going is not None:
                confidence.append(float(p[j]) if p is not None else float(sub.softmax(-1)[j]))
                if not keep_going(i + 1, confidence[-1]):
                    break
            if len(tokens) >= k:  # also ends the last depth: no head step whose output goes unused
                break
            pred, sub = self._step(pred, [token], n - 1 + i)
        draft = Draft(
            tokens,
            torch.stack(probs) if probs else None,
            confidence if keep_going is not None else None,
            parents=parents if tree else None,
        )
        return draft.grafted(looked.tokens, k) if tree and self.lookup is not None else draft

    def _step(self, features: torch.Tensor, tokens: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One head step over positions start..start+T-1: features (T, d), tokens the T tokens after
        them -> (the predicted feature at the last position (1, d), its logits (N,) over the head's
        vocabulary)."""
        ids = torch.tensor(tokens, device=features.device)
        if self.quant is not None:
            pred, logits = self.quant.step(features, ids, start, self.hcache)
            return pred[-1:], logits
        pred = self.head(features, self.embed_rows(ids).float(), start, self.hcache)[-1:]
        return pred, self.out(pred)[0]
