"""The fit of a pair's raw measurements (no model): per k, α, τ, acceptance by position, the
speed-up per prompt and its quartiles, both predictions (specdec.bench.costmodel) with their errors,
the replayed speed-ups; the best k, how k = "auto" did, the peers' summary; and the run's noise."""

from __future__ import annotations

import itertools
import math
import statistics

from specdec.bench import costmodel


def fit(pair: dict, ks: list[int | str]) -> dict:
    """The `configs`, `best_k`, `auto` and `peer_summary` of a pair (a `pairs[i]` dict) from its raw
    measurements, for the draft lengths ks. Speed-ups and predictions are per prompt, then the median
    over prompts."""
    costs, records = pair["costs"], pair["prompts"]
    configs = [_config_fit(k, records, costs) for k in ks]
    fixed = [c for c in configs if c["k"] != "auto"]
    best = lambda key: max(fixed, key=key)["k"] if fixed else None  # noqa: E731
    best_k = best(lambda c: c["speedup"]["median"])
    return {
        "configs": configs,
        "best_k": {
            "measured": best_k,
            "textbook": best(lambda c: c["predicted"]["textbook"]),
            "ours": best(lambda c: c["predicted"]["ours"]),
        },
        "auto": _auto_summary(configs),
        "peer_summary": _peer_summary(pair["peers"], records, _speculative(records, best_k)),
        "best_peer": _best_peer(pair["peers"], records, _speculative(records, best_k)),
    }


def _speculative(records: list[dict], best_k: int | None) -> str | None:
    """The config the peers are set against as our speculative decoding: the best fixed k, else
    k = "auto" where it ran on every prompt, else None."""
    if best_k is not None:
        return str(best_k)
    return "auto" if records and all("auto" in rec["runs"] for rec in records) else None


def _config_fit(k: int | str, records: list[dict], costs: dict) -> dict:
    """One `configs[i]` entry: k's runs over the prompts, pooled, with their speed-ups, predictions,
    errors, categories and replay."""
    runs = [rec["runs"][str(k)] for rec in records]
    measured = [r["decode_tokens_per_s"] / rec["plain"]["decode_tokens_per_s"] for r, rec in zip(runs, records)]
    ours = [costmodel.our_speedup(r, k, costs) for r in runs]
    mean_k = [r["drafted"] / r["rounds"] if r["rounds"] else 0.0 for r in runs]  # tokens drafted per round
    # The textbook formula for k = "auto" is taken at the mean draft length the run chose.
    kk = mean_k if k == "auto" else [k] * len(runs)
    textbook = [costmodel.textbook_speedup(r["alpha"], n, costmodel.cost_ratio(costs, n)) for r, n in zip(runs, kk)]
    by_category = {}
    for cat, idx in _categories(records).items():
        pooled = _pooled([runs[i] for i in idx])
        by_category[cat] = {
            "alpha": pooled["alpha"],
            "tau": pooled["tau"],
            "speedup": statistics.median(measured[i] for i in idx),
        }
    identical = [r["identical"] for r in runs if r["identical"] is not None]
    return {
        "k": k,
        **_pooled(runs),
        "mean_k": statistics.fmean(mean_k),
        "speedup": _quartiles(measured),
        "identical": [sum(identical), len(identical)],
        "predicted": {"textbook": statistics.median(textbook), "ours": statistics.median(ours)},
        # Each prediction is checked against the run it predicts, then the median is taken.
        "error": {
            name: _quartiles([costmodel.relative_error(p, m) for p, m in zip(values, measured)])["median"]
            for name, values in (("textbook", textbook), ("ours", ours))
        },
        "by_category": by_category,
        "replayed": _replayed(k, records),
    }


def _replayed(k: int | str, records: list[dict]) -> dict | None:
    """k's replayed speed-ups (quartiles, by category) and τ when every prompt was replayed
    (specdec.bench.replay), else None."""
    if not (records and all(rec.get("replay") for rec in records)):
        return None
    sim = [
        rec["replay"][str(k)]["decode_tokens_per_s"] / rec["replay"]["plain"]["decode_tokens_per_s"] for rec in records
    ]
    return {
        "speedup": _quartiles(sim),
        "tau": statistics.fmean(rec["replay"][str(k)]["tau"] for rec in records),
        "by_category": {
            cat: {"speedup": statistics.median(sim[i] for i in idx)} for cat, idx in _categories(records).items()
        },
    }


