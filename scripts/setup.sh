#!/usr/bin/env bash
# Creates .venv and installs specdec with its test tools. The CPU build of torch that lies on this
# machine's disk (torch==2.13.0) goes in first, so pip never pulls a multi-gigabyte CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test]"
