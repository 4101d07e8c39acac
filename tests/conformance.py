"""Helpers of the llama.cpp conformance tests (tests/test_conformance.py): tiny random transformers
models of each architecture, converted to GGUF by llama.cpp's own converter, quantized by its own
quantizer and run by llama.cpp itself, so that specdec's GGUF loader and forward are checked against
the reference implementation of the format on every architecture, not against specdec's reading of it.

The llama.cpp tools are those of llama-cpp-python==0.3.36, made once by scripts/llama_cpp_env.sh
and named by the environment variable SPECDEC_LLAMA_CPP (its folder: venv/bin/python imports
llama_cpp; llama.cpp/ holds convert_hf_to_gguf.py, conversion/ and gguf-py/). Tests that need them
skip without it (`needs_llama_cpp`); .ci/run sets it. llama.cpp runs in subprocesses, so that a crash
in it fails one test instead of taking pytest down.

Tokenizers. The converter needs one that it accepts, with exactly the model's vocabulary size:
- a SentencePiece model (tokenizer.model, trained here on TEXT, byte fallback), for every
  architecture whose converter reads one: llama, mistral, granite and smollm3 (LlamaModel), qwen2
  and qwen3 (Qwen2Model tries tokenizer.model before a BPE), gemma3, phi3. It is written as the
  GGUF's "llama" (SPM) vocabulary, whatever the architecture.
- a byte-level BPE (tokenizer.json, trained here with `tokenizers`) for olmo2, whose converter
  reads BPE tokenizers only. The converter names a BPE's pre-tokenizer by the hash of how it
  tokenizes a fixed text, and refuses a hash it does not know, which a tiny vocabulary's always
  is; `convert` answers "gpt-2" (the byte-level regex this BPE uses) where it would refuse.
The tests feed token ids, never text, so neither vocabulary's text handling is under test.

Sizes. Hidden 256, 8 query heads of 32 (2 key/value heads), FFN 256, vocabulary 320, 2 layers
(smollm3 4, gemma3 6: see _config): every matrix row is a multiple of 256, so llama.cpp's quantizer
gives every matrix the asked type (a K-quant or IQ4_XS row of another length would fall back to a
32-block type, see `quantize`). An F32 file is 3.5 MB (smollm3 6.4, gemma3 9), a Q4_K one 0.5 MB.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

ENV = "SPECDEC_LLAMA_CPP"
SETUP = f"export {ENV}=$(bash scripts/llama_cpp_env.sh)  # once: builds llama-cpp-python, about 10-17 minutes"

VOCAB = 320  # SentencePiece: 4 specials, 256 bytes, 60 learnt pieces; BPE: 3 specials, 256 bytes, 61 merges
UNK, BOS, EOS = 0, 1, 2
ENDOFTEXT = "<|endoftext|>"  # the SentencePiece vocabulary's id 3 (see _write_sentencepiece)
FIRST_ORDINARY = 4  # prompts are made of ids from here on: no special token
HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM = 256, 256, 8, 2, 32
# q and k projections' weights x3: attention scores of a few units, so that positions move the logits (Llama 3's
# rope scaling left out: 4-6 nats), yet not so sharp that llama.cpp's 8-bit activations (0.1-0.4 nats) swamp it
QK_SCALE = 3.0
LOGIT_SCALE = 8.0  # output layer x8: logits spread over several nats, so the top token rarely ties

# A few lines to train the tiny tokenizers on (any text would do: the tests feed token ids).
TEXT = """\
Speculative decoding drafts a few tokens cheaply and verifies them with one forward of the target.
The verifier accepts the longest prefix the target agrees with, then adds a recovered or bonus token.
A GGUF file holds the weights in blocks of four, five, six or eight bits, with a scale per block.
Rotary position embeddings turn each pair of query and key features by an angle that grows with position.
Sliding window attention lets a layer see only the last few tokens, while a global layer sees them all.
def fibonacci(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
{"name": "tiny", "layers": 2, "heads": 8, "vocab": 320, "ok": true}
"""

# The GGML type of each name `quantize` takes -> llama.cpp's file type that makes it the default type.
QTYPES = {
    "F16": 1, "BF16": 32, "Q4_0": 2, "Q4_1": 3, "Q5_0": 8, "Q5_1": 9, "Q8_0": 7,
    "Q2_K": 10, "Q3_K": 12, "Q4_K": 15, "Q5_K": 17, "Q6_K": 18, "IQ4_NL": 25, "IQ4_XS": 30,
}  # fmt: skip


# ---- finding llama.cpp's tools -------------------------------------------------------------------


@dataclass(frozen=True)
class LlamaCpp:
    """The folder scripts/llama_cpp_env.sh makes: python (its venv's, imports llama_cpp), converter
    (convert_hf_to_gguf.py) and gguf_py (the vendored gguf package the converter imports)."""

    root: Path

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    @property
    def converter(self) -> Path:
        return self.root / "llama.cpp" / "convert_hf_to_gguf.py"

    @property
    def gguf_py(self) -> Path:
        return self.root / "llama.cpp" / "gguf-py"


def llama_cpp() -> LlamaCpp | None:
    """The tools named by $SPECDEC_LLAMA_CPP, or None when it is unset. Raises RuntimeError when it
    names a folder that is not a complete one (a typo should fail, not skip)."""
    root = os.environ.get(ENV)
    if not root:
        return None
    tools = LlamaCpp(Path(root))
    if not (tools.python.is_file() and tools.converter.is_file() and tools.gguf_py.is_dir()):
        raise RuntimeError(f"{ENV}={root} is not a folder scripts/llama_cpp_env.sh made; run: {SETUP}")
    return tools


needs_llama_cpp = pytest.mark.skipif(not os.environ.get(ENV), reason=f"needs llama.cpp's tools: {SETUP}")


def _tools() -> LlamaCpp:
    tools = llama_cpp()
    if tools is None:
        raise RuntimeError(f"{ENV} is not set: {SETUP}")
    return tools


def _run(argv: list, what: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """argv run to its end; raises RuntimeError with the tail of its stderr when it fails."""
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True, env=env, timeout=timeout)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-25:])
        raise RuntimeError(f"{what} failed (exit status {done.returncode}):\n{tail}")
    return done


# ---- tiny models ---------------------------------------------------------------------------------


def _rope(**fields) -> dict:
    return {"rope_theta": 10000.0, **fields}


# Llama 3's rope scaling: the converter writes rope_freqs.weight, dividing the frequencies whose
# wavelength is over 16 positions by up to 8 (original context 64: most of a 32-wide head's).
LLAMA3_ROPE = _rope(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
)
# Phi-3's long rope: rope_factors_long/short tensors and an attention factor. Past 8 tokens (both prompts)
# the long factors: transformers picks them by the sequence's length, llama.cpp by its context's size,
# so a prompt of 8 tokens or fewer could differ.
PHI3_LONGROPE = _rope(
    rope_type="longrope",
    short_factor=[1.0 + i / 16 for i in range(HEAD_DIM // 2)],
    long_factor=[1.0 + i / 4 for i in range(HEAD_DIM // 2)],
    original_max_position_embeddings=8,
    factor=64.0,  # max_position_embeddings / original_max_position_embeddings
)
# Named variants of an architecture for the tests' parametrization: name -> (arch, make_tiny overrides).
VARIANTS = {
    "llama-rope-llama3": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama-rope-linear": ("llama", {"rope_parameters": _rope(rope_type="linear", factor=4.0)}),
    "phi3-longrope": ("phi3", {"rope_parameters": PHI3_LONGROPE, "original_max_position_embeddings": 8}),
}


def variant(name: str) -> tuple[str, dict]:
    """(arch, overrides) of a test case name: a VARIANTS entry, else the architecture itself."""
    return VARIANTS.get(name, (name, {}))


def _config(arch: str, **overrides):
    """The transformers config of a tiny `arch` model: shared sizes, then the architecture's own
    fields (chosen so that a loader ignoring one of them gets different logits), then `overrides`."""
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=UNK,
        tie_word_embeddings=False,
        rope_parameters=_rope(rope_type="default"),
    )
    per_arch = {
        "llama": (tf.LlamaConfig, {}),
        "mistral": (tf.MistralConfig, {"sliding_window": None}),
        "qwen2": (tf.Qwen2Config, {}),  # q/k/v biases (made random below)
        "qwen3": (tf.Qwen3Config, {}),  # per-head q/k RMSNorms (made random below)
        # gemma3: five sliding layers (window 16: a short prompt fits, a long one does not) then a global
        # one, with their own rope bases; tied embeddings as Gemma 3 has. The converter writes no layer
        # pattern and llama.cpp then takes Gemma 3's five sliding to one global, hence six layers.
        # llama.cpp scales queries by 1/sqrt(head_dim) whatever query_pre_attn_scalar says: head_dim here.
        "gemma3": (
            tf.Gemma3TextConfig,
            dict(num_hidden_layers=6, sliding_window=16, layer_types=["sliding_attention"] * 5 + ["full_attention"],
                 query_pre_attn_scalar=HEAD_DIM,
                 tie_word_embeddings=True,
                 rope_parameters={"sliding_attention": _rope(rope_type="default"),
                                  "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}}),
        ),
        # granite: its four multipliers away from 1 (llama.cpp ignores head_dim for Granite: it must be
        # hidden / heads, as it is here)
        "granite": (
            tf.GraniteConfig,
            dict(embedding_multiplier=12.0, attention_multiplier=0.05, residual_multiplier=0.22, logits_scaling=8.0),
        ),
        "olmo2": (tf.Olmo2Config, {}),  # q/k RMSNorms over all heads, norms after attention and FFN
        # smollm3: llama.cpp leaves out the rope in every fourth layer, whatever no_rope_layers says
        "smollm3": (tf.SmolLM3Config, dict(num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0], no_rope_layer_interval=4)),
        "phi3": (tf.Phi3Config, dict(hidden_act="silu", original_max_position_embeddings=512)),  # fused qkv, gate_up
    }  # fmt: skip
    if arch not in per_arch:
        raise ValueError(f"no tiny {arch!r}; known: {', '.join(per_arch)}")
    cls, fields = per_arch[arch]
    return cls(**{**common, **fields, **overrides})


def _randomize(model, seed: int) -> None:
    """Weights transformers starts at constants made random (norms, biases), q and k scaled up by
    QK_SCALE, the output layer by LOGIT_SCALE (a tied one through the embedding)."""
    g = torch.Generator().manual_seed(seed + 1)
    c = model.config
    q_rows, k_rows = c.num_attention_heads * HEAD_DIM, c.num_key_value_heads * HEAD_DIM
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # RMSNorm weights (1, or 0 in Gemma's 1 + w form)
                p.add_(0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("_proj.bias"):
                p.add_(0.5 * torch.randn(p.shape, generator=g))
            if name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias", "k_proj.bias")):
                p.mul_(QK_SCALE)
            elif name.endswith("qkv_proj.weight"):  # phi3's fused rows: q, then k, then v
                p[: q_rows + k_rows].mul_(QK_SCALE)
        out = model.get_output_embeddings().weight
        out.mul_(LOGIT_SCALE)


def make_tiny(arch: str, folder: str | os.PathLike, seed: int = 0, **overrides) -> Path:
    """A tiny random transformers `arch` model (llama, mistral, qwen2, qwen3, gemma3, granite, olmo2,
    smollm3, phi3) saved in `folder` (fp32 safetensors) with a tokenizer llama.cpp's converter
    accepts (see the module's docstring), for `convert`. overrides: config fields, e.g.
    rope_parameters={"rope_type": "llama3", ...} (see VARIANTS) or num_hidden_layers=4. Returns folder."""
    import transformers as tf

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = _config(arch, **overrides)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _randomize(model, seed)
    model.save_pretrained(folder)
    if arch == "olmo2":
        _write_bpe(folder)
    else:
        _write_sentencepiece(folder)
    return folder


def _specials() -> dict:
    return {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}


def _write_sentencepiece(folder: Path) -> None:
    """tokenizer.model: a SentencePiece BPE of VOCAB pieces (<unk> <s> </s> <|endoftext|>, the 256
    bytes, then pieces learnt from TEXT) and the tokenizer_config.json the converter reads (phi3's
    needs the class). llama.cpp fails to load a file named like Phi-3 whose vocabulary has no
    <|endoftext|> (it sets that token's attributes by name), hence the fourth special."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT.splitlines()), model_writer=model, vocab_size=VOCAB, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, unk_id=UNK, bos_id=BOS, eos_id=EOS, pad_id=-1,
        control_symbols=[ENDOFTEXT], num_threads=1, minloglevel=2,
    )  # fmt: skip
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    config = {"tokenizer_class": "LlamaTokenizer", **_specials(), "add_bos_token": True, "add_eos_token": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def _write_bpe(folder: Path) -> None:
    """tokenizer.json: a byte-level BPE of VOCAB tokens (<unk> <s> </s>, the 256 byte characters,
    merges learnt from TEXT) and its tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXT.splitlines(), trainer)
    if tok.get_vocab_size() != VOCAB:
        raise RuntimeError(f"the BPE has {tok.get_vocab_size()} tokens, not {VOCAB}: give TEXT more to merge")
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **_specials()}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


# ---- llama.cpp: convert, quantize, run -----------------------------------------------------------

# Runs convert_hf_to_gguf.py (argv[1], with its arguments) after one change: a BPE pre-tokenizer the
# converter does not recognise (a test's tiny BPE always is one) is named "gpt-2" instead of refused.
_CONVERT = """
import runpy, sys
from conversion import base
known = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        return "gpt-2"
base.TextModel.get_vocab_base_pre = pre
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(folder: str | os.PathLike, out_path: str | os.PathLike, outtype: str = "f32") -> Path:
    """llama.cpp's convert_hf_to_gguf.py on a transformers folder, run by this interpreter (torch,
    transformers and sentencepiece are here) with the vendored gguf-py first on the path; outtype
    one of the converter's (f32, f16, bf16, q8_0). Returns out_path; raises RuntimeError with the
    converter's last lines when it fails."""
    tools = _tools()
    out_path = Path(out_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tools.converter.parent), str(tools.gguf_py)])}
    argv = [sys.executable, "-c", _CONVERT, tools.converter, folder, "--outfile", out_path, "--outtype", outtype]
    _run(argv, f"convert_hf_to_gguf.py {folder}", env=env)
    return out_path


# Runs llama.cpp's quantizer: argv input, output, llama_ftype; pure: every matrix the file type's own
# type (no mixture of types by tensor, as Q4_K_M has), except where a row length forces a fallback.
_QUANTIZE = """
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype, params.nthread, params.pure = int(sys.argv[3]), 2, True
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
"""


def quantize(f32_gguf: str | os.PathLike, out_path: str | os.PathLike, qtype: str) -> Path:
    """llama.cpp's quantizer (llama_model_quantize, through llama-cpp-python in a subprocess) on a
    GGUF file: every matrix, token embedding and output layer included, to qtype (a QTYPES name);
    1-d tensors stay F32. A matrix whose rows are not a multiple of qtype's block (256 for the
    K-quants and IQ4_XS) gets llama.cpp's fallback type (seen with rows of 128: Q2_K and Q3_K ->
    Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL); the tiny models' rows never
    need one. No type here needs an importance matrix (every one quantizes the tiny models without).
    Returns out_path; raises RuntimeError with llama.cpp's last lines."""
    if qtype not in QTYPES:
        raise ValueError(f"quantize takes {', '.join(QTYPES)}, not {qtype!r}")
    out_path = Path(out_path)
    _run([_tools().python, "-c", _QUANTIZE, f32_gguf, out_path, QTYPES[qtype]], f"llama.cpp's quantizer ({qtype})")
    return out_path


# Prints nothing, writes llama.cpp's logits of every position to argv[3] (.npy). ggml's extra CPU
# buffer types (repacked weights, AMX tiles) are off, as specdec.bench.llama_worker turns them off
# (llama-cpp-python 0.3.36 crashes with them on an AMX CPU for batches of more than one row).
_LOGITS = """
import json, sys
import numpy as np
import llama_cpp
native = llama_cpp.llama_cpp
defaults = native.llama_model_default_params
def without_extra():
    params = defaults()
    if hasattr(params, "use_extra_bufts"):
        params.use_extra_bufts = False
    return params
native.llama_model_default_params = without_extra
ids = json.loads(sys.argv[2])
llm = llama_cpp.Llama(
    model_path=sys.argv[1], n_ctx=len(ids), n_batch=len(ids), n_ubatch=len(ids), n_threads=2,
    n_threads_batch=2, logits_all=True, type_k=0, type_v=0, flash_attn=False, verbose=False,
)
llm.eval(ids)
np.save(sys.argv[3], np.asarray(llm.scores[: len(ids)], dtype=np.float32))
"""


def llama_logits(gguf_path: str | os.PathLike, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits (len(ids), vocab) float32 of every position of the prompt `ids`, from one
    forward (llama-cpp-python in a subprocess, 2 threads, fp32 KV cache, no flash attention, extra
    buffer types off). Raises RuntimeError with its last lines when it fails or crashes."""
    out = Path(gguf_path).with_name(f".{Path(gguf_path).stem}-{os.getpid()}-logits.npy")
    try:
        _run([_tools().python, "-c", _LOGITS, gguf_path, json.dumps(list(ids)), out], f"llama.cpp on {gguf_path}")
        return np.load(out)
    finally:
        out.unlink(missing_ok=True)


def hf_logits(folder: str | os.PathLike, ids: list[int]) -> np.ndarray:
    """transformers' logits (len(ids), vocab) float32 of every position of `ids`: the original
    folder's fp32 forward, eager attention."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.inference_mode():
        return model(torch.tensor([list(ids)])).logits[0].float().numpy()


def prompt(n: int, seed: int = 0) -> list[int]:
    """A prompt of n token ids: <s> then random ordinary tokens (no special tokens, bytes and pieces
    alike)."""
    g = np.random.default_rng(seed)
    return [BOS] + g.integers(FIRST_ORDINARY, VOCAB, n - 1).tolist()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities of each row of logits, in float64."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))
