"""The package stays readable at a glance: no Python file over 500 lines, no function over 80 lines
or with more than 8 parameters (self and cls aside), no call passing more than 6 arguments by
position. A longer list of settings is a frozen config (GenerationOptions, ServeConfig, BenchConfig,
TrainConfig ...); a longer call names its arguments."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "specdec"
MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_PARAMETERS, MAX_POSITIONAL = 500, 80, 8, 6


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = node.args
    named = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
    return len(named) + (a.vararg is not None) + (a.kwarg is not None)


def offences(source: str, where: str) -> list[str]:
    """What in one module's source breaks the limits, one line each."""
    found = []
    if source.count("\n") > MAX_FILE_LINES:
        found.append(f"{where}: {source.count(chr(10))} lines")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > MAX_FUNCTION_LINES:
                found.append(f"{where}:{node.lineno} {node.name}: {length} lines")
            if _parameters(node) > MAX_PARAMETERS:
                found.append(f"{where}:{node.lineno} {node.name}: {_parameters(node)} parameters")
        elif isinstance(node, ast.Call) and len(node.args) > MAX_POSITIONAL:
            if not any(isinstance(a, ast.Starred) for a in node.args):
                found.append(f"{where}:{node.lineno}: a call with {len(node.args)} arguments by position")
    return found


def test_the_package_keeps_to_the_limits():
    found = [o for path in sorted(PACKAGE.rglob("*.py")) for o in offences(path.read_text(), str(path.name))]
    assert not found, "\n".join(found)


def test_each_limit_is_checked():
    long_function = "def f():\n" + "    x = 1\n" * 80
    many = "def f(a, b, c, d, e, f, g, h, i):\n    pass\n"
    method = "class C:\n    def m(self, a, b, c, d, e, f, g, h):\n        pass\n"  # self is not counted
    call = "g(1, 2, 3, 4, 5, 6, 7)\ng(1, 2, 3, 4, 5, 6, x=7)\n"
    assert offences(long_function, "m") == ["m:1 f: 81 lines"]
    assert offences(many, "m") == ["m:1 f: 9 parameters"]
    assert offences(method, "m") == []
    assert offences(call, "m") == ["m:1: a call with 7 arguments by position"]
    assert offences("x = 1\n" * 501, "m") == ["m: 501 lines"]
