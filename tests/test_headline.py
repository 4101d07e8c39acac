"""The README's headline table (specdec.bench.headline): exact rows from tiny results files, the
newest run of a (pair, workload) winning, and --check failing on a stale README only."""

import copy
import json
from pathlib import Path

from specdec.bench import headline

# A whole results file of schema version 1 (migrated on read), whose parts the runs below reuse.
BASE = json.loads((Path(__file__).parent / "data" / "small_results.json").read_text())


def _prompt(category: str, plain_tps: float) -> dict:
    prompt = copy.deepcopy(BASE["pairs"][0]["prompts"][0])
    prompt.update(id=category, category=category, runs={})
    prompt["plain"]["decode_tokens_per_s"] = plain_tps
    return prompt


def _config(k, speedup: float, identical: list[int]) -> dict:
    config = copy.deepcopy(BASE["pairs"][0]["configs"][0])
    config.update(k=k, identical=identical)
    config["speedup"]["median"] = speedup
    return config


def _run(created: str, cpu: str, workload: str, max_new_tokens: int, pairs: list[dict]) -> dict:
    run = copy.deepcopy(BASE)
    run.update(created=created, pairs=[{**copy.deepcopy(BASE["pairs"][0]), **pair} for pair in pairs])
    run["environment"]["cpu"] = cpu
    run["settings"].update(workload=workload, max_new_tokens=max_new_tokens)
    return run


def _write(tmp_path):
    lookup_old = {
        "target": "tiny",
        "drafter": "prompt-lookup",
        "draft": None,
        "dtype": "float32",
        "backend": "lean",
        "device": "cpu",
        "workload": "spec_bench_dev.jsonl",
        "prompts": [_prompt("qa", 10.0), _prompt("rag", 20.0)],
        "configs": [_config("auto", 1.1, [2, 2]), _config(2, 1.2, [2, 2])],
        "best_k": {"measured": 2, "textbook": 2, "ours": 2},
    }
    lookup_new = dict(
        lookup_old,
        prompts=[_prompt("qa", 30.0), _prompt("rag", 50.0)],
        configs=[_config("auto", 1.5, [2, 2]), _config(2, 1.25, [2, 2]), _config(4, 1.4, [1, 2])],
        best_k={"measured": 4, "textbook": 4, "ours": 4},
    )
    model = {
        "target": "big",
        "drafter": "model",
        "draft": "~/drafts/small",
        "dtype": "float32",
        "draft_dtype": "bfloat16",
        "draft_vocab": 65536,
        "backend": "lean",
        "device": "cpu",
        "workload": "humaneval_dev.jsonl",
        "prompts": [_prompt("humaneval", tps) for tps in (4.0, 5.0, 9.0)],
        "configs": [_config(3, 2.0, [3, 3])],
        "best_k": {"measured": 3, "textbook": 3, "ours": 3},
    }
    runs = {
        "a_old": _run(
            "2026-01-01T00:00:00+00:00",
            "AMD EPYC, 2 cores",
            "spec_bench_dev.jsonl",
            64,
            [lookup_old],
        ),
        "b_new": _run(
            "2026-01-02T00:00:00+00:00",
            "Intel(R) Xeon(R) Processor, 2 cores",
            "spec_bench_dev.jsonl",
            64,
            [lookup_new, model],
        ),
    }
    for name, run in runs.items():
        (tmp_path / "results" / name).mkdir(parents=True)
        (tmp_path / "results" / name / "results.json").write_text(json.dumps(run))
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\n{headline.BEGIN}\nold table\n{headline.END}\n\nafter\n")
    return readme


def test_rows_are_the_newest_run_of_each_pair_and_workload(tmp_path):
    _write(tmp_path)
    rows = headline.table(tmp_path / "results", tmp_path).splitlines()[4:]
    newest_lookup = (
        "| [tiny + prompt-lookup](results/b_new/) | Spec-Bench dev: 2 x 64 "
        "| fp32, lean | Intel Xeon Processor, 2 cores | 40.0 | k = 4: 1.40x | 1.50x | 5/6 |"
    )
    model_pair = (
        "| [big + small draft](results/b_new/) | HumanEval dev: 3 x 64 "
        "| fp32 (draft bf16, draft vocabulary 65,536), lean | Intel Xeon Processor, 2 cores | 5.0 | k = 3: 2.00x | - "
        "| 3/3 |"
    )
    assert rows == [newest_lookup, model_pair]


def test_check_fails_on_a_stale_readme_and_passes_on_a_fresh_one(tmp_path):
    readme = _write(tmp_path)
    args = ["--results", str(tmp_path / "results"), "--readme", str(readme)]
    assert headline.main([*args, "--check"]) == 1
    assert "old table" in readme.read_text()  # --check writes nothing

    assert headline.main(args) == 0
    text = readme.read_text()
    assert text.startswith(f"# title\n\n{headline.BEGIN}\n{headline.NOTE}\n")
    assert text.endswith(f"{headline.END}\n\nafter\n")
    assert headline.main([*args, "--check"]) == 0

    readme.write_text(text.replace("1.50x", "1.49x"))
    assert headline.main([*args, "--check"]) == 1


def test_a_readme_without_markers_is_an_error(tmp_path):
    _write(tmp_path)
    (tmp_path / "README.md").write_text("no markers\n")
    args = ["--results", str(tmp_path / "results"), "--readme", str(tmp_path / "README.md")]
    assert headline.main([*args, "--check"]) == 2


def test_the_readmes_table_is_the_one_results_gives():
    """The README's results table is generated: run `python -m specdec.bench.headline` after
    changing results/."""
    root = Path(__file__).resolve().parents[1]
    assert headline.main(["--results", str(root / "results"), "--readme", str(root / "README.md"), "--check"]) == 0


def test_the_serving_table_sets_each_server_at_its_most_requests_beside_one_at_a_time(tmp_path):
    def row(server, c, tps, same):
        ms = {"p50": 10.0, "p99": 20.0}
        return {
            "server": server,
            "concurrency": c,
            "requests": 8,
            "tokens_per_s": tps,
            "ttft_ms": ms,
            "same_as_first": same,
        }

    run = tmp_path / "results" / "serving_x"
    run.mkdir(parents=True)
    rows = [row("a", 1, 100.0, 8), row("a", 8, 250.0, 8), row("b", 1, 10.0, 8), row("b", 8, 60.0, 7)]
    data = {"cpu": "Intel(R) Xeon(R)", "target": "m", "workload": "w", "max_tokens": 64, "rows": rows}
    (run / "serving.json").write_text(json.dumps(data))
    lines = headline.serving_table(tmp_path / "results", tmp_path).splitlines()[4:]
    assert (
        lines[0]
        == "| [m, w, 64 tokens, Intel Xeon](results/serving_x/) | a | 100.0 | 8 | 250.0 | 2.50 | 10 / 20 | 8/8 |"
    )
    assert lines[1] == "|  | b | 10.0 | 8 | 60.0 | 6.00 | 10 / 20 | 7/8 |"
    assert headline.serving_table(tmp_path / "none", tmp_path) is None
    readme = "x\n<!-- serving:begin -->\nold\n<!-- serving:end -->\n"
    assert "| a | 100.0 |" in headline.splice_serving(readme, headline.serving_table(tmp_path / "results", tmp_path))
