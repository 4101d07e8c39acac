"""The target's own answers to real conversations' user turns (specdec.answers): what they
are (generate's tokens after the conversation so far, its own earlier answers in it), their masks,
the store (resume, a record cut off mid-write, keys kept apart), the code filter, and the command
line."""

from __future__ import annotations

import json

import pytest

from specdec import answers as answers_module
from specdec.answers import AnswerStore, conversation_data, self_answers, store_key
from specdec.cli import _parser, main
from specdec.engine import generate
from specdec.models.quantize import quantize_model
from specdec.train.conversations import ConversationConfig, DataError, chat_ids, conversation_rows, has_code
from specdec.train.train import TrainConfig, train_head

from .conftest import make_model, remake
from .conversation_cases import TEMPLATE, sharegpt_record

MAX_NEW = 5


@pytest.fixture(scope="module")
def target():
    model = make_model("llama", seed=6)
    model.tokenizer.chat_template = TEMPLATE
    return model


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "conv.jsonl"
    path.write_text("\n".join(json.dumps(sharegpt_record(i)) for i in range(5)))
    return str(path)


@pytest.fixture
def contexts(monkeypatch):
    """The prompts of every answer generated, in order (Decoding spied on)."""
    seen = []

    class Spy(answers_module.Decoding):
        def __init__(self, target, input_ids, *args, **kwargs):
            seen.append(list(input_ids))
            super().__init__(target, input_ids, *args, **kwargs)

    monkeypatch.setattr(answers_module, "Decoding", Spy)
    return seen


def _run(target, data, out, **kw):
    kw = {"n": 5, "max_tokens": 80, "max_new_tokens": MAX_NEW, "batch": 3, **kw}
    return self_answers(target, data, out, ConversationConfig(**kw))


def _store(target, data, out, max_tokens=80, max_new_tokens=MAX_NEW, temperature=0.0, seed=0):
    return AnswerStore(out, store_key(target, data, max_tokens, max_new_tokens, temperature, seed), target.name)


