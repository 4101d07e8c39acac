"""A markdown report of a bench results file (see specdec.bench.results); it reads only the file.

Up front the environment and the settings, then per (target, drafter) pair: its precision and
kernels, the resident memory its models took, the measured costs and the roofline, one row per draft
length k (alpha, tau, acceptance by position, measured speed-up, exactness, both predictions and
their errors), the best k three ways, speed-up by category, the replayed speed-ups
(specdec.bench.replay), peers, and any divergence from plain greedy decoding.
"""

from __future__ import annotations

import math

from specdec.bench.results import k_order
from specdec.exactness import near_tie

AUTO_NOTE = "0..8 tokens, from the costs and acceptance measured while generating"


def _nan(x) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def _f(x, spec: str = ".2f") -> str:
    """A number, or "-" for a missing or NaN one."""
    return "-" if _nan(x) else format(x, spec)


def _ms(x) -> str:
    return _f(x, ".3g")


def _x(x) -> str:
    """A speed-up: 1.23x."""
    return "-" if _nan(x) else f"{x:.2f}x"


def _pct(x) -> str:
    """A relative error: +12%."""
    return "-" if _nan(x) else f"{round(x * 100):+d}%"  # round() first: no "-0%"


def _count(pair) -> str:
    """[n, m] as n/m; "-" when nothing was compared."""
    if not pair or not pair[1]:
        return "-"
    return f"{pair[0]}/{pair[1]}"


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list], align: str | None = None) -> list[str]:
    """Markdown table lines; `align` is one of 'l' / 'r' per column (default: first left, rest right)."""
    align = align or "l" + "r" * (len(header) - 1)
    lines = [
        "| " + " | ".join(_cell(h) for h in header) + " |",
        "|" + "|".join(":---" if a == "l" else "---:" for a in align) + "|",
    ]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def _pair_name(pair: dict) -> str:
    return f"{pair['target']} / {pair['drafter']}" + (f" ({pair['draft']})" if pair.get("draft") else "")


def _header(results: dict) -> list[str]:
    env, st = results["environment"], results["settings"]
    temperature = st["temperature"]
    out = [
        "# specdec bench report",
        "",
        f"Results file schema `{results['schema']}` version {results['schema_version']}, created {results['created']}.",
        "",
        "## Environment",
        "",
    ]
    out += _table(
        ["", ""],
        [
            ["CPU", env["cpu"]],
            ["GPU", env["gpu"] or "none"],
            ["threads", env["threads"]],
            ["Python", env["python"]],
            ["torch", env["torch"]],
            ["transformers", env["transformers"]],
            ["platform", env["platform"]],
            ["git commit", env["git_commit"] or "unknown"],
        ],
        "ll",
    )
    out += ["", "## Settings", ""]
    rows = [
        ["workload", st["workload"]],
        ["categories", ", ".join(st["categories"]) or "-"],
        ["prompts per category (limit)", st["limit"]],
        ["max new tokens", st["max_new_tokens"]],
        ["temperature", f"{temperature:g}" + (" (greedy)" if temperature == 0 else " (sampling)")],
        ["draft lengths k", ", ".join(str(k) for k in st["ks"])],
        ["quick", "yes" if st["quick"] else "no"],
        ["repeats", st["repeats"]],
    ]
    if st["interleave"] is not None:
        rows.append(["a prompt's configs", "together, round by round" if st["interleave"] else "one after another"])
    out += _table(["", ""], rows, "ll")
    out += [
        "",
        "Speeds are decode-only tokens/s (prefill excluded); a speed-up is the median over prompts of "
        "speculative / plain tokens/s measured in the same run (with repeats, each prompt's median run "
        "per config counts). α = accepted / drafted tokens; τ = new "
        "tokens per round, the recovered or bonus token included. A prediction is made per "
        "prompt from that run's acceptance; its error is (predicted - measured) / measured for each prompt, "
        "and the table gives the median of those errors beside the median prediction.",
    ]
    return out


