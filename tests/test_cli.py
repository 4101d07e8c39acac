"""The command line, end to end on a tiny model saved as a local folder (a golden smoke test)."""

from __future__ import annotations

import io
import json
import re

import pytest

import specdec.cli
import specdec.commands.generate
from specdec.cli import TextStreamer, compare_lines, main, workload_prompt
from specdec.drafters import EagleDrafter, LayerSkipDrafter, ModelDrafter, PromptLookup, RandomDrafter, SuffixDrafter
from specdec.stats import RunStats

from .conftest import make_tokenizer


def test_generate_compare_reports_identical(model_dir, capsys):
    prompt = "w1 w2 w3 w4 w5 w1 w2 w3"
    assert main(["generate", prompt, "--target", str(model_dir), "-k", "3", "--max-new-tokens", "24", "--compare"]) == 0
    out = capsys.readouterr().out
    assert "identical to plain greedy: yes" in out
    assert "acceptance rate alpha" in out
    # the printed speed-ups are the ratios of the printed speeds (to their rounding)
    speeds = {
        line.split(":")[0]: [float(w) for w in re.findall(r"([\d.]+) (?:tokens/s decoding|end to end)", line)]
        for line in out.splitlines()
        if line.startswith(("plain decoding:", "speculative:"))
    }
    (decoding, end_to_end) = (float(x) for x in re.findall(r"([\d.]+)x", out.split("speed-up:")[1].splitlines()[0]))
    (pd, pe), (sd, se) = speeds["plain decoding"], speeds["speculative"]

    def tol(a, b):  # speeds printed to 0.05, ratios to 0.005
        return a / b * (0.05 / a + 0.05 / b) + 0.005

    assert abs(decoding - sd / pd) <= tol(sd, pd) and abs(end_to_end - se / pe) <= tol(se, pe)


def test_compare_separates_decoding_from_prefill():
    # 100 tokens each, the same 1 s prefill: decoding 2 s (plain) vs 1 s (speculative)
    plain = RunStats(k=0, new_tokens=100, prefill_s=1.0, total_s=3.0)
    spec = RunStats(k=4, new_tokens=100, prefill_s=1.0, total_s=2.0)
    lines = compare_lines([plain], [spec])
    assert lines[0].startswith("plain decoding:  50.0 tokens/s decoding, 33.3 end to end")
    assert "prefill 1000 ms" in lines[1]
    assert lines[2] == "speed-up:        2.00x decoding, 1.50x end to end (prefill included)"


def test_compare_reports_the_median_run_of_each_path():
    # three runs a path, one of each slowed by a noisy neighbour: the medians ignore them
    plains = [RunStats(k=0, new_tokens=100, prefill_s=1.0, total_s=t) for t in (3.0, 5.0, 3.0)]
    specs = [RunStats(k=4, new_tokens=100, prefill_s=1.0, total_s=t) for t in (2.0, 2.0, 4.0)]
    lines = compare_lines(plains, specs)
    assert lines[0].startswith("plain decoding:  50.0 tokens/s decoding, 33.3 end to end")
    assert lines[1].startswith("speculative:     100.0 tokens/s decoding, 50.0 end to end")
    assert lines[2] == (
        "speed-up:        2.00x decoding, 1.50x end to end (prefill included; medians of 3 runs each, alternated)"
    )
    with pytest.raises(ValueError, match="at least one run"):
        compare_lines([], specs)


def test_compare_says_why_from_the_rounds_costs():
    # plain: 0.1 s a token; speculative: 10 rounds of 5 tokens, each 2 plain steps verifying,
    # 1 drafting 4 tokens (c 0.25) and 0.1 other: 5 / 3.1 = 1.61x
    plain = RunStats(k=0, new_tokens=100, prefill_s=1.0, total_s=11.0)
    spec = RunStats(k="auto", new_tokens=50, rounds=10, drafted=40, accepted=40, prefill_s=1.0)
    spec.verify_s, spec.draft_s, spec.total_s = 2.0, 1.0, 1.0 + 2.0 + 1.0 + 0.1
    line = specdec.commands.generate.why_line([plain], [spec])
    assert "tau 5.00 tokens (k 4.00 drafted, alpha 1.00)" in line
    assert "2.00 plain steps verifying (V(k+1)/V(1)) + 1.00 drafting (k x c, c 0.25) + 0.10 other" in line
    assert line.endswith("5.00 / 3.10 = 1.61x decoding")
    assert specdec.commands.generate.why_line([plain], [RunStats(k="auto")]) is None  # no rounds


