"""Peers, from the same prompt ids: Hugging Face transformers' `generate` on the same model object,
plain, with prompt lookup (`prompt_lookup_num_tokens=`) and assisted generation (`assistant_model=`);
and llama.cpp (llama-cpp-python) on the same GGUF file, plain and with its prompt lookup drafter.

Each returns the new tokens and end-to-end tokens/s (prefill included, as `generate` reports no
split), to be set beside specdec's end-to-end tokens/s measured in the same run; llama.cpp also its
decode-only tokens/s (after the first new token), and the resident memory its model took.

Precision: llama.cpp runs the GGUF file's quantized weights, which specdec runs too by default
(--dtype auto); transformers runs the fp32 dequantization of them (loaded for it, Model.hf). Where two
runs read the same weights their tokens may still differ: the kernels round differently, and a
near-tie of the top two logits goes either way. The bench reports how much of our plain output a
peer reproduced, not exactness.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specdec.bench.memory import rss_bytes
from specdec.models.load import Model, synchronize

LLAMA_CPP_INSTALL = "pip install llama-cpp-python==0.3.36 diskcache"


@dataclass
class PeerRun:
    """tokens_per_s: end to end, prefill included. decode_tokens_per_s: after the first new token
    (llama.cpp only; None where the peer gives no split). rss_growth_bytes: the process's resident set
    growth when the peer's model was loaded and warmed up, on the call that loaded it (llama.cpp
    only; None otherwise), its KV cache for n_ctx tokens included."""

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


_LLAMAS: dict[str, object] = {}


def llama_cpp_generate(
    gguf: str, prompt: list[int], max_new_tokens: int, eos: frozenset[int], n_ctx: int = 4096, k: int = 0
) -> PeerRun:
    """Greedy decoding of the GGUF file itself with llama.cpp (llama-cpp-python), from the same
    prompt ids, with torch's thread count and a context (KV cache) of n_ctx tokens; with k > 0,
    llama-cpp-python's prompt lookup drafter (`LlamaPromptLookupDecoding`, k tokens a draft). The model
    is loaded once per (file, k, n_ctx) and warmed up with a short generation before the first timed
    one; that call's PeerRun carries the RSS growth of the load. Raises RuntimeError, saying how to
    install it, when llama-cpp-python is missing."""
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError as e:
        raise RuntimeError(f"llama-cpp-python is not installed ({e}): {LLAMA_CPP_INSTALL}") from e
    key = f"{gguf}:{k}:{n_ctx}"
    growth = None
    if key not in _LLAMAS:
        before = rss_bytes()
        draft = LlamaPromptLookupDecoding(num_pred_tokens=k) if k else None
        threads = torch.get_num_threads()
        llm = Llama(
            model_path=gguf,
            n_ctx=n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            draft_model=draft,
            verbose=False,
            logits_all=bool(k),  # a draft's tokens are verified from the logits of every position
        )
        _llama_run(llm, prompt, min(8, max_new_tokens), eos)  # warm-up: page the weights in, as ours are
        _LLAMAS[key] = llm
        after = rss_bytes()
        growth = after - before if after is not None and before is not None else None
    new, first, end = _llama_run(_LLAMAS[key], prompt, max_new_tokens, eos)
    return PeerRun(
        "llama-cpp-lookup" if k else "llama-cpp",
        new,
        len(new) / end,
        (len(new) - 1) / (end - first) if len(new) > 1 and end > first else None,
        growth,
        n_ctx,
    )


def _llama_run(llm, prompt: list[int], max_new_tokens: int, eos: frozenset[int]) -> tuple[list[int], float, float]:
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
