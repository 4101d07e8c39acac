"""`specdec report`: print the markdown report of a results.json (runs no model)."""

from __future__ import annotations

from pathlib import Path


def run(args) -> int:
    """Print the report."""
    from specdec.bench import results
    from specdec.bench.report import markdown_report

    print(markdown_report(results.load(args.results)))
    return 0


def add_parser(sub) -> None:
    """The command's parser and flags, on the command line's subparsers."""
    rp = sub.add_parser("report", help="print the markdown report of a results.json (runs no model)")
    rp.add_argument("results", type=Path)
