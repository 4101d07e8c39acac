"""The speculative decoding loop. With k = 0 (or no drafter) it is plain autoregressive decoding,
the baseline every comparison in specdec uses.

One round, as in gpt-fast and Leviathan et al. 2023:
  1. propose: the drafter proposes up to k tokens after the committed ones;
  2. verify: the target scores the last committed token plus the k drafted ones, k+1 positions,
     in ONE forward over its KV cache; the verifier keeps a prefix and adds one target token
     (a drafter may offer a token tree instead of a chain: greedy runs on the lean backend score
     every node in the same one forward under a tree attention mask and keep the longest path
     the target agrees with; elsewhere only the tree's main chain is verified);
  3. roll back: the target cache is cropped to the committed tokens minus the last (a model
     drafter rolls its own cache back at its next proposal);
  4. commit: tokens are committed one at a time, stopping exactly at EOS, a stop string or the
     budget.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Callable, Generator, Sequence

import torch

from .adaptive import AdaptiveK
from .cache import new_cache
from .drafters import Draft, Drafter, make_drafter, steerable
from .errors import ContextLengthError
from .models import Model, synchronize
from .sampling import Sampler, SamplingParams, processed_probs
from .stats import RunStats
from .verify import verify_greedy, verify_sampling, verify_tree_greedy

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
) -> Generation:
    """Generate up to max_new_tokens tokens after input_ids, speculatively when a drafter is given.

    input_ids: prompt ids, a list or a (n,) / (1, n) tensor. drafter: a Drafter, a registry name
    (`prompt-lookup`), or None for plain decoding. k: draft length per round (0 = plain decoding),
    or "auto" (the default): chosen every round, 0..k_max, from the costs and acceptance measured
    while generating (specdec.adaptive); each round it is clamped to the budget and the context
    left. temperature 0 is greedy, and then
    the output is token-for-token plain greedy decoding of the target; otherwise speculative
    sampling keeps the target's distribution exactly. seed: seeds the run's one torch.Generator
    (None: a random seed). stop: strings that end the text. stream: called after every round with
    the tokens committed in it.

    Raises ValueError on bad parameters (negative k, ...), ContextLengthError when the prompt leaves
    no room in the target's context, TokenizerMismatchError from a draft model that does not share
    the target's tokenizer.
    """
    rounds = stepwise(target, input_ids, drafter, k, k_max, max_new_tokens, temperature, top_k, top_p, seed, stop, stream)
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
) -> Generator[int, None, Generation]:
    """generate(), one round at a time: a generator that yields the number of new tokens committed
    so far after the prefill (0) and after every round, and returns the Generation. The time it
    spends suspended does not count in its stats, so that several generations can be run
    interleaved, round by round, and each still timed alone (specdec.bench measures its configs
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
    if drafter is None:
        k = 0
    adaptive = AdaptiveK.for_pair(target, drafter, k_max) if k == "auto" else None
    if adaptive:
        adaptive.begin()
    incremental = adaptive is not None and steerable(drafter)
    generator = torch.Generator()
    if seed is None:
        seed = generator.seed()
    else:
        generator.manual_seed(seed)
    sampler = Sampler(params, generator)
    eos = target.eos_token_ids
    vocab = target.vocab_size
    device = target.device

    stats = RunStats(k=k, prompt_tokens=len(prompt))
    start = time.perf_counter()
    if drafter is not None:
        drafter.prepare(target)
    kv = new_cache(target)
    kv.argmax_only = params.greedy  # greedy reads only the argmax: the lean output layer is screened in bf16
    if drafter is not None and hasattr(drafter, "attach"):
        drafter.attach(kv)  # a feature-level drafter reads the target's cache
    if len(prompt) > 1:
        kv.extend(prompt[:-1], all_logits=False)  # the cache holds all committed tokens but the last
    if adaptive:
        # once per target and context length: the verify-cost curve, here and where the output ends
        adaptive.verify.calibrate(kv, prompt, k_max + 1, ahead=max_new_tokens)
    synchronize(device)
    stats.prefill_s = time.perf_counter() - start
    paused += yield from _suspend(0)

    tokens = list(prompt)  # committed: prompt + output
    long_match = getattr(drafter, "long_match", None) if adaptive and params.greedy else None
    match = functools.partial(long_match, tokens) if long_match else None  # eagle-tree's, see AdaptiveK.plan
    out: list[int] = []
    while not stats.stop_reason:
        budget, room = max_new_tokens - len(out), n_ctx - len(tokens)
        if budget <= 0 or room <= 0:
            stats.stop_reason = "length" if budget <= 0 else "context"
            break
        # A round commits at most k+1 tokens and its forward reaches position len(tokens) - 1 + k.
        t_round = time.perf_counter()
        kk = min(k_max if adaptive else k, budget - 1, room - 1)
        if adaptive:
            adaptive.verify.at(len(tokens))
            kk = adaptive.plan(kk, incremental, match)
        t0 = time.perf_counter()
        if kk <= 0:
            draft = Draft([])
        elif incremental:
            draft = drafter.propose(tokens, kk, sampler, keep_going=adaptive.keep_going)
        else:
            draft = drafter.propose(tokens, kk, sampler)
        synchronize(device)  # on a GPU: the draft's queued work counts as drafting
        t1 = time.perf_counter()
        tree = draft.parents is not None
        if tree and not (params.greedy and hasattr(kv, "keep_path")):
            draft, tree = draft.chain(), False  # tree verification: greedy, lean backend
        chain = _usable((draft.chain() if tree else draft).tokens[:kk], vocab)
        cut_at = len(chain)
        if adaptive:  # a tree is cut by depth, as its main chain would be
            deterministic = params.greedy or draft.probs is None
            cut_at = adaptive.cut(chain, deterministic, len(tokens), draft.match_length)
        if tree:
            draft = draft.pruned(cut_at, vocab, kk)
            nodes = [tokens[-1]] + draft.tokens  # node 0, the root: the last committed token
            parents = [-1] + [p + 1 for p in draft.parents]
            logits = kv.extend(nodes, parents=parents)  # (len(nodes), V)
        else:
            drafted = chain[:cut_at]
            logits = kv.extend([tokens[-1]] + drafted)  # (len(drafted) + 1, V)
        synchronize(device)
        t2 = time.perf_counter()
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1

        if tree:
            verdict, path = verify_tree_greedy(nodes, parents, logits)
            kv.keep_path(len(tokens) - 1, path)
            accepted, n_verified = [nodes[i] for i in path[1:]], len(draft.tokens)
            depth = max(draft.depths(), default=0)
        else:
            if params.greedy:
                verdict = verify_greedy(drafted, logits)
            else:
                q = None if draft.probs is None else _match_vocab(draft.probs[: len(drafted)], vocab)
                verdict = verify_sampling(drafted, q, processed_probs(logits, params), generator)
            accepted, n_verified, depth = drafted[: verdict.n_accepted], len(drafted), len(drafted)
        kv.rollback(len(tokens) + verdict.n_accepted)
        stats.record_round(n_verified, verdict.n_accepted, depth)
        if adaptive:
            adaptive.observe(n_verified, verdict.n_accepted, (t2 - t1) * 1e3, (t1 - t0) * 1e3,
                             (time.perf_counter() - t_round - (t2 - t0)) * 1e3, kk, incremental, depth,
                             draft.match_length)

        committed = []
        for t in accepted + [verdict.token]:
            committed.append(t)
            if t in eos:
                stats.stop_reason = "eos"
            elif stop and _stop_at(target.tokenizer.decode(out + committed, skip_special_tokens=True), stop) >= 0:
                stats.stop_reason = "stop"
            if stats.stop_reason:
                break
        tokens += committed
        out += committed
        if adaptive:
            adaptive.resolve(tokens)
        if stream is not None:
            stream(committed)
        paused += yield from _suspend(len(out))

    if adaptive:
        adaptive.resolve(tokens, final=True)
    stats.new_tokens = len(out)
    stats.total_s = time.perf_counter() - start - paused
    text = target.tokenizer.decode(out, skip_special_tokens=True)
    cut = _stop_at(text, stop)
    return Generation(out, text if cut < 0 else text[:cut], stats)


def _suspend(n_out: int) -> Generator[int, None, float]:
    """Yield n_out; return the seconds until the caller resumed."""
    t = time.perf_counter()
    yield n_out
    return time.perf_counter() - t


def _stop_at(text: str, stop: Sequence[str]) -> int:
    """Index where the earliest stop string starts in text, or -1."""
    hits = [i for i in (text.find(s) for s in stop if s) if i >= 0]
    return min(hits) if hits else -1


def _usable(tokens: list[int], vocab: int) -> list[int]:
    """The draft up to its first id the target cannot score (a draft with a wider vocabulary)."""
    for i, t in enumerate(tokens):
        if not 0 <= t < vocab:
            return tokens[:i]
    return tokens


def _match_vocab(q: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft probabilities (n, V_draft) as (n, vocab): zero-padded when the target's logits are
    wider (Qwen 151936 vs 152064), cut when narrower (padding ids only, checked at load)."""
    if q.shape[1] < vocab:
        return torch.nn.functional.pad(q, (0, vocab - q.shape[1]))
    return q[:, :vocab]
