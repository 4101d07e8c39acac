"""The target's scoring of a draft, its side of a round (specdec.round): the Verifier protocol, and
TargetVerifier, the engine's, which runs the target's forward over its KV cache and applies the
rejection rule (specdec.rejection: greedy, speculative sampling, token trees) with the run's
penalties and logprobs.
The bench's replay has its own Verifier (specdec.bench.replay), with no forward.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from specdec.drafters.draft import Draft
from specdec.grammar import Constraint
from specdec.rejection import verify_greedy, verify_sampling, verify_tree_greedy
from specdec.sampling import Penalties, Sampler, TokenLogprob, logprobs_of, processed_probs


class Verifier(Protocol):
    """The target's side of a round.

    verifies_trees: whether score() takes a token tree (else a tree's main chain is verified).
    score(tokens, draft): the target's forward over tokens[-1] plus the draft (a chain, or a tree
    with parents), timed as the round's verify; returns what judge() reads (logits).
    judge(scores, tokens, draft): the accepted draft tokens and the one token the target adds.
    rollback(n): the target's cache keeps the first n tokens of the sequence.
    """

    verifies_trees: bool

    def score(self, tokens: list[int], draft: Draft) -> Any: ...

    def judge(self, scores: Any, tokens: list[int], draft: Draft) -> tuple[list[int], int]: ...

    def rollback(self, n: int) -> None: ...


class TargetVerifier:
    """The engine's Verifier: the target's forward over its KV cache (kv, a specdec.cache cache).

    A token tree is verified in the same one forward under a tree attention mask where the cache
    can keep a path of it (the lean backend) and decoding is greedy, without penalties, bias or
    logprobs; elsewhere its main chain is. logit_bias ((id, bias) pairs) is added to each row of a
    verified block, then the penalties (a Penalties) apply to it with that row's history, so that
    every drafter and k gives what plain decoding with them gives; last, a grammar's Constraint masks
    each row by its state after that row's prefix. With top_logprobs (not None)
    each round's committed tokens' TokenLogprobs are left in last_logprobs."""

    def __init__(
        self,
        kv,
        sampler: Sampler,
        penalties: Penalties,
        prompt_len: int,
        top_logprobs: int | None = None,
        logit_bias: tuple[tuple[int, float], ...] = (),
        constraint: Constraint | None = None,
    ):
        self.kv, self.sampler, self.penalties, self.prompt_len = kv, sampler, penalties, prompt_len
        self.top_logprobs = top_logprobs
        self.bias_ids = torch.tensor([t for t, _ in logit_bias], dtype=torch.long)
        self.bias = torch.tensor([[b for _, b in logit_bias]], dtype=torch.float32)  # (1, len(logit_bias))
        self.constraint = constraint
        plain = penalties.neutral and top_logprobs is None and not logit_bias and constraint is None
        self.verifies_trees = sampler.params.greedy and plain and kv.keeps_paths
        self.last_logprobs: list[TokenLogprob] = []

    def block(self, tokens: list[int], draft: Draft) -> tuple[list[int], list[int] | None]:
        """The tokens to score (the last committed one, then the draft) and their tree parents."""
        parents = None if draft.parents is None else [-1] + [p + 1 for p in draft.parents]
        return [tokens[-1]] + draft.tokens, parents

    def score(self, tokens: list[int], draft: Draft) -> torch.Tensor:
        """Logits (1 + len(draft.tokens), V): node 0 is the last committed token."""
        block, parents = self.block(tokens, draft)
        return self.kv.extend(block) if parents is None else self.kv.extend(block, parents=parents)

    def judge(self, logits: torch.Tensor, tokens: list[int], draft: Draft) -> tuple[list[int], int]:
        """The accepted draft tokens and the target's one token (recovered, or the bonus), from
        score()'s logits (1 + len(draft.tokens), V); a tree's accepted path is kept in the cache."""
        if draft.parents is not None:
            nodes = [tokens[-1]] + draft.tokens
            verdict, path = verify_tree_greedy(nodes, [-1] + [p + 1 for p in draft.parents], logits)
            self.kv.keep_path(len(tokens) - 1, path)
            return [nodes[i] for i in path[1:]], verdict.token
        raw = logits
        logits = self.processed(logits, tokens, draft)
        if self.sampler.params.greedy:
            verdict = verify_greedy(draft.tokens, logits)
        else:
            q = None if draft.probs is None else _match_vocab(draft.probs, logits.shape[-1])
            verdict = verify_sampling(
                draft.tokens, q, processed_probs(logits, self.sampler.params), self.sampler.generator
            )
        accepted = draft.tokens[: verdict.n_accepted]
        if self.constraint is not None:
            self.constraint.settle(verdict.n_accepted, verdict.token)
        if self.top_logprobs is not None:
            self.last_logprobs = logprobs_of(raw, accepted + [verdict.token], self.top_logprobs)
        return accepted, verdict.token

    def processed(self, logits: torch.Tensor, tokens: list[int], draft: Draft) -> torch.Tensor:
        """The logits (n, V) of a verified chain as plain decoding reads them at each row: logit_bias
        added (before the penalties, as vLLM), the penalties with each row's history, then the
        grammar's mask by its state after each row's prefix (consuming the draft, settled by judge)."""
        if self.bias_ids.numel():
            logits = logits.float().cpu().index_add(1, self.bias_ids, self.bias.expand(logits.shape[0], -1))
        if not self.penalties.neutral:
            logits = self.penalties.apply(logits, tokens[: self.prompt_len], tokens[self.prompt_len :], draft.tokens)
        if self.constraint is not None:
            logits = self.constraint.mask(logits, draft.tokens, self.sampler.params.greedy)
        return logits

    def rollback(self, n: int) -> None:
        """The cache keeps the first n tokens."""
        self.kv.rollback(n)


def _match_vocab(q: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft probabilities (n, V_draft) as (n, vocab): zero-padded when the target's logits are
    wider (Qwen 151936 vs 152064), cut when narrower (padding ids only, checked at load)."""
    if q.shape[1] < vocab:
        return torch.nn.functional.pad(q, (0, vocab - q.shape[1]))
    return q[:, :vocab]