def _memory(pair: dict) -> list[str]:
    """Resident memory of each model's load (specdec.bench.memory), where the file records it."""
    rows = []
    for key, who in (("memory", pair["target"]), ("draft_memory", pair.get("draft"))):
        m = pair.get(key)
        if not m:
            continue
        rows.append(
            [
                f"{'draft' if key == 'draft_memory' else 'target'} {who}",
                _f(m.get("rss_growth_mb"), ".0f"),
                _f(m.get("file_mb"), ".0f"),
                _f(m.get("growth_per_file_byte"), ".2f"),
                _f(m.get("file_resident_mb"), ".0f"),
                _f(m.get("other_mb"), ".0f"),
                _f(m.get("rss_after_mb"), ".0f"),
                _f(m.get("peak_rss_mb"), ".0f"),
            ]
        )
    if not rows:
        return []
    return (
        ["### Resident memory", ""]
        + _table(
            [
                "model",
                "RSS growth MB",
                "GGUF file MB",
                "growth / file",
                "file resident MB",
                "other MB",
                "RSS after MB",
                "peak RSS MB",
            ],
            rows,
        )
        + [
            "",
            "RSS growth: the process's resident set after the load and a warm-up forward (its KV cache freed), "
            "minus before the load: the weights as the backend keeps them, and whatever the load used for the "
            "first time (tokenizer, kernels, library code). A GGUF file run at its own precision is memory-mapped: "
            "file resident is its pages mapped in, other the rest of the growth (matrices regrouped at load are "
            "copies there, their file pages released). Peak RSS: the process's highest "
            "so far (the interpreter, torch and the bandwidth probe included).",
        ]
    )


def _costs(pair: dict) -> list[str]:
    costs = pair["costs"]
    curve = sorted((int(n), v) for n, v in costs["verify_ms"].items())
    v1 = dict(curve).get(1)
    out = [f"### Costs (ms, medians, at a context of {costs['context_tokens']} tokens)", ""]
    out += _table(["n", "V(n) ms", "V(n)/V(1)"], [[n, _ms(v), _f(v / v1 if v1 else float("nan"))] for n, v in curve])
    header = ["k", "draft ms per proposal", "draft ms per drafted token", "c = per token / V(1)"]
    rows = []
    for k, ms in sorted((int(k), v) for k, v in costs["draft_ms"].items()):
        rows.append([k, _ms(ms), _ms(ms / k if k else float("nan")), _f(_ratio_at(costs, k), ".3g")])
    if rows:
        out += [""] + _table(header, rows)
    out += ["", f"Overhead per round (outside draft and verify): {_ms(costs['overhead_ms'])} ms."]
    roof = costs.get("roofline")
    if roof:
        frac = roof["fraction"]
        widest = max(frac, key=int)
        screened = " (its output layer screened)" if roof.get("screened_output_layer") else ""
        out += [
            "",
            f"Roofline ({pair['backend']} backend, {roof['weights'] or pair['precision']}): a one-token forward "
            f"reads{screened} {roof['weight_mb']:.0f} MB of weights; at the {roof['bandwidth_gbs']:.1f} GB/s measured "
            f"here that takes at least {_ms(roof['floor_ms'])} ms. V(1) reaches {frac['1']:.0%} of that floor, "
            f"V({widest}) {frac[widest]:.0%}.",
        ]
    row = costs.get("row_cost")
    if row:
        out += [
            "",
            f"An added row ({row['kernel']} kernel): {_ms(row['marginal_ms'])} ms (the slope of V(n)); its "
            f"{row['macs_per_row'] / 1e6:.0f} M multiply-adds take {_ms(row['peak_ms'])} ms at the "
            f"{row['peak_gmacs']:.0f} G/s this CPU's product instruction reached alone"
            + (f": {row['fraction']:.0%} of that peak." if row.get("fraction") else "."),
        ]
        widest = max(n for n, _ in curve)
        if v1 and widest > 1:  # no kernel on this CPU can make n rows cheaper than their arithmetic
            floor = 1 + (widest - 1) * row["peak_ms"] / v1
            out[-1] += f" At that peak V({widest})/V(1) can be no less than {floor:.2f} at this V(1)."
    if pair.get("products"):
        out += ["", f"Matrix products (fp32, CPU): {pair['products']}."]
    elif pair.get("kernel"):
        out += ["", f"Matrix products: {pair['kernel']}."]
    if pair.get("draft_kernel"):
        out += ["", f"Draft model's matrix products: {pair['draft_kernel']}."]
    for key, who in (("padded_rows", "target"), ("draft_padded_rows", "draft")):
        table = pair.get(key)
        if table:
            out += [
                "",
                f"Row padding ({who}, specdec.backends.rows): a forward of n new tokens runs as more rows where "
                "oneDNN's kernel for them was timed faster: "
                + ", ".join(f"{n} -> {m}" for n, m in table.items())
                + ".",
            ]
    return out


