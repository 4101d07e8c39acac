"""Choosing which decoder layers a layer-skip draft keeps (`specdec calibrate-skip`).

The search is a greedy one (Draft & Verify, Zhang et al. 2023, searches the same space with Bayesian
optimisation) made cheap: starting from all layers, drop one layer at a time, each time the one
whose removal keeps the draft's acceptance highest, down to max_keep layers and on while that
improves the estimated speed-up; then keep the point of that path, among those with at most
max_keep layers, with the best estimated speed-up.

Acceptance is measured without running speculative decoding. With greedy verification a round
accepts drafted tokens exactly as long as the draft's argmax agrees with the target's next token
(while every earlier one was accepted the draft saw the true prefix), so one teacher-forced
forward of the draft over prompt + the target's own greedy output gives, per position, whether a
draft there is right, and from that τ (mean accepted length, bonus included) for draft length k
follows exactly. Candidates reuse the hidden states of the layers before the removed one.

The estimated speed-up per round is τ / (k·c + v): c is the draft's cost per token relative to the
target (kept decoder parameters plus the output layer, over the target's: decoding at batch 1 is
memory-bound), v the target's cost to verify k+1 tokens relative to one (timed here, or given).

The prompts are the package's own (specdec/data/calibration_prompts.jsonl), not a benchmark's. The
chosen layers are written atomically to <cache>/layer-skip/<model>.json, which LayerSkipDrafter
reads by model name. Registry models also have a calibration shipped in the package
(specdec/data/layer-skip/<model>.json); a model with neither is calibrated at the first use of
its layer-skip draft (skip_layers_for), once, and the result cached.
"""

from __future__ import annotations

import hashlib
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from pathlib import Path

import torch
from tqdm import tqdm

from specdec.cache import new_cache
from specdec.models.load import Model
from specdec.models.skip import build_view, decoder_layers, parse_layers
from specdec.models.weights import atomic_write, cache_dir

SCHEMA = "specdec.layer-skip/1"
SHIPPED = resources.files("specdec").joinpath("data", "layer-skip")  # calibrations that ship with the package


def calibration_prompts() -> list[str]:
    """The packaged calibration prompts (12 short texts over Spec-Bench-like task kinds)."""
    text = resources.files("specdec").joinpath("data/calibration_prompts.jsonl").read_text()
    return [json.loads(line)["text"] for line in text.splitlines() if line.strip()]


