"""Conformance with llama.cpp and transformers (helpers: tests/conformance.py). A tiny random model of
each architecture, converted to GGUF by llama.cpp's own converter, runs on specdec's quantized backend:
- its F32 file gives transformers' log-probabilities (fp32 forward of the original folder) at every
  position of a short (16 tokens) and a long (256 tokens) prompt: the long one goes past a sliding
  window and turns the rotary embedding through large angles, so a rope, window or norm read wrongly
  shows by nats;
- its Q8_0 and Q4_K files (llama.cpp's quantizer) give llama.cpp's own log-probabilities and top tokens.
The tests need llama.cpp's tools (SPECDEC_LLAMA_CPP, from scripts/llama_cpp_env.sh) and skip without.

Tolerances, in nats, on log-probabilities (max over every position and every token); measured on a
2-core AMD EPYC over the cases below, 256-token prompt the worst:
- F32_TOL, specdec (fp32 activations, fp32 KV cache) against transformers: both compute in fp32, in
  different orders. Measured up to 1.5e-5 (gemma3).
- FP16_KV_TOL, the same with specdec's default fp16 KV cache: keys and values rounded to fp16.
  Measured up to 0.007 (olmo2).
- QUANT_TOL, specdec against llama.cpp on the same quantized file: both dequantize the same blocks,
  but llama.cpp rounds activations to 8 bits for its quantized products (specdec's fp32 activations
  do not; its int8 ones round their own way), and the tiny models' sharp attention amplifies that.
  Measured up to 0.26 (Q8_0) and 0.36 (Q4_K), fp32 activations.
- LLAMA_CPP_TOL, llama.cpp's F32 file against transformers (a check of the tiny models and the
  converter, not of specdec): ggml's GELU is a fp16 table lookup. Measured up to 4e-3 (gemma3).
For scale, a rope read wrongly: the Llama 3 rope-scaled model read without its rope_freqs (specdec
before it read them) is 4.4 (short) and 5.6 (long prompt) nats off transformers, the linear-scaled
one read unscaled 8.0 and 6.5.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.backends.qkernel import INT8_TYPES, kernels
from specdec.backends.quant import QuantModel
from specdec.models.gguf import hf_config, read_gguf

from .conformance import (
    QTYPES,
    convert,
    hf_logits,
    llama_cpp,
    llama_logits,
    log_softmax,
    make_tiny,
    needs_llama_cpp,
    prompt,
    quantize,
    variant,
)

F32_TOL, FP16_KV_TOL, QUANT_TOL, LLAMA_CPP_TOL = 1e-3, 0.05, 0.75, 1e-2
PROMPTS = {"short": prompt(16, seed=1), "long": prompt(256, seed=2)}

# Test cases: an architecture, or a VARIANTS name of tests/conformance.py (an architecture with other
# rope scaling). RUNS: specdec runs them; NOT_YET: expected to fail until it does (move a name across).
RUNS = [
    "llama",
    "qwen2",
    "llama-rope-llama3",
    "llama-rope-linear",
    "qwen3",
    "gemma3",
    "granite",
    "olmo2",
    "smollm3",
    "phi3",
    "phi3-longrope",
]
NOT_YET: list[str] = []  # architectures or variants specdec does not run yet: xfail until they do
CASES = RUNS + [
    pytest.param(name, marks=pytest.mark.xfail(strict=False, reason="not on the quantized backend yet"))
    for name in NOT_YET
]


class Tiny:
    """The tiny models of a test session, each made, converted and quantized once, in a folder of its
    own: folder(name) the transformers folder, gguf(name, qtype) the llama.cpp file."""

    def __init__(self, tmp_path_factory):
        self.tmp = tmp_path_factory
        self.folders, self.files = {}, {}

    def folder(self, name: str):
        if name not in self.folders:
            arch, overrides = variant(name)
            self.folders[name] = make_tiny(arch, self.tmp.mktemp(name) / "hf", **overrides)
        return self.folders[name]

    def gguf(self, name: str, qtype: str = "F32"):
        if (name, qtype) not in self.files:
            if qtype == "F32":
                folder = self.folder(name)
                self.files[name, qtype] = convert(folder, folder.parent / "F32.gguf")
            else:
                f32 = self.gguf(name)
                self.files[name, qtype] = quantize(f32, f32.parent / f"{qtype}.gguf", qtype)
        return self.files[name, qtype]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> Tiny:
    llama_cpp()  # a SPECDEC_LLAMA_CPP naming no complete folder fails here
    return Tiny(tmp_path_factory)


def specdec_logits(path, ids: list[int], activations: str = "fp32", kv_dtype=torch.float32) -> np.ndarray:
    """specdec's quantized forward (QuantModel, as specdec.load_model builds it for a GGUF file) over the
    prompt in one call: logits (len(ids), vocab) of every position."""
    gguf = read_gguf(path)
    model = QuantModel(gguf, hf_config(gguf), activations=activations, kv_dtype=kv_dtype)
    n = len(ids)
    keys = [torch.empty(model.n_kv, n, model.head_dim, dtype=model.kv_dtype) for _ in model.layers]
    values = [torch.empty(model.n_kv, n, model.head_dim, dtype=model.kv_dtype) for _ in model.layers]
    return model.forward(torch.tensor(ids), keys, values, torch.empty(n, model.hidden_size), 0, n).numpy()


def max_error(got: np.ndarray, want: np.ndarray) -> float:
    """The largest difference of log-probabilities, over every position and token."""
    return float(np.abs(log_softmax(got) - log_softmax(want)).max())


def test_the_tiny_models_positions_move_their_logits(tmp_path):
    """The tiny models are sharp enough that a rope read wrongly fails the F32 comparison by far: the
    same weights with and without Llama 3's rope scaling give log-probabilities nats apart."""
    ids = PROMPTS["long"]
    plain = hf_logits(make_tiny("llama", tmp_path / "plain"), ids)
    arch, overrides = variant("llama-rope-llama3")
    scaled = hf_logits(make_tiny(arch, tmp_path / "scaled", **overrides), ids)
    assert max_error(plain, scaled) > 1000 * F32_TOL