def _no_generation(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("an answer was generated again")

    monkeypatch.setattr(answers_module, "Decoding", refuse)


def test_each_turn_is_the_targets_greedy_answer_after_its_own_earlier_answers(target, data, tmp_path, contexts):
    tok = target.tokenizer
    rows = _run(target, data, tmp_path / "a", n=2, batch=2)
    stored = _store(target, data, tmp_path / "a").known
    assert sorted(stored) == [0, 1] and len(rows) == 2 and len(contexts) == 4  # two turns each
    for i, row in enumerate(rows):
        user1, user2 = f"w{10 + i} w11 w12", "w13"
        first = chat_ids(tok, [{"role": "user", "content": user1}], True)
        answer1 = generate(target, first, None, k=0, max_new_tokens=MAX_NEW).tokens
        text1 = tok.decode(answer1, skip_special_tokens=True)
        second = chat_ids(
            tok,
            [
                {"role": "user", "content": user1},
                {"role": "assistant", "content": text1},
                {"role": "user", "content": user2},
            ],
            True,
        )
        assert first in contexts and second in contexts  # turn 2 answered after the target's own answer 1
        assert "w20" not in tok.decode(second)  # not after the dataset's answer
        answer2 = generate(target, second, None, k=0, max_new_tokens=MAX_NEW).tokens
        assert stored[i][1] == [answer1, answer2]
        # the row: the rendered conversation with the target's answers; the mask on them (and the end of turn)
        text2 = tok.decode(answer2, skip_special_tokens=True)
        masked = [t for t, m in zip(row["answer"], row["mask"]) if m]
        unmasked = [t for t, m in zip(row["answer"], row["mask"]) if not m]
        assert masked == tok(f"{text1} w3 {text2} w3", add_special_tokens=False)["input_ids"]
        assert tok.decode(unmasked) == f"w1 {user1} w3 w2 w1 {user2} w3 w2"
        assert row["prompt"] == [] and len(row["mask"]) == len(row["answer"])


def test_on_the_quantized_backend_a_turn_continues_from_the_previous_turns_cache(tmp_path, data, monkeypatch):
    """Turn 2 starts from turn 1's KV cache (only the new user turn is fed) and its answer is still
    the one a fresh cache gives: the quantized kernels' rows have the same bits in any prefill."""
    fp32 = make_model("llama", seed=6)
    quant = remake(fp32, hf=None, lean=None, gguf=quantize_model(fp32.hf, "q8_0", "tiny"), config=fp32.hf.config)
    quant.tokenizer.chat_template = TEMPLATE
    fed = []

    class Spy(answers_module.Decoding):
        def __init__(self, target, input_ids, *args, cache=None, **kwargs):
            super().__init__(target, input_ids, *args, cache=cache, **kwargs)
            fed.append([list(input_ids), len(self.unfed()), None])

        def result(self, total_s):
            generation = super().result(total_s)
            next(f for f in fed if f[0] == self.prompt)[2] = generation.tokens
            return generation

    monkeypatch.setattr(answers_module, "Decoding", Spy)
    rows = _run(quant, data, tmp_path / "q", n=2, batch=2)
    assert len(rows) == 2 and len(fed) == 4
    for context, feeds, answer in fed:
        assert answer == generate(quant, context, None, k=0, max_new_tokens=MAX_NEW).tokens  # a fresh cache's
        assert feeds <= len(context) - 1
    assert sum(feeds < len(context) - 1 for context, feeds, _ in fed) == 2  # each second turn fed only its new part


def test_a_conversation_stops_where_its_context_reaches_max_tokens(target, data, tmp_path, contexts):
    rows = _run(target, data, tmp_path / "a", n=1, max_tokens=9)
    (answers,) = (a for _, a in _store(target, data, tmp_path / "a", max_tokens=9).known.values())
    first = chat_ids(target.tokenizer, [{"role": "user", "content": "w10 w11 w12"}], True)
    assert len(first) == 6 and len(contexts) == 1  # turn 2's context would not fit
    assert answers == [generate(target, first, None, k=0, max_new_tokens=9 - 6).tokens]  # its budget: what fits
    assert len(rows[0]["answer"]) <= 9
    with pytest.raises(DataError, match="fits in 6 tokens"):  # no first turn leaves room for an answer
        _run(target, data, tmp_path / "b", max_tokens=6)


def test_a_rerun_generates_nothing_and_gives_the_same_rows(target, data, tmp_path, monkeypatch):
    out = tmp_path / "a"
    rows = _run(target, data, out, n=3)
    _no_generation(monkeypatch)
    assert _run(target, data, out, n=3) == rows
    assert _run(target, data, out, n=2) == rows[:2]
    assert _run(target, data, out, n=3, batch=1) == rows  # the batch size is not part of the key


def test_a_store_cut_mid_record_keeps_its_complete_records(target, data, tmp_path, contexts):
    out = tmp_path / "a"
    rows = _run(target, data, out)
    store = _store(target, data, out)
    size, last = store.path.stat().st_size, list(store.known)[-1]  # records in the order written
    store.path.write_bytes(store.path.read_bytes()[:-7])  # killed mid-write
    contexts.clear()
    assert _run(target, data, out) == rows
    assert len(contexts) == 2 and all(f"w{10 + last}" in target.tokenizer.decode(c) for c in contexts)
    assert store.path.stat().st_size == size  # the broken record cut, the redone one appended whole
    with store.path.open("ab") as f:  # a header alone, then a corrupted body
        f.write(b"SDA")
    body = bytearray(store.path.read_bytes())
    body[-20] ^= 0xFF
    store.path.write_bytes(bytes(body))
    contexts.clear()
    assert _run(target, data, out) == rows and len(contexts) == 2


def test_a_different_key_does_not_reuse_answers(target, data, tmp_path, contexts):
    out = tmp_path / "a"
    _run(target, data, out, n=2)
    contexts.clear()
    _run(target, data, out, n=2, max_new_tokens=MAX_NEW + 1)
    assert len(contexts) == 4  # all answered again, in a store of their own
    assert len(list(out.iterdir())) == 2
    contexts.clear()
    _run(target, data, out, n=5)
    _run(target, data, out, n=5, seed=3)  # greedy: another starting point, the same answers
    assert len(contexts) == 2 * 3
    store = _store(target, data, out)
    (store.folder / "key.json").write_text(json.dumps({"another": "key"}))
    with pytest.raises(DataError, match="another key"):
        _run(target, data, out)


def test_sampled_answers_depend_on_the_seed_not_on_the_batch(target, data, tmp_path):
    def answers(out, **kw):
        _run(target, data, out, temperature=50.0, **kw)
        return _store(target, data, out, temperature=50.0, seed=kw.get("seed", 0)).known

    one = answers(tmp_path / "a", batch=1)
    assert answers(tmp_path / "b", batch=4) == one
    assert answers(tmp_path / "c", seed=5) != one
    greedy = _run(target, data, tmp_path / "d")
    assert [r["answer"] for r in _run(target, data, tmp_path / "a", temperature=50.0, batch=1)] != [
        r["answer"] for r in greedy
    ]


def test_has_code():
    assert has_code("why does this fail?\n```\nx = 1\n```")
    assert has_code("def f(x):\n    return x\nclass A:\n    pass\nimport os")
    assert has_code("int main() {\n  printf(1);\n  return 0;\n}")
    assert has_code("const f = (a) => a + 1\nlet x = f(2)\nconsole.log(x);")
    assert not has_code("I want to import a car from Germany. What are the taxes?")
    assert not has_code("Write a poem about the sea; make it short.\nThank you.")


def test_code_only_and_exclude_choose_the_conversations(target, tmp_path, contexts):
    records = [sharegpt_record(i) for i in range(4)]
    records[1]["conversations"][2]["value"] = "w13\n```\nw40\n```"  # code in a user turn
    records[3]["conversations"][1]["value"] = "w20\n```\nw41\n```"  # code only in an answer
    path = tmp_path / "conv.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    code = conversation_rows(target, str(path), n=4, code_only=True)
    assert [r["text"].split()[0] for r in code] == ["w11"]
    rows = _run(target, str(path), tmp_path / "a", code_only=True)
    assert [r["text"].split()[0] for r in rows] == ["w11"]
    assert list(_store(target, str(path), tmp_path / "a").known) == [1]
    rows = _run(target, str(path), tmp_path / "b", exclude=("w12 w11",))  # conversation 2's first turn
    assert [r["text"].split()[0] for r in rows] == ["w10", "w11", "w13"]
    assert 2 not in _store(target, str(path), tmp_path / "b").known
    assert all("w12 w11" not in target.tokenizer.decode(c) for c in contexts)


def test_mix_gives_both_and_the_source_says_which(target, data, tmp_path):
    config = ConversationConfig(n=2, max_tokens=80, max_new_tokens=3)
    rows, source = conversation_data(target, data, tmp_path / "a", "mix", config)
    assert rows[:2] == conversation_rows(target, data, 2, 80)
    assert rows[2:] == self_answers(target, data, tmp_path / "a", config)
    assert source["answers"] == "mix" and source["answer_tokens"] == 3 and source["answer_temperature"] == 0.0
    _, plain = conversation_data(target, data, tmp_path / "a", "sharegpt", ConversationConfig(n=2))
    assert plain["answers"] == "sharegpt" and "answer_tokens" not in plain
    with pytest.raises(ValueError, match="answers must be one of"):
        conversation_data(target, data, tmp_path / "a", "theirs")


def test_a_head_trains_on_the_targets_answers(target, data, tmp_path):
    config = TrainConfig(
        epochs=1,
        vocab=40,
        head_out=tmp_path / "h.safetensors",
        data=data,
        conversations=4,
        steps=1,
        answers="self",
        answer_tokens=4,
        max_tokens=80,
    )
    s = train_head(target, tmp_path / "run", config, conversation_data=conversation_data)
    assert s["answers"] == "self" and s["answer_tokens"] == 4 and s["code_only"] is False and s["sequences"] == 4
    assert s["positions"] == 4 * (4 + 1 + 4 + 1)  # two answers of 4 tokens and their ends of turn
    assert any((tmp_path / "run" / "answers").iterdir())
    with pytest.raises(ValueError, match="needs data"):
        train_head(target, tmp_path / "run2", TrainConfig(vocab=40, answers="self"), conversation_data)
    with pytest.raises(ValueError, match="needs conversation_data"):
        train_head(target, tmp_path / "run3", TrainConfig(vocab=40, data=data, answers="self"))


def test_the_command_line_takes_the_flags_and_refuses_self_without_data(capsys):
    args = _parser().parse_args(
        ["train", "--data", "sharegpt", "--answers", "self", "--answer-temperature", "0.7", "--answer-tokens", "64"]
        + ["--code-only"]
    )
    assert (args.answers, args.answer_temperature, args.answer_tokens, args.code_only) == ("self", 0.7, 64, True)
    assert _parser().parse_args(["train"]).answers == "sharegpt"
    assert main(["train", "--answers", "self"]) == 2
    assert "--answers self needs --data" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parser().parse_args(["train", "--answers", "theirs"])
