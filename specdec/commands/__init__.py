"""The `specdec` commands, one module per command, each with `run(args) -> int` (the exit status)
for the argparse namespace specdec.cli parses; specdec.cli holds the parser and dispatches. What
several commands share is in specdec.commands.common."""