def test_generate_with_a_model_drafter_and_sampling(model_dir, capsys):
    args = [
        "generate",
        "w5 w6 w7",
        "--target",
        str(model_dir),
        "--drafter",
        "model",
        "--draft",
        str(model_dir),
        "--temperature",
        "0.8",
        "--top-k",
        "20",
        "--seed",
        "1",
        "--max-new-tokens",
        "12",
        "-k",
        "3",
    ]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out.split("---")[0] == first.split("---")[0]  # same seed and k, same text
    # A draft equal to the target accepts (almost) everything: the acceptance rate is printed.
    assert "acceptance rate alpha" in first


@pytest.mark.parametrize("drafter", ["model", "model-lookup"])
def test_draft_quantize_and_vocab_reach_a_draft_model(model_dir, tmp_path, monkeypatch, capsys, drafter):
    """--draft-quantize is the draft model's load option for every drafter with a draft model (not
    refused as a drafter option), and --draft-vocab cuts its output layer."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))  # the vocabulary's ranking is cached there
    args = ["generate", "w5 w6 w7", "--target", str(model_dir), "--drafter", drafter, "--draft", str(model_dir)]
    args += ["--draft-quantize", "q8_0", "--draft-vocab", "20", "--max-new-tokens", "8", "-k", "2", "--compare"]
    assert main(args) == 0
    assert "identical to plain greedy: yes" in capsys.readouterr().out


NO_MODEL = "no/such-model-offline"
GENERATE = ["generate", "w1", "--target", NO_MODEL]


@pytest.mark.parametrize(
    "argv, message",
    [
        ([*GENERATE, "-k", "-2"], "-k: k (draft length) must be >= 0"),
        ([*GENERATE, "-k", "x"], "-k: k (draft length) must be >= 0"),
        ([*GENERATE, "--k-max", "0"], "--k-max: must be a whole number >= 1, got '0'"),
        ([*GENERATE, "--max-new-tokens", "-1"], "--max-new-tokens: must be a whole number >= 0, got '-1'"),
        (["bench", "--pair", NO_MODEL, "--k", "auto,-1"], "--k: k (draft length) must be >= 0"),
        (["loadtest", "--target", NO_MODEL, "-k", "two"], "-k: k (draft length) must be >= 0"),
    ],
)
def test_bad_flags_are_refused_by_the_parser(argv, message, capsys):
    """A bad draft length or budget is the parser's error (usage, the flag, the message, exit 2),
    before any model loads (the model named here does not exist)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith(f"usage: specdec {argv[0]} ") and "Traceback" not in err
    assert f"specdec {argv[0]}: error: argument {message}" in err


def test_every_command_dispatches():
    sub = next(a for a in specdec.cli._parser()._actions if a.dest == "command")
    assert set(sub.choices) == set(specdec.cli.COMMANDS)


def test_bad_input_is_one_clear_line(model_dir, capsys):
    assert main(["generate", "w1", "--target", str(model_dir), "--drafter", "model"]) == 2
    assert "the model drafter needs a draft model: pass --draft MODEL" in capsys.readouterr().err
    # serve checks it before loading the target
    assert main(["serve", "--target", "no/such-model-offline", "--drafter", "model"]) == 2
    assert "the model drafter needs a draft model: pass --draft MODEL" in capsys.readouterr().err
    assert main(["generate", "hi", "--target", "no/such-model-offline", "--cache-dir", "/nonexistent"]) == 2
    # a flag of another drafter is refused, not dropped
    assert main(["generate", "w1", "--target", str(model_dir), "--drafter", "suffix", "--max-ngram", "2"]) == 2
    assert "the suffix drafter takes no max_ngram option (--max-ngram)" in capsys.readouterr().err


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"specdec {version('specdec')}"


