"""The bench's results file (results.json): its schema, one pydantic model per record kind with
every field described where it is declared, validation, migration of version 1, atomic save, load.

Stages are separate (bench -> results.json -> fit -> report and plots); the report and the plots
read only this file and never run a model. The file is the JSON form of `BenchResults`, which starts
{"schema": "specdec.bench", "schema_version": 2, ...}. `load` returns it as a dict (the form the
report, the plots and the README's table read), checked against the models.

Units: times in ms unless a name ends in `_s` (seconds), memory in MB (10^6 bytes). Speeds are
decode-only tokens/s (prefill excluded: it is the same forward in every configuration); a speed-up is
the median over prompts of speculative / plain tokens/s measured in the same run. Draft lengths k are
an int >= 1 or "auto"; a mapping by k or by n uses str(k) as its key. α = accepted / drafted tokens;
τ = new tokens per round, the recovered or bonus token included.

A field typed `... | None` says where None applies; "v1: None" marks a field a version-1 file did
not record. Version 1 ("schema": "specdec.bench/1") is migrated on read by `_from_v1`, the one place
that fills what older files lack; version 2 dropped its duplicate keys "dtype" (now "precision")
and "draft_dtype" ("draft_precision").
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError

from specdec.models.weights import atomic_write

SCHEMA = "specdec.bench"
SCHEMA_VERSION = 2
V1 = "specdec.bench/1"
REGENERATE = "regenerate it with `specdec bench` (docs/bench.md, Reproducing results/)"


def _draft_length(value):
    if value == "auto" or type(value) is int:
        return value
    raise ValueError("a draft length k must be an integer or 'auto'")


K = Annotated[int | str, PlainValidator(_draft_length)]  # a draft length: an int (0: plain decoding) or "auto"
Counts = Annotated[list[int], Field(min_length=2, max_length=2)]  # [n, of m]


class _Record(BaseModel):
    """Strict: no type coercion (an int is accepted for a float), no field the model does not name."""

    model_config = ConfigDict(strict=True, extra="forbid")


class Environment(_Record):
    cpu: str  # model name and core count: "AMD EPYC 7B13, 2 cores"
    gpu: str | None  # torch.cuda's device 0; None without one
    threads: int  # torch's thread count
    python: str
    torch: str
    transformers: str
    platform: str
    git_commit: str | None  # ends in "-dirty" when specdec's files differ from it; None outside a checkout
    memory_bandwidth_gbs: float | None  # read bandwidth measured at the start of the run (v1: None)


class Settings(_Record):
    workload: str  # the workload file's name
    categories: list[str]
    limit: int | None  # prompts per category
    max_new_tokens: int
    temperature: float  # 0: greedy
    ks: list[K]
    quick: bool
    repeats: int  # generations per prompt and config; the median run counts
    peers: list[str] | None  # v1: None
    peer_k: int | None  # the llama.cpp prompt lookup peer's draft length (v1: None)
    replay: bool  # replay asked for (specdec.bench.replay)
    interleave: bool | None  # a repeat's configs ran together, round by round (measure.run_all); v1: None


class Memory(_Record):
    """Resident memory of one model's load (specdec.bench.memory); each None without /proc."""

    rss_before_mb: float | None
    rss_after_mb: float | None  # after the load and a warm-up forward
    rss_growth_mb: float | None  # after minus before
    peak_rss_mb: float | None  # the process's ru_maxrss so far
    file_mb: float | None  # a GGUF model at its own precision: the file's size (else None, as below)
    file_resident_mb: float | None  # its pages mapped in
    other_mb: float | None  # the rest of the growth
    growth_per_file_byte: float | None