def _file_name(model_name: str) -> str:
    """<model>.json for a registry name; a path or hub id gets a safe name and a hash of itself."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", model_name).strip("._") or "model"
    if safe != model_name:  # a path or hub id: keep distinct names distinct
        safe += "-" + hashlib.sha256(model_name.encode()).hexdigest()[:8]
    return f"{safe}.json"


def skip_file(model_name: str, cache=None) -> Path:
    """Where the calibration of `model_name` (a registry name, path or hub id) is stored."""
    return cache_dir(cache) / "layer-skip" / _file_name(model_name)


def _read_layers(file, n_layers: int) -> list[int] | None:
    """The layers a calibration file (a Path or a package resource) keeps, or None when it is
    missing, unreadable, or made for another schema or another number of decoder layers."""
    try:
        data = json.loads(file.read_text())
        if data.get("schema") != SCHEMA or data.get("n_layers") != n_layers:
            return None
        return parse_layers(data["layers"], n_layers)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def save_skip_layers(result: dict, cache=None) -> Path:
    """Write a calibration result (as calibrate_skip returns it) atomically: to a temporary file in
    the same folder, then renamed, so a reader never sees a partial file. Returns the path."""
    path = skip_file(result["model"], cache)

    def write(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)

    return atomic_write(path, write)


def skip_layers_for(target: Model, cache=None) -> list[int]:
    """The layers a layer-skip draft of `target` keeps when none are given: the calibration stored
    in the cache, else the one shipped with the package (registry models), else one made now with
    calibrate_skip's defaults, saved to the cache and so made once. Calibrating says so on stderr
    and shows its progress there. A stored or shipped file made for another number of decoder
    layers, or unreadable, counts as none."""
    n_layers = len(decoder_layers(target.hf))
    path = skip_file(target.name, cache)
    for file in (path, SHIPPED.joinpath(_file_name(target.name))):
        layers = _read_layers(file, n_layers)
        if layers is not None:
            return layers
    print(
        f"calibrating layer-skip for {target.name}: choosing the decoder layers its draft keeps (once; "
        f"progress below); cached at {path}",
        file=sys.stderr,
    )
    result = calibrate_skip(target, bar=True)
    save_skip_layers(result, cache)
    return result["layers"]


def simulated_tau(matches: list[bool], k: int) -> tuple[int, int]:
    """Rounds and accepted tokens of greedy speculative decoding with draft length k over one
    output, given whether the draft's token at each output position would be right.

    matches: (n,) for the n output tokens. Each round drafts min(k, tokens left - 1), accepts the
    leading right ones and commits one more, as specdec.engine does; τ = n / rounds."""
    n, i, rounds, accepted = len(matches), 0, 0, 0
    while i < n:
        kk = min(k, n - i - 1)
        a = 0
        while a < kk and matches[i + a]:
            a += 1
        rounds, accepted, i = rounds + 1, accepted + a, i + a + 1
    return rounds, accepted


def greedy_reference(target: Model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The target's plain greedy output after `prompt`: the tokens specdec.engine.generate gives
    with no drafter, by the same forward over the same KV cache (greedy reads only the argmax), up
    to max_new_tokens, an end-of-sequence token (kept) or the end of the context."""
    kv = new_cache(target)
    kv.argmax_only = True  # as the engine's greedy path: the lean output layer is screened
    if len(prompt) > 1:
        kv.extend(prompt[:-1], all_logits=False)  # the cache holds all committed tokens but the last
    out: list[int] = []
    last = prompt[-1]
    while len(out) < max_new_tokens and len(prompt) + len(out) < target.n_ctx:
        last = int(kv.extend([last])[-1].argmax())  # logits (1, V)
        out.append(last)
        if last in target.eos_token_ids:
            break
    return out