def _peer_summary(peers: list[dict], records: list[dict], spec: str | None) -> list[dict]:
    """Per peer (in order of first appearance), its speed against our plain decoding and against our
    speculative config `spec` (tokens/s, medians over prompts), its exactness and agreement, weights
    and memory."""
    plain_tps = {rec["id"]: rec["plain"]["tokens_per_s"] for rec in records}
    spec_tps = {rec["id"]: rec["runs"][spec]["tokens_per_s"] for rec in records} if spec else {}
    plain_decode = {rec["id"]: rec["plain"]["decode_tokens_per_s"] for rec in records}
    summary = []
    for name in dict.fromkeys(p["name"] for p in peers):
        rows = [p for p in peers if p["name"] == name and not math.isnan(p["tokens_per_s"])]
        same = [p["identical"] for p in rows if p["identical"] is not None]
        agreement = [p["agreement"] for p in rows if p.get("agreement") is not None]
        decode = [p["decode_tokens_per_s"] / plain_decode[p["prompt_id"]] for p in rows if p.get("decode_tokens_per_s")]
        growth = [p["rss_growth_mb"] for p in rows if p.get("rss_growth_mb") is not None]
        first = rows[0] if rows else {}
        summary.append(
            {
                "name": name,
                "vs_plain": _quartiles([p["tokens_per_s"] / plain_tps[p["prompt_id"]] for p in rows])["median"],
                "vs_speculative": _quartiles([p["tokens_per_s"] / spec_tps[p["prompt_id"]] for p in rows])["median"]
                if spec_tps
                else float("nan"),
                "identical": [sum(same), len(same)],
                "agreement": statistics.fmean(agreement) if agreement else None,
                "decode_vs_plain": _quartiles(decode)["median"] if decode else None,
                "weights": first.get("weights"),
                "same_weights": first.get("same_weights"),
                "rss_growth_mb": growth[0] if growth else None,
                "n_ctx": first.get("n_ctx"),
            }
        )
    return summary


def _best_peer(peers: list[dict], records: list[dict], spec: str | None) -> dict | None:
    """The fastest peer on each prompt (end-to-end tokens/s) against our plain decoding and, ours over
    it, our speculative config `spec` (medians over the prompts every peer that ran finished); None
    without peers."""
    ran = [p for p in peers if not math.isnan(p["tokens_per_s"])]
    if not ran:
        return None
    fastest: dict[str, float] = {}
    for p in ran:
        fastest[p["prompt_id"]] = max(fastest.get(p["prompt_id"], 0.0), p["tokens_per_s"])
    timed = [rec for rec in records if rec["id"] in fastest]
    ours = [rec["runs"][spec]["tokens_per_s"] / fastest[rec["id"]] for rec in timed] if spec else []
    return {
        "peers": list(dict.fromkeys(p["name"] for p in ran)),
        "vs_plain": _quartiles([fastest[rec["id"]] / rec["plain"]["tokens_per_s"] for rec in timed])["median"],
        "speculative_over_best": _quartiles(ours)["median"] if ours else None,
    }


def _quartiles(values: list[float]) -> dict:
    """{"median", "min", "max", "q1", "q3"} of values, NaNs left out (all NaN: NaN each)."""
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return dict.fromkeys(("median", "min", "max", "q1", "q3"), float("nan"))
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "min": values[0], "max": values[-1], "q1": q[0], "q3": q[2]}


def _pooled(runs: list[dict]) -> dict:
    """α, τ and acceptance per draft position of runs pooled (their tokens summed, not their ratios
    averaged); NaN without drafts or rounds."""
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


def ratio_noise(records: list[dict]) -> float | None:
    """A run's timing noise: the standard deviation between repeats of log(speed of config a / speed
    of config b) on one prompt, pooled over prompts and pairs of fixed configs (plain decoding and
    each fixed k: runs that repeat exactly, so the spread is the host's); about the relative spread
    of one repeat's speed-up (0.03: 3%). records: a pair's `prompts` (results.PromptRecord dicts).
    None under 2 repeats."""
    variances = []
    for rec in records:
        fixed = [rec["plain"]] + [run for k, run in rec["runs"].items() if k != "auto"]
        for a, b in itertools.combinations([run["decode_tokens_per_s_repeats"] for run in fixed], 2):
            if len(a) > 1:
                variances.append(statistics.variance([math.log(x / y) for x, y in zip(a, b)]))
    return math.sqrt(statistics.fmean(variances)) if variances else None
