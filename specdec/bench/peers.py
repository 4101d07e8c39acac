"""Peers on the same model object and prompt: Hugging Face transformers' `generate`, plain, with
prompt lookup (`prompt_lookup_num_tokens=`) and assisted generation (`assistant_model=`).

Each returns the new tokens and end-to-end tokens/s (prefill included, as `generate` reports no
split), to be set beside specdec's end-to-end tokens/s measured in the same run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from specdec.models.load import Model, synchronize


@dataclass
class PeerRun:
    name: str
    tokens: list[int]
    tokens_per_s: float


@torch.inference_mode()
def hf_generate(
    name: str, target: Model, prompt: list[int], max_new_tokens: int, draft: Model | None = None, k: int = 4
) -> PeerRun:
    """One greedy transformers `generate` run. name: "hf" (plain), "hf-lookup" (prompt lookup with
    k tokens), or "hf-assisted" (assisted generation with `draft`, a constant k)."""
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
    synchronize(target.device)
    start = time.perf_counter()
    out = target.hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs)
    synchronize(target.device)
    elapsed = time.perf_counter() - start
    new = out[0, len(prompt) :].tolist()
    return PeerRun(name, new, len(new) / elapsed)


_LLAMAS: dict[str, object] = {}


def llama_cpp_generate(
    gguf: str, prompt: list[int], max_new_tokens: int, eos: frozenset[int], n_ctx: int = 4096, k: int = 0
) -> PeerRun:
    """Greedy decoding of the GGUF file itself with llama.cpp (llama-cpp-python), from the same
    prompt ids; with k > 0, llama-cpp-python's prompt lookup drafter (`LlamaPromptLookupDecoding`).
    Note the precision differs: llama.cpp runs the quantized weights, specdec their fp32
    dequantization, so identical tokens are not expected. Raises RuntimeError when
    llama-cpp-python is not installed."""
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError as e:
        raise RuntimeError("llama-cpp-python is not installed (pip install llama-cpp-python)") from e
    key = f"{gguf}:{k}"
    if key not in _LLAMAS:
        draft = LlamaPromptLookupDecoding(num_pred_tokens=k) if k else None
        _LLAMAS[key] = Llama(
            model_path=gguf,
            n_ctx=n_ctx,
            n_threads=torch.get_num_threads(),
            draft_model=draft,
            verbose=False,
            logits_all=bool(k),
        )
    llm = _LLAMAS[key]
    llm.reset()
    new: list[int] = []
    start = time.perf_counter()
    for token in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        new.append(int(token))
        if token in eos or len(new) >= max_new_tokens:
            break
    elapsed = time.perf_counter() - start
    return PeerRun("llama-cpp-lookup" if k else "llama-cpp", new, len(new) / elapsed)