def _configs(pair: dict) -> list[str]:
    configs = sorted(pair["configs"], key=lambda c: k_order(c["k"]))
    out = ["### Speed-up by draft length k", ""]
    rows = []
    for c in configs:
        s = c["speedup"]
        rows.append(
            [
                f"auto (mean {_f(c.get('mean_k'))})" if c["k"] == "auto" else c["k"],
                _f(c["alpha"]),
                _f(c["tau"]),
                _f(cost_ratio(pair["costs"], c), ".3g"),
                " ".join(_f(a) for a in c["acceptance_per_position"]) or "-",
                f"{_x(s['median'])} [{_f(s['min'])}..{_f(s['max'])}]",
                _count(c["identical"]),
                _x(c["predicted"]["textbook"]),
                _pct(c["error"]["textbook"]),
                _x(c["predicted"]["ours"]),
                _pct(c["error"]["ours"]),
            ]
        )
    out += _table(
        [
            "k",
            "α",
            "τ",
            "c",
            "acceptance by position",
            "speed-up median [min..max]",
            "identical",
            "textbook",
            "textbook error",
            "ours",
            "ours error",
        ],
        rows,
        "rrrrlrrrrrr",
    )
    best = pair["best_k"]
    out += ["", f"Best fixed k: measured {best['measured']}, textbook {best['textbook']}, ours {best['ours']}."]
    out += [
        "",
        "c: a drafted token's cost over the target's one-row forward V(1) (the measured draft costs at "
        "that k; auto: at its mean draft length), the cost ratio the textbook speed-up takes.",
    ]
    if pair.get("ratio_noise") is not None:
        out += [
            "",
            f"Timing noise of this run: {pair['ratio_noise'] * 100:.1f}% (the spread between repeats of one "
            "prompt's speed ratio of two fixed configs, which repeat exactly; sd, pooled; "
            "specdec.bench.run.ratio_noise).",
        ]
    auto = pair.get("auto")
    if auto:
        out += [
            "",
            f"k = auto (chosen every round, {AUTO_NOTE}): {_x(auto['vs_best_fixed'])} the speed-up of the "
            f"best fixed k ({auto['best_fixed_k']}); on its worst category ({auto['worst_category']}) "
            f"{_x(auto['worst_category_vs_plain'])} plain decoding.",
        ]
        again = auto.get("replayed")
        if again:
            out += [
                "",
                f"Replayed (the same policies on each prompt's plain output, timed by the costs above, "
                f"no timing noise; specdec.bench.replay): auto {_x(again['vs_best_fixed'])} the speed-up of the best "
                f"fixed k ({again['best_fixed_k']}); on its worst category ({again['worst_category']}) "
                f"{_x(again['worst_category_vs_plain'])} plain decoding.",
            ]
    return out


