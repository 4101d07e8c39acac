"""Real conversations as draft-head training data: reading (a file cut off mid-record, JSONL,
both record formats), rendering with the chat template and masking the assistant turns, keeping the
benchmarks out, and training a head on them."""

from __future__ import annotations

import json

import pytest

from specdec.train.conversations import DataError, conversation_rows, encode, messages_of, read_records
from specdec.train.head import load_head
from specdec.train.train import TrainConfig, train_head

from .conftest import make_model
from .conversation_cases import TEMPLATE, sharegpt_record


# a template that marks roles with words the tiny tokenizer knows: w1 user, w2 assistant, w3 end of turn
def _target():
    target = make_model("llama", seed=6)
    target.tokenizer.chat_template = TEMPLATE
    return target


def test_a_file_cut_off_mid_record_keeps_its_complete_records(tmp_path):
    text = json.dumps([sharegpt_record(i) for i in range(3)], indent=1)
    cut = tmp_path / "cut.json"
    cut.write_text(text[: text.rindex('"gpt"')])  # the last record is broken off
    assert [r["id"] for r in read_records(cut)] == ["0", "1"]
    lines = tmp_path / "c.jsonl"
    lines.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": "w1"}]}) for _ in range(2)))
    assert len(read_records(lines)) == 2
    with pytest.raises(DataError, match="no conversations file"):
        read_records(tmp_path / "missing.json")
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(DataError, match="no JSON object"):
        read_records(tmp_path / "empty.json")


def test_roles_are_mapped_and_empty_turns_dropped():
    record = {
        "conversations": [
            {"from": "human", "value": "a"},
            {"from": "gpt", "value": " "},
            {"from": "bing", "value": "x"},
        ]
    }
    assert messages_of(record) == [{"role": "user", "content": "a"}]
    assert messages_of({"messages": [{"role": "assistant", "content": "b"}]}) == [{"role": "assistant", "content": "b"}]
    assert messages_of({"text": "not a conversation"}) == []


def test_the_mask_covers_exactly_the_assistant_turns():
    tok = _target().tokenizer
    ids, mask = encode(tok, messages_of(sharegpt_record(0)), max_tokens=100)
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "w20 w21 w22 w23 w3 w24 w25 w3"
    assert tok.decode([t for t, m in zip(ids, mask) if not m]) == "w1 w10 w11 w12 w3 w2 w1 w13 w3 w2"
    short = encode(tok, messages_of(sharegpt_record(0)), max_tokens=4)  # no assistant token fits
    assert short is None


def test_conversation_rows_keep_the_benchmarks_out(tmp_path):
    path = tmp_path / "conv.json"
    path.write_text(json.dumps([sharegpt_record(i) for i in range(5)]))
    rows = conversation_rows(_target(), str(path), n=10, exclude=("w11 w11",))  # conversation 1's first turn
    assert len(rows) == 4 and all("w11 w11" not in r["text"] for r in rows)
    assert len(conversation_rows(_target(), str(path), n=3)) == 3
    with pytest.raises(DataError, match="no conversation"):
        conversation_rows(_target(), str(path), n=10, exclude=("w21 w22",))  # in every one
    no_template = make_model("llama", seed=6)
    no_template.tokenizer.chat_template = None
    with pytest.raises(DataError, match="chat template"):
        conversation_rows(no_template, str(path), n=3)


def test_a_head_trains_on_conversations(tmp_path):
    path = tmp_path / "conv.jsonl"
    path.write_text("\n".join(json.dumps(sharegpt_record(i)) for i in range(12)))
    dest = tmp_path / "head.safetensors"
    target = _target()
    config = TrainConfig(epochs=1, vocab=40, head_out=dest, data=str(path), conversations=10, steps=2)
    s = train_head(target, tmp_path / "run", config)
    assert s["data"] == str(path) and s["conversations"] == 10 and s["sequences"] == 10
    assert s["positions"] == 10 * 8  # the assistant tokens only: 8 per conversation
    _, meta = load_head(dest, hidden_size=64)
    assert meta["data"] == str(path) and meta["conversations"] == 10
