"""The draft model's precision chosen by measurement (specdec.drafters.precision)."""

from __future__ import annotations

import json

import pytest

from specdec.drafters import precision
from specdec.models.gguf import hf_config, read_gguf
from specdec.models.load import Model

from .conftest import make_byte_tokenizer
from .gguf_cases import write_tiny


def _model(path, name="tiny"):
    g = read_gguf(path)
    return Model(None, make_byte_tokenizer(), name, gguf=g, config=hf_config(g))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("precision")
    return write_tiny(folder / "target.gguf", "qwen2", seed=0), write_tiny(folder / "other.gguf", "qwen2", seed=1)


def test_the_textbook_speedup_takes_the_best_k():
    assert precision.textbook_speedup(0.0, 0.25) == pytest.approx(1 / 1.25)  # k = 1: one token per round
    assert precision.textbook_speedup(1.0, 0.1) == pytest.approx(9 / 1.8)  # every guess kept: k = 8
    # a = 0.8, c = 0.2: k = 1..5 give 1.5, 1.743, 1.845, 1.8676, 1.8446: k = 4
    assert precision.textbook_speedup(0.8, 0.2) == pytest.approx(3.3616 / 1.8)


def test_a_given_type_is_kept_without_measuring():
    assert precision.draft_quantize(object(), "any", {"quantize": "q4_0"}) == "q4_0"
    assert precision.draft_quantize(object(), "any", {"quantize": "none"}) is None


def test_measure_counts_agreement_with_the_target_and_times_both(tiny):
    target_file, other_file = tiny
    target = _model(target_file)
    same, other = _model(target_file, "same"), _model(other_file, "other")
    measured = precision.measure(target, {None: same, "q4_0": other})
    assert measured[None]["a"] == 1.0  # the target itself guesses every one of its own tokens
    assert measured["q4_0"]["a"] < 0.5  # another random model rarely does (vocabulary 64)
    for m in measured.values():
        assert m["c"] > 0 and m["speedup"] == pytest.approx(precision.textbook_speedup(m["a"], m["c"]))


def test_the_choice_is_the_faster_prediction_cached_per_file(tiny, tmp_path, monkeypatch):
    target = _model(tiny[0])
    draft_file = tmp_path / "draft.gguf"
    draft_file.write_bytes(b"x" * 10)
    calls = []
    speedups = {None: 1.5, "q4_0": 1.7}

    def measure(t, drafts):
        calls.append(sorted(drafts, key=str))
        return {q: {"c": 0.2, "a": 0.8, "speedup": speedups[q]} for q in drafts}

    monkeypatch.setattr(precision, "gguf_file_of", lambda spec, root, pull=False: draft_file)
    monkeypatch.setattr(precision, "load_model", lambda spec, **kw: target)  # any quantized model
    monkeypatch.setattr(precision, "measure", measure)
    kwargs = {"cache": str(tmp_path)}
    assert precision.draft_quantize(target, "draft", kwargs) == "q4_0"
    assert precision.draft_quantize(target, "draft", kwargs) == "q4_0"  # from the cache
    assert len(calls) == 1 and calls[0] == [None, "q4_0"]
    saved = json.loads(next((tmp_path / "draft-precision").glob("draft-*.json")).read_text())
    assert saved["chosen"] == "q4_0" and saved["measured"]["own"]["speedup"] == 1.5
    draft_file.write_bytes(b"x" * 11)  # another file: measured again
    speedups["q4_0"] = 1.4
    assert precision.draft_quantize(target, "draft", kwargs) is None
    assert len(calls) == 2


def test_no_choice_off_the_quantized_backend(tiny, tmp_path, monkeypatch):
    target = _model(tiny[0])
    monkeypatch.setattr(precision, "measure", lambda *a: pytest.fail("measured"))
    kwargs = {"cache": str(tmp_path)}
    assert precision.draft_quantize(target, "not-a-file", kwargs) is None  # no GGUF file behind it
    monkeypatch.setattr(precision, "gguf_file_of", lambda spec, root, pull=False: tiny[1])
    assert precision.draft_quantize(target, "draft", {**kwargs, "dtype": "float32"}) is None
    assert precision.draft_quantize(target, "draft", {**kwargs, "backend": "hf"}) is None


def test_the_llama_cpp_peer_runs_a_requantized_drafts_file(tiny):
    import dataclasses
    from pathlib import Path

    from specdec.bench.peer_rows import _gguf_of

    own = _model(tiny[1])
    assert _gguf_of(own, str(tiny[1]), None) == str(tiny[1])  # the file it runs from
    blocks = dataclasses.replace(own.gguf, path=Path("draft"))  # quantize_model's: no file behind it
    requantized = Model(None, own.tokenizer, "draft", gguf=blocks, config=own.config)
    assert _gguf_of(requantized, str(tiny[1]), None) == str(tiny[1])  # no file of its own: the spec's
