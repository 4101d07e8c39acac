"""generate() and stepwise(): speculative decoding of one prompt. With k = 0 (or no drafter) it is
plain autoregressive decoding, the baseline every comparison in specdec uses.

The loop lives here: the prefill, then rounds, each verified by its own forward. A sequence's state
(its cache, drafter, policy, stop rules) is a specdec.decoding.Decoding, which specdec.batch runs
many of at once; one round (plan, propose, verify, roll back, learn) is specdec.round's, which the bench's
replay runs too. Tokens are committed one at a time, stopping exactly at EOS, a stop string or the
budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence

import torch

from specdec.adaptive import AdaptiveK
from specdec.decoding import Decoding, Generation
from specdec.drafters.base import Drafter
from specdec.models.load import Model, synchronize
from specdec.options import AUTO_K_MAX, GenerationOptions, options_from

__all__ = ["AUTO_K_MAX", "Generation", "GenerationOptions", "generate", "stepwise"]


def generate(
    target: Model,
    input_ids: Sequence[int] | torch.Tensor,
    drafter: Drafter | str | None = None,
    options: GenerationOptions | None = None,
    *,
    stream: Callable[[list[int]], None] | None = None,
    policy: AdaptiveK | None = None,
    **option_fields,
) -> Generation:
    """Generate up to max_new_tokens tokens after input_ids, speculatively when a drafter is given.

    input_ids: prompt ids, a list or a (n,) / (1, n) tensor. drafter: a Drafter, a registry name
    (`prompt-lookup`), or None for plain decoding. The generation's options are a
    GenerationOptions, or its fields as keyword arguments (not both):
    k: draft length per round (0 = plain decoding), or "auto" (the default): chosen every round,
    0..k_max, from the costs and acceptance measured while generating (specdec.adaptive); each
    round it is clamped to the budget and the context left. max_new_tokens (128). temperature 0
    (the default) is greedy, and then the output is token-for-token plain greedy decoding of the
    target; otherwise speculative sampling keeps the target's distribution exactly (top_k, top_p).
    seed: seeds the run's one torch.Generator (None: a random seed). stop: strings that end the
    text. penalties: frequency, presence and repetition penalties (specdec.sampling.Penalties),
    applied at every position of a verified block as plain decoding applies them. logprobs: None,
    or 0..20: the Generation then carries each new token's log-probability under the target (and
    that many most likely tokens'), equal to plain decoding's.

    stream: called after every round with the tokens committed in it. policy: with k="auto", the
    AdaptiveK to use and update (its k_max replaces k_max), so that what it learnt carries over to
    the next generation; default: a new one over the target's verify-cost curve as calibrated on
    this machine (cached on disk, specdec.adaptive.costs).

    Raises ValueError on bad options (negative k, ...), TypeError for an unknown option,
    ContextLengthError when the prompt leaves no room in the target's context,
    TokenizerMismatchError from a draft model that does not share the target's tokenizer.
    """
    rounds = stepwise(target, input_ids, drafter, options, stream=stream, policy=policy, **option_fields)
    while True:
        try:
            next(rounds)
        except StopIteration as done:
            return done.value


def stepwise(
    target: Model,
    input_ids: Sequence[int] | torch.Tensor,
    drafter: Drafter | str | None = None,
    options: GenerationOptions | None = None,
    *,
    stream: Callable[[list[int]], None] | None = None,
    policy: AdaptiveK | None = None,
    **option_fields,
) -> Generator[int, None, Generation]:
    """generate(), one round at a time: a generator that yields the number of new tokens committed
    so far after the prefill (0) and after every round, and returns the Generation. The time it
    spends suspended does not count in its stats, so that several generations can be run
    interleaved, round by round, and each still timed alone (specdec.bench.measure runs its configs
    so: the host's slow spells then fall on all of them alike). Parameters and errors: generate();
    bad options raise at the call, the rest at the first next().
    """
    options = options_from(options, option_fields)
    return _rounds(target, input_ids, drafter, options, stream, policy)


def _rounds(target, input_ids, drafter, options, stream, policy) -> Generator[int, None, Generation]:
    paused = 0.0  # seconds suspended at a yield
    start = time.perf_counter()
    seq = Decoding(target, input_ids, drafter, options, policy)
    if rest := seq.unfed():
        seq.feed(rest)
    seq.ready()
    synchronize(target.device)
    seq.stats.prefill_s = time.perf_counter() - start
    paused += yield from _suspend(0)
    while not seq.finished:
        committed = seq.step()
        if stream is not None:
            stream(committed)
        paused += yield from _suspend(len(seq.out))
    return seq.result(time.perf_counter() - start - paused)


def _suspend(n_out: int) -> Generator[int, None, float]:
    """Yield n_out; return the seconds until the caller resumed."""
    t = time.perf_counter()
    yield n_out
    return time.perf_counter() - t
