"""One generation's state, from its options to its Generation: the prompt, the committed tokens,
the target's KV cache, the drafter, the adaptive policy and the stop rules (a Decoding).

specdec.engine runs one Decoding with its own forwards; specdec.batch runs many, their forwards
batched. Both go through the same steps (prefill, then rounds: specdec.round's speculative_round,
whose propose, verify forward and conclude a batch runs apart, then take), so a sequence's tokens do
not depend on which runs it.
A driver talks only to the Decoding: it says what each forward is to run (Rows) and takes back
its scores.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from specdec.adaptive import AdaptiveK, Share, VerifyCosts
from specdec.cache import new_cache
from specdec.drafters.base import Drafter
from specdec.drafters.factory import make_drafter
from specdec.errors import ContextLengthError
from specdec.grammar import Constraint
from specdec.models.load import Model, synchronize
from specdec.options import GenerationOptions
from specdec.round import Proposal, Speculation, conclude, propose, speculative_round
from specdec.sampling import Sampler, TokenLogprob
from specdec.scoring import TargetVerifier
from specdec.stats import RunStats
from specdec.textstream import IncrementalText


@dataclass
class Generation:
    """tokens: the new token ids (an EOS that ended the run included); text: their decoding
    without special tokens, cut before a stop string; stats: see specdec.stats; logprobs: one
    TokenLogprob per token when asked for, else None."""

    tokens: list[int]
    text: str
    stats: RunStats
    logprobs: list[TokenLogprob] | None = None


class Rows(NamedTuple):
    """What one sequence puts into a target forward (specdec.cache.extend_batch): `tokens` after
    what `cache` holds, their tree `parents` (None for a chain), and whether the forward returns
    logits for every row (a verify) or none (a prompt block)."""

    cache: Any
    tokens: list[int]
    all_logits: bool
    parents: list[int] | None


class Decoding:
    """One prompt's generation, round by round.

    input_ids: the prompt, a list or a (n,) / (1, n) tensor. drafter: a Drafter, a registry name,
    or None (plain decoding). options: a GenerationOptions (default: its defaults). policy: with
    k="auto", the AdaptiveK to use and update (its k_max replaces options.k_max); default: a new
    one over the target's verify-cost curve. cache: a KV cache of this target to continue from (a
    finished Decoding's `kv`, e.g. a conversation's previous turn), rolled back to its longest
    common prefix with the prompt: only the rest is fed. On a batch-invariant backend the tokens
    are those of a fresh cache (its rows have the bits of any prefill's); elsewhere they may
    differ in the last bits.

    Raises ContextLengthError when the prompt leaves no room in the target's context, ValueError
    for an empty prompt, a logit_bias id outside the vocabulary, or a cache with a drafter that
    reads the target's cache, GrammarError (a ValueError) for
    a grammar llguidance cannot follow, TypeError for a drafter that is not a specdec Drafter.

    The steps, for a driver (specdec.engine, specdec.batch): `unfed()` (the prompt but its last
    token), fed with `feed(block)` or, batched, in chunks as `prefill_rows(chunk)`; `ready()` after
    them; then while not `finished`: `step()` alone, or batched `next_round()` (a Proposal), a
    forward over its `verify_rows()`, and `commit(proposal, scores, verify_s)`; at the end
    `result()`.
    """

    def __init__(
        self,
        target: Model,
        input_ids: Sequence[int] | torch.Tensor,
        drafter: Drafter | str | None = None,
        options: GenerationOptions | None = None,
        policy: AdaptiveK | None = None,
        cache=None,
    ):
        options = options or GenerationOptions()
        k, max_new_tokens, seed, logprobs = options.k, options.max_new_tokens, options.seed, options.logprobs
        params = options.sampling
        prompt = _checked_prompt(target, input_ids)
        drafter = _checked_drafter(drafter)
        bad = [t for t, _ in options.logit_bias if t >= target.vocab_size]
        if bad:
            raise ValueError(f"logit_bias: token id {bad[0]} is outside {target.name}'s {target.vocab_size} ids")
        self.constraint = Constraint(options.grammar, target) if options.grammar is not None else None
        if drafter is None:
            k = 0
        if k == "auto":
            policy = policy or AdaptiveK(VerifyCosts.for_model(target), k_max=options.k_max)
            policy.begin()
        else:
            policy = None
        generator = torch.Generator()
        if seed is None:
            seed = generator.seed()
        else:
            generator.manual_seed(seed)
        self.target, self.prompt, self.max_new_tokens, self.stop = target, prompt, max_new_tokens, options.stop
        self.sampler = Sampler(params, generator)
        self.penalties = options.penalties
        self.drafter, self.policy = drafter, policy
        self.stats = RunStats(k=k, prompt_tokens=len(prompt))
        self.tokens = list(prompt)  # committed: prompt + output
        self.out: list[int] = []
        self.text = IncrementalText(target.tokenizer) if self.stop else None  # the output's, for the stop strings
        self.logprobs: list[TokenLogprob] | None = [] if logprobs is not None else None
        self.k = k
        if cache is not None and drafter is not None and drafter.reads_target_cache:
            raise ValueError("a drafter that reads the target's cache needs a fresh one: pass no cache")
        if drafter is not None:
            drafter.prepare(target)
        self.kv = new_cache(target) if cache is None else cache
        if cache is not None:
            cache.sync(prompt)  # rolled back to what the prompt shares with it
        # greedy reading the raw logits' argmax only (no bias, penalties, grammar or logprobs): the
        # lean output layer is screened in bf16
        plain = self.penalties.neutral and not options.logit_bias and logprobs is None and not self.constraint
        self.kv.argmax_only = params.greedy and plain
        if drafter is not None and drafter.reads_target_cache:
            drafter.attach(self.kv)

        def clock() -> float:
            synchronize(target.device)  # on a GPU: queued work counts where it was queued
            return time.perf_counter()

        self.spec = Speculation(
            drafter=drafter,
            k=0 if policy else k,
            k_max=policy.k_max if policy else 0,
            policy=policy,
            sampler=self.sampler,
            vocab=target.vocab_size,
            clock=clock,
        )
        self.verifier = TargetVerifier(
            self.kv,
            self.sampler,
            self.penalties,
            len(prompt),
            top_logprobs=logprobs,
            logit_bias=options.logit_bias,
            constraint=self.constraint,
        )
        self.eos = frozenset() if options.ignore_eos else target.eos_token_ids
        self.stop_ids = frozenset(options.stop_token_ids)

    @property
    def verify_costs(self) -> VerifyCosts | None:
        """The verify-cost curve its k="auto" policy plans with (None without one)."""
        return self.policy.costs if self.policy else None

    def unfed(self) -> list[int]:
        """The prompt tokens still to feed to the cache: the prompt but its last token and what the
        cache already holds (the last prompt token is the first of the first round). A driver feeds
        them in one block or in chunks, in order: the cache gets the same bits either way on a
        batch-invariant backend."""
        return self.prompt[len(self.kv) : -1]

    def feed(self, block: list[int]) -> None:
        """Run a prompt block (unfed() or a chunk of it) through the target into the cache, alone."""
        self.kv.extend(block, all_logits=False)  # the cache holds all committed tokens but the last

    def prefill_rows(self, block: list[int]) -> Rows:
        """A prompt block (unfed() or a chunk of it) as rows of a batched forward, no logits kept."""
        return Rows(self.kv, block, False, None)

    def ready(self, calibrate: bool = True) -> None:
        """After the prefill: the drafter's own prefill (Drafter.prefill: a draft model's cache over
        the prompt), and with k="auto" and calibrate, the target's verify-cost curve timed here and
        where the output ends, once per target, context range and machine (cached on disk,
        specdec.adaptive.costs)."""
        if self.drafter is not None and self.k != 0:
            self.drafter.prefill(self.prompt)
        if self.policy and calibrate:
            self.policy.costs.calibrate(self.kv, self.prompt, self.policy.k_max + 1, ahead=self.max_new_tokens)

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

    def _limits(self) -> tuple[int, int, list[int]]:
        """The next round's budget (new tokens still allowed), room (positions left in the target's
        context) and forced tokens (a grammar's, when speculating: k = 0 is plain decoding)."""
        budget, room = self.max_new_tokens - len(self.out), self.target.n_ctx - len(self.tokens)
        speculating = self.constraint is not None and self.drafter is not None and self.k != 0
        return budget, room, list(self.constraint.forced()) if speculating else []

    def step(self) -> list[int]:
        """One round alone (specdec.round.speculative_round: plan and draft, the target's forward
        over it, timed by the run's clock, judge, roll back), then its tokens committed (take).
        Returns the tokens committed. Only while not finished."""
        budget, room, forced = self._limits()
        rnd = speculative_round(self.spec, self.tokens, budget, room, self.verifier, self.stats, forced=forced)
        return self.take(rnd.committed)

    def next_round(self, share: Share | None = None) -> Proposal:
        """A batched round's step 1 (specdec.round.propose): its plan and draft; share: its part in
        the batch's costs, for the policy. Only while not finished."""
        budget, room, forced = self._limits()
        return propose(self.spec, self.tokens, budget, room, self.verifier.verifies_trees, share=share, forced=forced)

    def verify_rows(self, proposal: Proposal) -> Rows:
        """A batched round's step 2: what the target scores for a proposal, as rows of a forward:
        the last committed token then the draft (and a tree's parents), logits for every row."""
        block, parents = self.verifier.block(self.tokens, proposal.checked)
        return Rows(self.kv, block, True, parents)

    def commit(self, proposal: Proposal, scores: torch.Tensor, verify_s: float, timed: bool = True) -> list[int]:
        """A batched round's step 3 (specdec.round.conclude) from the target's scores of
        verify_rows(proposal) (a forward of verify_s seconds; timed as conclude's), then its tokens
        committed (take). Returns the tokens committed."""
        rnd = conclude(self.spec, proposal, scores, verify_s, self.verifier, self.stats, timed=timed)
        return self.take(rnd.committed)

    def take(self, tokens: list[int]) -> list[int]:
        """Commit a round's tokens up to an EOS, a stop token or string, or the budget. Returns the
        tokens committed."""
        committed = []
        for t in tokens:
            committed.append(t)
            if t in self.eos:
                self.stats.stop_reason = "eos"
            elif t in self.stop_ids:
                self.stats.stop_reason = "stop"
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


def _checked_prompt(target: Model, input_ids: Sequence[int] | torch.Tensor) -> list[int]:
    """The prompt's ids as a list. Raises ValueError when it is empty, ContextLengthError when it
    leaves no room in the target's context."""
    prompt = [int(t) for t in (input_ids.flatten().tolist() if torch.is_tensor(input_ids) else input_ids)]
    if not prompt:
        raise ValueError("the prompt is empty: give at least one token (e.g. the BOS token)")
    n_ctx = target.n_ctx
    if len(prompt) >= n_ctx:
        raise ContextLengthError(
            f"the prompt has {len(prompt)} tokens but {target.name}'s context holds {n_ctx}: "
            f"shorten it to at most {n_ctx - 1} tokens so that at least one can be generated"
        )
    return prompt


def _checked_drafter(drafter: Drafter | str | None) -> Drafter | None:
    """A registry name built, a Drafter as it is. Raises TypeError for anything else."""
    if isinstance(drafter, str):
        drafter = make_drafter(drafter)
    if drafter is not None and not isinstance(drafter, Drafter):
        raise TypeError(
            f"drafter must be a specdec Drafter (subclass specdec.Drafter) or a name, got {type(drafter).__name__}"
        )
    return drafter


def stop_at(text: str, stop: Sequence[str]) -> int:
    """Index where the earliest stop string starts in text, or -1."""
    hits = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return min(hits) if hits else -1
