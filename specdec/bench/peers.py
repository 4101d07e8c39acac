"""Peers, from the same prompt ids: Hugging Face transformers' `generate` on the same model object,
plain, with prompt lookup (`prompt_lookup_num_tokens=`) and assisted generation (`assistant_model=`);
and llama.cpp (llama-cpp-python) on the same GGUF file, plain and with its prompt lookup drafter, in a
process of its own so that a crash in llama.cpp is that peer's reported failure, not the bench's end.

Each returns the new tokens and end-to-end tokens/s (prefill included, as `generate` reports no
split), to be set beside specdec's end-to-end tokens/s measured in the same run; llama.cpp also its
decode-only tokens/s (after the first new token), and the resident memory its model took (in its own
process).

Precision: llama.cpp runs the GGUF file's quantized weights, which specdec runs too by default
(--dtype auto); transformers runs the fp32 dequantization of them (loaded for it, Model.hf). Where two
runs read the same weights their tokens may still differ: the kernels round differently, and a
near-tie of the top two logits goes either way. The bench reports how much of our plain output a
peer reproduced, not exactness.
"""

from __future__ import annotations

import atexit
import json
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from specdec.models.load import Model, synchronize


@dataclass
class PeerRun:
    """tokens_per_s: end to end, prefill included. decode_tokens_per_s: after the first new token
    (llama.cpp only; None where the peer gives no split). rss_growth_bytes: the resident set growth
    of llama.cpp's process when the peer's model was loaded and warmed up, on the call that loaded it
    (llama.cpp only; None otherwise), its KV cache for n_ctx tokens included."""

    name: str
    tokens: list[int]
    tokens_per_s: float
    decode_tokens_per_s: float | None = None
    rss_growth_bytes: int | None = None
    n_ctx: int | None = None


_HF_WARM: set[tuple[str, int]] = set()  # (peer, id of its transformers model) warmed up


@torch.inference_mode()
def hf_generate(
    name: str, target: Model, prompt: list[int], max_new_tokens: int, draft: Model | None = None, k: int = 4
) -> PeerRun:
    """One greedy transformers `generate` run. name: "hf" (plain), "hf-lookup" (prompt lookup with
    k tokens), or "hf-assisted" (assisted generation with `draft`, a constant k). The transformers
    model (for a quantized target its fp32 dequantization, loaded at first use) is fetched, and each
    peer warmed up by a short generation on its first call, before the clock starts."""
    kwargs: dict = dict(max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None)
    eos = sorted(target.eos_token_ids)
    kwargs["eos_token_id"] = eos or None
    kwargs["pad_token_id"] = eos[0] if eos else 0
    if name == "hf-lookup":
        kwargs["prompt_lookup_num_tokens"] = k
    elif name == "hf-assisted":
        if draft is None:
            raise ValueError("hf-assisted needs a draft model")
        kwargs.update(
            assistant_model=draft.hf,
            num_assistant_tokens=k,
            num_assistant_tokens_schedule="constant",
            assistant_confidence_threshold=0.0,
        )
    elif name != "hf":
        raise ValueError(f"unknown peer {name!r}: hf, hf-lookup, hf-assisted")
    ids = torch.tensor([prompt], device=target.device)
    model = target.hf
    if (name, id(model)) not in _HF_WARM:
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **{**kwargs, "max_new_tokens": 4})
        _HF_WARM.add((name, id(model)))
    synchronize(target.device)
    start = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
    synchronize(target.device)
    elapsed = time.perf_counter() - start
    new = out[0, len(prompt) :].tolist()
    return PeerRun(name, new, len(new) / elapsed)


class LlamaWorker:
    """The llama.cpp peer's process (specdec.bench.llama_worker), started at its first request and
    kept for the next ones: llama.cpp runs there, so a crash in it ends that process, not the bench.
    Its stderr goes to a temporary file, whose last lines explain a crash."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.log = tempfile.TemporaryFile(mode="w+")
        self.died: str | None = None  # why the process ended, once it has

    def request(self, **fields) -> dict:
        """One request's reply (a dict, see llama_worker). Raises RuntimeError when the process dies,
        and for every later request of this worker (a peer that crashed once is not tried again)."""
        if self.died:
            raise RuntimeError(self.died)
        if self.proc is None:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "specdec.bench.llama_worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.log,
                text=True,
            )
        try:
            self.proc.stdin.write(json.dumps(fields) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if line:
            return json.loads(line)
        code = self.proc.wait()
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        self.log.seek(0)
        tail = " | ".join(self.log.read().strip().splitlines()[-3:])
        self.died = f"llama.cpp's process died ({how}){': ' + tail if tail else ''}"
        raise RuntimeError(self.died)

    def close(self) -> None:
        """End the process (it exits when its stdin closes)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None


_WORKER: LlamaWorker | None = None


def llama_cpp_generate(
    gguf: str,
    prompt: list[int],
    max_new_tokens: int,
    eos: frozenset[int],
    n_ctx: int = 4096,
    k: int = 0,
    extra_bufts: bool | None = None,
) -> PeerRun:
    """Greedy decoding of the GGUF file itself with llama.cpp (llama-cpp-python), from the same
    prompt ids, with torch's thread count and a context (KV cache) of n_ctx tokens; with k > 0,
    llama-cpp-python's prompt lookup drafter (`LlamaPromptLookupDecoding`, k tokens a draft). It runs
    in a process of its own (LlamaWorker), where the model is loaded once per (file, k, n_ctx) and
    warmed up with a short generation before the first timed one; that call's PeerRun carries the
    resident memory the load added to that process. extra_bufts: ggml's extra CPU buffer types
    (None: off where the CPU has AMX, see specdec.bench.llama_worker). Raises RuntimeError, saying how
    to install it, when llama-cpp-python is missing, and when llama.cpp crashed (its process died:
    the signal and the last lines it wrote)."""
    global _WORKER
    if _WORKER is None:
        _WORKER = LlamaWorker()
        atexit.register(_WORKER.close)
    reply = _WORKER.request(
        gguf=gguf,
        n_ctx=n_ctx,
        k=k,
        threads=torch.get_num_threads(),
        prompt=list(prompt),
        max_new_tokens=max_new_tokens,
        eos=sorted(eos),
        extra_bufts=extra_bufts,
    )
    if "error" in reply:
        raise RuntimeError(reply["error"])
    new, first, end = reply["tokens"], reply["first_s"], reply["end_s"]
    return PeerRun(
        "llama-cpp-lookup" if k else "llama-cpp",
        new,
        len(new) / end,
        (len(new) - 1) / (end - first) if len(new) > 1 and end > first else None,
        reply["rss_growth_bytes"],
        n_ctx,
    )
