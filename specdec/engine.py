"""generate() and stepwise(): speculative decoding of one prompt. With k = 0 (or no drafter) it is
plain autoregressive decoding, the baseline every comparison in specdec uses.

The loop lives here: the prefill, then rounds, each verified by its own forward. A sequence's state
(its cache, drafter, policy, stop rules) is specdec.sequence's, which specdec.batch runs many of at
once; one round (plan, propose, verify, roll back, learn) is specdec.round's, which the bench's
replay runs too. Tokens are committed one at a time, stopping exactly at EOS, a stop string or the
budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence

import torch

from specdec.adaptive import AdaptiveK
from specdec.drafters.base import Drafter
from specdec.models.load import Model, synchronize
from specdec.sampling import Penalties
from specdec.sequence import AUTO_K_MAX, Generation
from specdec.sequence import Sequence as _Sequence

__all__ = ["AUTO_K_MAX", "Generation", "generate", "stepwise"]


def generate(
    target: Model,
    input_ids: Sequence[int] | torch.Tensor,
    drafter: Drafter | str | None = None,
    k: int | str = "auto",
    k_max: int = AUTO_K_MAX,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stream: Callable[[list[int]], None] | None = None,
    policy: AdaptiveK | None = None,
    penalties: Penalties | None = None,
    logprobs: int | None = None,
) -> Generation:
    """Generate up to max_new_tokens tokens after input_ids, speculatively when a drafter is given.

    input_ids: prompt ids, a list or a (n,) / (1, n) tensor. drafter: a Drafter, a registry name
    (`prompt-lookup`), or None for plain decoding. k: draft length per round (0 = plain decoding),
    or "auto" (the default): chosen every round, 0..k_max, from the costs and acceptance measured
    while generating (specdec.adaptive); each round it is clamped to the budget and the context
    left. policy: with k="auto", the AdaptiveK to use and update (its k_max replaces k_max), so that
    what it learnt carries over to the next generation; default: a new one over the target's
    verify-cost curve as calibrated on this machine (cached on disk, specdec.adaptive.costs).
    temperature 0 is greedy, and then
    the output is token-for-token plain greedy decoding of the target; otherwise speculative
    sampling keeps the target's distribution exactly. seed: seeds the run's one torch.Generator
    (None: a random seed). stop: strings that end the text. stream: called after every round with
    the tokens committed in it. penalties: frequency, presence and repetition penalties
    (specdec.sampling.Penalties), applied at every position of a verified block as plain decoding
    applies them. logprobs: None, or 0..20: the Generation then carries each new token's
    log-probability under the target (and that many most likely tokens'), equal to plain
    decoding's.

    Raises ValueError on bad parameters (negative k, ...), ContextLengthError when the prompt leaves
    no room in the target's context, TokenizerMismatchError from a draft model that does not share
    the target's tokenizer.
    """
    rounds = stepwise(
        target, input_ids, drafter, k, k_max, max_new_tokens, temperature, top_k, top_p, seed, stop, stream, policy,
        penalties, logprobs,
    )  # fmt: skip
    while True:
        try:
            next(rounds)
        except StopIteration as done:
            return done.value


def stepwise(
    target: Model,
    input_ids: Sequence[int] | torch.Tensor,
    drafter: Drafter | str | None = None,
    k: int | str = "auto",
    k_max: int = AUTO_K_MAX,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stream: Callable[[list[int]], None] | None = None,
    policy: AdaptiveK | None = None,
    penalties: Penalties | None = None,
    logprobs: int | None = None,
) -> Generator[int, None, Generation]:
    """generate(), one round at a time: a generator that yields the number of new tokens committed
    so far after the prefill (0) and after every round, and returns the Generation. The time it
    spends suspended does not count in its stats, so that several generations can be run
    interleaved, round by round, and each still timed alone (specdec.bench.run measures its configs
    so: the host's slow spells then fall on all of them alike). Parameters and errors: generate();
    the errors are raised at the first next().
    """
    paused = 0.0  # seconds suspended at a yield
    start = time.perf_counter()
    seq = _Sequence(
        target, input_ids, drafter, k, k_max, max_new_tokens, temperature, top_k, top_p, seed, stop, policy,
        penalties, logprobs,
    )  # fmt: skip
    for block in seq.prefill_blocks():
        seq.kv.extend(block, all_logits=False)  # the cache holds all committed tokens but the last
    seq.ready()
    synchronize(target.device)
    seq.stats.prefill_s = time.perf_counter() - start
    paused += yield from _suspend(0)
    while not seq.finished:
        proposal = seq.next_round()
        t1 = seq.spec.clock()
        scores = seq.verifier.score(seq.tokens, proposal.checked)
        committed = seq.commit(proposal, scores, seq.spec.clock() - t1)
        if stream is not None:
            stream(committed)
        paused += yield from _suspend(len(seq.out))
    return seq.result(time.perf_counter() - start - paused)


def _suspend(n_out: int) -> Generator[int, None, float]:
    """Yield n_out; return the seconds until the caller resumed."""
    t = time.perf_counter()
    yield n_out
    return time.perf_counter() - t