class Roofline(_Record):
    """The memory roofline of the target's forward (specdec.bench.roofline)."""

    weight_mb: float  # weights one forward reads
    weights: str | None  # what they are: the model's precision (quantized blocks for "gguf ..."); v1: None
    bandwidth_gbs: float
    floor_ms: float  # weight_mb at bandwidth_gbs
    fraction: dict[str, float]  # by n: floor_ms / V(n)
    screened_output_layer: bool  # greedy read the output layer screened (specdec.backends.screen, .qscreen)


class RowCost(_Record):
    """An added verify row against the product instruction's peak (specdec.bench.rowcost)."""

    kernel: Literal["amx", "vnni", "avx2", "fp32"]
    macs_per_row: int  # multiply-adds of one row through every matrix, the output layer included
    peak_gmacs: float  # G multiply-adds/s at the instruction's measured peak
    marginal_ms: float  # least-squares slope of V(n) over n
    peak_ms: float  # macs_per_row at the peak
    fraction: float | None  # peak_ms / marginal_ms; None for a slope <= 0


class Costs(_Record):
    """Medians after warm-up, timed round-robin, on a KV cache of context_tokens (run.measure_costs)."""

    context_tokens: int  # the workload's typical KV length
    verify_ms: dict[str, float]  # by n: V(n), one target forward over n new tokens
    draft_ms: dict[str, float]  # by k: D1, one drafter proposal of k tokens, the drafter one token behind
    draft_catchup_ms: dict[str, float]  # by k: D2, two tokens behind (after a fully accepted round)
    overhead_ms: float  # per round, outside draft and verify (sampling, bookkeeping)
    roofline: Roofline | None  # None without a measured bandwidth
    row_cost: RowCost | None  # None off the quantized backend


class Divergence(_Record):
    """Where a greedy speculative output first differs from plain decoding (specdec.exactness)."""

    position: int  # index in the new tokens
    plain_token: int | None  # None: that output had ended
    other_token: int | None
    logit_gap: float  # the target's top-1 minus top-2 logit there
    logit_ulp: float | None  # the spacing of the logits' dtype at the top-1 logit (v1: None)


class Run(_Record):
    """One generation's stats: RunStats.to_dict() (specdec.stats, where its fields are described;
    a field it adds passes unchecked), with every repeat's speed."""

    model_config = ConfigDict(extra="allow")

    k: K  # 0: plain decoding
    prompt_tokens: int
    new_tokens: int
    rounds: int
    drafted: int
    accepted: int
    drafted_at: list[int]  # by draft position
    accepted_at: list[int]
    k_per_round: list[int] | None  # v1: None
    forced: int = 0  # tokens a grammar forced, verified as free drafts (not in drafted / accepted)
    prefill_s: float
    draft_s: float
    verify_s: float
    total_s: float
    other_s: float
    stop_reason: str
    alpha: float  # α
    tau: float  # τ, bonus included
    acceptance_per_position: list[float]
    mean_k: float | None  # tokens drafted per round (v1: None)
    tokens_per_s: float  # end to end
    decode_tokens_per_s: float
    decode_tokens_per_s_repeats: list[float] | None  # every repeat's, in the order run (v1: None)


class SpecRun(Run):
    """A speculative config's median run on a prompt."""

    identical: bool | None  # every repeat's output equals plain decoding's; None when sampling
    divergence: Divergence | None  # the first repeat that differs, where one does


class Replayed(_Record):
    """A config replayed on the prompt's plain output under the measured costs (specdec.bench.replay)."""

    decode_tokens_per_s: float  # simulated
    rounds: int
    drafted: int
    accepted: int
    tau: float
    mean_k: float


class PromptRecord(_Record):
    """Raw measurements of one prompt."""

    id: str
    category: str
    prompt_tokens: int
    plain: Run  # plain decoding's median run
    runs: dict[str, SpecRun]  # by k
    replay: dict[str, Replayed] | None  # by k and "plain"; None when not greedy, for a drafter that
    # reads the target's cache, with --no-replay (and v1 files without it)


