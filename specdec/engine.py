"""generate() and stepwise(): speculative decoding of one prompt. With k = 0 (or no drafter) it is
plain autoregressive decoding, the baseline every comparison in specdec uses.

The set-up (prefill, the adaptive policy's verify-cost curve) and the loop live here; one round
(plan, propose, verify, roll back, learn) is specdec.round's, which the bench's replay runs too.
Tokens are committed one at a time, stopping exactly at EOS, a stop string or the budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

import torch

from specdec.adaptive import AdaptiveK, VerifyCosts
from specdec.cache import new_cache
from specdec.drafters.base import Drafter
from specdec.drafters.draft import Draft
from specdec.drafters.factory import make_drafter
from specdec.errors import ContextLengthError
from specdec.models.load import Model, synchronize
from specdec.round import Speculation, speculative_round
from specdec.sampling import Sampler, SamplingParams, processed_probs
from specdec.stats import RunStats
from specdec.verify import verify_greedy, verify_sampling, verify_tree_greedy

AUTO_K_MAX = 8  # the longest draft k = "auto" chooses by default


@dataclass
class Generation:
    """tokens: the new token ids (an EOS that ended the run included); text: their decoding
    without special tokens, cut before a stop string; stats: see specdec.stats."""

    tokens: list[int]
    text: str
    stats: RunStats


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
    the tokens committed in it.

    Raises ValueError on bad parameters (negative k, ...), ContextLengthError when the prompt leaves
    no room in the target's context, TokenizerMismatchError from a draft model that does not share
    the target's tokenizer.
    """
    rounds = stepwise(
        target, input_ids, drafter, k, k_max, max_new_tokens, temperature, top_k, top_p, seed, stop, stream, policy
    )
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
) -> Generator[int, None, Generation]:
    """generate(), one round at a time: a generator that yields the number of new tokens committed
    so far after the prefill (0) and after every round, and returns the Generation. The time it
    spends suspended does not count in its stats, so that several generations can be run
    interleaved, round by round, and each still timed alone (specdec.bench.run measures its configs
    so: the host's slow spells then fall on all of them alike). Parameters and errors: generate();
    the errors are raised at the first next().
    """
    paused = 0.0  # seconds suspended at a yield
    if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise ValueError(f"k (draft length) must be an integer >= 0 or 'auto', got {k!r}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
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
    sampler = Sampler(params, generator)
    eos = target.eos_token_ids

    stats = RunStats(k=k, prompt_tokens=len(prompt))
    start = time.perf_counter()
    if drafter is not None:
        drafter.prepare(target)
    kv = new_cache(target)
    kv.argmax_only = params.greedy  # greedy reads only the argmax: the lean output layer is screened in bf16
    if drafter is not None and drafter.reads_target_cache:
        drafter.attach(kv)
    if len(prompt) > 1:
        kv.extend(prompt[:-1], all_logits=False)  # the cache holds all committed tokens but the last
    if policy:
        # once per target, context range and machine: the verify-cost curve, here and where the output ends
        policy.verify.calibrate(kv, prompt, policy.k_max + 1, ahead=max_new_tokens)
    synchronize(target.device)
    stats.prefill_s = time.perf_counter() - start
    paused += yield from _suspend(0)

    def clock() -> float:
        synchronize(target.device)  # on a GPU: queued work counts where it was queued
        return time.perf_counter()

    spec = Speculation(
        drafter, 0 if policy else k, policy.k_max if policy else 0, policy, sampler, target.vocab_size, clock
    )
    verifier = TargetVerifier(kv, sampler)
    tokens = list(prompt)  # committed: prompt + output
    out: list[int] = []
    while not stats.stop_reason:
        budget, room = max_new_tokens - len(out), target.n_ctx - len(tokens)
        if budget <= 0 or room <= 0:
            stats.stop_reason = "length" if budget <= 0 else "context"
            break
        committed = []
        for t in speculative_round(spec, tokens, budget, room, verifier, stats).committed:
            committed.append(t)
            if t in eos:
                stats.stop_reason = "eos"
            elif stop and _stop_at(target.tokenizer.decode(out + committed, skip_special_tokens=True), stop) >= 0:
                stats.stop_reason = "stop"
            if stats.stop_reason:
                break
        tokens += committed
        out += committed
        if policy:
            policy.resolve(tokens)
        if stream is not None:
            stream(committed)
        paused += yield from _suspend(len(out))

    if policy:
        policy.resolve(tokens, final=True)
    stats.new_tokens = len(out)
    stats.total_s = time.perf_counter() - start - paused
    text = target.tokenizer.decode(out, skip_special_tokens=True)
    cut = _stop_at(text, stop)
    return Generation(out, text if cut < 0 else text[:cut], stats)


class TargetVerifier:
    """The engine's Verifier (specdec.round): the target's forward over its KV cache.

    A token tree is verified in the same one forward under a tree attention mask where the cache
    can keep a path of it (the lean backend) and decoding is greedy; elsewhere its main chain is."""

    def __init__(self, kv, sampler: Sampler):
        self.kv, self.sampler = kv, sampler
        self.verifies_trees = sampler.params.greedy and hasattr(kv, "keep_path")

    def score(self, tokens: list[int], draft: Draft) -> torch.Tensor:
        """Logits (1 + len(draft.tokens), V): node 0 is the last committed token."""
        if draft.parents is None:
            return self.kv.extend([tokens[-1]] + draft.tokens)
        return self.kv.extend([tokens[-1]] + draft.tokens, parents=[-1] + [p + 1 for p in draft.parents])

    def judge(self, logits: torch.Tensor, tokens: list[int], draft: Draft) -> tuple[list[int], int]:
        if draft.parents is not None:
            nodes = [tokens[-1]] + draft.tokens
            verdict, path = verify_tree_greedy(nodes, [-1] + [p + 1 for p in draft.parents], logits)
            self.kv.keep_path(len(tokens) - 1, path)
            return [nodes[i] for i in path[1:]], verdict.token
        if self.sampler.params.greedy:
            verdict = verify_greedy(draft.tokens, logits)
        else:
            q = None if draft.probs is None else _match_vocab(draft.probs, logits.shape[-1])
            verdict = verify_sampling(
                draft.tokens, q, processed_probs(logits, self.sampler.params), self.sampler.generator
            )
        return draft.tokens[: verdict.n_accepted], verdict.token

    def rollback(self, n: int) -> None:
        self.kv.rollback(n)


def _suspend(n_out: int) -> Generator[int, None, float]:
    """Yield n_out; return the seconds until the caller resumed."""
    t = time.perf_counter()
    yield n_out
    return time.perf_counter() - t


def _stop_at(text: str, stop: Sequence[str]) -> int:
    """Index where the earliest stop string starts in text, or -1."""
    hits = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return min(hits) if hits else -1


def _match_vocab(q: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft probabilities (n, V_draft) as (n, vocab): zero-padded when the target's logits are
    wider (Qwen 151936 vs 152064), cut when narrower (padding ids only, checked at load)."""
    if q.shape[1] < vocab:
        return torch.nn.functional.pad(q, (0, vocab - q.shape[1]))
    return q[:, :vocab]
