"""The bench's measurements of one pair: its costs (V(n), draft(k), the per-round overhead), timed
round-robin for interleaved medians, and its runs, every config of a prompt together round by round."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Generator

import torch

from specdec.adaptive import AdaptiveK, VerifyCosts
from specdec.bench.config import BenchConfig
from specdec.bench.roofline import roofline
from specdec.bench.rowcost import row_cost
from specdec.cache import new_cache
from specdec.drafters import Drafter
from specdec.engine import AUTO_K_MAX, Generation, generate, stepwise
from specdec.models.load import Model, synchronize
from specdec.sampling import Sampler, SamplingParams


def _interleaved_medians(
    fns: dict[str, tuple], repeats: int, warmup: int = 2, device: torch.device = torch.device("cpu")
) -> dict[str, float]:
    """Median ms of each (setup, timed) pair of zero-argument functions, timed round-robin (each
    once per pass) so that a burst of load on a shared machine falls on every point alike; on a
    GPU each timing waits for the work it queued (models.synchronize)."""
    times: dict[str, list[float]] = {key: [] for key in fns}
    for i in range(warmup + repeats):
        for key, (setup, fn) in fns.items():
            setup()
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            if i >= warmup:
                times[key].append((time.perf_counter() - start) * 1e3)
    return {key: statistics.median(t) for key, t in times.items()}


def measure_costs(
    target: Model, drafter: Drafter, context: list[int], ks: list[int], repeats: int = 9, greedy: bool = True
) -> dict:
    """Costs in ms (medians) on a KV cache that holds `context`, whose length is the workload's
    typical context length:
    - verify_ms[n]: one target forward over n = 1..max(ks)+1 new tokens, V(n);
    - draft_ms[k]: one proposal of k tokens when the drafter's state lags the context by one token
      (the round before rejected a drafted token);
    - draft_catchup_ms[k]: the same when it lags by two (the round before accepted everything, so
      the last drafted token and the bonus token are both new to a draft model).
    greedy: time the forwards and drafts greedy decoding runs (else sampling's)."""
    kv = new_cache(target)
    kv.argmax_only = greedy  # as the engine's cache: the output layer screened when greedy
    drafter.prepare(target)
    if drafter.reads_target_cache:
        drafter.attach(kv)  # before the first forward: a head with taps has the cache keep them
    kv.extend(context[:-1], all_logits=False)
    n_keep = len(kv)
    block = (context * (max(ks) + 2))[: max(ks) + 1]
    nothing = lambda: None  # noqa: E731

    def verify(n: int) -> None:
        kv.extend(block[:n])
        kv.rollback(n_keep)

    dev = target.device
    verify_curve = _interleaved_medians(
        {str(n): (nothing, lambda n=n: verify(n)) for n in range(1, max(ks) + 2)}, repeats, device=dev
    )
    sampler = Sampler(SamplingParams(temperature=0.0 if greedy else 1.0), torch.Generator().manual_seed(0))
    propose = lambda k: lambda: drafter.propose(context, k, sampler)  # noqa: E731
    # lag(n) leaves a model drafter at context[:-n]
    lag = lambda n: lambda: drafter.propose(context[:-n], 1, sampler)  # noqa: E731
    draft_cost = _interleaved_medians({str(k): (lag(1), propose(k)) for k in ks}, repeats, device=dev)
    catchup_cost = _interleaved_medians({str(k): (lag(2), propose(k)) for k in ks}, repeats, device=dev)
    return {
        "context_tokens": len(context),
        "verify_ms": verify_curve,
        "draft_ms": draft_cost,
        "draft_catchup_ms": catchup_cost,
        "overhead_ms": 0.0,
    }


def cost_ks(ks: tuple | list) -> list[int]:
    """The draft lengths whose costs are measured, ascending: every fixed k, and for k = "auto" the
    lengths it chooses from (1 and AUTO_K_MAX)."""
    return sorted({k for k in ks if k != "auto"} | ({1, AUTO_K_MAX} if "auto" in ks else set()))


def pair_costs(target: Model, drafter: Drafter, encoded: list[list[int]], ks: list[int], run: dict) -> dict:
    """Warm up every path once (speculative at the largest of ks, plain), then measure_costs at the
    typical KV length of the decode (the median prompt plus half the new tokens; run: generate's
    keyword arguments) on cost_context. Returns the costs without overhead, roofline and row cost."""
    generate(target, encoded[0], drafter, k=max(ks), **{**run, "max_new_tokens": 8})
    generate(target, encoded[0], None, **{**run, "max_new_tokens": 8})
    ctx_len = int(statistics.median(len(e) for e in encoded)) + run["max_new_tokens"] // 2
    context = cost_context(drafter, encoded, min(ctx_len, target.n_ctx - max(ks) - 2))
    return measure_costs(target, drafter, context, ks, greedy=run["temperature"] == 0)


def cost_context(drafter: Drafter, encoded: list[list[int]], length: int, give: int = 64) -> list[int]:
    """The context the costs are timed on: the prompts one after another, longest first (repeated only
    if they are all shorter together), cut to `length` tokens, and shortened by up to `give` tokens
    until the drafter would draft with its own model or head: a hybrid's free lookup branch
    (Drafter.long_match) is not the cost its c stands for. Raises ValueError for no tokens."""
    joined = [t for e in sorted(encoded, key=len, reverse=True) for t in e]
    if not joined or length < 2:
        raise ValueError("the cost context needs prompts of at least two tokens")
    joined = (joined * (length // len(joined) + 1))[:length]
    for cut in range(length, max(2, length - give) - 1, -1):
        if drafter.long_match(joined[:cut]) is None:
            return joined[:cut]
    return joined


def roofline_and_row_cost(target: Model, verify_ms: dict, bandwidth_gbs: float | None, greedy: bool) -> dict:
    """{"roofline": the target's memory roofline (None without a bandwidth), "row_cost": an added
    verify row against the product instruction's peak (None off the quantized backend)}."""
    return {
        "roofline": roofline(target, verify_ms, bandwidth_gbs, greedy=greedy) if bandwidth_gbs else None,
        "row_cost": row_cost(target, verify_ms),
    }


def overhead_ms(records: list[dict]) -> float:
    """The fixed per-round overhead in ms: time outside draft and verify per round, the median over
    every run of every prompt (records: results.PromptRecord dicts)."""
    per_round = [
        r["other_s"] / r["rounds"] * 1e3
        for rec in records
        for r in [rec["plain"], *rec["runs"].values()]
        if r["rounds"]
    ]
    return statistics.median(per_round)


def config_drafters(
    target: Model,
    ids: list[int],
    drafter: Drafter,
    new_drafter: Callable[[], Drafter],
    config: BenchConfig,
    warm_k: int,
) -> tuple[dict, AdaptiveK]:
    """Each config's drafter ({k: drafter} for config.ks): its own when config.interleave, warmed up
    on `ids` at the fixed k warm_k (auto's policy not started), else the one `drafter`; and
    k = "auto"'s policy, carried across prompts."""
    own = {k: new_drafter() if config.interleave else drafter for k in config.ks}
    policy = AdaptiveK(VerifyCosts.for_model(target, config.load.get("cache")), k_max=AUTO_K_MAX)
    if config.interleave:
        for d in own.values():  # at a fixed k: warm it without starting auto's policy
            generate(target, ids, d, k=warm_k, **{**config.run, "max_new_tokens": 8})
    return own, policy


def warm_verify_costs(target: Model, policy: AdaptiveK, encoded: list[list[int]], max_new_tokens: int) -> None:
    """Time k = "auto"'s verify-cost curve (VerifyCosts.calibrate) where each prompt's generation would
    time it at its prefill, before any prompt is timed: a cost paid once per target, context range and
    machine (the curve is cached on disk), not part of one prompt's end-to-end time. A context within
    the curve's spacing of a timed one costs nothing (encoded: the prompts' token ids)."""
    costs, ahead = policy.costs, min(max_new_tokens, policy.costs.ahead_max)
    for ids in encoded:
        at = len(ids) - 1  # the engine's cache at calibration: the prompt but its last token
        if costs.needs(at) or costs.needs(at + ahead):
            kv = new_cache(target)
            kv.extend(ids[:-1], all_logits=False)
            costs.calibrate(kv, ids, policy.k_max + 1, ahead=max_new_tokens)


def run_configs(
    target: Model, ids: list[int], own: dict, policy: AdaptiveK, run: dict, config: BenchConfig
) -> dict[str, list[Generation]]:
    """One prompt's generations by config ("plain" and each str(k) of config.ks), config.repeats
    each (run: generate's keyword arguments): every repeat runs all configs (run_all), its order
    rotated so that no config always runs first."""
    timed: dict[str, list[Generation]] = {}
    configs = [0, *config.ks]  # 0: plain decoding
    for r in range(config.repeats):
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        steps = {
            str(k) if k else "plain": stepwise(
                target, ids, own[k] if k else None, k=k, policy=policy if k == "auto" else None, **run
            )
            for k in order
        }
        for name, spec in run_all(steps, config.interleave).items():
            timed.setdefault(name, []).append(spec)
    return timed


def run_all(steps: dict[str, Generator[int, None, Generation]], interleave: bool = True) -> dict[str, Generation]:
    """Run generations (specdec.engine.stepwise, by name) to their end and return their results.
    interleave: round by round, always stepping the one with the fewest new tokens so far (ties: in
    the order given), so that they pass through the output together and a slow spell of a shared
    host falls on each alike (each one's stats leave out the time it waited); else one after
    another, in the order given."""
    made: dict[str, int] = dict.fromkeys(steps, 0)
    done: dict[str, Generation] = {}
    while len(done) < len(steps):
        todo = [name for name in steps if name not in done]
        name = min(todo, key=made.__getitem__) if interleave else todo[0]
        try:
            made[name] = next(steps[name])
        except StopIteration as end:
            done[name] = end.value
    return done


def median_run(generations: list[Generation]) -> Generation:
    """Of repeated generations of one config on one prompt, the one with the median decode speed
    (the lower middle one for an even count), so that its timings are one real run's."""
    ranked = sorted(generations, key=lambda g: g.stats.decode_tokens_per_s)
    return ranked[(len(ranked) - 1) // 2]
