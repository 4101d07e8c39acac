#!/usr/bin/env bash
# Builds (once) and names llama.cpp's `llama-server`, the peer of `specdec bench --peers llama-server`:
# from the llama.cpp source that the llama-cpp-python==0.3.36 sdist on PyPI vendors, for this CPU
# (-march=native), the server alone. It lives in the specdec cache and is reused; it is built beside
# it and renamed when complete, so an interrupted build never leaves a half cache. About 9 minutes
# on 2 cores. Needs cmake and a C++ compiler.
# Prints the binary:  export SPECDEC_LLAMA_SERVER=$(bash scripts/llama_server.sh)
set -euo pipefail
VERSION=0.3.36
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
dest="${SPECDEC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/specdec}/llama-server-$VERSION"
if ! [ -x "$dest/llama-server" ]; then
  command -v cmake >/dev/null || { echo "llama_server.sh: cmake is needed (apt install cmake)" >&2; exit 1; }
  rm -rf "$dest.tmp"
  mkdir -p "$dest.tmp/sdist"
  "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
    -d "$dest.tmp/sdist" "llama-cpp-python==$VERSION" >&2
  tar -xzf "$dest.tmp/sdist"/llama_cpp_python-$VERSION.tar.gz -C "$dest.tmp/sdist"
  src="$dest.tmp/sdist/llama_cpp_python-$VERSION/vendor/llama.cpp"
  cmake -S "$src" -B "$dest.tmp/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF >&2
  cmake --build "$dest.tmp/build" --target llama-server -j "$(nproc)" >&2
  cp "$dest.tmp/build/bin/llama-server" "$dest.tmp/llama-server"
  cp "$src/LICENSE" "$dest.tmp/LICENSE"
  rm -rf "$dest.tmp/sdist" "$dest.tmp/build"
  rm -rf "$dest"
  mv "$dest.tmp" "$dest"
fi
echo "$dest/llama-server"
