"""Tiny random transformers and word-level tokenizers that the tests build themselves."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from specdec.models.load import Model, Quantized

VOCAB = 64  # tokenizer size; ids 0..2 are <unk> <s> </s>
N_CTX = 96
EOS = 2


def make_tokenizer(words: list[str] | None = None) -> PreTrainedTokenizerFast:
    words = words if words is not None else [f"w{i}" for i in range(VOCAB - 3)]
    vocab = {tok: i for i, tok in enumerate(["<unk>", "<s>", "</s>"] + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


BYTE_CHARS = [*"abcdefghijklmnopqrstuvwxyz0123456789", *'{}":,Ġ[]-._!?()=+*/;<>#@%']  # 61 characters


def make_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A 64-token character-level tokenizer (a BPE with no merges: every text has one tokenization)
    in the byte-level alphabet (Ġ is a space), with a byte-level decoder, as grammar libraries need;
    ids 0..2 are <unk> <s> </s>, then BYTE_CHARS."""
    vocab = {tok: i for i, tok in enumerate(["<unk>", "<s>", "</s>"] + BYTE_CHARS)}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def make_model(
    arch: str = "llama",
    seed: int = 0,
    vocab_size: int = VOCAB,
    tokenizer=None,
    eos: frozenset[int] = frozenset(),
    n_ctx: int = N_CTX,
    name: str | None = None,
    heads: int = 4,
    kv_heads: int = 2,
) -> Model:
    """A 2-layer random model, hidden size 64. eos is empty by default so runs have a known length.
    "gemma3" has a sliding-window layer (window 8) followed by a full-attention one, as Gemma 3
    does."""
    cls_cfg = {
        "llama": (LlamaForCausalLM, LlamaConfig),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config),
        "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig),
    }
    extra = {"gemma3": dict(sliding_window=8, head_dim=16, layer_types=["sliding_attention", "full_attention"])}
    cls, cfg_cls = cls_cfg[arch]
    cfg = cfg_cls(
        **extra.get(arch, {}),
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=n_ctx,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    hf = cls(cfg).eval()
    # Spread the logits (the default init gives near-uniform ones) so argmax ties are not a concern.
    with torch.no_grad():
        hf.lm_head.weight.mul_(20)
    return Model(hf, tokenizer if tokenizer is not None else make_tokenizer(), name or f"tiny-{arch}-{seed}", eos)


def remake(model: Model, **changes) -> Model:
    """A new Model with `model`'s fields except `changes` (hf, tokenizer, name, eos_token_ids, backend,
    lean, gguf, config, hf_loader, kv_dtype), built (and checked) by Model's constructor; the lean forward is
    shared unless `lean` is given."""
    fields = dict(
        hf=model._hf,
        tokenizer=model.tokenizer,
        name=model.name,
        eos_token_ids=model.eos_token_ids,
        backend=model.backend,
        lean=model._lean,
        gguf=model.gguf,
        config=model._config,
        hf_loader=model._hf_loader,
        kv_dtype=model._kv_dtype,
    )
    fields |= changes
    gguf, config, loader, kv_dtype = (fields.pop(f) for f in ("gguf", "config", "hf_loader", "kv_dtype"))
    return Model(**fields, gguf=Quantized(gguf, config, loader, kv_dtype))


@pytest.fixture(scope="session", autouse=True)
def session_verify_cost_cache(tmp_path_factory):
    """Verify-cost curves (specdec.adaptive.costs) cached by session- and module-scoped fixtures
    (a server's) go to a temporary folder, never to the user's cache."""
    folder = tmp_path_factory.mktemp("verify-costs-session")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("specdec.adaptive.costs.folder", lambda cache=None: folder)
        yield folder


@pytest.fixture(autouse=True)
def verify_cost_cache(tmp_path_factory, monkeypatch):
    """Each test caches verify-cost curves in a folder of its own, so no test reads a curve that
    another one timed."""
    folder = tmp_path_factory.mktemp("verify-costs")
    monkeypatch.setattr("specdec.adaptive.costs.folder", lambda cache=None: folder)
    return folder


@pytest.fixture(autouse=True)
def keep_thread_count():
    """Every test leaves torch's thread count as it found it (the invariance tests set 1 or 2)."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session", params=["llama", "qwen2", "gemma3"])
def target(request) -> Model:
    return make_model(request.param, seed=1)


@pytest.fixture(scope="session")
def draft_model() -> Model:
    return make_model("llama", seed=7, name="tiny-draft")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny Llama saved as a Hugging Face folder, for the CLI and the bench to load."""
    folder = tmp_path_factory.mktemp("tiny")
    model = make_model("llama", seed=1)
    model.hf.save_pretrained(folder)
    model.tokenizer.save_pretrained(folder)
    return folder


def prompt_ids(n: int = 12, seed: int = 0) -> list[int]:
    """A prompt with a repeated phrase, so prompt lookup finds matches."""
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(3, VOCAB, (n // 2,), generator=g).tolist()
    return [1] + phrase + phrase[: n - 1 - len(phrase)]


@pytest.fixture(scope="session")
def smol() -> Model:
    """The packaged SmolLM2-135M at its GGUF precision (Q4_1); skips when it is not pulled."""
    from specdec.models.registry import REGISTRY
    from specdec.models.weights import cache_dir, is_pulled

    name = REGISTRY["smollm2-135m"].name
    if not is_pulled(name, cache_dir()):
        pytest.skip(f"{name} is not pulled: run `specdec models pull {name}`")
    from specdec.models.load import load_model

    return load_model(name)
