"""Every repository path the code, the build files and the docs name exists: a file that moved leaves
no stale pointer behind (a docstring's `specdec/csrc/gemv.cpp` after the kernels moved under backends/)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "specdec"
# a path as the text writes it: from the repository's root or from a folder of the package
NAMED = re.compile(
    r"(?<![\w./-])((?:specdec|tests|docs|scripts|results|csrc|quant|"
    + "|".join(sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("_")))
    + r")/[\w./-]*\w)(?![\w*<])"
)
BASES = (ROOT, PACKAGE, PACKAGE / "backends", PACKAGE / "backends" / "csrc")  # where a short path starts


def _texts() -> list[Path]:
    code = [p for pattern in ("**/*.py", "**/*.h", "**/*.cpp") for p in PACKAGE.glob(pattern)]
    return [*code, ROOT / "pyproject.toml", ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("scripts/*")]


def test_the_texts_are_found():
    names = {p.name for p in _texts()}
    assert {"round.py", "matmul.h", "gemv.cpp", "pyproject.toml", "README.md", "engine.md"} <= names


def test_every_path_named_exists():
    missing = []
    for text in _texts():
        for match in NAMED.finditer(text.read_text(encoding="utf-8", errors="replace")):
            named = match.group(1).rstrip(".")
            if not any((base / named).exists() for base in BASES):
                missing.append(f"{text.relative_to(ROOT)} names {named}")
    assert not missing, "\n".join(missing)


def test_a_stale_path_would_be_caught():
    found = [m.group(1) for m in NAMED.finditer("built at first use (specdec/csrc/gemv.cpp); see backends/gemv.py")]
    assert found == ["specdec/csrc/gemv.cpp", "backends/gemv.py"]
    assert not any((base / found[0]).exists() for base in BASES) and any((b / found[1]).exists() for b in BASES)
