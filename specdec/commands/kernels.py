"""`specdec kernels`: time the quantized products per GGML type against the CPU's peak."""

from __future__ import annotations

from specdec.bench.kernels import DEFAULT_TYPES


def run(args) -> int:
    """Time the types and print the table; exits with the message for what it cannot time."""
    from specdec.bench.kernels import run as time_kernels
    from specdec.bench.kernels import table

    if args.columns <= 0 or args.columns % 256:
        raise SystemExit(f"specdec kernels: --columns must be a positive multiple of 256, not {args.columns}")
    int8 = None if args.activations == "auto" else args.activations == "int8"
    try:
        print(table(time_kernels([t.strip() for t in args.types.split(",") if t.strip()], args.columns, args.mb, int8)))
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"specdec kernels: {e}") from None
    return 0


def add_parser(sub) -> None:
    """The command's parser and flags, on the command line's subparsers."""
    kn = sub.add_parser(
        "kernels", help="time the quantized products per GGML type: an added row's cost against the CPU's peak"
    )
    kn.add_argument("--types", default=",".join(DEFAULT_TYPES), help="comma-separated GGML types")
    kn.add_argument("--columns", type=int, default=1536, help="K, the matrix's columns (a multiple of 256)")
    kn.add_argument("--mb", type=int, help="the matrix's size in MB (default: 4x the last-level cache)")
    kn.add_argument("--activations", choices=("auto", "int8", "fp32"), default="auto")