def _replayed(pair: dict) -> list[str]:
    """Per category: replayed speed-up of each k, and auto over that category's best fixed k,
    measured and replayed."""
    configs = sorted((c for c in pair["configs"] if c.get("replayed")), key=lambda c: k_order(c["k"]))
    if not configs:
        return []
    auto = pair.get("auto") or {}
    again = auto.get("replayed") or {}
    measured, replayed = auto.get("vs_best_fixed_by_category") or {}, again.get("vs_best_fixed_by_category") or {}
    rows = [
        [cat]
        + [_x(c["replayed"]["by_category"][cat]["speedup"]) for c in configs]
        + ([_x(measured.get(cat)), _x(replayed.get(cat))] if auto else [])
        for cat in configs[0]["replayed"]["by_category"]
    ]
    rows.append(
        ["all (median)"]
        + [_x(c["replayed"]["speedup"]["median"]) for c in configs]
        + ([_x(auto.get("vs_best_fixed")), _x(again.get("vs_best_fixed"))] if auto else [])
    )
    header = (
        ["category"]
        + [f"replayed k={c['k']}" for c in configs]
        + (["auto / best fixed k, measured", "auto / best fixed k, replayed"] if auto else [])
    )
    return [
        "### Replayed speed-up by category",
        "",
        "Each config replayed on the prompt's plain greedy output: the rounds a real run makes (the drafter "
        "runs), timed by the measured costs instead of the clock (specdec.bench.replay). The best fixed k is "
        "each category's own.",
        "",
    ] + _table(header, rows)


def _categories(pair: dict) -> list[str]:
    configs = sorted(pair["configs"], key=lambda c: k_order(c["k"]))
    cats: list[str] = []
    for c in configs:
        cats += [cat for cat in c["by_category"] if cat not in cats]
    if not cats:
        return []
    rows = []
    for cat in cats:
        by = [c["by_category"].get(cat, {}) for c in configs]
        rows.append([cat] + [_x(b.get("speedup")) for b in by] + [_f(b.get("alpha")) for b in by])
    header = ["category"] + [f"speed-up k={c['k']}" for c in configs] + [f"α k={c['k']}" for c in configs]
    return ["### By category", ""] + _table(header, rows)


def _peers(pair: dict) -> list[str]:
    out = []
    summary = pair.get("peer_summary") or []
    if summary:
        ours = pair["precision"]
        ctx = [p["n_ctx"] for p in summary if p.get("n_ctx")]
        rows = [
            [
                p["name"],
                _x(p["vs_plain"]),
                _x(p["vs_speculative"]),
                _x(p.get("decode_vs_plain")),
                _count(p["identical"]),
                _f(p.get("agreement")),
                _f(p.get("rss_growth_mb"), ".0f"),
                _weights(p, ours),
            ]
            for p in summary
        ]
        out += [
            "### Peers",
            "",
            "Ratios are the peer's tokens/s over ours on the same prompt ids (above 1.00x: the peer is "
            "faster): end to end (prefill included), against our plain decoding and our speculative decoding "
            "(the best fixed k, else k = auto); decode only "
            "(after the first new token), where the peer gives the split, against our plain decoding. "
            '"same output": prompts whose greedy tokens equal our plain output; "common prefix": the share of '
            "our plain output the peer reproduced before its first differing token (mean over prompts). This "
            "is agreement, not an exactness check: even on the same weights, other kernels round differently "
            "and a near-tie of the top two logits can go either way; llama.cpp rounds the activations to 8 bits in "
            "its own blocks before its quantized products (as our int8 path does, in other blocks), so its logits "
            "differ from ours by more than the rounding of sums. "
            "RSS MB: resident memory the peer's load added to the process it runs in"
            + (f" (llama.cpp's own process, its KV cache for {ctx[0]} tokens included)" if ctx else "")
            + ".",
            "",
        ]
        out += _table(
            [
                "peer",
                "vs our plain",
                "vs our speculative",
                "decode vs our plain",
                "same output",
                "common prefix",
                "RSS MB",
                "weights",
            ],
            rows,
            "lrrrrrrl",
        )
        best = pair.get("best_peer")
        if best and len(best["peers"]) > 1:
            ours = best["speculative_over_best"]
            out += [
                "",
                f"The fastest of {', '.join(best['peers'])} on each prompt ran at {_x(best['vs_plain'])} our plain "
                "decoding end to end"
                + (f"; our speculative decoding ran at {_x(ours)} its speed" if ours is not None else "")
                + " (medians over prompts).",
            ]
    failed = [p for p in pair.get("peers") or [] if p.get("error")]
    if failed:
        out += ["", "Peer runs that failed:", ""]
        out += [f"- {p['name']} on `{p['prompt_id']}`: {p['error']}" for p in failed]
    return out