def test_models_list_shows_the_registry(tmp_path, capsys):
    assert main(["models", "list", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma-3-270m"]:
        assert name in out
    assert "yes" not in out  # nothing is pulled in an empty cache


def test_workload_prompt_reads_both_formats(tmp_path):
    f = tmp_path / "w.jsonl"
    f.write_text(
        json.dumps({"category": "qa", "turns": ["first?", "second?"]})
        + "\n"
        + json.dumps({"category": "summarization", "turns": ["sum it"]})
        + "\n"
        + json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n"})
        + "\n"
    )
    assert workload_prompt(f, "summarization", 0) == "sum it"
    assert workload_prompt(f, None, 0) == "first?"
    assert workload_prompt(f, None, 2) == "def f():\n"
    with pytest.raises(ValueError, match="out of range"):
        workload_prompt(f, "qa", 1)


def test_streamer_holds_back_a_stop_string_prefix():
    tok = make_tokenizer()
    out = io.StringIO()
    s = TextStreamer(tok, ["w5 w6"], out)
    ids = tok("w1 w2 w5")["input_ids"]
    s(ids)
    assert out.getvalue() == "w1 w2 "  # "w5" could start the stop string: held back
    s(tok("w7")["input_ids"])
    assert out.getvalue() == "w1 w2 w5 w7"


class _Built(Exception):
    """Raised by the spy below once the CLI has built its drafter: nothing is generated."""


@pytest.mark.parametrize(
    "flags, kind, expect",
    [
        ([], PromptLookup, dict(max_ngram=3, min_ngram=1)),
        (["--max-ngram", "4", "--min-ngram", "2"], PromptLookup, dict(max_ngram=4, min_ngram=2)),
        (["--drafter", "model", "--draft", "MODEL_DIR"], ModelDrafter, dict(lookup=None)),
        (["--draft", "MODEL_DIR"], ModelDrafter, dict(lookup_kind=PromptLookup)),  # with a draft: model-lookup
        (["--drafter", "random"], RandomDrafter, {}),
        (
            ["--drafter", "suffix", "--min-match", "2", "--corpus", "CORPUS"],
            SuffixDrafter,
            dict(min_match=2, tree=False, corpus_read=True),
        ),
        (["--drafter", "suffix-tree"], SuffixDrafter, dict(min_match=1, tree=True, corpus_read=False)),
        (
            ["--drafter", "layer-skip", "--layers", "0-1", "--cache-dir", "CACHE"],
            LayerSkipDrafter,
            dict(layers=[0, 1], cache="CACHE"),
        ),
        (["--drafter", "layer-skip"], LayerSkipDrafter, dict(layers=None, cache=None)),
        (
            ["--drafter", "eagle", "--head", "h.safetensors", "--cache-dir", "CACHE"],
            EagleDrafter,
            dict(spec="h.safetensors", cache="CACHE", alternatives=0),
        ),
        (["--drafter", "eagle-tree"], EagleDrafter, dict(spec=None, alternatives=1)),
    ],
)
def test_generate_builds_the_drafter_its_flags_name(model_dir, tmp_path, monkeypatch, flags, kind, expect):
    """`specdec generate` builds each drafter from its own flags (drafter_from_options); the drafters'
    own defaults apply to the flags not given (a flag of another drafter is refused:
    test_bad_input_is_one_clear_line)."""
    corpus = tmp_path / "corpus.json"
    corpus.write_text(json.dumps([[5, 6], [7, 8]]))
    subst = {"MODEL_DIR": str(model_dir), "CORPUS": str(corpus), "CACHE": str(tmp_path)}
    build, built = specdec.commands.generate.drafter_from_options, []

    def spy(name, **options):
        built.append(build(name, **options))
        raise _Built

    monkeypatch.setattr(specdec.commands.generate, "drafter_from_options", spy)
    with pytest.raises(_Built):
        main(["generate", "w1 w2", "--target", str(model_dir), *[subst.get(f, f) for f in flags]])
    (drafter,) = built
    assert type(drafter) is kind
    if kind is ModelDrafter:
        assert drafter.draft.name == str(model_dir)
    for attr, value in expect.items():
        if attr == "corpus_read":
            assert (len(drafter.corpus) > 0) == value
        elif attr == "lookup_kind":
            assert type(drafter.lookup) is value
        else:
            want = subst.get(value, value) if isinstance(value, str) else value
            assert getattr(drafter, attr) == want, attr


def test_recalibrate_times_the_verify_cost_curve_again(model_dir, verify_cost_cache, capsys):
    run = ["generate", "w1 w2 w3 w1 w2", "--target", str(model_dir), "--max-new-tokens", "6"]  # k auto
    assert main(run) == 0
    first = [p.name for p in verify_cost_cache.iterdir()]
    assert len(first) == 1 and "dropped" not in capsys.readouterr().err
    stale = verify_cost_cache / first[0]
    timed = stale.read_text()
    stale.write_text(timed + "\n ")  # marked (still the same JSON): is it rewritten?
    marked = stale.read_text()
    assert marked != timed
    assert main(run) == 0 and stale.read_text() == marked  # the cached curve served
    assert main([*run, "--recalibrate"]) == 0
    assert f"{model_dir}: 1 cached verify-cost curve(s) dropped" in capsys.readouterr().err
    assert [p.name for p in verify_cost_cache.iterdir()] == first and stale.read_text() != marked  # timed anew


# ---- structured output and the logit controls of `specdec generate` ----------------------------


BAD_BIAS = "--logit-bias: must be ID=BIAS pairs, a token id >= 0 and a bias in [-100, 100], got "


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--json-schema", "MISSING"], "--json-schema: cannot read MISSING: No such file or directory"),
        (["--json-schema", "NOT_JSON"], "--json-schema: NOT_JSON: the JSON schema is not valid JSON"),
        (["--json-schema", "NOT_OBJECT"], "--json-schema: NOT_OBJECT: a JSON schema is an object, got list"),
        (["--grammar", "MISSING"], "--grammar: cannot read MISSING"),
        (["--regex", "(yes|no)", "--choice", "yes,no"], "--choice: not allowed with argument --regex"),
        (["--json-object", "--grammar", "LARK"], "--grammar: not allowed with argument --json-object"),
        (["--choice", "yes,,no"], "--choice: an empty choice in 'yes,,no'"),
        (["--logit-bias", "17"], BAD_BIAS + "'17'"),
        (["--logit-bias", "1=2,x=1"], BAD_BIAS + "'x=1'"),
        (["--logit-bias", "17=101"], BAD_BIAS + "'17=101'"),
        (["--logit-bias=-1=5"], BAD_BIAS + "'-1=5'"),
        (["--stop-token-ids", "1,x"], "--stop-token-ids: must be a whole number >= 0, got 'x'"),
    ],
)
def test_bad_grammar_and_logit_flags_are_refused_by_the_parser(flags, message, tmp_path, capsys):
    """A grammar file that cannot be read, a schema that is not JSON (or not an object), two
    grammars at once, a bad --logit-bias or stop token id: the parser's error (exit 2), before
    any model loads (the target does not exist)."""
    files = {
        "MISSING": tmp_path / "missing.json",
        "NOT_JSON": tmp_path / "schema.json",
        "NOT_OBJECT": tmp_path / "list.json",
        "LARK": tmp_path / "g.lark",
    }
    files["NOT_JSON"].write_text("{type: object")
    files["NOT_OBJECT"].write_text("[1, 2]")
    files["LARK"].write_text('start: "yes" | "no"\n')
    argv = [*GENERATE, *[str(files[f]) if f in files else f for f in flags]]
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    for name, path in files.items():
        message = message.replace(name, str(path))
    assert e.value.code == 2 and err.startswith("usage: specdec generate ") and "Traceback" not in err
    assert f"specdec generate: error: argument {message}" in err