@needs_llama_cpp
@pytest.mark.parametrize("name", RUNS + NOT_YET)
def test_llama_cpp_agrees_with_transformers_on_the_tiny_model(tiny, name):
    """The harness itself: llama.cpp on the converted F32 file gives transformers' log-probabilities, so a
    difference in the tests below is specdec's."""
    for which, ids in PROMPTS.items():
        err = max_error(llama_logits(tiny.gguf(name), ids), hf_logits(tiny.folder(name), ids))
        assert err < LLAMA_CPP_TOL, f"{which} prompt: llama.cpp is {err:.3g} nats off transformers"


@needs_llama_cpp
@pytest.mark.parametrize("name", CASES)
def test_f32_file_gives_transformers_logprobs(tiny, name):
    """Both prompts, with a fp32 and with the default fp16 KV cache; the message gives every error."""
    errors = {}
    for which, ids in PROMPTS.items():
        want = hf_logits(tiny.folder(name), ids)
        errors[which, "fp32"] = max_error(specdec_logits(tiny.gguf(name), ids), want)
        errors[which, "fp16"] = max_error(specdec_logits(tiny.gguf(name), ids, kv_dtype=torch.float16), want)
    tolerance = {"fp32": F32_TOL, "fp16": FP16_KV_TOL}
    said = ", ".join(f"{which} prompt, {kv} KV cache: {err:.3g}" for (which, kv), err in errors.items())
    assert all(err < tolerance[kv] for (_, kv), err in errors.items()), f"specdec is off transformers by (nats) {said}"


@needs_llama_cpp
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("name", CASES)
def test_quantized_file_gives_llama_cpps_logprobs_and_top_tokens(tiny, name, qtype):
    """specdec's top token is llama.cpp's wherever llama.cpp's top two are more than 2 x QUANT_TOL apart
    (closer ones may swap within the tolerance), and every log-probability is within QUANT_TOL."""
    _check_against_llama_cpp(tiny, name, qtype)


@needs_llama_cpp
@pytest.mark.parametrize("qtype", [q for q in QTYPES if q not in ("Q8_0", "Q4_K")])
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_every_block_type_gives_llama_cpps_logprobs_and_top_tokens(tiny, name, qtype):
    """The same for every type llama.cpp's quantizer makes here (each multiplied in its blocks by
    specdec), on a plain architecture and the one with the most steps of its own."""
    _check_against_llama_cpp(tiny, name, qtype)


def _check_against_llama_cpp(tiny, name: str, qtype: str) -> None:
    path = tiny.gguf(name, qtype)
    assert {t.qtype for t in read_gguf(path).tensors.values() if len(t.shape) == 2} == {qtype}  # no fallback type
    errors = {}
    for which, ids in PROMPTS.items():
        want, got = log_softmax(llama_logits(path, ids)), log_softmax(specdec_logits(path, ids))
        top2 = np.sort(want, axis=-1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 2 * QUANT_TOL
        swapped = np.flatnonzero(clear & (got.argmax(-1) != want.argmax(-1)))
        assert not len(swapped), f"{which} prompt: specdec's top token differs from llama.cpp's at {swapped.tolist()}"
        errors[which] = float(np.abs(got - want).max())
    said = ", ".join(f"{which} prompt: {err:.3g}" for which, err in errors.items())
    assert max(errors.values()) < QUANT_TOL, f"specdec is off llama.cpp by (nats) {said}"


@needs_llama_cpp
@pytest.mark.skipif(not kernels().int8_available(), reason="int8 activations need AVX2 or AVX512-VNNI")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
@pytest.mark.parametrize("name", CASES)
def test_quantized_file_with_int8_activations_gives_llama_cpps_logprobs(tiny, name, qtype):
    """As above with the int8 activations specdec uses where the CPU has AVX2 or VNNI: both round activations
    to 8 bits, each its own way (QUANT_TOL was measured without VNNI: this case's errors were not)."""
    path = tiny.gguf(name, qtype)
    errors = {}
    for which, ids in PROMPTS.items():
        errors[which] = max_error(specdec_logits(path, ids, activations="int8"), llama_logits(path, ids))
    said = ", ".join(f"{which} prompt: {err:.3g}" for which, err in errors.items())
    assert max(errors.values()) < QUANT_TOL, f"int8 activations: specdec is off llama.cpp by (nats) {said}"


@needs_llama_cpp
@pytest.mark.skipif(not kernels().int8_available(), reason="int8 activations need AVX2 or AVX512-VNNI")
@pytest.mark.parametrize("qtype", [q for q in INT8_TYPES if q not in ("Q8_0", "Q4_K")])
@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_every_int8_kernel_gives_llama_cpps_logprobs(tiny, name, qtype):
    """Each other type with an int8 kernel, on a plain architecture and on Gemma 3, within QUANT_TOL."""
    path = tiny.gguf(name, qtype)
    errors = {
        which: max_error(specdec_logits(path, ids, activations="int8"), llama_logits(path, ids))
        for which, ids in PROMPTS.items()
    }
    said = ", ".join(f"{which} prompt: {err:.3g}" for which, err in errors.items())
    assert max(errors.values()) < QUANT_TOL, f"int8 activations: specdec is off llama.cpp by (nats) {said}"
