"""llama.cpp's own server as a peer, run as users run it: `llama-server` on the same GGUF files and
prompt ids, plain, with a draft model (`-md DRAFT --spec-type draft-simple`: with `-md` alone it
loads the draft and never drafts) and with its n-gram drafters (`--spec-type ngram-simple`,
`ngram-mod`). One server per configuration, started at its first request, warmed up, and kept for the
next ones; a configuration's server replaces the one before it (one model set in memory at a time).

The binary is built from the llama.cpp source that the llama-cpp-python==0.3.36 sdist vendors by
scripts/llama_server.sh; it is found at $SPECDEC_LLAMA_SERVER or in the specdec cache. On a CPU with
AMX the server runs with `--no-repack` (its weight repacking dies with SIGILL there).
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from specdec.bench.llama_worker import cpu_has_amx
from specdec.bench.peers import PeerRun
from specdec.models.weights import cache_dir

VERSION = "0.3.36"
START_S = 300.0  # the most a server may take to load its models and answer /health
# Each configuration's arguments after the target's; DRAFT and K are filled in.
CONFIGS: dict[str, tuple[str, ...]] = {
    "llama-server": (),
    "llama-server-draft": ("-md", "DRAFT", "--spec-type", "draft-simple", "--spec-draft-n-max", "K"),
    "llama-server-ngram": ("--spec-type", "ngram-simple"),
    "llama-server-ngram-mod": ("--spec-type", "ngram-mod"),
}


def server_binary() -> Path:
    """The llama-server binary: $SPECDEC_LLAMA_SERVER, else the one scripts/llama_server.sh built in
    the specdec cache. Raises RuntimeError, saying how to build it, when there is none."""
    given = os.environ.get("SPECDEC_LLAMA_SERVER")
    path = Path(given) if given else cache_dir() / f"llama-server-{VERSION}" / "llama-server"
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise RuntimeError(
            f"llama-server is not built ({path}): run `bash scripts/llama_server.sh` (about 9 minutes on 2 cores) "
            "or set SPECDEC_LLAMA_SERVER to a llama-server binary"
        )
    return path


def server_args(name: str, gguf: str, draft_gguf: str | None, k: int, threads: int, n_ctx: int) -> list[str]:
    """The command line of configuration `name` (a key of CONFIGS) on these files. Raises ValueError
    for an unknown name, or a draft configuration without a draft file."""
    if name not in CONFIGS:
        raise ValueError(f"unknown llama-server peer {name!r}; known: {', '.join(CONFIGS)}")
    extra = list(CONFIGS[name])
    if "DRAFT" in extra and draft_gguf is None:
        raise ValueError(f"{name} needs a draft model's GGUF file (a pair with a draft)")
    extra = [draft_gguf if a == "DRAFT" else str(k) if a == "K" else a for a in extra]
    args = ["-m", gguf, *extra, "-t", str(threads), "-tb", str(threads), "-c", str(n_ctx), "-np", "1"]
    args += ["--no-webui", "--host", "127.0.0.1"]
    if "-md" in extra:
        args += ["--spec-draft-threads", str(threads)]
    return args + (["--no-repack"] if cpu_has_amx() else [])


class LlamaServer:
    """One llama-server process on a free local port, its log in a temporary file. Raises
    RuntimeError when it exits or does not answer /health within START_S seconds (with its log's
    last lines)."""

    def __init__(self, args: list[str]):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log = tempfile.TemporaryFile()
        cmd = [str(server_binary()), *args, "--port", str(self.port)]
        self.process = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_S
        while not self._healthy():
            if self.process.poll() is not None or time.monotonic() > deadline:
                how = "exited" if self.process.poll() is not None else f"gave no answer in {START_S:.0f} s"
                tail = self.tail()
                self.close()
                raise RuntimeError(f"llama-server {how} ({self.process.returncode}): {tail}")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def tail(self, lines: int = 3) -> str:
        """The last lines the server wrote."""
        self.log.seek(0)
        text = self.log.read().decode(errors="replace").strip().splitlines()
        return " | ".join(text[-lines:])

    def complete(self, prompt: list[int], max_new_tokens: int) -> tuple[dict, float]:
        """One greedy /completion from these token ids, without the server's prompt cache: its reply
        (a dict: `tokens`, `stop_type`, `timings`) and the request's wall-clock seconds. Raises
        RuntimeError when the request fails (the server's last lines)."""
        body = dict(
            prompt=list(prompt),
            n_predict=max_new_tokens,
            temperature=0.0,
            cache_prompt=False,
            return_tokens=True,
        )
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=600) as r:
                reply = json.loads(r.read())
        except (urllib.error.URLError, OSError) as e:
            raise RuntimeError(f"llama-server's request failed ({e}): {self.tail()}") from e
        return reply, time.perf_counter() - start

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()


_SERVER: tuple[tuple, LlamaServer] | None = None  # (its arguments, the server) kept for the next request


def _close() -> None:
    global _SERVER
    if _SERVER is not None:
        _SERVER[1].close()
        _SERVER = None


atexit.register(_close)


def llama_server_generate(
    name: str,
    gguf: str,
    prompt: list[int],
    max_new_tokens: int,
    threads: int,
    n_ctx: int = 4096,
    draft_gguf: str | None = None,
    k: int = 8,
) -> PeerRun:
    """Greedy decoding by llama-server configuration `name` (CONFIGS) from these prompt ids, with
    `threads` threads and a context of n_ctx tokens; the draft configuration with draft_gguf and
    `--spec-draft-n-max k`. The server is started (and warmed up with a short request) at the
    first call of a configuration and kept. tokens_per_s: end to end, the request's wall clock;
    decode_tokens_per_s: llama-server's own generation timing. The tokens end with the end token
    that stopped the answer, if one did (as ours do). Raises RuntimeError when llama-server is not built,
    does not start, or fails a request; ValueError as server_args."""
    global _SERVER
    args = server_args(name, gguf, draft_gguf, k, threads, n_ctx)
    if _SERVER is None or _SERVER[0] != tuple(args):
        _close()
        server = LlamaServer(args)
        server.complete(prompt[:16], 4)  # warm up
        _SERVER = (tuple(args), server)
    reply, seconds = _SERVER[1].complete(prompt, max_new_tokens)
    tokens = [int(t) for t in reply.get("tokens", [])]  # the end token that stopped it included, as in ours
    timings = reply.get("timings", {})
    decode = timings.get("predicted_per_second")
    return PeerRun(name, tokens, len(tokens) / seconds if seconds > 0 else float("nan"), decode, None, n_ctx)