def test_grammar_and_logit_flags_parse(tmp_path):
    """Each grammar flag parses into its Grammar (--choice comma-separated and repeatable);
    --logit-bias and --stop-token-ids are comma-separated and repeatable."""
    from specdec.grammar import Grammar

    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object"}')
    lark = tmp_path / "g.lark"
    lark.write_text('start: "a"\n')
    parse = specdec.cli._parser().parse_args
    args = parse([*GENERATE, "--choice", "yes,no", "--choice", "maybe"])
    assert args.grammar == Grammar.choice(["yes", "no", "maybe"])
    assert parse([*GENERATE, "--json-schema", str(schema)]).grammar == Grammar.json_schema({"type": "object"})
    assert parse([*GENERATE, "--json-object"]).grammar == Grammar.json_object()
    assert parse([*GENERATE, "--regex", "a+"]).grammar == Grammar.regex("a+")
    assert parse([*GENERATE, "--grammar", str(lark)]).grammar == Grammar.lark('start: "a"\n')
    assert parse(GENERATE).grammar is None
    args = parse(
        [*GENERATE, "--logit-bias", "5=1.5,6=-100", "--logit-bias", "7=0", "--stop-token-ids", "3,4"]
        + ["--stop-token-ids", "9", "--min-p", "0.1", "--ignore-eos"]
    )
    assert args.logit_bias == [(5, 1.5), (6, -100.0), (7, 0.0)] and args.stop_token_ids == [3, 4, 9]
    assert args.min_p == 0.1 and args.ignore_eos


def _smollm2() -> str:
    from specdec.models.weights import cache_dir, is_pulled

    if not is_pulled("smollm2-135m", cache_dir()):
        pytest.skip("smollm2-135m is not pulled: run `specdec models pull smollm2-135m`")
    return "smollm2-135m"


@pytest.mark.parametrize("grammar", [["--choice", "yes,no"], ["--regex", "(yes|no)"]])
def test_a_grammar_constrains_real_smollm2(grammar, capsys):
    """On the real model, the printed text is exactly one of the choices; the forced tokens are
    reported after the stats, and --compare's plain run follows the same grammar."""
    argv = ["generate", "Is the sky blue? Answer yes or no.", "--target", _smollm2(), "--chat", *grammar]
    assert main([*argv, "--max-new-tokens", "8", "-k", "2", "--compare"]) == 0
    out = capsys.readouterr().out
    text, stats = out.split("\n\n--- speculative\n")
    assert text in ("yes", "no")
    assert re.search(r"^grammar \((choice|regex)\): \d+ tokens forced, verified as free drafts$", stats, re.M)
    assert "identical to plain greedy: yes" in stats


def test_a_grammar_llguidance_refuses_is_one_clear_line(capsys):
    assert main(["generate", "hi", "--target", _smollm2(), "--regex", "(", "--max-new-tokens", "4", "-k", "2"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("error: --regex: grammar error: ") and "unclosed group" in err[-1]
    assert "Traceback" not in "\n".join(err)
