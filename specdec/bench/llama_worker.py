"""The llama.cpp peer's process: greedy generations with llama-cpp-python, one JSON request a line on
stdin, one JSON reply a line on stdout, so that a crash inside llama.cpp (a segmentation fault in its
AMX buffers, say) ends this process and not the bench (specdec.bench.peers.llama_cpp_generate).

Run as `python -m specdec.bench.llama_worker`. A request: {"gguf", "n_ctx", "k", "threads", "prompt",
"max_new_tokens", "eos", "extra_bufts"}; the reply: {"tokens", "first_s", "end_s", "rss_growth_bytes",
"extra_bufts"} or {"error"}. A model is loaded once per (file, k, n_ctx, threads) and warmed up with a
short generation before its first timed one; that reply carries the resident memory the load added to
this process. extra_bufts: whether ggml may use its extra CPU buffer types (repacked weights, AMX
tiles); None: off on a CPU with AMX, where llama-cpp-python 0.3.36's crash on batches of more than one
row, else llama.cpp's default (on).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

INSTALL = "pip install llama-cpp-python==0.3.36 diskcache"


def cpu_has_amx() -> bool:
    """Whether /proc/cpuinfo lists AMX int8 tiles."""
    try:
        return any(
            line.startswith("flags") and "amx_int8" in line.split()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
        )
    except OSError:
        return False


def _load(request: dict):
    """A llama_cpp.Llama for the request's file, draft length, context and threads, and whether its
    extra buffer types are on. Raises RuntimeError, saying how to install it, without llama-cpp-python."""
    try:
        import llama_cpp
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError as e:
        raise RuntimeError(f"llama-cpp-python is not installed ({e}): {INSTALL}") from e
    extra = request.get("extra_bufts")
    extra = not cpu_has_amx() if extra is None else bool(extra)
    native = llama_cpp.llama_cpp
    defaults = native.llama_model_default_params
    if not extra:  # Llama() takes its model parameters from this function, then sets its own keywords

        def without_extra():
            params = defaults()
            if hasattr(params, "use_extra_bufts"):
                params.use_extra_bufts = False
            return params

        native.llama_model_default_params = without_extra
    try:
        k, threads = request["k"], request["threads"]
        llm = Llama(
            model_path=request["gguf"],
            n_ctx=request["n_ctx"],
            n_threads=threads,
            n_threads_batch=threads,
            draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k) if k else None,
            verbose=False,
            logits_all=bool(k),  # a draft's tokens are verified from the logits of every position
        )
    finally:
        native.llama_model_default_params = defaults
    return llm, extra


def _run(llm, prompt: list[int], max_new_tokens: int, eos: set[int]) -> tuple[list[int], float, float]:
    """(new tokens, seconds to the first one, seconds to the last one) of a greedy generation."""
    llm.reset()
    new: list[int] = []
    first = 0.0
    start = time.perf_counter()
    for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        new.append(int(token))
        if len(new) == 1:
            first = time.perf_counter() - start
        if token in eos or len(new) >= max_new_tokens:
            break
    return new, first, time.perf_counter() - start


def serve(requests, reply) -> None:
    """Answer each request (a JSON line of `requests`) with reply(dict)."""
    from specdec.bench.memory import rss_bytes

    loaded: dict[tuple, tuple] = {}
    for line in requests:
        try:
            r = json.loads(line)
            key = (r["gguf"], r["k"], r["n_ctx"], r["threads"], r.get("extra_bufts"))
            growth = None
            if key not in loaded:
                before = rss_bytes()
                llm, extra = _load(r)
                _run(llm, r["prompt"], min(8, r["max_new_tokens"]), set(r["eos"]))  # warm-up: page the weights in
                loaded[key] = (llm, extra)
                after = rss_bytes()
                growth = after - before if after is not None and before is not None else None
            llm, extra = loaded[key]
            tokens, first, end = _run(llm, r["prompt"], r["max_new_tokens"], set(r["eos"]))
            reply({"tokens": tokens, "first_s": first, "end_s": end, "rss_growth_bytes": growth, "extra_bufts": extra})
        except Exception as e:  # an error, not a crash: said, and the next request is served
            reply({"error": f"{type(e).__name__}: {e}"})


def main() -> None:
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever llama.cpp prints goes to stderr: stdout carries the replies alone

    def reply(d: dict) -> None:
        out.write(json.dumps(d) + "\n")
        out.flush()

    serve(sys.stdin, reply)


if __name__ == "__main__":
    main()
