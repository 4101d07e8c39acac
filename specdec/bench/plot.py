"""Figures from a bench results file (see specdec.bench.results): PNGs drawn with matplotlib's Agg
backend, without running any model. Five figures per (target, drafter) pair:

- `<slug>_acceptance_vs_k.png`: acceptance rate alpha and mean accepted length tau vs k;
- `<slug>_speedup_vs_k.png`: measured speed-up vs k beside the textbook and our predictions;
- `<slug>_acceptance_by_position.png`: acceptance by draft position, one line per k;
- `<slug>_verify_cost.png`: the verify-cost curve V(n) against V(1)*n and a flat V(1);
- `<slug>_speedup_by_category.png`: speed-up per workload category, one bar per k.
"""

from __future__ import annotations

import math
import re
from functools import partial
from pathlib import Path

from specdec.bench.results import k_order
from specdec.models.weights import atomic_write

FIGURES = ("acceptance_vs_k", "speedup_vs_k", "acceptance_by_position", "verify_cost", "speedup_by_category")


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9._]+", "-", str(text).lower()).strip("-._") or "x"


def pair_slug(pair: dict) -> str:
    """File-name prefix of a pair: `<target>_<drafter>`, plus `-<draft>` when there is a draft model."""
    drafter = pair["drafter"] + (f"-{pair['draft']}" if pair.get("draft") else "")
    return f"{_slug(pair['target'])}_{_slug(drafter)}"


def _num(x) -> float:
    return float("nan") if x is None else float(x)


def _title(pair: dict, what: str) -> str:
    drafter = pair["drafter"] + (f" ({pair['draft']})" if pair.get("draft") else "")
    return f"{what}\n{pair['target']} / {drafter} on {pair['workload']}"


def _save(fig, path: Path) -> Path:
    """Write the figure as PNG, atomically (specdec.models.weights.atomic_write)."""
    return atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))


def _new_figure(size=(7.0, 5.2)):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _legend(ax, handles=None, ncols: int = 2) -> None:
    """A legend below the axes, where it cannot hide data."""
    kw = {"handles": handles} if handles else {}
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncols=ncols, fontsize="small", frameon=False, **kw)


def _no_data(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} in the results", ha="center", va="center", transform=ax.transAxes)


def _k_axis(ax, ks: list[int]) -> None:
    ax.set_xlabel("draft length k (tokens)")
    if ks:
        ax.set_xticks(ks)
        ax.set_xlim(min(ks) - 0.5, max(ks) + 0.5)


def _split_auto(configs: list[dict]) -> tuple[list[dict], dict | None]:
    """The fixed-k configs (for a k axis) and the k = "auto" one, if any."""
    return [c for c in configs if c["k"] != "auto"], next((c for c in configs if c["k"] == "auto"), None)


def _acceptance_vs_k(pair: dict, configs: list[dict]):
    fig, ax = _new_figure()
    configs, auto = _split_auto(configs)
    ks = [c["k"] for c in configs]
    alpha = [_num(c["alpha"]) for c in configs]
    tau = [_num(c["tau"]) for c in configs]
    l1 = ax.plot(ks, alpha, "o-", color="tab:blue", label="acceptance rate α (left axis)")
    ax.set_ylabel("acceptance rate α (accepted / drafted)")
    ax.set_ylim(0, 1.05)
    ax2 = ax.twinx()
    l2 = ax2.plot(ks, tau, "s--", color="tab:orange", label="mean accepted length τ, bonus included (right axis)")
    ax2.set_ylabel("τ (tokens per round)")
    top = max([t for t in tau if not math.isnan(t)] + [1.0])
    if auto:  # k = "auto" has no single k: drawn as levels across the axis
        l1 += [
            ax.axhline(
                _num(auto["alpha"]),
                color="tab:blue",
                linestyle=":",
                label=f"α, k = auto (mean k {_num(auto.get('mean_k')):.2f})",
            )
        ]
        l2 += [ax2.axhline(_num(auto["tau"]), color="tab:orange", linestyle=":", label="τ, k = auto")]
        top = max(top, _num(auto["tau"]) if not math.isnan(_num(auto["tau"])) else 1.0)
    ax2.set_ylim(0, top * 1.1)
    _k_axis(ax, ks)
    ax.set_title(_title(pair, "Acceptance vs draft length"))
    _legend(ax, l1 + l2, ncols=1)
    if not configs:
        _no_data(ax, "configurations")
    return fig


def _speedup_vs_k(pair: dict, configs: list[dict]):
    fig, ax = _new_figure()
    configs, auto = _split_auto(configs)
    ks = [c["k"] for c in configs]
    med = [_num(c["speedup"]["median"]) for c in configs]
    lo = [m - _num(c["speedup"]["min"]) for m, c in zip(med, configs)]
    hi = [_num(c["speedup"]["max"]) - m for m, c in zip(med, configs)]
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="plain decoding (1.0)")
    ax.errorbar(
        ks,
        med,
        yerr=[lo, hi],
        fmt="o-",
        color="black",
        capsize=4,
        linewidth=1.6,
        label="measured: median, bars min..max over prompts",
    )
    ax.plot(
        ks,
        [_num(c["predicted"]["textbook"]) for c in configs],
        "^--",
        color="tab:red",
        label="predicted, textbook (V(k+1) = V(1))",
    )
    ax.plot(
        ks,
        [_num(c["predicted"]["ours"]) for c in configs],
        "s:",
        color="tab:green",
        linewidth=2,
        label="predicted, ours (measured V(n), draft, overhead)",
    )
    if auto:
        ax.axhline(
            _num(auto["speedup"]["median"]),
            color="tab:purple",
            linewidth=2,
            label=f"measured, k = auto (chosen per round, mean k {_num(auto.get('mean_k')):.2f})",
        )
    _k_axis(ax, ks)
    ax.set_ylabel("speed-up over plain decoding (×)")
    ax.set_title(_title(pair, "Speed-up vs draft length"))
    _legend(ax)
    if not configs:
        _no_data(ax, "configurations")
    return fig


