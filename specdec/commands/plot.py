"""`specdec plot`: draw the PNGs of a results.json (runs no model)."""

from __future__ import annotations


def run(args) -> int:
    """Draw the plots (next to results.json unless --out) and print their paths."""
    from specdec.bench import results
    from specdec.bench.plot import plot_results

    for png in plot_results(results.load(args.results), args.out or args.results.parent):
        print(png)
    return 0
