#!/usr/bin/env bash
# Makes (once) and names the llama.cpp tools of the conformance tests (tests/conformance.py): the
# llama-cpp-python==0.3.36 sdist from PyPI, whose vendored llama.cpp gives the converter
# (convert_hf_to_gguf.py with its conversion/ package and gguf-py/), and a virtual environment with
# llama-cpp-python built from that sdist for this CPU (the reference logits and the quantizer). The
# folder lives in the specdec cache and is reused; it is built beside it and renamed when complete,
# so an interrupted build never leaves a half cache. The build takes about 10 minutes on 2 cores.
# Layout:  venv/bin/python (imports llama_cpp)   llama.cpp/convert_hf_to_gguf.py   llama.cpp/gguf-py/
# Prints the folder:  export SPECDEC_LLAMA_CPP=$(bash scripts/llama_cpp_env.sh)
set -euo pipefail
VERSION=0.3.36
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
dest="${SPECDEC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/specdec}/llama-cpp-$VERSION"
if ! { [ -f "$dest/llama.cpp/convert_hf_to_gguf.py" ] \
  && "$dest/venv/bin/python" -c "import llama_cpp" >/dev/null 2>&1; }; then
  rm -rf "$dest.tmp"
  mkdir -p "$dest.tmp/sdist"
  "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
    -d "$dest.tmp/sdist" "llama-cpp-python==$VERSION" >&2
  tar -xzf "$dest.tmp/sdist"/llama_cpp_python-$VERSION.tar.gz -C "$dest.tmp/sdist"
  vendored="$dest.tmp/sdist/llama_cpp_python-$VERSION/vendor/llama.cpp"
  mkdir "$dest.tmp/llama.cpp"
  cp -r "$vendored/convert_hf_to_gguf.py" "$vendored/conversion" "$vendored/gguf-py" \
    "$vendored/LICENSE" "$dest.tmp/llama.cpp/"
  "$PYTHON" -m venv "$dest.tmp/venv"
  # Only the libraries the bindings load: no multimodal library, tools, tests or examples. -march=native
  # for this CPU; the reference runs with ggml's extra buffer types off (tests/conformance.py).
  CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "$dest.tmp/venv/bin/python" -m pip install --quiet --disable-pip-version-check \
    "$dest.tmp/sdist"/llama_cpp_python-$VERSION.tar.gz >&2
  rm -rf "$dest.tmp/sdist"
  rm -rf "$dest"
  mv "$dest.tmp" "$dest"
fi
echo "$dest"