def _acceptance_by_position(pair: dict, configs: list[dict]):
    fig, ax = _new_figure()
    longest = 0
    markers = "osD^vP*X"
    for i, c in enumerate(configs):  # shrinking markers of different shapes: equal points stay visible
        acc = [_num(a) for a in c["acceptance_per_position"]]
        if acc:
            ax.plot(
                range(1, len(acc) + 1),
                acc,
                "-",
                marker=markers[i % len(markers)],
                markersize=max(4.0, 11.0 - 2.0 * i),
                label=f"k = {c['k']}",
            )
            longest = max(longest, len(acc))
    ax.set_xlabel("draft position i (1 = first drafted token)")
    ax.set_ylabel("acceptance rate at position i")
    ax.set_ylim(0, 1.05)
    if longest:
        ax.set_xticks(range(1, longest + 1))
        ax.set_xlim(0.5, longest + 0.5)
        _legend(ax, ncols=min(len(configs), 4))
    else:
        _no_data(ax, "drafted tokens")
    ax.set_title(_title(pair, "Acceptance by draft position"))
    return fig


def _verify_cost(pair: dict):
    fig, ax = _new_figure()
    curve = sorted((int(n), _num(v)) for n, v in pair["costs"]["verify_ms"].items())
    if curve:
        ns = [n for n, _ in curve]
        v1 = dict(curve).get(1, curve[0][1] / curve[0][0])
        ax.plot(ns, [v for _, v in curve], "o-", color="tab:blue", linewidth=2, label="measured V(n)")
        ax.plot(ns, [v1 * n for n in ns], ":", color="tab:red", linewidth=2, label="V(1)·n (n one-token forwards)")
        ax.plot(ns, [v1] * len(ns), "--", color="gray", label="V(1) flat (the textbook assumption)")
        ax.set_xticks(ns)
        ax.set_ylim(0, None)
        _legend(ax, ncols=1)
    else:
        _no_data(ax, "verify costs")
    ax.set_xlabel("new tokens n in one target forward")
    ax.set_ylabel("verify time V(n) (ms)")
    ctx = pair["costs"].get("context_tokens")
    ax.set_title(_title(pair, f"Verify cost (context {ctx} tokens)"))
    return fig


def _speedup_by_category(pair: dict, configs: list[dict], categories: list[str]):
    fig, ax = _new_figure((max(7.0, 1.6 + 1.3 * len(categories)), 5.2))
    n = max(len(configs), 1)
    width = 0.8 / n
    for i, c in enumerate(configs):
        xs = [j + (i - (n - 1) / 2) * width for j in range(len(categories))]
        ys = [_num(c["by_category"].get(cat, {}).get("speedup")) for cat in categories]
        ax.bar(xs, ys, width=width * 0.95, label=f"k = {c['k']}")
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1, label="plain decoding (1.0)")
    ax.set_xticks(range(len(categories)), categories, rotation=20 if len(categories) > 4 else 0)
    ax.set_xlabel("workload category")
    ax.set_ylabel("median speed-up over plain decoding (×)")
    ax.set_title(_title(pair, "Speed-up by category"))
    ax.margins(y=0.15)
    _legend(ax, ncols=min(n + 1, 5))
    if not configs or not categories:
        _no_data(ax, "categories")
    return fig


def plot_results(results: dict, out_dir: Path) -> list[Path]:
    """Draw the five figures of every pair in `results` (a loaded results file) as PNGs under
    `out_dir` (created if needed); each file is written atomically. Returns the written paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    seen: dict[str, int] = {}
    for pair in results["pairs"]:
        slug = pair_slug(pair)
        seen[slug] = seen.get(slug, 0) + 1
        if seen[slug] > 1:
            slug = f"{slug}-{seen[slug]}"
        configs = sorted(pair["configs"], key=lambda c: k_order(c["k"]))
        present = [cat for c in configs for cat in c["by_category"]]
        order = list(results.get("settings", {}).get("categories") or []) + present
        categories = [cat for i, cat in enumerate(order) if cat in present and cat not in order[:i]]
        figures = {
            "acceptance_vs_k": partial(_acceptance_vs_k, pair, configs),
            "speedup_vs_k": partial(_speedup_vs_k, pair, configs),
            "acceptance_by_position": partial(_acceptance_by_position, pair, configs),
            "verify_cost": partial(_verify_cost, pair),
            "speedup_by_category": partial(_speedup_by_category, pair, configs, categories),
        }
        for name in FIGURES:
            written.append(_save(figures[name](), out_dir / f"{slug}_{name}.png"))
    return written