class PeerRun(_Record):
    """One peer's generation of one prompt (specdec.bench.peers); a failed one has only its error."""

    name: str  # hf, hf-lookup, hf-assisted, llama-cpp, llama-cpp-lookup
    prompt_id: str
    tokens_per_s: float  # end to end; NaN when it failed
    decode_tokens_per_s: float | None  # after the first new token (llama.cpp)
    identical: bool | None  # its output equals our plain greedy output; None when sampling
    agreement: float | None  # share of our plain output reproduced before its first difference
    weights: str | None  # what it ran
    same_weights: bool | None  # whether that is what we ran
    rss_growth_mb: float | None  # its load's resident memory (llama.cpp, first prompt)
    n_ctx: int | None  # llama.cpp's context (its KV cache)
    error: str | None  # "ExceptionName: message" when it failed


class Quartiles(_Record):
    median: float
    min: float
    max: float
    q1: float
    q3: float


class Predicted(_Record):
    textbook: float  # Leviathan et al.'s formula (specdec.bench.costmodel)
    ours: float  # the measured costs and acceptance per position


class CategoryFit(_Record):
    alpha: float
    tau: float
    speedup: float  # median over the category's prompts


class ReplayedCategory(_Record):
    speedup: float


class ReplayedFit(_Record):
    speedup: Quartiles
    tau: float  # mean over prompts
    by_category: dict[str, ReplayedCategory]


class ConfigFit(_Record):
    """The fit of one k over all prompts (run.fit)."""

    k: K
    alpha: float  # pooled over prompts
    tau: float
    acceptance_per_position: list[float]
    mean_k: float | None  # tokens drafted per round, mean over prompts (v1: None)
    speedup: Quartiles  # over prompts
    identical: Counts  # [prompts identical to plain decoding, prompts compared] (greedy only)
    predicted: Predicted  # median over prompts
    error: Predicted  # median over prompts of (predicted - measured) / measured
    by_category: dict[str, CategoryFit]
    replayed: ReplayedFit | None  # when every prompt was replayed


class BestK(_Record):
    """The best fixed k three ways; None without a fixed k."""

    measured: int | None
    textbook: int | None
    ours: int | None


class AutoVersusFixed(_Record):
    """k = "auto" against the fixed k (run._auto_versus_fixed)."""

    vs_best_fixed: float  # auto's median speed-up over that of the best fixed k
    best_fixed_k: int | None
    worst_category: str | None
    worst_category_vs_plain: float  # auto's speed-up on its worst category
    vs_best_fixed_by_category: dict[str, float] | None  # over each category's best fixed k (v1: None)


class Auto(AutoVersusFixed):
    replayed: AutoVersusFixed | None  # the same from the replayed speed-ups, when every config has them


class PeerSummary(_Record):
    """One peer over all prompts: ratios of its tokens/s to ours, medians over prompts."""

    name: str
    vs_plain: float  # end to end, over our plain decoding
    vs_speculative: float  # over our speculative decoding: the best fixed k, else k = "auto"
    decode_vs_plain: float | None  # decode only (llama.cpp)
    identical: Counts
    agreement: float | None  # mean over prompts
    weights: str | None
    same_weights: bool | None
    rss_growth_mb: float | None
    n_ctx: int | None


class BestPeer(_Record):
    """The fastest of the peers on each prompt (end to end), over all prompts: medians over prompts."""

    peers: list[str]  # the peers it takes the fastest of
    vs_plain: float  # its tokens/s over our plain decoding's
    speculative_over_best: float | None  # our speculative decoding's (as vs_speculative) over its; None: none ran


