"""`specdec bench`: exactness, acceptance, costs and speed-up of speculative decoding on a workload,
with the cost model's predictions and peers, measured in one run (run_bench, one pair: bench_pair).

For each pair (target, drafter) the bench
  1. loads its models, each load measured in resident memory (specdec.bench.loading);
  2. measures the costs: V(n), one target forward over n = 1..max(k)+1 new tokens at a realistic
     KV length, and one drafter proposal of k tokens (medians after warm-up; specdec.bench.measure);
  3. runs, prompt by prompt, plain decoding (k = 0) and speculative decoding for every k together,
     round by round (measure.run_all), checking greedy outputs token for token against plain
     decoding (specdec.bench.records);
  4. runs the peers on the same model (or, for llama.cpp, the same GGUF file) and prompt ids
     (specdec.bench.peer_rows);
  5. replays every config on the plain outputs where it can (specdec.bench.replay);
  6. fits: per k, alpha, tau, acceptance by position, the median per-prompt speed-up, and both
     predictions (specdec.bench.costmodel) with their errors (specdec.bench.fit).
Beside the speeds it records what each model is (its precision and the kernels that ran it), the
memory roofline of its forward over the bytes it reads (specdec.bench.roofline), and the resident
memory its load took (specdec.bench.memory). Then results.json (specdec.bench.results) and a markdown
report are written; plots are a separate stage (`specdec plot`).
"""

from __future__ import annotations

from datetime import UTC, datetime

from tqdm import tqdm

from specdec.bench.config import BenchConfig, Pair
from specdec.bench.environment import environment
from specdec.bench.loading import encode_prompt, load_pair
from specdec.bench.measure import (
    config_drafters,
    cost_ks,
    overhead_ms,
    pair_costs,
    roofline_and_row_cost,
    run_configs,
    warm_verify_costs,
)
from specdec.bench.peer_rows import PeerRuns
from specdec.bench.records import pair_record, prompt_record
from specdec.bench.replay import replay_prompts, replayable
from specdec.bench.results import SCHEMA, SCHEMA_VERSION, PairRecord, validate
from specdec.bench.roofline import memory_bandwidth_gbs
from specdec.bench.workloads import Prompt
from specdec.grammar import Grammar
from specdec.models.load import resolve_device


def run_bench(config: BenchConfig, prompts: list[Prompt]) -> dict:
    """The whole results of config.pairs on prompts, in the file's JSON form
    (specdec.bench.results.BenchResults.to_dict(), schema version SCHEMA_VERSION), validated.

    Each pair is benched in turn (bench_pair) under config (repeats, interleave, replay: see
    BenchConfig; with interleave off, the speed ratio of two configs on one prompt spreads several
    times more between repeats than together, figures in docs/bench.md). Raises ValueError on bad
    ks, repeats < 1 or no prompts (and, naming the field, on results that do not fit the schema)."""
    if config.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {config.repeats}")
    ks = list(config.ks)
    if not ks or any(k != "auto" and (not isinstance(k, int) or k < 1) for k in ks):
        raise ValueError(f"--k needs draft lengths >= 1 or 'auto' (plain decoding is always measured), got {ks}")
    if not prompts:
        raise ValueError("the workload selection is empty")
    bandwidth = memory_bandwidth_gbs(resolve_device(config.load.get("device", "cpu")))
    results = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "environment": {**environment(), "memory_bandwidth_gbs": bandwidth},
        "settings": _settings(config, prompts),
        "pairs": [bench_pair(config, pair, prompts, bandwidth) for pair in config.pairs],
    }
    return validate(results, "run_bench").to_dict()


def _settings(config: BenchConfig, prompts: list[Prompt]) -> dict:
    """The results' `settings` (results.Settings): the config as run, the prompts' categories."""
    return {
        "workload": config.workload,
        "categories": sorted({p.category for p in prompts}),
        "limit": config.limit,
        "max_new_tokens": config.max_new_tokens,
        "temperature": config.temperature,
        "ks": list(config.ks),
        "quick": config.quick,
        "repeats": config.repeats,
        "peers": list(config.peers),
        "peer_k": config.peer_k,
        "replay": config.replay,
        "interleave": config.interleave,
    }


def bench_pair(
    config: BenchConfig, pair: Pair, prompts: list[Prompt], bandwidth_gbs: float | None = None
) -> PairRecord:
    """Everything for one pair: its `pairs[i]` record of results.json (specdec.bench.results.PairRecord).

    In this order: load the models (loading.load_pair); warm up and measure the costs
    (measure.pair_costs); give each config its drafter (measure.config_drafters) and time k = "auto"'s
    verify-cost curve at the prompts' contexts (measure.warm_verify_costs); the roofline (with
    bandwidth_gbs, the measured memory bandwidth in GB/s) and an added row's cost; per prompt, plain
    decoding and every k (measure.run_configs), checked against plain decoding
    (records.prompt_record), then the peers (peer_rows.PeerRuns); the per-round overhead; the replay,
    when config.replay, greedy, the drafter allows it (replay.replayable) and no prompt has a grammar
    (replay.replay_prompts); the fit (records.pair_record). Raises ValueError when the record does not
    fit the schema."""
    models = load_pair(pair, config)
    target, drafter = models.target, models.new_drafter()
    encoded = [encode_prompt(target, p) for p in prompts]
    measured_ks = cost_ks(config.ks)  # every fixed k; for "auto", the lengths it chooses from
    costs = pair_costs(target, drafter, encoded, measured_ks, config.run)
    own, policy = config_drafters(target, encoded[0], drafter, models.new_drafter, config, max(measured_ks))
    if "auto" in config.ks:
        warm_verify_costs(target, policy, encoded, config.run["max_new_tokens"])
    costs.update(roofline_and_row_cost(target, costs["verify_ms"], bandwidth_gbs, config.greedy))
    peers = PeerRuns.of_pair(pair, config, models, encoded)
    records, peer_rows, outputs = [], [], []
    bar = tqdm(
        total=len(prompts) * (len(config.ks) + 1 + len(config.peers)),
        desc=f"bench {pair.target} / {pair.drafter}",
        disable=not config.progress,
    )
    for prompt, ids in zip(prompts, encoded):
        # a prompt with a JSON schema: every config under its grammar (plain constrained decoding
        # the baseline); the peers run no grammar here, so they are left out of such prompts
        run = {**config.run, "grammar": Grammar.json_schema(prompt.schema)} if prompt.schema else config.run
        timed = run_configs(target, ids, own, policy, run, config)
        record, plain = prompt_record(target, prompt, ids, timed, config)
        bar.update(1 + len(config.ks))
        for name in config.peers:
            if peers.runs(name, prompt):
                peer_rows.append(peers.row(name, prompt.id, ids, plain))
            bar.update()
        records.append(record)
        outputs.append(plain)
    bar.close()

    costs["overhead_ms"] = overhead_ms(records)
    grammars = any(p.schema for p in prompts)  # a replay has no grammar: its forced tokens would be drafts
    if config.replay and config.greedy and replayable(drafter) and not grammars:
        desc = f"replay {pair.target} / {pair.drafter}"
        runs = list(zip(encoded, outputs))
        replays = replay_prompts(target, drafter, runs, config.ks, costs, desc=desc, progress=config.progress)
        for rec, replayed in zip(records, replays):
            rec["replay"] = replayed
    precision = models.draft_model.precision if models.draft_model else getattr(drafter, "precision", None)  # a head's
    return pair_record(
        pair, config, models, draft_precision=precision, costs=costs, records=records, peer_rows=peer_rows
    )
