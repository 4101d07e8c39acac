"""Incremental detokenization (specdec.textstream) against the full decode, on the registry's real
tokenizers (byte-level BPE: characters split across tokens, special tokens) and a word-level one."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec.models.load import load_model
from specdec.models.weights import cache_dir, is_pulled
from specdec.textstream import CONTEXT, IncrementalText, TextDeltas

from .conftest import make_tokenizer

TEXT = "Grüße, 世界! Café naïve 🙂🚀 — x = [i**2 for i in range(10)]\n\tdone. 日本語のテキスト 😀👍🏽"
TOKENIZERS: dict[str, object] = {}


def tokenizer(name: str):
    if name == "words":
        return make_tokenizer()
    if name not in TOKENIZERS:
        if not is_pulled(name, cache_dir()):
            pytest.skip(f"{name} is not pulled: run `specdec models pull {name}`")
        TOKENIZERS[name] = load_model(name).tokenizer
    return TOKENIZERS[name]


def decode(tok, ids):
    return tok.decode(list(ids), skip_special_tokens=True)


def token_lists(name: str):
    """Token id lists: the ids of real text with characters split across tokens, shuffled in runs,
    with random ids of the whole vocabulary (special tokens included) mixed in; then chunk sizes."""
    tok = tokenizer(name)
    real = tok(TEXT)["input_ids"] if name != "words" else tok("a b c d e f g h")["input_ids"]
    ids = st.one_of(st.sampled_from(real), st.integers(0, len(tok) - 1))
    runs = st.lists(st.lists(ids, min_size=1, max_size=4) | st.just(real[:12]), min_size=1, max_size=24)
    return runs.map(lambda rs: [i for r in rs for i in r])


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b", "words"])
def test_incremental_text_is_the_full_decode(name):
    tok = tokenizer(name)

    @settings(max_examples=60, deadline=None)
    @given(ids=token_lists(name), chunks=st.lists(st.integers(1, 5), min_size=1, max_size=8))
    def check(ids, chunks):
        text, done, c = IncrementalText(tok), 0, 0
        while done < len(ids):
            n = chunks[c % len(chunks)]
            c += 1
            new = ids[done : done + n]
            assert text.peek(new) == decode(tok, ids[: done + n])  # without appending
            assert text.add(new) == decode(tok, ids[: done + n])
            done += n
        assert text.ids == ids

    check()


def test_the_real_texts_characters_split_across_tokens_are_decoded_one_token_at_a_time():
    tok = tokenizer("smollm2-135m")
    ids = tok(TEXT)["input_ids"]
    text = IncrementalText(tok)
    partial = 0
    for i, t in enumerate(ids):
        got = text.add([t])
        assert got == decode(tok, ids[: i + 1])
        partial += got.endswith("\ufffd")
    assert text.add([]) == TEXT and partial > 0  # some characters took several tokens
    assert len(ids) > 3 * CONTEXT  # the window moved along the text


def test_deltas_release_the_whole_text_once_and_hold_back_a_stop_string():
    tok = tokenizer("smollm2-135m")
    ids = tok(TEXT)["input_ids"]
    deltas = TextDeltas(tok, [])
    assert "".join(deltas(ids[i : i + 3]) for i in range(0, len(ids), 3)) == TEXT
    stop = "naïve"
    deltas = TextDeltas(tok, [stop])
    assert "".join(deltas([t]) for t in ids) == TEXT[: TEXT.index(stop)]
