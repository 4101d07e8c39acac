"""The `specdec` commands, one module per command, each with `add_parser(sub)` (its flags) and
`run(args) -> int` (the exit status) for the argparse namespace; specdec.cli builds the parser from
them and dispatches. The flag groups and argparse types several commands share are in
specdec.commands.flags, the rest they share in specdec.commands.common."""