def _weights(peer: dict, ours: str) -> str:
    """What the peer ran, beside ours: "same (gguf Q4_1+Q8_0)" or "float32 (ours: gguf ...)"."""
    weights = peer.get("weights")
    if not weights:
        return "-"
    return f"same ({weights})" if peer.get("same_weights") else f"{weights} (ours: {ours})"


def _in_ulp(d: dict) -> str:
    """ " = 2 ulp of the logits' dtype: a near-tie" for a divergence that records its ulp (files
    before it do not)."""
    gap, ulp = d.get("logit_gap"), d.get("logit_ulp")
    if gap is None or ulp is None or not ulp > 0:
        return ""
    return f" = {gap / ulp:.3g} ulp of the logits' dtype" + (
        ": a floating-point near-tie" if near_tie(gap, ulp) else ""
    )


def _divergences(pair: dict) -> list[str]:
    items = []
    for prompt in pair["prompts"]:
        for k, run in sorted(prompt["runs"].items(), key=lambda kv: k_order(kv[0] if kv[0] == "auto" else int(kv[0]))):
            if run.get("identical") is False:
                d = run.get("divergence") or {}
                where = (
                    f"first differing token at position {d['position']} (plain {d['plain_token']}, "
                    f"speculative {d['other_token']}), top-2 logit gap {_f(d.get('logit_gap'), '.2g')}" + _in_ulp(d)
                    if d
                    else "no divergence recorded"
                )
                items.append(f"- `{prompt['id']}`, k = {k}: {where}")
    if not items:
        return []
    return ["### Divergences from plain greedy decoding", ""] + items


def markdown_report(results: dict) -> str:
    """The report of a loaded results file, as markdown text: environment and settings, then per
    pair its costs, the per-k table, best k, by-category table, peers and divergences."""
    out = _header(results)
    for pair in results["pairs"]:
        draft = pair["draft_precision"]
        out += [
            "",
            f"## {_pair_name(pair)}",
            "",
            f"precision {pair['precision']}, backend {pair['backend']}, device {pair['device']}, "
            f"workload {pair['workload']}, {len(pair['prompts'])} prompts"
            + (f"; draft precision {draft}" if draft else "")
            + (f"; draft vocabulary {pair['draft_vocab']:,} tokens" if pair.get("draft_vocab") else "")
            + ".",
            "",
        ]
        for section in (
            _memory(pair),
            _costs(pair),
            _configs(pair),
            _categories(pair),
            _replayed(pair),
            _peers(pair),
            _divergences(pair),
        ):
            if section:
                out += section + [""]
    return "\n".join(out).rstrip() + "\n"


def cost_ratio(costs: dict, config: dict) -> float:
    """c, the cost ratio of a config: a drafted token's ms over the target's one-row forward V(1),
    from the measured draft costs at its k (k = "auto": at its mean draft length, rounded, at least 1;
    NaN where nothing was measured)."""
    k = config["k"] if config["k"] != "auto" else max(1, round(config.get("mean_k") or 1))
    measured = [int(n) for n in costs["draft_ms"]]
    return _ratio_at(costs, min(measured, key=lambda m: abs(m - k))) if measured else float("nan")


def _ratio_at(costs: dict, n: int) -> float:
    """A drafted token's ms over V(1) when drafting n tokens (costs as in the results file)."""
    v1 = costs["verify_ms"].get("1") or costs["verify_ms"].get(1)
    ms = costs["draft_ms"].get(str(n), costs["draft_ms"].get(n))
    return ms / n / v1 if n and v1 and ms is not None else float("nan")
