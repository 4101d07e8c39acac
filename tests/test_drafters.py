"""The suffix drafter (a suffix automaton over the context and a corpus) and the layer-skip drafter
(the target with some decoder layers skipped), and its calibration; the factory that builds every
drafter from options (cli, bench and serve)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import generate, make_drafter
from specdec.cli import main
from specdec.drafters import EagleDrafter, ModelDrafter, PromptLookup, RandomDrafter
from specdec.drafters.factory import (
    DRAFTERS,
    REGISTERED,
    check_options,
    drafter_from_options,
    options_for,
)
from specdec.drafters.layerskip import LayerSkipDrafter
from specdec.drafters.lookup import MAX_MATCH, continuation
from specdec.drafters.suffix import SuffixAutomaton, SuffixDrafter, load_corpus
from specdec.models.load import load_model
from specdec.models.skip import parse_layers, skip_view
from specdec.sampling import Sampler, SamplingParams
from specdec.train.calibrate import (
    CalibrateConfig,
    _run_from,
    calibrate_skip,
    save_skip_layers,
    simulated_tau,
    skip_file,
    skip_layers_for,
)

from .conftest import VOCAB, make_model, prompt_ids

N_NEW = 40
GREEDY = Sampler(SamplingParams())
sequences = st.lists(st.integers(0, 3), min_size=1, max_size=60)


# ---- the suffix automaton against brute force ---------------------------------------------------


def brute_repeat(seq: list[int]) -> tuple[int, int, int]:
    """(length, end of the most recent earlier occurrence, occurrences) of the longest suffix of
    seq that also ends earlier in it, by trying every length."""
    n = len(seq)
    for length in range(n - 1, 0, -1):
        ends = [e for e in range(length - 1, n - 1) if seq[e - length + 1 : e + 1] == seq[n - length :]]
        if ends:
            return length, ends[-1], len(ends) + 1
    return 0, -1, 0


@settings(max_examples=150, deadline=None)
@given(sequences)
def test_longest_repeat_matches_brute_force(seq):
    sam = SuffixAutomaton()
    for i, token in enumerate(seq):
        sam.extend([token])
        length, state, end = sam.longest_repeat()
        want_length, want_end, want_count = brute_repeat(seq[: i + 1])
        assert (length, end) == (want_length, want_end), seq[: i + 1]
        if length:
            assert sam.count[state] == want_count


@settings(max_examples=100, deadline=None)
@given(sequences, st.lists(st.integers(0, 3), max_size=30))
def test_matching_statistics_match_brute_force(corpus, text):
    """step() tracks the longest suffix of another text that occurs anywhere in the sequence."""
    sam = SuffixAutomaton()
    sam.extend(corpus)
    state, matched = 0, 0
    for i, token in enumerate(text):
        state, matched = sam.step(state, matched, token)
        seen = text[: i + 1]
        want = max(
            (
                n
                for n in range(len(seen) + 1)
                if any(corpus[s : s + n] == seen[len(seen) - n :] for s in range(len(corpus) - n + 1))
            ),
            default=0,
        )
        assert matched == want
        if matched:  # the state's recorded occurrence really ends with the matched text
            end = sam.recent[state]
            assert corpus[end - matched + 1 : end + 1] == seen[len(seen) - matched :]


def test_separators_stop_matches_and_drafts():
    sam = SuffixAutomaton()
    sam.extend([5, 6, 7])
    sam.add_separator()
    sam.extend([5, 6])
    length, _, end = sam.longest_repeat()
    assert (length, end) == (2, 1)
    assert sam.continuation(end, 4) == [7]  # stops at the separator after 7
    with pytest.raises(ValueError, match="max_depth"):
        SuffixAutomaton(max_depth=0)


def test_capped_statistics_stay_real_occurrences():
    """With the statistics walk capped, a long repetition still yields genuine earlier matches."""
    seq = [1, 2] * 40 + [3] + [1, 2] * 5
    sam = SuffixAutomaton(max_depth=2)
    sam.extend(seq)
    length, _, end = sam.longest_repeat()
    assert length == brute_repeat(seq)[0]
    assert seq[end - length + 1 : end + 1] == seq[len(seq) - length :] and end < len(seq) - 1


# ---- the suffix drafter -------------------------------------------------------------------------


@pytest.mark.parametrize("frequent", [True, False])
def test_drafter_proposes_the_longest_matchs_continuation(frequent):
    # "9 1 2" occurs twice: after the longer match "8 9 1 2" comes 30, after "9 1 2" alone 20.
    context = [8, 9, 1, 2, 30, 31, 32, 9, 1, 2, 20, 21, 5, 8, 9, 1, 2]
    draft = SuffixDrafter(frequent=frequent).propose(context, 3)
    assert draft.tokens == [30, 31, 32] and draft.match_length == 4
    # Prompt lookup capped at 3 tokens takes the most recent "9 1 2" instead.
    assert make_drafter("prompt-lookup", max_ngram=3).propose(context, 3, GREEDY).tokens == [20, 21, 5]


@pytest.mark.parametrize("frequent", [True, False])
def test_drafter_continues_a_repetition_past_the_end(frequent):
    context = [4, 5, 6, 4, 5, 6, 4]
    assert SuffixDrafter(frequent=frequent).propose(context, 7).tokens == [5, 6, 4, 5, 6, 4, 5]


def test_prompt_lookup_continues_a_repetition_past_the_end():
    lookup = make_drafter("prompt-lookup", max_ngram=3)
    assert lookup.propose([4, 5, 6, 4, 5, 6, 4], 7, GREEDY).tokens == [5, 6, 4, 5, 6, 4, 5]
    assert lookup.propose([9, 7, 7, 7], 4, GREEDY).tokens == [7, 7, 7, 7]  # a one-token loop, drafted k deep
    assert lookup.propose([1, 2, 3, 4, 1, 2], 2, GREEDY).tokens == [3, 4]  # far occurrences as before


def test_min_match_and_nothing_to_match():
    context = [1, 2, 3, 9, 2]  # only the 1-token suffix "2" occurred before
    assert SuffixDrafter(min_match=1).propose(context, 2).tokens == [3, 9]
    assert SuffixDrafter(min_match=2).propose(context, 2).tokens == []
    assert SuffixDrafter().propose([1, 2, 3], 4).tokens == []
    assert SuffixDrafter().propose(context, 0).tokens == []


def test_frequent_continuation_prefers_the_most_common():
    context = [1, 2, 7, 1, 2, 7, 1, 2, 8, 1, 2]  # after "1 2": 7 twice, 8 once (most recent)
    assert SuffixDrafter(frequent=False).propose(context, 1).tokens == [8]
    assert SuffixDrafter().propose(context, 1).tokens == [7]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 5), min_size=2, max_size=80),
    st.lists(st.integers(1, 6), min_size=1, max_size=20),
    st.booleans(),
)
def test_incremental_equals_rebuild(seq, steps, frequent):
    """The drafter extended round by round proposes what a fresh one built on the whole context does."""
    drafter = SuffixDrafter(frequent=frequent, corpus=[seq[::-1]])
    end = 1
    for step in steps:
        end = min(end + step, len(seq))
        fresh = SuffixDrafter(frequent=frequent, corpus=[seq[::-1]]).propose(seq[:end], 4)
        assert drafter.propose(seq[:end], 4).tokens == fresh.tokens
    assert drafter.ctx.tokens == seq[:end]  # extended, never rebuilt past what it saw


def test_new_context_resets():
    drafter = SuffixDrafter()
    first = [1, 2, 3, 4, 1, 2]
    assert drafter.propose(first, 2).tokens == [3, 4]
    assert drafter.propose(first + [3], 2).tokens == [4, 1]
    other = [7, 1, 2, 9, 1, 2]  # not an extension of `first`: nothing from `first` may leak in
    assert drafter.propose(other, 2).tokens == [9, 1]
    assert drafter.ctx.tokens == other
    drafter.prepare(None)
    assert drafter.ctx.tokens == [] and drafter.propose([5, 1, 2], 2).tokens == []


def test_corpus_and_remembered_outputs():
    drafter = SuffixDrafter(corpus=[[10, 11, 12, 13, 14]])
    assert drafter.propose([3, 10, 11], 3).tokens == [12, 13, 14]
    assert drafter.propose([3, 10, 11, 12, 13, 14], 3).tokens == []  # the corpus match runs into the document's end
    # "10 11" matches in both the context and the corpus: the context's (more recent text) wins.
    assert SuffixDrafter(corpus=[[10, 11, 13]]).propose([3, 10, 11, 12, 10, 11], 3).tokens == [12, 10, 11]
    late = SuffixDrafter()
    assert late.propose([3, 20, 21], 2).tokens == []
    late.add_document([20, 21, 22, 23])  # mid-generation: the context is matched against it afresh
    assert late.propose([3, 20, 21], 2).tokens == [22, 23]
    remembering = SuffixDrafter(remember=True)
    remembering.prepare(None)
    remembering.propose([1, 2], 2)  # prompt [1, 2]
    remembering.propose([1, 2, 40, 41, 42, 43], 2)  # output so far 40..43
    remembering.prepare(None)  # a new generation: the last output goes into the corpus
    assert remembering.propose([6, 40, 41], 2).tokens == [42, 43]
    assert SuffixDrafter().propose([6, 40, 41], 2).tokens == []
    with pytest.raises(ValueError, match="token ids"):
        SuffixDrafter(corpus=["some text"])
    with pytest.raises(ValueError, match="min_match"):
        SuffixDrafter(min_match=0)


def test_corpus_files(tmp_path):
    lists = tmp_path / "lists.json"
    lists.write_text(json.dumps([[10, 11, 12], [20, 21]]))
    assert load_corpus(lists) == [[10, 11, 12], [20, 21]]
    data = tmp_path / "data.json"  # as `specdec train` writes it: the target's answers are the corpus
    data.write_text(json.dumps({"key": {}, "rows": [{"text": "t", "prompt": [1, 2], "answer": [30, 31, 32]}]}))
    assert load_corpus(data) == [[30, 31, 32]]
    assert SuffixDrafter(corpus=load_corpus(data)).propose([5, 30, 31], 1).tokens == [32]
    for bad, text in (
        (tmp_path / "missing.json", None),
        (tmp_path / "bad.json", "{nope"),
        (tmp_path / "obj.json", '{"a": 1}'),
    ):
        if text is not None:
            bad.write_text(text)
        with pytest.raises(ValueError, match="corpus"):
            load_corpus(bad)


# ---- layer skipping -----------------------------------------------------------------------------


def test_layer_view_shares_weights_and_leaves_the_target_alone():
    target = make_model("llama", seed=1)
    before = [(layer.self_attn.layer_idx, layer.self_attn) for layer in target.hf.model.layers]
    view = skip_view(target, [1])
    shared = {p.data_ptr() for p in target.hf.parameters()}
    assert all(p.data_ptr() in shared for p in view.hf.parameters())
    assert view.hf.lm_head.weight.data_ptr() == target.hf.lm_head.weight.data_ptr()
    assert view.hf.model.layers[0].mlp.down_proj.weight is target.hf.model.layers[1].mlp.down_proj.weight
    assert len(view.hf.model.layers) == 1 and view.hf.config.num_hidden_layers == 1
    assert view.hf.model.layers[0].self_attn.layer_idx == 0
    assert [(layer.self_attn.layer_idx, layer.self_attn) for layer in target.hf.model.layers] == before
    assert len(target.hf.model.layers) == 2 and target.hf.config.num_hidden_layers == 2


def test_parse_layers():
    assert parse_layers("0-2,5, 7") == [0, 1, 2, 5, 7]
    assert parse_layers([3, 1, 3]) == [1, 3]
    for bad, msg in [("", "empty"), ("1,x", "bad layer"), ([0, 4], "0..1")]:
        with pytest.raises(ValueError, match=msg):
            parse_layers(bad, 2)


def test_full_view_is_the_target(target):
    """Keeping every layer, the draft is the target: every drafted token is accepted."""
    prompt = prompt_ids()
    got = generate(target, prompt, LayerSkipDrafter([0, 1]), k=4, max_new_tokens=N_NEW)
    assert got.stats.alpha == 1.0 and got.tokens == generate(target, prompt, None, max_new_tokens=N_NEW).tokens


@pytest.mark.parametrize("k", [1, 2, 4, 8, "auto"])
def test_greedy_equals_plain(target, k):
    prompt = prompt_ids()
    base = generate(target, prompt, None, max_new_tokens=N_NEW)
    drafters = {
        "suffix": SuffixDrafter(),
        "suffix-recent": SuffixDrafter(frequent=False, min_match=2),
        "layer-skip-0": LayerSkipDrafter([0]),
        "layer-skip-1": LayerSkipDrafter("1"),
    }
    for name, drafter in drafters.items():
        got = generate(target, prompt, drafter, k=k, max_new_tokens=N_NEW)
        assert got.tokens == base.tokens, f"{name}, k={k}"
        assert got.stats.accepted + got.stats.rounds == N_NEW, name
        assert got.stats.drafted > 0 or k == "auto", name  # auto may find drafting does not pay


def test_layer_skip_sampling_gives_valid_reproducible_output(target):
    prompt = prompt_ids()

    def run(seed):
        return generate(
            target, prompt, LayerSkipDrafter([0]), k=3, max_new_tokens=30, temperature=1.0, top_p=0.9, seed=seed
        )

    a, b, c = run(5), run(5), run(6)
    assert len(a.tokens) == 30 and all(0 <= t < VOCAB for t in a.tokens)
    assert a.tokens == b.tokens and a.tokens != c.tokens
    assert 0 < a.stats.drafted and a.stats.accepted <= a.stats.drafted


def test_teacher_forced_tau_is_the_engines(target):
    """The calibration's premise: one teacher-forced forward of the draft predicts exactly the
    rounds greedy speculative decoding takes."""
    prompt = prompt_ids()
    for layers, k in [([0], 3), ([1], 4)]:
        run = generate(target, prompt, LayerSkipDrafter(layers), k=k, max_new_tokens=N_NEW)
        out = torch.tensor(run.tokens)
        view = skip_view(target, layers)
        embeds = view.hf.get_input_embeddings()(torch.tensor([prompt + run.tokens[:-1]]))
        matches = (_run_from(view, embeds, len(out))[0] == out).tolist()
        assert simulated_tau(matches, k) == (run.stats.rounds, run.stats.accepted)


def test_calibration_is_written_atomically_and_loaded(tmp_path, monkeypatch):
    target = make_model("qwen2", seed=1, name="tiny/qwen2")
    config = CalibrateConfig(prompts=("w1 w2 w3 w1 w2", "w9 w8 w7"), k=3, max_new_tokens=12, verify_ratio=1.5)
    res = calibrate_skip(target, config)
    assert res["n_layers"] == 2 and len(res["layers"]) == 1 and res["verify_ratio"] == 1.5
    assert [len(p["layers"]) for p in res["path"]] == [2, 1] and res["path"][0][
        "tau"
    ] == 4.0  # all accepted: 12 tokens in 3 rounds
    assert 0 < res["draft_cost"] < 1 and res["est_speedup"] == pytest.approx(res["tau"] / (3 * res["draft_cost"] + 1.5))
    # The search's τ (from hidden states reused across candidates) is that of the chosen draft run for real.
    prompts = [target.encode(t) for t in ["w1 w2 w3 w1 w2", "w9 w8 w7"]]
    runs = [generate(target, p, LayerSkipDrafter(res["layers"]), k=3, max_new_tokens=12).stats for p in prompts]
    assert res["tau"] == pytest.approx(sum(r.new_tokens for r in runs) / sum(r.rounds for r in runs))

    path = save_skip_layers(res, tmp_path)
    assert path == skip_file("tiny/qwen2", tmp_path) and path.parent == tmp_path / "layer-skip"
    assert json.loads(path.read_text())["layers"] == res["layers"]
    with monkeypatch.context() as m:  # read from the cache, not calibrated again
        m.setattr("specdec.train.calibrate.calibrate_skip", lambda *a, **kw: pytest.fail("calibrated again"))
        assert skip_layers_for(target, tmp_path) == res["layers"]
    drafter = LayerSkipDrafter(cache=tmp_path)
    drafter.prepare(target)
    assert drafter.view.hf.config.num_hidden_layers == 1

    # A write that fails half way leaves the previous file whole and no temporary file behind.
    def broken_dump(obj, f, **kw):
        f.write('{"half": ')
        raise OSError("disk full")

    monkeypatch.setattr(json, "dump", broken_dump)
    with pytest.raises(OSError):
        save_skip_layers({**res, "layers": [0]}, tmp_path)
    monkeypatch.undo()
    assert json.loads(path.read_text())["layers"] == res["layers"]
    assert os.listdir(path.parent) == [path.name]  # (a stale file is made again: tests/test_layerskip.py)


def test_cli_suffix_layer_skip_and_calibrate(model_dir, tmp_path, capsys):
    base = [
        "generate",
        "w1 w2 w3 w4 w1 w2 w3",
        "--target",
        str(model_dir),
        "-k",
        "3",
        "--max-new-tokens",
        "16",
        "--compare",
    ]
    assert main(base + ["--drafter", "suffix", "--min-match", "2"]) == 0
    assert "identical to plain greedy: yes" in capsys.readouterr().out
    assert main(base + ["--drafter", "layer-skip", "--layers", "1"]) == 0
    assert "identical to plain greedy: yes" in capsys.readouterr().out
    assert (
        main(
            [
                "calibrate-skip",
                "--target",
                str(model_dir),
                "--max-new-tokens",
                "8",
                "--verify-ratio",
                "1.2",
                "--cache-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    assert "keep 1 of 2 layers" in capsys.readouterr().out
    assert main(base + ["--drafter", "layer-skip", "--cache-dir", str(tmp_path)]) == 0
    assert "identical to plain greedy: yes" in capsys.readouterr().out


# ---- the factory from options -------------------------------------------------------------------


# Every registered drafter with a value for each option it takes, and what it then is.
def _examples(draft_model, corpus_file, cache, quantized_draft) -> dict:
    return {
        "prompt-lookup": (dict(max_ngram=4, min_ngram=2), PromptLookup, dict(max_ngram=4, min_ngram=2)),
        "model": (dict(draft=quantized_draft, vocab=8), ModelDrafter, dict(checked={})),
        "model-lookup": (dict(draft=draft_model, vocab=None), ModelDrafter, dict(draft=draft_model)),
        "random": ({}, RandomDrafter, {}),
        "suffix": (dict(corpus=[[5, 6, 7]], min_match=2), SuffixDrafter, dict(min_match=2, tree=False)),
        "suffix-tree": (dict(corpus=corpus_file, min_match=3), SuffixDrafter, dict(min_match=3, tree=True)),
        "layer-skip": (dict(layers="0-1", cache=cache), LayerSkipDrafter, dict(layers=[0, 1], cache=cache)),
        "eagle": (
            dict(head="h.safetensors", cache=cache, quantize="q4_0", vocab=512),
            EagleDrafter,
            dict(spec="h.safetensors", cache=cache, alternatives=0, lookup=None, quantize="q4_0", vocab=512),
        ),
        "eagle-tree": (
            dict(head="h.safetensors", cache=cache, quantize="q8_0", vocab=None),
            EagleDrafter,
            dict(spec="h.safetensors", alternatives=1, quantize="q8_0", vocab=None),
        ),
    }


def test_every_drafter_builds_from_its_options(draft_model, model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))  # the vocabulary's ranking is cached there
    corpus_file = tmp_path / "corpus.json"
    corpus_file.write_text(json.dumps([[5, 6, 7], [8, 9]]))
    quantized = load_model(str(model_dir), quantize="q8_0")
    examples = _examples(draft_model, str(corpus_file), tmp_path, quantized)
    assert set(examples) == set(DRAFTERS) == set(REGISTERED)  # a new drafter needs a row here
    for name, (options, kind, expect) in examples.items():
        assert set(options) == set(REGISTERED[name].options), name  # every option it takes is exercised
        drafter = drafter_from_options(name, **options)
        assert type(drafter) is kind, name
        for attr, value in expect.items():
            assert getattr(drafter, attr) == value, (name, attr)
        required = {o: v for o, v in options.items() if o in REGISTERED[name].required}
        assert type(drafter_from_options(name, **required)) is kind  # the others have defaults
    for name, entry in REGISTERED.items():
        assert entry.main is None or entry.main in entry.options, name
        assert set(entry.required) <= set(entry.options), name
    assert len(drafter_from_options("suffix", corpus=corpus_file).corpus) > 0  # a path: load_corpus
    assert drafter_from_options("eagle-tree").lookup is not None
    assert drafter_from_options("model", draft=quantized, vocab=8).draft.lean().lm_head.out_features == 8


def test_wrong_or_missing_options_are_one_clear_error(draft_model):
    with pytest.raises(ValueError, match=r"^the model drafter needs a draft model: pass --draft MODEL$"):
        drafter_from_options("model")
    with pytest.raises(
        ValueError,
        match=r"the suffix drafter takes no max_ngram option \(--max-ngram\); "
        r"it takes corpus, min_match",
    ):
        drafter_from_options("suffix", max_ngram=3)
    with pytest.raises(
        ValueError,
        match=r"the random drafter takes no head option \(--head\); "
        r"it takes none",
    ):
        drafter_from_options("random", head="h.safetensors")
    with pytest.raises(ValueError, match="the prompt-lookup drafter takes no draft option"):
        drafter_from_options("prompt-lookup", draft=draft_model)
    with pytest.raises(
        ValueError,
        match=r"the eagle drafter takes no layers option \(--layers\); "
        r"it takes head, cache",
    ):
        drafter_from_options("eagle", layers="0")
    with pytest.raises(ValueError, match="unknown drafter 'nope'; known: prompt-lookup, model"):
        drafter_from_options("nope")
    with pytest.raises(ValueError, match="unknown drafter option 'ngram'"):
        check_options("prompt-lookup", ngram=3)
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):  # the drafter's own check of a value
        drafter_from_options("prompt-lookup", max_ngram=2, min_ngram=3)
    check_options("model", draft="a-spec", max_ngram=None)  # None is "not given"


def test_options_for_keeps_what_a_drafter_takes():
    settings = dict(draft="d", layers="0", head=None, cache="c", max_ngram=4, min_ngram=1, min_match=2)
    assert options_for("prompt-lookup", settings) == dict(max_ngram=4, min_ngram=1)
    assert options_for("eagle", settings) == dict(cache="c")  # head None: not given
    assert options_for("model", settings) == dict(draft="d")
    assert options_for("random", settings) == {}
    with pytest.raises(ValueError, match="unknown drafter"):
        options_for("nope", settings)


def test_serve_offers_every_drafter_it_has_options_for(draft_model):
    from specdec.serve.app import _registry_drafters

    plain = _registry_drafters(None, max_ngram=5, min_ngram=2)
    assert set(plain) == set(DRAFTERS) - {"model", "model-lookup"}  # the model drafters only with a draft model
    assert (plain["prompt-lookup"].max_ngram, plain["prompt-lookup"].min_ngram) == (5, 2)
    assert type(plain["eagle-tree"]) is EagleDrafter and plain["suffix-tree"].tree
    with_draft = _registry_drafters(draft_model, max_ngram=3, min_ngram=1)
    assert set(with_draft) == set(DRAFTERS) and with_draft["model"].draft is draft_model


def test_a_model_draft_with_lookup_proposes_a_long_match_for_free_and_stays_exact(target, draft_model):
    drafter = ModelDrafter(draft_model, lookup=True)
    drafter.prepare(target)
    repeated = [5, 9, 13, 17, 21, 25, 29, 33]
    context = [3, 4] + repeated + [7, 8] + repeated[:6]  # the last 6 tokens occurred before
    calls = []
    original = drafter.kv.extend
    drafter.kv.extend = lambda *a, **kw: calls.append(a) or original(*a, **kw)
    draft = drafter.propose(context, 4, GREEDY)
    assert draft.tokens == [29, 33, 7, 8] and draft.match_length >= 6
    assert calls == []  # the draft model did not run
    assert drafter.long_match(context) == draft.match_length
    assert drafter.long_match(context[:-3]) is None  # a 3-token match: the model drafts
    ids = prompt_ids(12) * 2
    plain = generate(target, ids, None, k=0, max_new_tokens=24)
    assert generate(target, ids, ModelDrafter(draft_model, lookup=True), k=4, max_new_tokens=24).tokens == plain.tokens


def test_a_draft_model_fills_its_cache_with_the_prefill_not_in_the_first_round(target, draft_model):
    from specdec.engine import stepwise

    drafter = ModelDrafter(draft_model)
    ids = prompt_ids(40)
    rounds = stepwise(target, ids, drafter, k=4, max_new_tokens=24)
    assert next(rounds) == 0  # the prefill is done
    assert drafter.kv.tokens == ids[:-1]  # the draft model's too, so its time counts as prefill
    fed = []
    original = drafter.kv.extend
    drafter.kv.extend = lambda tokens, **kw: fed.append(list(tokens)) or original(tokens, **kw)
    next(rounds)
    assert fed[0] == ids[-1:]  # the first round feeds the prompt's last token only
    for _ in rounds:
        pass
    plain = generate(target, ids, None, k=0, max_new_tokens=24)
    assert generate(target, ids, ModelDrafter(draft_model), k=4, max_new_tokens=24).tokens == plain.tokens


def test_a_draft_model_reads_only_its_window_of_a_long_prompt_and_stays_exact(target, draft_model):
    from specdec.engine import stepwise

    drafter = ModelDrafter(draft_model, window=8)
    ids = prompt_ids(40)
    rounds = stepwise(target, ids, drafter, k=4, max_new_tokens=24)
    assert next(rounds) == 0
    assert drafter.kv.tokens == ids[32:-1]  # the prompt's last 8 tokens but the one the first round feeds
    for _ in rounds:
        pass
    assert drafter.kv.tokens[:7] == ids[32:-1]  # the draft went on from there
    plain = generate(target, ids, None, k=0, max_new_tokens=24)
    for window in (1, 8, None):
        spec = generate(target, ids, ModelDrafter(draft_model, lookup=True, window=window), k=4, max_new_tokens=24)
        assert spec.tokens == plain.tokens
    with pytest.raises(ValueError, match="at least 1 token"):
        ModelDrafter(draft_model, window=0)


def _scanned(context: list[int], k: int, max_ngram: int, min_ngram: int) -> tuple[list[int], int | None]:
    """Prompt lookup by a scan of the whole context (its definition), to check the indexed one."""
    L = len(context)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        for start in range(L - n - 1, -1, -1):
            if context[start : start + n] == context[L - n :]:
                length = n
                while (
                    length < MAX_MATCH
                    and start - (length - n) > 0
                    and context[start - (length - n) - 1] == context[L - length - 1]
                ):
                    length += 1
                return continuation(context, start + n, k), length
    return [], None


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(0, 5), min_size=1, max_size=60),
    st.lists(st.integers(0, 5), max_size=40),
    st.integers(1, 4),
    st.integers(1, 4),
)
def test_indexed_prompt_lookup_equals_the_scan_as_a_context_grows_or_changes(prompt, output, max_ngram, min_ngram):
    min_ngram = min(min_ngram, max_ngram)
    lookup = PromptLookup(max_ngram, min_ngram)
    tokens = list(prompt)
    for t in [None, *output]:  # a generation's list, grown by appends
        if t is not None:
            tokens.append(t)
        draft = lookup.propose(tokens, 5, GREEDY)
        assert (draft.tokens, draft.match_length) == _scanned(tokens, 5, max_ngram, min_ngram)
    for other in (tokens[: len(tokens) // 2], [t + 1 for t in tokens], tokens + [0, 1]):  # shorter, changed, new list
        draft = lookup.propose(other, 3, GREEDY)
        assert (draft.tokens, draft.match_length) == _scanned(other, 3, max_ngram, min_ngram)


def test_forks_of_a_drafter_with_prompt_lookup_keep_tables_of_their_own():
    # the batch and the server fork one drafter per sequence: a lookup table shared between two
    # contexts would be rebuilt at every call, or worse, answer from the other's n-grams
    a_context, b_context = [5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3, 4, 1, 2]
    drafters = [PromptLookup(), SuffixDrafter(tree=True, lookup=True), ModelDrafter(make_model("llama"), lookup=True)]
    for drafter in drafters:
        table = drafter if isinstance(drafter, PromptLookup) else drafter.lookup
        a, b = (d if isinstance(d, PromptLookup) else d.lookup for d in (drafter.fork(), drafter.fork()))
        assert a is not table and b is not a, drafter
        for _ in range(2):
            assert a.propose(a_context, 3, GREEDY).tokens == [7, 5, 6]
            assert b.propose(b_context, 2, GREEDY).tokens == [3, 4]
        assert a._seen == a_context and b._seen == b_context and table._seen == []
    # a drafter made of drafters forks its parts: a layer-skip drafter's inner model drafter
    skip = LayerSkipDrafter([0])
    skip.prepare(make_model("llama"))
    forks = [skip.fork(), skip.fork()]
    assert len({id(skip._inner), *(id(f._inner) for f in forks)}) == 3


def test_forks_of_a_model_drafter_check_the_tokenizers_once(target, draft_model, monkeypatch):
    """A server forks its drafter for every request: the vocabulary comparison (about a second for
    152k tokens) runs once per target, not once per fork."""
    import specdec.drafters.model as model_module

    calls = []
    real = model_module.check_same_tokenizer
    monkeypatch.setattr(model_module, "check_same_tokenizer", lambda t, d: calls.append(1) or real(t, d))
    drafter = ModelDrafter(draft_model)
    for fork in (drafter.fork(), drafter.fork(), drafter):
        fork.prepare(target)
    assert len(calls) == 1
