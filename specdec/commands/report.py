"""`specdec report`: print the markdown report of a results.json (runs no model)."""

from __future__ import annotations


def run(args) -> int:
    """Print the report."""
    from specdec.bench import results
    from specdec.bench.report import markdown_report

    print(markdown_report(results.load(args.results)))
    return 0
