"""One generation's state, from its validated parameters to its Generation: the prompt, the
committed tokens, the target's KV cache, the drafter, the adaptive policy and the stop rules.

specdec.engine runs one Sequence with its own forwards; specdec.batch runs many, their forwards
batched. Both go through the same steps (prefill, then rounds of specdec.round's propose, a
verify forward and conclude, then commit), so a sequence's tokens do not depend on which runs it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from specdec.adaptive import AdaptiveK, VerifyCosts
from specdec.cache import new_cache
from specdec.drafters.base import Drafter
from specdec.drafters.draft import Draft
from specdec.drafters.factory import make_drafter
from specdec.errors import ContextLengthError
from specdec.models.load import Model, synchronize
from specdec.round import Proposal, Round, Speculation, conclude, propose
from specdec.sampling import Penalties, Sampler, SamplingParams, TokenLogprob, logprobs_of, processed_probs
from specdec.stats import RunStats
from specdec.textstream import IncrementalText
from specdec.verify import verify_greedy, verify_sampling, verify_tree_greedy

AUTO_K_MAX = 8  # the longest draft k = "auto" chooses by default
MAX_TOP_LOGPROBS = 20  # as OpenAI's API


@dataclass
class Generation:
    """tokens: the new token ids (an EOS that ended the run included); text: their decoding
    without special tokens, cut before a stop string; stats: see specdec.stats; logprobs: one
    TokenLogprob per token when asked for, else None."""

    tokens: list[int]
    text: str
    stats: RunStats
    logprobs: list[TokenLogprob] | None = None


class Sequence:
    """One prompt's generation, round by round. Parameters: specdec.engine.generate's (the policy,
    when given with k="auto", is used and updated; penalties: a Penalties; logprobs: None, or how
    many most likely tokens to report beside each committed token's log-probability, 0..20).

    Raises ValueError on bad parameters, ContextLengthError when the prompt leaves no room in the
    target's context, TypeError for a drafter that is not a specdec Drafter.

    The steps, for a driver (specdec.engine, specdec.batch): `prefill_blocks()` (the prompt but its
    last token, to feed to the cache), `ready()` after they ran; then while not `finished`:
    `next_round()` (a Proposal), the target's scores of it (`block()` is what to feed), and
    `commit(proposal, scores, verify_s)`; at the end `result()`.
    """

    def __init__(
        self,
        target: Model,
        input_ids: Seq[int] | torch.Tensor,
        drafter: Drafter | str | None = None,
        k: int | str = "auto",
        k_max: int = AUTO_K_MAX,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Seq[str] = (),
        policy: AdaptiveK | None = None,
        penalties: Penalties | None = None,
        logprobs: int | None = None,
    ):
        if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ValueError(f"k (draft length) must be an integer >= 0 or 'auto', got {k!r}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {logprobs}")
        params = SamplingParams(temperature, top_k, top_p)
        prompt = [int(t) for t in (input_ids.flatten().tolist() if torch.is_tensor(input_ids) else input_ids)]
        if not prompt:
            raise ValueError("the prompt is empty: give at least one token (e.g. the BOS token)")
        n_ctx = target.n_ctx
        if len(prompt) >= n_ctx:
            raise ContextLengthError(
                f"the prompt has {len(prompt)} tokens but {target.name}'s context holds {n_ctx}: "
                f"shorten it to at most {n_ctx - 1} tokens so that at least one can be generated"
            )
        if isinstance(drafter, str):
            drafter = make_drafter(drafter)
        if drafter is not None and not isinstance(drafter, Drafter):
            raise TypeError(
                f"drafter must be a specdec Drafter (subclass specdec.Drafter) or a name, got {type(drafter).__name__}"
            )
        if drafter is None:
            k = 0
        if k == "auto":
            policy = policy or AdaptiveK(VerifyCosts.for_model(target), k_max=k_max)
            policy.begin()
        else:
            policy = None
        generator = torch.Generator()
        if seed is None:
            seed = generator.seed()
        else:
            generator.manual_seed(seed)
        self.target, self.prompt, self.max_new_tokens, self.stop = target, prompt, max_new_tokens, tuple(stop)
        self.sampler = Sampler(params, generator)
        self.penalties = penalties or Penalties()
        self.top_logprobs = logprobs
        self.drafter, self.policy = drafter, policy
        self.stats = RunStats(k=k, prompt_tokens=len(prompt))
        self.tokens = list(prompt)  # committed: prompt + output
        self.out: list[int] = []
        self.text = IncrementalText(target.tokenizer) if self.stop else None  # the output's, for the stop strings
        self.logprobs: list[TokenLogprob] | None = [] if logprobs is not None else None
        self.k = k
        if drafter is not None:
            drafter.prepare(target)
        self.kv = new_cache(target)
        # greedy without penalties or logprobs reads only the argmax: the lean output layer is screened in bf16
        self.kv.argmax_only = params.greedy and self.penalties.neutral and logprobs is None
        if drafter is not None and drafter.reads_target_cache:
            drafter.attach(self.kv)

        def clock() -> float:
            synchronize(target.device)  # on a GPU: queued work counts where it was queued
            return time.perf_counter()

        self.spec = Speculation(
            drafter, 0 if policy else k, policy.k_max if policy else 0, policy, self.sampler, target.vocab_size, clock
        )
        self.verifier = TargetVerifier(self.kv, self.sampler, self.penalties, len(prompt), logprobs)

    def prefill_blocks(self, chunk: int | None = None) -> list[list[int]]:
        """The prompt but its last token, in blocks of at most `chunk` tokens (None: one block), to
        feed to the cache in order; the last prompt token is the first of the first round."""
        rest = self.prompt[:-1]
        if not rest:
            return []
        chunk = chunk or len(rest)
        return [rest[i : i + chunk] for i in range(0, len(rest), chunk)]

    def ready(self, calibrate: bool = True) -> None:
        """After the prefill: with k="auto" and calibrate, time the target's verify-cost curve
        here and where the output ends, once per target, context range and machine (cached on disk,
        specdec.adaptive.costs)."""
        if self.policy and calibrate:
            self.policy.verify.calibrate(self.kv, self.prompt, self.policy.k_max + 1, ahead=self.max_new_tokens)

    @property
    def finished(self) -> bool:
        """Whether the generation has ended (stats.stop_reason says why); sets the reason when the
        budget or the context is used up."""
        if not self.stats.stop_reason:
            if self.max_new_tokens - len(self.out) <= 0:
                self.stats.stop_reason = "length"
            elif self.target.n_ctx - len(self.tokens) <= 0:
                self.stats.stop_reason = "context"
        return bool(self.stats.stop_reason)

    def next_round(self) -> Proposal:
        """Plan and draft the next round (specdec.round.propose). Only while not finished."""
        budget, room = self.max_new_tokens - len(self.out), self.target.n_ctx - len(self.tokens)
        return propose(self.spec, self.tokens, budget, room, self.verifier.verifies_trees)

    def block(self, proposal: Proposal) -> tuple[list[int], list[int] | None]:
        """What the target scores for a proposal: the last committed token then the draft, and the
        tree's parents (None for a chain)."""
        return self.verifier.block(self.tokens, proposal.checked)

    def commit(self, proposal: Proposal, scores: torch.Tensor, verify_s: float, timed: bool = True) -> list[int]:
        """Conclude the round from the target's scores of block(proposal) (a forward of verify_s
        seconds; timed as in specdec.round.conclude) and commit its tokens up to an EOS, a stop
        string or the budget. Returns the tokens committed."""
        rnd: Round = conclude(self.spec, proposal, scores, verify_s, self.verifier, self.stats, timed)
        eos, committed = self.target.eos_token_ids, []
        for t in rnd.committed:
            committed.append(t)
            if t in eos:
                self.stats.stop_reason = "eos"
            elif self.text is not None and stop_at(self.text.peek(committed), self.stop) >= 0:
                self.stats.stop_reason = "stop"
            if self.stats.stop_reason:
                break
        self.tokens += committed
        self.out += committed
        if self.text is not None:
            self.text.add(committed)
        if self.logprobs is not None:
            self.logprobs += self.verifier.last_logprobs[: len(committed)]
        if self.policy:
            self.policy.resolve(self.tokens)
        return committed

    def result(self, total_s: float) -> Generation:
        """The finished Generation; total_s: the seconds it took (prefill included)."""
        if self.policy:
            self.policy.resolve(self.tokens, final=True)
        self.stats.new_tokens = len(self.out)
        self.stats.total_s = total_s
        text = self.target.tokenizer.decode(self.out, skip_special_tokens=True)
        cut = stop_at(text, self.stop)
        return Generation(self.out, text if cut < 0 else text[:cut], self.stats, self.logprobs)


class TargetVerifier:
    """The engine's Verifier (specdec.round): the target's forward over its KV cache.

    A token tree is verified in the same one forward under a tree attention mask where the cache
    can keep a path of it (the lean backend) and decoding is greedy, without penalties or
    logprobs; elsewhere its main chain is. Penalties (a Penalties) apply to each row of a verified
    block with that row's history, so that every drafter and k gives what plain decoding with them
    gives. With top_logprobs (not None) each round's committed tokens' TokenLogprobs are left in
    last_logprobs."""

    def __init__(self, kv, sampler: Sampler, penalties: Penalties, prompt_len: int, top_logprobs: int | None = None):
        self.kv, self.sampler, self.penalties, self.prompt_len = kv, sampler, penalties, prompt_len
        self.top_logprobs = top_logprobs
        plain = penalties.neutral and top_logprobs is None
        self.verifies_trees = sampler.params.greedy and plain and hasattr(kv, "keep_path")
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
        if draft.parents is not None:
            nodes = [tokens[-1]] + draft.tokens
            verdict, path = verify_tree_greedy(nodes, [-1] + [p + 1 for p in draft.parents], logits)
            self.kv.keep_path(len(tokens) - 1, path)
            return [nodes[i] for i in path[1:]], verdict.token
        raw = logits
        if not self.penalties.neutral:
            logits = self.penalties.apply(logits, tokens[: self.prompt_len], tokens[self.prompt_len :], draft.tokens)
        if self.sampler.params.greedy:
            verdict = verify_greedy(draft.tokens, logits)
        else:
            q = None if draft.probs is None else _match_vocab(draft.probs, logits.shape[-1])
            verdict = verify_sampling(
                draft.tokens, q, processed_probs(logits, self.sampler.params), self.sampler.generator
            )
        accepted = draft.tokens[: verdict.n_accepted]
        if self.top_logprobs is not None:
            self.last_logprobs = logprobs_of(raw, accepted + [verdict.token], self.top_logprobs)
        return accepted, verdict.token

    def rollback(self, n: int) -> None:
        self.kv.rollback(n)


def stop_at(text: str, stop: Seq[str]) -> int:
    """Index where the earliest stop string starts in text, or -1."""
    hits = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return min(hits) if hits else -1


def _match_vocab(q: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft probabilities (n, V_draft) as (n, vocab): zero-padded when the target's logits are
    wider (Qwen 151936 vs 152064), cut when narrower (padding ids only, checked at load)."""
    if q.shape[1] < vocab:
        return torch.nn.functional.pad(q, (0, vocab - q.shape[1]))
    return q[:, :vocab]