class PairRecord(_Record):
    """Everything measured for one (target, drafter) pair: what ran, the raw measurements, the fit."""

    target: str
    drafter: str
    draft: str | None  # the pair's third part: a draft model, corpus, layers or head file
    workload: str
    precision: str  # the target's (Model.precision): "float32", "bfloat16", "gguf Q4_1+Q8_0"
    draft_precision: str | None  # a draft model's, or an EAGLE head's ("gguf Q8_0 head", "float32 head")
    draft_vocab: int | None = None  # --draft-vocab: the tokens the drafter may propose (None: all, or a head's own)
    backend: Literal["lean", "hf"]  # how the forwards ran (v1 files without it: "hf")
    device: str  # "cpu", "cuda:0"
    kernel: str | None  # what ran the target's products (run.kernel); None: transformers', bf16, a GPU
    draft_kernel: str | None
    products: str | None  # lean fp32 on the CPU: specdec.backends.gemv's status
    memory: Memory | None  # the target's load (v1: None)
    draft_memory: Memory | None  # a draft model's load
    padded_rows: dict[str, int] | None  # the lean backend's rows a forward of n runs as (specdec.backends.rows)
    draft_padded_rows: dict[str, int] | None
    ratio_noise: float | None  # timing noise (run.ratio_noise); None under 2 repeats
    costs: Costs
    prompts: list[PromptRecord]
    peers: list[PeerRun]
    configs: list[ConfigFit]
    best_k: BestK
    auto: Auto | None  # when k = "auto" ran
    peer_summary: list[PeerSummary]
    best_peer: BestPeer | None = None  # with at least one peer


class BenchResults(_Record):
    """A whole results file."""

    schema_: Literal["specdec.bench"] = Field(alias="schema")  # "schema" in the file (a name BaseModel has)
    schema_version: Literal[2]
    created: str  # ISO 8601, seconds
    environment: Environment
    settings: Settings
    pairs: list[PairRecord]

    def to_dict(self) -> dict:
        """The file's JSON form, as `load` returns it."""
        return self.model_dump(by_alias=True)


def k_order(k: int | str) -> tuple[int, int]:
    """Sort key for draft lengths: the fixed k ascending, then "auto"."""
    return (1, 0) if k == "auto" else (0, int(k))


R = TypeVar("R", bound=BaseModel)


def parse(model: type[R], data, source: str) -> R:
    """`data` as a `model` record; raises ValueError naming `source` and the first bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _problem(e, source) from None


def _problem(e: ValidationError, source: str) -> ValueError:
    """A ValidationError in one line: "<source>: <where>: missing field 'x'" or "<source>: field <path>: ..."."""
    errors = e.errors()
    first, more = errors[0], f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    loc = list(first["loc"])
    path = lambda parts: "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts).lstrip(".")  # noqa: E731
    if first["type"] == "missing" and loc:
        where = path(loc[:-1])
        return ValueError(f"{source}: {where + ': ' if where else ''}missing field {loc[-1]!r}{more}")
    if first["type"] == "extra_forbidden":
        return ValueError(f"{source}: field {path(loc)!r} is not in schema version {SCHEMA_VERSION}{more}")
    got = repr(first.get("input"))
    got = got if len(got) <= 60 else got[:57] + "..."
    return ValueError(f"{source}: field {path(loc)!r}: {first['msg']}, got {got}{more}")


def validate(results: dict | BenchResults, source: str = "results") -> BenchResults:
    """The typed results of a dict in the current schema version (run_bench's, or a file's read as JSON).

    Raises ValueError naming `source` and the first bad field, or the version when it is not
    SCHEMA_VERSION (load migrates version 1 first)."""
    if isinstance(results, BenchResults):
        return results
    if not isinstance(results, dict):
        raise ValueError(f"{source}: expected a JSON object, got {type(results).__name__}")
    if results.get("schema") != SCHEMA or results.get("schema_version") != SCHEMA_VERSION:
        raise ValueError(
            f"{source}: results schema {results.get('schema')!r} version {results.get('schema_version')!r}; this "
            f"specdec reads {SCHEMA!r} version {SCHEMA_VERSION} and migrates {V1!r}: {REGENERATE}"
        )
    return parse(BenchResults, results, source)


def save(results: dict | BenchResults, path: str | os.PathLike) -> Path:
    """Validate (ValueError naming the field, before anything is written), then write the file
    atomically (a temporary file, then a rename). Returns the path."""
    data = validate(results, str(path)).to_dict()

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)

    return atomic_write(path, write)


def load(path: str | os.PathLike) -> dict:
    """Read a results file, migrate it from version 1 if it is one, validate it, and return its
    JSON form (BenchResults.to_dict()). Raises ValueError naming the file (and the field) for a file
    that cannot be read, has another version or does not fit the schema."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read results file {path}: {e}") from None
    if isinstance(data, dict) and data.get("schema") == V1 and "schema_version" not in data:
        data = _from_v1(data)
    return validate(data, str(path)).to_dict()


