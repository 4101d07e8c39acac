"""Drafting with a smaller causal LM that shares the target's tokenizer (Leviathan et al. 2023;
transformers' `assistant_model=`)."""

from __future__ import annotations

import torch

from specdec.cache import new_cache
from specdec.drafters.base import Branch, Drafter, KeepGoing
from specdec.drafters.draft import Draft
from specdec.drafters.lookup import PromptLookup, long_lookup
from specdec.drafters.vocab import draft_vocab, vocab_view
from specdec.models.load import Model, check_same_tokenizer, load_model
from specdec.sampling import Sampler

WINDOW = 256  # the draft reads at most the prompt's last WINDOW tokens (docs/drafters.md: its prefill)


class ModelDrafter(Drafter):
    """k autoregressive steps of a draft model over its own KV cache.

    draft: a loaded Model, or anything load_model accepts. Before each proposal the draft cache is
    rolled back to the longest prefix it shares with the committed context, so it always holds
    committed tokens only. prepare() raises TokenizerMismatchError when the draft's tokenizer
    differs from the target's.

    vocab: draft over only the `vocab` most frequent tokens (specdec.drafters.vocab: a quantized
    draft's output layer cut to those rows; a cheaper step, never another output). Raises
    ValueError for a draft not on the quantized backend or a size outside 1..its vocabulary.

    lookup (greedy only): when prompt lookup's match is at least LONG_MATCH tokens long (text the
    context repeats), propose lookup's draft instead, for free (as eagle-tree does); the draft
    model catches up on those tokens at its next proposal.

    window: the draft model reads only the prompt's last `window` tokens, and everything after
    them (None: the whole prompt). Its prefill, paid before the first token, then costs at most
    `window` tokens of the draft whatever the prompt's length; a shorter context changes the
    draft's guesses, never the output. Raises ValueError below 1.
    """

    incremental = True
    branches = True

    def __init__(
        self,
        draft: Model | str,
        vocab: int | None = None,
        lookup: bool = False,
        window: int | None = WINDOW,
        **load_kwargs,
    ):
        if window is not None and window < 1:
            raise ValueError(f"the draft's window must be at least 1 token (or None: the whole prompt), not {window}")
        self.window = window
        self.start = 0  # where the draft's context begins in the target's: the prompt's last `window` tokens
        self.draft = draft if isinstance(draft, Model) else load_model(draft, **load_kwargs)
        self.lookup = PromptLookup() if lookup else None
        if vocab is not None:  # its output layer cut to the vocab most frequent tokens (specdec.drafters.vocab)
            self.draft = vocab_view(self.draft, draft_vocab(self.draft, vocab, load_kwargs.get("cache")))
        self.kv = new_cache(self.draft)
        # the targets whose tokenizer was checked (by id): one dict shared with every fork, so that a
        # server's forks, one per request, check once (a 152k vocabulary takes about a second)
        self.checked: dict[int, Model] = {}

    def prepare(self, target: Model) -> None:
        if self.checked.get(id(target)) is not target:
            check_same_tokenizer(target, self.draft)
            self.checked[id(target)] = target
        self.kv = new_cache(self.draft)
        self.start = 0

    def prefill(self, prompt: list[int]) -> None:
        """The draft model's cache over the prompt's last `window` tokens but the last one (the
        first proposal feeds that one), in one forward; then its parts' (Drafter.prefill)."""
        super().prefill(prompt)
        self.start = max(0, len(prompt) - self.window) if self.window is not None else 0
        todo = self.kv.sync(prompt[self.start :])[:-1]
        if todo and max(todo) < self.draft.vocab_size:
            self.kv.extend(todo, all_logits=False)

    def long_match(self, context: list[int]) -> int | None:
        """Lookup's match length when propose() would propose lookup's draft (greedy), else None."""
        looked = long_lookup(self.lookup, context, 1)
        return looked.match_length if looked is not None else None

    def propose(
        self,
        context: list[int],
        k: int,
        sampler: Sampler,
        keep_going: KeepGoing | None = None,
        branch: Branch | None = None,
    ) -> Draft:
        """Up to k tokens; with keep_going, after each drafted token keep_going(n drafted so far,
        the draft's probability for the last token) decides whether to draft another (the
        adaptive policy of specdec.adaptive.policy), and the Draft carries those confidences.
        With branch (greedy, with keep_going), branch(the second choice's probability at each
        depth) returns the depths at which to offer the draft's second choice too; the draft is
        then a token tree: the drafted chain first (its main chain), then those second choices,
        each a leaf beside its depth's token. They cost no draft forward: the draft model's logits
        at each depth already rank them."""
        seen = context[self.start :]  # what the draft reads: from its window's start
        k = min(k, self.draft.n_ctx - len(seen) + 1)  # positions left in the draft's context
        if k <= 0:
            return Draft([])
        looked = long_lookup(self.lookup, context, k) if sampler.params.greedy else None
        if looked is not None:
            return looked
        todo = self.kv.sync(seen)
        self.kv.argmax_only = sampler.params.greedy  # confidences then come from screened logits: close enough
        if max(todo) >= self.draft.vocab_size:  # the target emitted an id the draft cannot embed
            return Draft([])
        branch = branch if keep_going is not None and sampler.params.greedy else None
        logits = self.kv.extend(todo, all_logits=False)[-1]  # (V,)
        tokens, probs, confidence, second = [], [], [], []
        for i in range(k):
            token, p = sampler.choose(logits)
            tokens.append(token)
            probs.append(p)
            if keep_going is not None:
                q = p if p is not None else logits.float().softmax(-1)
                confidence.append(float(q[token]))
                if branch is not None:  # q is this step's own (greedy): with the token masked, its max is the second
                    q[token] = -1.0
                    second.append((q, float(q.max())))  # the second's id is looked up only where verified
                if not keep_going(i + 1, confidence[-1]):
                    break
            if i < k - 1:
                logits = self.kv.extend([token], all_logits=False)[-1]
        draft = Draft(
            tokens,
            None if sampler.params.greedy else torch.stack(probs),
            confidence if keep_going is not None else None,
        )
        depths = branch([p for _, p in second]) if second else []
        if not depths:
            return draft
        parents = list(range(-1, len(tokens) - 1)) + [d - 2 for d in depths]
        chosen = [int(second[d - 1][0].argmax()) for d in depths]
        return Draft(tokens + chosen, confidence=draft.confidence, parents=parents)