@torch.inference_mode()
def _run_from(view: Model, inputs: torch.Tensor, n_out: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Run the view's layers on hidden states `inputs` (1, T, H): its argmax (n_out,) over the last
    n_out positions, and the hidden state entering each of its layers."""
    out = view.hf(inputs_embeds=inputs, use_cache=False, output_hidden_states=True, logits_to_keep=n_out)
    return out.logits[0].argmax(-1), list(out.hidden_states[: len(view.hf.model.layers)])


def draft_cost_ratio(target: Model, kept: list[int]) -> float:
    """c: the draft's cost per token relative to the target's, by parameter count (kept decoder
    layers plus the output layer, over all layers plus the output layer)."""
    size = [sum(p.numel() for p in layer.parameters()) for layer in decoder_layers(target.hf)]
    head = target.hf.get_output_embeddings().weight.numel()
    return (sum(size[i] for i in kept) + head) / (sum(size) + head)


def verify_cost_ratio(target: Model, k: int, context: list[int], repeats: int = 7) -> float:
    """v: the target's time to score k+1 tokens over its time for one, on a KV cache holding
    `context` (medians, the two timed alternately)."""
    kv = new_cache(target)
    kv.argmax_only = True  # greedy decoding's forward (specdec.backends.screen)
    kv.extend(context, all_logits=False)
    n = len(kv)
    times: dict[int, list[float]] = {1: [], k + 1: []}
    for i in range(repeats + 1):  # the first pass warms up
        for width in times:
            start = time.perf_counter()
            kv.extend(context[:width])
            if i:
                times[width].append(time.perf_counter() - start)
            kv.rollback(n)
    return statistics.median(times[k + 1]) / statistics.median(times[1])


@dataclass(frozen=True)
class CalibrateConfig:
    """What `specdec calibrate-skip` is asked for; calibrate_skip checks it.

    prompts: texts (None: the packaged calibration prompts), wrapped in the chat template when
    chat and the model has one. k: draft length the estimate assumes (>= 1). max_new_tokens:
    length of the target's greedy output per prompt that acceptance is measured on (>= 2). beam:
    after the first step (which tries every layer), try only the `beam` layers whose removal
    scored best when last tried (0: every layer at every step, the exact greedy search, about
    L/beam times slower). max_keep: the choice keeps at most this many of the L layers (None:
    L - 1; Draft & Verify skips about half the layers of 13B models, but on a small model each
    layer matters more and the output layer alone is a large share of a step, see
    docs/drafters.md). patience: once within max_keep layers, stop after this many steps without
    a better estimate (>= 1). verify_ratio: v, None to time it."""

    prompts: tuple[str, ...] | None = None
    k: int = 4
    max_new_tokens: int = 32
    beam: int = 4
    max_keep: int | None = None
    patience: int = 3
    verify_ratio: float | None = None
    chat: bool = True


def calibrate_skip(
    target: Model,
    config: CalibrateConfig | None = None,
    progress: Callable[[str], None] | None = None,
    bar: bool = False,
) -> dict:
    """Pick the decoder layers a layer-skip draft of `target` keeps as `config` says
    (CalibrateConfig; its defaults when None); see the module docstring. progress: called with a
    line per step. bar: show progress bars on stderr, over the reference prompts, then over the
    search's steps (at most L - 1).

    Returns a dict (schema specdec.layer-skip/1): model, n_layers, layers (the choice), tau,
    est_speedup, draft_cost, verify_ratio, k, the settings, and `path`: every step's layers, τ
    and estimated speed-up. Raises ValueError on k < 1, max_new_tokens < 2, beam < 0, patience < 1,
    max_keep outside 1..L-1, or no prompts.
    """
    c = config or CalibrateConfig()
    n_layers = len(decoder_layers(target.hf))
    max_keep = n_layers - 1 if c.max_keep is None else c.max_keep
    if c.k < 1 or c.max_new_tokens < 2 or c.beam < 0 or c.patience < 1 or not 1 <= max_keep < n_layers:
        raise ValueError(
            f"need k >= 1, max_new_tokens >= 2, beam >= 0, patience >= 1 and 1 <= max_keep < {n_layers} "
            f"(the layers); got k={c.k}, max_new_tokens={c.max_new_tokens}, beam={c.beam}, patience={c.patience}, "
            f"max_keep={max_keep}"
        )
    prompts = calibration_prompts() if c.prompts is None else list(c.prompts)
    if not prompts:
        raise ValueError("no calibration prompts")
    say = progress or (lambda line: None)
    use_chat = c.chat and bool(getattr(target.tokenizer, "chat_template", None))
    started = time.perf_counter()
    seqs = _reference_outputs(target, prompts, use_chat, c.max_new_tokens, bar)
    say(
        f"reference outputs: {len(seqs)} prompts, {sum(len(o) for _, o in seqs)} tokens "
        f"({time.perf_counter() - started:.0f} s)"
    )
    v = c.verify_ratio if c.verify_ratio is not None else verify_cost_ratio(target, c.k, seqs[0][0][0].tolist())
    estimate = _Estimate(target, c.k, v)

    def log(line: str) -> None:
        say(f"{line} ({time.perf_counter() - started:.0f} s)")

    path = _search(estimate, seqs, c, max_keep, log, bar)
    best = max((p for p in path if len(p["layers"]) <= max_keep), key=lambda p: p["est_speedup"])
    return {
        "schema": SCHEMA,
        "model": target.name,
        "n_layers": n_layers,
        "layers": best["layers"],
        "tau": best["tau"],
        "est_speedup": best["est_speedup"],
        "draft_cost": best["draft_cost"],
        "verify_ratio": v,
        "k": c.k,
        "max_new_tokens": c.max_new_tokens,
        "prompts": len(seqs),
        "beam": c.beam,
        "max_keep": max_keep,
        "patience": c.patience,
        "chat": use_chat,
        "seconds": time.perf_counter() - started,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "path": path,
    }


def _reference_outputs(
    target: Model, prompts: list[str], chat: bool, max_new_tokens: int, bar: bool
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The target's own greedy outputs, what a draft has to agree with: per prompt whose output
    has >= 2 tokens, (ids (1, T) = prompt + output[:-1], output (n,)). Raises ValueError when
    there is none."""
    seqs = []
    for text in tqdm(prompts, desc="reference outputs", unit="prompt", disable=not bar):
        ids = target.encode(text, chat=chat)
        out = greedy_reference(target, ids, max_new_tokens)
        if len(out) >= 2:
            seqs.append((torch.tensor([ids + out[:-1]]), torch.tensor(out)))
    if not seqs:
        raise ValueError("the target ended every calibration prompt at once: nothing to measure on")
    return seqs


@dataclass(frozen=True)
class _Estimate:
    """τ and the estimated speed-up τ / (k·c + v) of a set of kept layers."""

    target: Model
    k: int
    v: float

    def tau(self, matches: list[list[bool]]) -> float:
        """τ over outputs whose positions the draft gets right or not (simulated_tau)."""
        return sum(len(m) for m in matches) / sum(simulated_tau(m, self.k)[0] for m in matches)

    def point(self, kept: list[int], tau: float) -> dict:
        """A step of the search's path: its layers, τ, estimated speed-up and draft cost c."""
        c = draft_cost_ratio(self.target, kept)
        return {"layers": list(kept), "tau": tau, "est_speedup": tau / (self.k * c + self.v), "draft_cost": c}


def _search(estimate: _Estimate, seqs: list, config: CalibrateConfig, max_keep: int, log, bar: bool) -> list[dict]:
    """The greedy search's path from all layers (module docstring): one point per step, each
    dropping the tried layer whose removal keeps τ highest; log is called with a line per step."""
    target = estimate.target
    kept = list(range(len(decoder_layers(target.hf))))
    path = [estimate.point(kept, estimate.tau([[True] * len(out) for _, out in seqs]))]
    with torch.inference_mode():  # per prompt: the hidden state entering each kept layer
        embed = target.hf.get_input_embeddings()
        inputs = [_run_from(build_view(target, kept), embed(ids), 1)[1] for ids, _ in seqs]
    last_tau: dict[int, float] = {}  # layer -> τ when it was last tried for removal
    best_est, stale = float("-inf"), 0  # best estimate within max_keep, steps since it improved
    steps = tqdm(total=len(kept) - 1, desc="layer search", unit="step", disable=not bar)
    while len(kept) > 1 and stale < config.patience:
        beam = config.beam
        tried = kept if beam == 0 or not last_tau else sorted(kept, key=lambda j: -last_tau[j])[:beam]
        drop, inputs = _best_removal(estimate, kept, tried, inputs, seqs, last_tau)
        kept = [j for j in kept if j != drop]
        path.append(estimate.point(kept, last_tau.pop(drop)))
        if len(kept) <= max_keep:
            stale = 0 if path[-1]["est_speedup"] > best_est else stale + 1
            best_est = max(best_est, path[-1]["est_speedup"])
        log(
            f"drop layer {drop:>3}: {len(kept):>3} left, tau {path[-1]['tau']:.2f}, "
            f"est. speed-up {path[-1]['est_speedup']:.2f}x"
        )
        steps.set_postfix_str(f"{len(kept)} layers, est. speed-up {path[-1]['est_speedup']:.2f}x", refresh=False)
        steps.update()
    steps.close()
    return path


def _best_removal(estimate: _Estimate, kept: list[int], tried: list[int], inputs: list, seqs: list, last_tau: dict):
    """Of the layers `tried`, the one whose removal from `kept` keeps τ highest, and the hidden
    states entering each layer left, per prompt; records every tried layer's τ in last_tau."""
    best = None
    for j in tried:
        i = kept.index(j)
        rest = build_view(estimate.target, kept[i + 1 :])  # the layers after j, fed the state entering j
        runs = [_run_from(rest, hs[i], len(out)) for hs, (_, out) in zip(inputs, seqs)]
        last_tau[j] = estimate.tau([(pred == out).tolist() for (pred, _), (_, out) in zip(runs, seqs)])
        if best is None or last_tau[j] > last_tau[best[0]]:
            best = (j, [hs[:i] + after for hs, (_, after) in zip(inputs, runs)])
    return best
