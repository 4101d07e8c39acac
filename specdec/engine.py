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
    """Generate up to max_new_tokens tokens after input_ids, speculatively when a drafter is given
    (Leviathan et al. 2023; Chen et al. 2023).

    Arguments:
    - input_ids: the prompt's ids, a list or a (n,) / (1, n) tensor.
    - drafter: a Drafter, a registry name (`prompt-lookup`), or None for plain decoding.
    - options: a GenerationOptions, or its fields as keyword arguments (not both), among them:
      k, the draft length per round (0: plain decoding), or "auto" (the default): chosen every
      round, 0..k_max, from the costs and acceptance measured while generating (specdec.adaptive),
      clamped to the budget and the context left; max_new_tokens (128); temperature (0, the
      default, is greedy), top_k, top_p, seed (of the run's one torch.Generator; None: random);
      stop strings; penalties (specdec.sampling.Penalties); logprobs (None, or 0..20 most likely
      tokens beside each new token's).
    - stream: called after every round with the tokens committed in it.
    - policy: with k="auto", the AdaptiveK to use and update (its k_max replaces k_max), so that
      what it learnt carries over to the next generation; default: a new one over the target's
      verify-cost curve as calibrated on this machine (cached on disk, specdec.adaptive.costs).

    Returns a Generation: the new tokens, their text and the run's RunStats. Greedy, it is token for
    token plain greedy decoding of the target; sampling, speculative sampling keeps the target's
    distribution exactly. Log-probabilities equal plain decoding's.

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
