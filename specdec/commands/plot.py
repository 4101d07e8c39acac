"""`specdec plot`: draw the PNGs of a results.json (runs no model)."""

from __future__ import annotations

from pathlib import Path


def run(args) -> int:
    """Draw the plots (next to results.json unless --out) and print their paths."""
    from specdec.bench import results
    from specdec.bench.plot import plot_results

    for png in plot_results(results.load(args.results), args.out or args.results.parent):
        print(png)
    return 0


def add_parser(sub) -> None:
    """The command's parser and flags, on the command line's subparsers."""
    pt = sub.add_parser("plot", help="draw the PNGs of a results.json (runs no model)")
    pt.add_argument("results", type=Path)
    pt.add_argument("--out", type=Path, help="folder for the PNGs (default: next to results.json)")
