"""`specdec bench`: exactness, acceptance, costs and speed-up of speculative decoding on a workload,
with the cost model's predictions and peers, measured in one run.

For each pair (target, drafter) the bench
  1. measures the costs: V(n), one target forward over n = 1..max(k)+1 new tokens at a realistic
     KV length, and one drafter proposal of k tokens (medians after warm-up);
  2. runs, prompt by prompt, plain decoding (k = 0) and speculative decoding for every k together,
     round by round (run_all), checking greedy outputs token for token against plain decoding;
  3. runs the peers on the same model (or, for llama.cpp, the same GGUF file) and prompt ids;
  4. fits: per k, alpha, tau, acceptance by position, the median per-prompt speed-up, and both
     predictions (specdec.bench.costmodel) with their errors.
Beside the speeds it records what each model is (its precision and the kernels that ran it), the
memory roofline of its forward over the bytes it reads (specdec.bench.roofline), and the resident
memory its load took (specdec.bench.memory). Then results.json (specdec.bench.results) and a markdown
report are written; plots are a separate stage (`specdec plot`).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
from tqdm import tqdm

from specdec.adaptive import AdaptiveK, VerifyCosts
from specdec.backends import gemv
from specdec.bench import costmodel
from specdec.bench.llama_server import llama_server_generate
from specdec.bench.memory import MB, footprint, rss_bytes
from specdec.bench.peers import hf_generate, llama_cpp_generate
from specdec.bench.replay import controller, replayable
from specdec.bench.replay import replay as replay_run
from specdec.bench.results import SCHEMA, SCHEMA_VERSION, PairRecord, PeerRun, parse, validate
from specdec.bench.roofline import memory_bandwidth_gbs, roofline
from specdec.bench.rowcost import row_cost
from specdec.bench.workloads import Prompt
from specdec.cache import common_prefix, new_cache
from specdec.drafters import Drafter
from specdec.drafters.factory import REGISTERED, drafter_from_options, options_for
from specdec.engine import AUTO_K_MAX, Generation, generate, stepwise
from specdec.exactness import first_divergence
from specdec.grammar import Grammar
from specdec.models.load import Model, load_model, resolve_device, synchronize
from specdec.models.registry import REGISTRY
from specdec.models.weights import cache_dir, gguf_path
from specdec.sampling import Sampler, SamplingParams

QUICK_CATEGORIES = ["summarization", "translation", "qa", "math_reasoning", "writing"]
DRAFT_PEERS = ("hf-assisted", "llama-server-draft")  # peers that run the pair's draft model: model pairs only


@dataclass(frozen=True)
class Pair:
    """target and drafter names as the CLI takes them; draft is the draft model for `model`."""

    target: str
    drafter: str = "prompt-lookup"
    draft: str | None = None

    @classmethod
    def parse(cls, text: str) -> Pair:
        """`target[:drafter[:draft]]`, e.g. `qwen2.5-coder-1.5b:model:qwen2.5-coder-0.5b`; for
        `layer-skip` the third part is the layers to keep, e.g. `smollm2-135m:layer-skip:0-9,12`; for
        `eagle` and `eagle-tree` a draft head file (default: the target's stored head); for `suffix` and
        `suffix-tree` a corpus file (drafters.suffix.load_corpus)."""
        parts = text.split(":")
        if not 1 <= len(parts) <= 3 or (len(parts) > 1 and parts[1] == "model" and len(parts) != 3):
            raise ValueError(f"--pair {text!r}: use TARGET[:DRAFTER[:DRAFT]], DRAFT required for the model drafter")
        return cls(*parts)


def environment() -> dict:
    """Hardware and versions, for the results file."""
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = git_commit(Path(__file__).resolve().parent)
    return {
        "cpu": f"{cpu}, {os.cpu_count()} cores",
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "git_commit": commit,
    }


def git_commit(folder: Path) -> str | None:
    """The commit checked out where `folder` lies, with "-dirty" appended when files under `folder`
    differ from it, changed or new and not ignored (a bench run on uncommitted code says so); None
    outside a git checkout."""
    try:
        run = lambda *args: subprocess.run(["git", *args], capture_output=True, text=True, cwd=folder)  # noqa: E731
        head = run("rev-parse", "HEAD").stdout.strip()
        if not head:
            return None
        changed = run("status", "--porcelain", "--", ".").stdout.strip()
        return head + ("-dirty" if changed else "")
    except OSError:
        return None


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


def kernel(model: Model | None) -> str | None:
    """Which kernels ran a model's products, for the results: specdec's batch-invariant quantized
    kernels for a GGUF model run at its own precision (naming GGML types dequantized to fp32 at load,
    if any), gemv's status (specdec.backends.gemv) for the lean backend in fp32 on the CPU, else None
    (transformers' forward, bf16, a GPU: not ours to describe)."""
    if model is None:
        return None
    if model.gguf is not None:
        lean = model.lean()
        return lean.kernel + (f"; {', '.join(lean.fallback)} dequantized to fp32 at load" if lean.fallback else "")
    if model.backend == "lean" and model.device.type == "cpu" and model.precision == "float32":
        return gemv.status()
    return None


def load_measured(spec: str, greedy: bool = True, **load_kwargs) -> tuple[Model, dict]:
    """load_model(spec, **load_kwargs) and the resident memory it took (specdec.bench.memory.footprint):
    measured after the backend's weights are built and a warm-up forward over one token (the BOS
    token, else id 0) has read every matrix (a GGUF model's memory map counts only once touched), its
    KV cache freed again. greedy: warm up greedy's forward (a lean fp32 model builds its bf16 screen
    of the output layer for it)."""
    before = rss_bytes()
    model = load_model(spec, **load_kwargs)
    kv = new_cache(model)
    kv.argmax_only = greedy
    kv.extend([getattr(model.config, "bos_token_id", None) or 0], all_logits=False)
    del kv
    return model, footprint(before, model.gguf)


def _gguf_of(model: Model, spec: str, cache) -> str:
    """The GGUF file behind a model, for the llama.cpp peer: the one a GGUF model runs from (at its own
    precision), else the file of a registry name or a .gguf path (dequantized here: --dtype float32)."""
    if model.gguf is not None:
        return str(model.gguf.path)
    if spec in REGISTRY:
        return str(gguf_path(REGISTRY[spec], cache_dir(cache)))
    if spec.endswith(".gguf"):
        return spec
    raise ValueError(f"the llama.cpp peer needs a GGUF target (a registry name or a .gguf file), not {spec!r}")


@functools.cache
def _gguf_precision(path: str) -> str:
    """The GGML types of a GGUF file's matrices, as Model.precision names them ("gguf Q4_1+Q8_0"); read
    once per file, not once per prompt."""
    from specdec.models.gguf import read_gguf

    return read_gguf(Path(path)).precision


def encode_prompt(model: Model, prompt: Prompt) -> list[int]:
    """A workload prompt's token ids: in the model's chat template when the prompt is conversational
    and the model has one."""
    return model.encode(prompt.text, chat=prompt.chat and bool(getattr(model.tokenizer, "chat_template", None)))


def bench_pair(
    pair: Pair,
    prompts: list[Prompt],
    ks: list[int],
    max_new_tokens: int,
    temperature: float,
    peers: list[str],
    workload: str,
    peer_k: int = 4,
    progress: bool = True,
    bandwidth_gbs: float | None = None,
    draft_dtype: torch.dtype | None = None,
    draft_quantize: str | None = None,
    draft_vocab: int | None = None,
    repeats: int = 1,
    replay: bool = True,
    interleave: bool = True,
    **load_kwargs,
) -> PairRecord:
    """Everything for one pair: its `pairs[i]` record of results.json (specdec.bench.results.PairRecord).

    In this order: load the models, each load measured in resident memory (load_measured, _drafters);
    warm up and measure the costs (_measure); give each config its drafter (_config_drafters); the
    roofline and an added row's cost (_roofline_and_row_cost); per prompt, plain decoding and every k
    (_run_configs), checked against plain decoding (_prompt_record), then the peers (_peer_run); the
    per-round overhead; the replay (_replay); the fit (_pair_record).
    load_kwargs go to load_model; draft_dtype overrides their dtype for a draft model, draft_quantize
    their quantize (a GGUF type the draft is requantized to at load; None: its own precision; a
    head's type); draft_vocab: the drafter's vocabulary size (specdec.drafters.vocab; None: its own);
    bandwidth_gbs (measured memory bandwidth, GB/s) adds the roofline of the target's forward.
    replay: when greedy, the drafter allows it (specdec.bench.replay) and no prompt has a grammar,
    replay every config on each prompt's plain output under the measured costs: speeds without the
    machine's noise.
    interleave: run a repeat's configs together, round by round (run_all), each with a drafter of its
    own; else one after another. Raises ValueError when the record does not fit the schema."""
    greedy = temperature == 0
    cache = load_kwargs.get("cache")
    target, memory = load_measured(pair.target, greedy=greedy, **load_kwargs)
    encoded = [encode_prompt(target, p) for p in prompts]
    draft_kwargs = {**load_kwargs, "quantize": draft_quantize}
    new_drafter, draft_model, draft_memory = _drafters(pair, greedy, draft_dtype, draft_kwargs, draft_vocab)
    drafter = new_drafter()
    run = dict(max_new_tokens=max_new_tokens, temperature=temperature, seed=0)
    # The costs are measured for every fixed k, and for k = "auto" over the lengths it chooses from.
    cost_ks = sorted({k for k in ks if k != "auto"} | ({1, AUTO_K_MAX} if "auto" in ks else set()))
    costs = _measure(target, drafter, encoded, cost_ks, run)
    own, policy = _config_drafters(target, encoded[0], drafter, new_drafter, ks, max(cost_ks), run, interleave, cache)
    costs.update(_roofline_and_row_cost(target, costs["verify_ms"], bandwidth_gbs, greedy))

    # llama.cpp allocates its whole KV cache up front: room for the longest prompt and its output
    peer_ctx = min(target.n_ctx, -(-(max(map(len, encoded)) + max_new_tokens + peer_k + 16) // 256) * 256)
    peer_run = functools.partial(
        _peer_run, target=target, spec=pair.target, draft_model=draft_model, draft_spec=pair.draft,
        max_new_tokens=max_new_tokens, peer_k=peer_k, n_ctx=peer_ctx, cache=cache, greedy=greedy,
    )  # fmt: skip
    records, peer_rows, outputs = [], [], []
    bar = tqdm(
        total=len(prompts) * (len(ks) + 1 + len(peers)),
        desc=f"bench {pair.target} / {pair.drafter}",
        disable=not progress,
    )
    for prompt, ids in zip(prompts, encoded):
        # a prompt with a JSON schema: every config under its grammar (plain constrained decoding
        # the baseline); the peers run no grammar here, so they are left out of such prompts
        constrained = {**run, "grammar": Grammar.json_schema(prompt.schema)} if prompt.schema else run
        timed = _run_configs(target, ids, ks, own, policy, constrained, repeats, interleave)
        record, plain = _prompt_record(target, prompt, ids, ks, timed, greedy)
        bar.update(1 + len(ks))
        for name in peers:
            if not prompt.schema and (draft_model is not None or name not in DRAFT_PEERS):
                peer_rows.append(peer_run(name, prompt.id, ids, plain))
            bar.update()
        records.append(record)
        outputs.append(plain)
    bar.close()

    costs["overhead_ms"] = _overhead_ms(records)
    grammars = any(p.schema for p in prompts)  # a replay has no grammar: its forced tokens would be drafts
    if replay and greedy and replayable(drafter) and not grammars:
        desc = f"replay {pair.target} / {pair.drafter}"
        _replay(target, drafter, records, encoded, outputs, ks, costs, desc, progress)
    precision = draft_model.precision if draft_model else getattr(drafter, "precision", None)  # a head's
    return _pair_record(
        pair, workload, ks, target, draft_model, memory, draft_memory, costs, records, peer_rows, precision, draft_vocab
    )


def _drafters(
    pair: Pair, greedy: bool, draft_dtype: torch.dtype | None, load_kwargs: dict, vocab: int | None = None
) -> tuple[Callable[[], Drafter], Model | None, dict | None]:
    """A maker of the pair's drafters (one per config when interleaved: drafters keep per-generation
    state), and its draft model with its load's resident memory (None, None without one). The pair's
    third part fills its drafter's main option (its REGISTERED entry's `main`): a draft model (loaded once, here, in
    draft_dtype, else load_kwargs' dtype, else its own precision; the peers use it too), a corpus file,
    layers or a head file."""
    main = REGISTERED[pair.drafter].main if pair.drafter in REGISTERED else None
    source = pair.draft if main else None
    draft_model, draft_memory = None, None
    if source and main == "draft":
        dtype = draft_dtype or load_kwargs.get("dtype")  # None: the draft's own precision (load_model)
        source, draft_memory = load_measured(source, greedy, **{**load_kwargs, "dtype": dtype})
        draft_model = source
    settings = {"cache": load_kwargs.get("cache"), "quantize": load_kwargs.get("quantize"), "vocab": vocab}
    options = options_for(pair.drafter, {**settings, **({main: source} if main else {})})
    return functools.partial(drafter_from_options, pair.drafter, **options), draft_model, draft_memory


def _measure(target: Model, drafter: Drafter, encoded: list[list[int]], cost_ks: list[int], run: dict) -> dict:
    """Warm up every path once (speculative at the largest k, plain), then measure_costs at the typical
    KV length of the decode (the median prompt plus half the new tokens) on cost_context. Returns the
    costs without overhead, roofline and row cost."""
    generate(target, encoded[0], drafter, k=max(cost_ks), **{**run, "max_new_tokens": 8})
    generate(target, encoded[0], None, **{**run, "max_new_tokens": 8})
    ctx_len = int(statistics.median(len(e) for e in encoded)) + run["max_new_tokens"] // 2
    context = cost_context(drafter, encoded, min(ctx_len, target.n_ctx - max(cost_ks) - 2))
    return measure_costs(target, drafter, context, cost_ks, greedy=run["temperature"] == 0)


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


def _config_drafters(
    target: Model,
    ids: list[int],
    drafter: Drafter,
    new_drafter: Callable[[], Drafter],
    ks: list,
    warm_k: int,
    run: dict,
    interleave: bool,
    cache,
) -> tuple[dict, AdaptiveK]:
    """Each config's drafter ({k: drafter}): its own when interleaved, warmed up on `ids` at the fixed
    k warm_k (auto's policy not started), else the one `drafter`; and k = "auto"'s policy, carried
    across prompts."""
    own = {k: new_drafter() if interleave else drafter for k in ks}
    policy = AdaptiveK(VerifyCosts.for_model(target, cache), k_max=AUTO_K_MAX)
    if interleave:
        for d in own.values():  # at a fixed k: warm it without starting auto's policy
            generate(target, ids, d, k=warm_k, **{**run, "max_new_tokens": 8})
    return own, policy


def _roofline_and_row_cost(target: Model, verify_ms: dict, bandwidth_gbs: float | None, greedy: bool) -> dict:
    """{"roofline": the target's memory roofline (None without a bandwidth), "row_cost": an added
    verify row against the product instruction's peak (None off the quantized backend)}."""
    return {
        "roofline": roofline(target, verify_ms, bandwidth_gbs, greedy=greedy) if bandwidth_gbs else None,
        "row_cost": row_cost(target, verify_ms),
    }


def _run_configs(
    target: Model, ids: list[int], ks: list, own: dict, policy: AdaptiveK, run: dict, repeats: int, interleave: bool
) -> dict[str, list[Generation]]:
    """One prompt's generations by config ("plain" and each str(k)), `repeats` each: every repeat runs
    all configs (run_all), its order rotated so that no config always runs first."""
    timed: dict[str, list[Generation]] = {}
    configs = [0, *ks]  # 0: plain decoding
    for r in range(repeats):
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        steps = {
            str(k) if k else "plain": stepwise(
                target, ids, own[k] if k else None, k=k, policy=policy if k == "auto" else None, **run
            )
            for k in order
        }
        for name, spec in run_all(steps, interleave).items():
            timed.setdefault(name, []).append(spec)
    return timed


def _prompt_record(
    target: Model, prompt: Prompt, ids: list[int], ks: list, timed: dict[str, list[Generation]], greedy: bool
) -> tuple[dict, list[int]]:
    """A prompt's record (results.PromptRecord, its replay still None) from its generations, each
    config's by its median run, and plain decoding's output tokens. Greedy: every repeat of every k
    is checked token for token against plain decoding (the first that differs gives the divergence)."""
    plain = _median_run(timed["plain"])
    runs = {}
    for k in ks:
        spec = _median_run(timed[str(k)])
        d = {**spec.stats.to_dict(), "decode_tokens_per_s_repeats": _speeds(timed[str(k)])}
        d["identical"], d["divergence"] = None, None
        if greedy:
            odd = next((g for g in timed[str(k)] if g.tokens != plain.tokens), spec)
            div = first_divergence(target, ids, plain.tokens, odd.tokens)
            d["identical"], d["divergence"] = div is None, None if div is None else vars(div)
        runs[str(k)] = d
    record = {
        "id": prompt.id,
        "category": prompt.category,
        "prompt_tokens": len(ids),
        "plain": {**plain.stats.to_dict(), "decode_tokens_per_s_repeats": _speeds(timed["plain"])},
        "runs": runs,
        "replay": None,
    }
    return record, plain.tokens


def _speeds(generations: list[Generation]) -> list[float]:
    """Each generation's decode tokens/s, in the order run."""
    return [g.stats.decode_tokens_per_s for g in generations]


def _peer_run(
    name: str,
    prompt_id: str,
    ids: list[int],
    plain: list[int],
    *,
    target: Model,
    spec: str,
    draft_model: Model | None,
    draft_spec: str | None,
    max_new_tokens: int,
    peer_k: int,
    n_ctx: int,
    cache,
    greedy: bool,
) -> dict:
    """One peer's run of one prompt (specdec.bench.peers) as a `peers[i]` row (results.PeerRun), its
    output held against ours (plain: our plain decoding's tokens). A peer that fails gives a row with
    its error and NaN tokens/s: a result to report, not a reason to stop."""
    try:
        if name.startswith("llama-server"):  # llama.cpp as users serve it, its own speculation included
            gguf = _gguf_of(target, spec, cache)
            draft_gguf = _gguf_of(draft_model, draft_spec, cache) if draft_model is not None else None
            threads = torch.get_num_threads()
            peer = llama_server_generate(name, gguf, ids, max_new_tokens, threads, n_ctx, draft_gguf, peer_k)
            weights = target.precision if target.gguf is not None else _gguf_precision(gguf)
            same_weights = target.gguf is not None
        elif name.startswith("llama-cpp"):
            gguf = _gguf_of(target, spec, cache)
            k = peer_k if name == "llama-cpp-lookup" else 0
            peer = llama_cpp_generate(gguf, ids, max_new_tokens, target.eos_token_ids, n_ctx=n_ctx, k=k)
            weights = target.precision if target.gguf is not None else _gguf_precision(gguf)
            same_weights = target.gguf is not None
        else:
            peer = hf_generate(name, target, ids, max_new_tokens, draft=draft_model, k=peer_k)
            # transformers runs the model object's fp32 (or bf16) weights: a GGUF model's dequantization
            weights = str(target.hf.dtype).removeprefix("torch.")
            same_weights = target.gguf is None
        return {
            "name": name,
            "prompt_id": prompt_id,
            "tokens_per_s": peer.tokens_per_s,
            "decode_tokens_per_s": peer.decode_tokens_per_s,
            "identical": peer.tokens == plain if greedy else None,
            "agreement": _agreement(peer.tokens, plain) if greedy else None,
            "weights": weights,
            "same_weights": same_weights,
            "rss_growth_mb": None if peer.rss_growth_bytes is None else peer.rss_growth_bytes / MB,
            "n_ctx": peer.n_ctx,
            "error": None,
        }
    except Exception as e:  # a peer failing is a result to report, not a reason to stop
        error = f"{type(e).__name__}: {e}"
        return {
            **dict.fromkeys(PeerRun.model_fields),
            "name": name,
            "prompt_id": prompt_id,
            "tokens_per_s": float("nan"),
            "error": error,
        }


def _overhead_ms(records: list[dict]) -> float:
    """The fixed per-round overhead in ms: time outside draft and verify per round, the median over
    every run of every prompt."""
    per_round = [
        r["other_s"] / r["rounds"] * 1e3
        for rec in records
        for r in [rec["plain"], *rec["runs"].values()]
        if r["rounds"]
    ]
    return statistics.median(per_round)


def _replay(
    target: Model,
    drafter: Drafter,
    records: list[dict],
    encoded: list[list[int]],
    outputs: list[list[int]],
    ks: list,
    costs: dict,
    desc: str,
    progress: bool,
) -> None:
    """Set each prompt record's "replay": plain decoding and every k replayed on the prompt's plain
    output (outputs) under the measured costs (specdec.bench.replay), auto's policy carried across
    prompts as in the measured runs."""
    policy = controller(costs) if "auto" in ks else None
    for rec, ids, out in tqdm(list(zip(records, encoded, outputs)), desc=desc, disable=not progress):
        rec["replay"] = {
            str(k) if k else "plain": _brief(replay_run(target, ids, out, drafter, k, costs, policy=policy))
            for k in [0, *ks]
        }


def _pair_record(
    pair: Pair,
    workload: str,
    ks: list,
    target: Model,
    draft_model: Model | None,
    memory: dict,
    draft_memory: dict | None,
    costs: dict,
    records: list[dict],
    peer_rows: list[dict],
    draft_precision: str | None = None,
    draft_vocab: int | None = None,
) -> PairRecord:
    """The typed record of a pair: what ran (precision, kernels, memory), the raw measurements, and
    their fit (fit). Raises ValueError naming the field that does not fit the schema."""
    raw = {
        "target": pair.target,
        "drafter": pair.drafter,
        "draft": pair.draft,
        "workload": workload,
        "precision": target.precision,
        "draft_precision": draft_precision,
        "draft_vocab": draft_vocab,
        "backend": target.backend,
        "device": str(target.device),
        "kernel": kernel(target),
        "draft_kernel": kernel(draft_model),
        "products": kernel(target) if target.gguf is None else None,  # gemv's status, the fp32 lean path's
        "memory": memory,
        "draft_memory": draft_memory,
        "padded_rows": _padded_rows(target),
        "draft_padded_rows": _padded_rows(draft_model),
        "ratio_noise": ratio_noise(records),
        "costs": costs,
        "prompts": records,
        "peers": peer_rows,
    }
    return parse(PairRecord, {**raw, **fit(raw, ks)}, f"bench {pair.target} / {pair.drafter}")


def _agreement(peer: list[int], plain: list[int]) -> float:
    """The share of our plain greedy output a peer reproduced before its first differing token (1.0:
    the same tokens; both empty: 1.0)."""
    longest = max(len(peer), len(plain))
    return common_prefix(peer, plain) / longest if longest else 1.0


def _brief(stats) -> dict:
    """What results.json keeps of a replayed run (specdec.bench.replay): simulated speed, rounds, tokens."""
    return {
        "decode_tokens_per_s": stats.decode_tokens_per_s,
        "rounds": stats.rounds,
        "drafted": stats.drafted,
        "accepted": stats.accepted,
        "tau": stats.tau,
        "mean_k": stats.mean_k,
    }


def _padded_rows(model) -> dict[str, int] | None:
    """The lean backend's row table of a model (specdec.backends.rows): {n: rows a forward of n runs as}."""
    if model is None or model.backend != "lean":
        return None
    return {str(n): m for n, m in model.lean().rows.items()}


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


def ratio_noise(records: list[dict]) -> float | None:
    """A run's timing noise: the standard deviation between repeats of log(speed of config a / speed
    of config b) on one prompt, pooled over prompts and pairs of fixed configs (plain decoding and
    each fixed k: runs that repeat exactly, so the spread is the host's); about the relative spread
    of one repeat's speed-up (0.03: 3%). records: bench_pair's `prompts`. None under 2 repeats."""
    variances = []
    for rec in records:
        fixed = [rec["plain"]] + [run for k, run in rec["runs"].items() if k != "auto"]
        for a, b in itertools.combinations([run["decode_tokens_per_s_repeats"] for run in fixed], 2):
            if len(a) > 1:
                variances.append(statistics.variance([math.log(x / y) for x, y in zip(a, b)]))
    return math.sqrt(statistics.fmean(variances)) if variances else None


def _median_run(generations: list[Generation]) -> Generation:
    """Of repeated generations of one config on one prompt, the one with the median decode speed
    (the lower middle one for an even count), so that its timings are one real run's."""
    ranked = sorted(generations, key=lambda g: g.stats.decode_tokens_per_s)
    return ranked[(len(ranked) - 1) // 2]


def _quartiles(values: list[float]) -> dict:
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return {
            "median": float("nan"),
            "min": float("nan"),
            "max": float("nan"),
            "q1": float("nan"),
            "q3": float("nan"),
        }
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "min": values[0], "max": values[-1], "q1": q[0], "q3": q[2]}


def _pooled(runs: list[dict]) -> dict:
    drafted = sum(r["drafted"] for r in runs)
    accepted = sum(r["accepted"] for r in runs)
    rounds = sum(r["rounds"] for r in runs)
    width = max((len(r["drafted_at"]) for r in runs), default=0)
    at = lambda key, i: sum(r[key][i] for r in runs if i < len(r[key]))  # noqa: E731
    return {
        "alpha": accepted / drafted if drafted else float("nan"),
        "tau": sum(r["new_tokens"] for r in runs) / rounds if rounds else float("nan"),
        "acceptance_per_position": [at("accepted_at", i) / at("drafted_at", i) for i in range(width)],
    }


def fit(pair: dict, ks: list[int]) -> dict:
    """The `configs`, `best_k`, `auto` and `peer_summary` of a pair (a `pairs[i]` dict) from its raw
    measurements (no model). Speed-ups and predictions are per prompt, then the median over prompts."""
    costs, records = pair["costs"], pair["prompts"]
    configs = []
    for k in ks:
        runs = [rec["runs"][str(k)] for rec in records]
        measured = [r["decode_tokens_per_s"] / rec["plain"]["decode_tokens_per_s"] for r, rec in zip(runs, records)]
        ours = [costmodel.our_speedup(r, k, costs) for r in runs]
        mean_k = [r["drafted"] / r["rounds"] if r["rounds"] else 0.0 for r in runs]  # tokens drafted per round
        # The textbook formula for k = "auto" is taken at the mean draft length the run chose.
        kk = mean_k if k == "auto" else [k] * len(runs)
        textbook = [costmodel.textbook_speedup(r["alpha"], n, costmodel.cost_ratio(costs, n)) for r, n in zip(runs, kk)]
        speed = _quartiles(measured)
        predicted = {"textbook": statistics.median(textbook), "ours": statistics.median(ours)}
        by_category = {}
        for cat, idx in _categories(records).items():
            pooled = _pooled([runs[i] for i in idx])
            by_category[cat] = {
                "alpha": pooled["alpha"],
                "tau": pooled["tau"],
                "speedup": statistics.median(measured[i] for i in idx),
            }
        identical = [r["identical"] for r in runs if r["identical"] is not None]
        configs.append(
            {
                "k": k,
                **_pooled(runs),
                "mean_k": statistics.fmean(mean_k),
                "speedup": speed,
                "identical": [sum(identical), len(identical)],
                "predicted": predicted,
                # Each prediction is checked against the run it predicts, then the median is taken.
                "error": {
                    name: _quartiles([costmodel.relative_error(p, m) for p, m in zip(values, measured)])["median"]
                    for name, values in (("textbook", textbook), ("ours", ours))
                },
                "by_category": by_category,
            }
        )
        configs[-1]["replayed"] = None
        if records and all(rec.get("replay") for rec in records):  # the same runs replayed (specdec.bench.replay)
            sim = [
                rec["replay"][str(k)]["decode_tokens_per_s"] / rec["replay"]["plain"]["decode_tokens_per_s"]
                for rec in records
            ]
            configs[-1]["replayed"] = {
                "speedup": _quartiles(sim),
                "tau": statistics.fmean(rec["replay"][str(k)]["tau"] for rec in records),
                "by_category": {
                    cat: {"speedup": statistics.median(sim[i] for i in idx)}
                    for cat, idx in _categories(records).items()
                },
            }
    fixed = [c for c in configs if c["k"] != "auto"]
    best = lambda key: max(fixed, key=key)["k"] if fixed else None  # noqa: E731
    plain_tps = {rec["id"]: rec["plain"]["tokens_per_s"] for rec in records}
    best_k = best(lambda c: c["speedup"]["median"])
    spec_tps = {rec["id"]: rec["runs"][str(best_k)]["tokens_per_s"] for rec in records} if best_k else {}
    peer_summary = []
    plain_decode = {rec["id"]: rec["plain"]["decode_tokens_per_s"] for rec in records}
    for name in dict.fromkeys(p["name"] for p in pair["peers"]):
        rows = [p for p in pair["peers"] if p["name"] == name and not math.isnan(p["tokens_per_s"])]
        same = [p["identical"] for p in rows if p["identical"] is not None]
        agreement = [p["agreement"] for p in rows if p.get("agreement") is not None]
        decode = [p["decode_tokens_per_s"] / plain_decode[p["prompt_id"]] for p in rows if p.get("decode_tokens_per_s")]
        growth = [p["rss_growth_mb"] for p in rows if p.get("rss_growth_mb") is not None]
        peer_summary.append(
            {
                "name": name,
                "vs_plain": _quartiles([p["tokens_per_s"] / plain_tps[p["prompt_id"]] for p in rows])["median"],
                "vs_speculative": _quartiles([p["tokens_per_s"] / spec_tps[p["prompt_id"]] for p in rows])["median"]
                if spec_tps
                else float("nan"),
                "identical": [sum(same), len(same)],
                "agreement": statistics.fmean(agreement) if agreement else None,
                "decode_vs_plain": _quartiles(decode)["median"] if decode else None,
                "weights": rows[0].get("weights") if rows else None,
                "same_weights": rows[0].get("same_weights") if rows else None,
                "rss_growth_mb": growth[0] if growth else None,
                "n_ctx": rows[0].get("n_ctx") if rows else None,
            }
        )
    return {
        "configs": configs,
        "best_k": {
            "measured": best_k,
            "textbook": best(lambda c: c["predicted"]["textbook"]),
            "ours": best(lambda c: c["predicted"]["ours"]),
        },
        "auto": _auto_summary(configs),
        "peer_summary": peer_summary,
    }


def _categories(records: list[dict]) -> dict[str, list[int]]:
    """{category: indices of its prompts}, in order of first appearance."""
    out: dict[str, list[int]] = {}
    for i, rec in enumerate(records):
        out.setdefault(rec["category"], []).append(i)
    return out


def _auto_summary(configs: list[dict]) -> dict | None:
    """How k = "auto" did against the best fixed k (overall and per category) and against plain
    decoding on its worst category, from the measured speed-ups and, under "replayed", from
    the replayed ones when every config has them (specdec.bench.replay); see _auto_versus_fixed."""
    auto = next((c for c in configs if c["k"] == "auto"), None)
    if auto is None:
        return None
    fixed = {c["k"]: c for c in configs if c["k"] != "auto"}
    replayed = None
    if auto.get("replayed") and all(c.get("replayed") for c in fixed.values()):
        replayed = _auto_versus_fixed(auto["replayed"], {k: c["replayed"] for k, c in fixed.items()})
    return {**_auto_versus_fixed(auto, fixed), "replayed": replayed}


def _auto_versus_fixed(auto: dict, fixed: dict) -> dict:
    """auto's speed-ups ({"speedup": {"median"}, "by_category": {cat: {"speedup"}}}) against the fixed
    k's ({k: the same}): its median over that of the best fixed k (the best median), its speed-up
    over plain decoding on its worst category, and per category its speed-up over that category's
    best fixed k's."""
    best_k = max(fixed, key=lambda k: fixed[k]["speedup"]["median"], default=None)
    worst = min(auto["by_category"].items(), key=lambda kv: kv[1]["speedup"], default=(None, {"speedup": float("nan")}))
    return {
        "vs_best_fixed": auto["speedup"]["median"] / fixed[best_k]["speedup"]["median"] if fixed else float("nan"),
        "best_fixed_k": best_k,
        "worst_category": worst[0],
        "worst_category_vs_plain": worst[1]["speedup"],
        "vs_best_fixed_by_category": {
            cat: a["speedup"] / max(f["by_category"][cat]["speedup"] for f in fixed.values())
            for cat, a in auto["by_category"].items()
        }
        if fixed
        else {},
    }


def run_bench(
    pairs: list[Pair],
    prompts: list[Prompt],
    workload: str,
    ks: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    peers: list[str] = (),
    quick: bool = False,
    peer_k: int = 4,
    categories: list[str] | None = None,
    limit: int | None = None,
    progress: bool = True,
    repeats: int = 1,
    replay: bool = True,
    interleave: bool = True,
    **load_kwargs,
) -> dict:
    """The whole results of the given pairs and prompts, in the file's JSON form
    (specdec.bench.results.BenchResults.to_dict(), schema version SCHEMA_VERSION), validated.

    repeats: how many times each prompt is generated per config (plain, each k); a prompt's speed
    per config is its median run's. More repeats narrow the noise of a shared machine. interleave:
    a repeat runs its configs together, round by round (run_all), so that the host's slow spells
    fall on all of them alike; else one after another (plain, k1, k2, ..., then k1, k2, ..., plain:
    each repeat rotates the order; the speed ratio of two configs on one prompt then spreads several
    times more between repeats than together, figures in docs/bench.md). replay: also replay every
    config without noise where that is possible (see bench_pair). Raises ValueError on bad ks,
    repeats < 1 or an empty selection (and, naming the field, on results that do not fit the schema)."""
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {repeats}")
    if not ks or any(k != "auto" and (not isinstance(k, int) or k < 1) for k in ks):
        raise ValueError(f"--k needs draft lengths >= 1 or 'auto' (plain decoding is always measured), got {ks}")
    if not prompts:
        raise ValueError("the workload selection is empty")
    bandwidth = memory_bandwidth_gbs(resolve_device(load_kwargs.get("device", "cpu")))
    results = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "environment": {**environment(), "memory_bandwidth_gbs": bandwidth},
        "settings": {
            "workload": workload,
            "categories": sorted({p.category for p in prompts}),
            "limit": limit,
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "ks": ks,
            "quick": quick,
            "repeats": repeats,
            "peers": list(peers),
            "peer_k": peer_k,
            "replay": replay,
            "interleave": interleave,
        },
        "pairs": [
            bench_pair(
                pair,
                prompts,
                ks,
                max_new_tokens,
                temperature,
                list(peers),
                workload,
                peer_k=peer_k,
                progress=progress,
                bandwidth_gbs=bandwidth,
                repeats=repeats,
                replay=replay,
                interleave=interleave,
                **load_kwargs,
            )
            for pair in pairs
        ],
    }
    return validate(results, "run_bench").to_dict()