def _from_v1(data: dict) -> dict:
    """A version-1 file (its JSON as read) in version 2: the one place that fills in what older files
    lack. Absent fields become None (not recorded), except where the older runs' value is known:
    backend "hf" and device "cpu" (before either was recorded, the bench ran transformers on the CPU),
    replay False, repeats 1, screened_output_layer False, D2 = D1 where D2 was not measured (as the
    cost model took it), no peer summaries, no forced tokens (no grammars then). "dtype" and
    "draft_dtype" become "precision" and "draft_precision" (kept where a file has both). Anything
    malformed is left for validation to name."""
    out = copy.deepcopy(data)
    out.update(schema=SCHEMA, schema_version=SCHEMA_VERSION)
    _fill(out.get("environment"), memory_bandwidth_gbs=None)
    _fill(out.get("settings"), repeats=1, peers=None, peer_k=None, replay=False, interleave=None)
    for pair in _dicts(out.get("pairs")):
        if "dtype" in pair:
            pair.setdefault("precision", pair.pop("dtype"))
        pair.setdefault("draft_precision", pair.pop("draft_dtype", None))
        _fill(pair, backend="hf", device="cpu", kernel=None)
        _fill(pair, draft_kernel=None, products=None, memory=None, draft_memory=None, padded_rows=None)
        _fill(pair, draft_padded_rows=None, ratio_noise=None, auto=None, peer_summary=[])
        costs = pair.get("costs")
        if isinstance(costs, dict):
            _fill(costs, draft_catchup_ms=copy.deepcopy(costs.get("draft_ms")), roofline=None, row_cost=None)
            _fill(costs["roofline"], weights=None, screened_output_layer=False)
        for prompt in _dicts(pair.get("prompts")):
            _fill(prompt, replay=None)
            runs = prompt.get("runs")
            for run in [prompt.get("plain"), *(runs.values() if isinstance(runs, dict) else [])]:
                _fill(run, k_per_round=None, mean_k=None, decode_tokens_per_s_repeats=None, forced=0)
                if isinstance(run, dict):
                    _fill(run.get("divergence"), logit_ulp=None)
        for peer in _dicts(pair.get("peers")):
            _fill(peer, decode_tokens_per_s=None, agreement=None, weights=None, same_weights=None)
            _fill(peer, rss_growth_mb=None, n_ctx=None)
        for config in _dicts(pair.get("configs")):
            _fill(config, mean_k=None, replayed=None)
        _fill(pair.get("auto"), vs_best_fixed_by_category=None, replayed=None)
        for summary in _dicts(pair.get("peer_summary")):
            _fill(summary, decode_vs_plain=None, agreement=None, weights=None, same_weights=None)
            _fill(summary, rss_growth_mb=None, n_ctx=None)
    return out


def _fill(obj, **defaults) -> None:
    """Set each absent key of obj (when it is a dict) to its default."""
    if isinstance(obj, dict):
        for key, value in defaults.items():
            obj.setdefault(key, value)


def _dicts(items) -> list[dict]:
    """The dicts in a list not validated yet (anything else is validation's to name)."""
    return [item for item in items if isinstance(item, dict)] if isinstance(items, list) else []
