"""The results file's stages after the bench: load / save, the figures, the markdown report.
All of them read tests/data/small_results.json and run no model."""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import pytest

from specdec.bench import results as results_mod
from specdec.bench.plot import plot_results
from specdec.bench.report import markdown_report
from specdec.stats import RunStats

DATA = Path(__file__).parent / "data" / "small_results.json"
FIGURES = ["acceptance_vs_k", "speedup_vs_k", "acceptance_by_position", "verify_cost", "speedup_by_category"]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture()
def data() -> dict:
    return results_mod.load(DATA)


def _canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True)  # NaN-safe equality (NaN != NaN in a dict comparison)


def _row(report: str, k: int | str) -> list[str]:
    """Cells of the main table's row for k (the only table whose rows carry "x [" speed-up ranges)."""
    start = "| auto (mean " if k == "auto" else f"| {k} |"
    rows = [line for line in report.splitlines() if line.startswith(start) and "x [" in line]
    assert len(rows) == 1, rows
    return [cell.strip() for cell in rows[0].strip("|").split("|")]


# --- the stored data ---------------------------------------------------------------------------


def test_stored_file_is_small_valid_and_complete(data):
    assert DATA.stat().st_size < 60_000
    assert len(data["pairs"]) == 1
    pair = data["pairs"][0]
    assert (pair["target"], pair["drafter"], pair["draft"]) == ("tiny-llama", "prompt-lookup", None)
    keys = set(RunStats(k=0).to_dict())
    for prompt in pair["prompts"]:
        assert keys <= set(prompt["plain"])
        assert set(prompt["runs"]) == {str(k) for k in data["settings"]["ks"]}
        for run in prompt["runs"].values():
            assert keys | {"identical", "divergence"} <= set(run)


# --- plots -------------------------------------------------------------------------------------


def _check_png(path: Path):
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[0] > 200 and pixels.shape[1] > 200
    assert pixels[..., :3].var() > 0  # not a blank image


def test_plot_results_writes_five_pngs_per_pair(data, tmp_path):
    out = tmp_path / "plots"
    paths = plot_results(data, out)
    expected = [out / f"tiny-llama_prompt-lookup_{name}.png" for name in FIGURES]
    assert sorted(paths) == sorted(expected)
    assert sorted(os.listdir(out)) == sorted(p.name for p in expected)  # no temporary file left
    for path in paths:
        _check_png(path)
    assert len({p.read_bytes() for p in paths}) == len(paths)  # five different figures


def test_plot_results_several_pairs_and_nan(data, tmp_path):
    second = copy.deepcopy(data["pairs"][0])
    second.update(drafter="model", draft="tiny-draft")
    second["configs"][0]["alpha"] = float("nan")
    second["configs"][0]["acceptance_per_position"] = []
    data["pairs"].append(second)
    paths = plot_results(data, tmp_path)
    assert len(paths) == 10 and len(set(paths)) == 10
    assert sum(p.name.startswith("tiny-llama_model-tiny-draft_") for p in paths) == 5
    for path in paths:
        _check_png(path)


def test_plot_leaves_no_temporary_file_when_writing_fails(data, tmp_path, monkeypatch):
    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        plot_results(data, tmp_path)
    assert os.listdir(tmp_path) == []


# --- report ------------------------------------------------------------------------------------


def test_report_contents(data):
    report = markdown_report(data)
    pair = data["pairs"][0]
    env = data["environment"]
    for text in (
        env["cpu"],
        env["torch"],
        env["transformers"],
        env["git_commit"],
        "## tiny-llama / prompt-lookup",
        "spec_bench_dev.jsonl",
        "summarization",
        "translation",
    ):
        assert text in report
    assert report.index(env["cpu"]) < report.index("## tiny-llama")  # environment stated up front
    for config in pair["configs"]:
        cells = _row(report, config["k"])
        speedup = config["speedup"]
        assert cells[4].startswith(f"{speedup['median']:.2f}x ")
        assert f"[{speedup['min']:.2f}..{speedup['max']:.2f}]" in cells[4]
        assert cells[1] == f"{config['alpha']:.2f}"
        assert cells[5] == f"{config['identical'][0]}/{config['identical'][1]}"
        assert cells[6] == f"{config['predicted']['textbook']:.2f}x"
        assert cells[7] == f"{round(config['error']['textbook'] * 100):+d}%"
        assert cells[9] == f"{round(config['error']['ours'] * 100):+d}%"
        assert len(cells[3].split()) == len(config["acceptance_per_position"])  # acceptance at each draft position
        if config["k"] != "auto":
            assert len(cells[3].split()) == config["k"]
    assert _row(report, 4)[5] == "3/4"
    assert _row(report, "auto")[0] == f"auto (mean {pair['configs'][-1]['mean_k']:.2f})"
    best = pair["best_k"]
    assert f"Best fixed k: measured {best['measured']}, textbook {best['textbook']}, ours {best['ours']}." in report
    auto = pair["auto"]
    assert f"{auto['vs_best_fixed']:.2f}x the speed-up of the best fixed k ({best['measured']})" in report
    assert f"worst category ({auto['worst_category']}) {auto['worst_category_vs_plain']:.2f}x plain" in report
    assert "2e-06" in report and "translation-1" in report and "position 57" in report
    assert "| hf-lookup | 1.07x |" in report
    assert "| 1 | 65 | 1.00 |" in report  # V(1) and V(1)/V(1) in the costs table
    assert "Matrix products" not in report  # none recorded in this pair
    pair["products"] = "specdec gemv for 1-2 rows, oneDNN for more"
    assert "Matrix products (fp32, CPU): specdec gemv for 1-2 rows, oneDNN for more." in markdown_report(data)


def test_report_prints_dash_for_nan(data, tmp_path):
    assert _row(markdown_report(data), 1)[1] != "-"
    data["pairs"][0]["configs"][0]["alpha"] = float("nan")
    data["pairs"][0]["configs"][0]["error"]["ours"] = float("nan")
    reloaded = results_mod.load(results_mod.save(data, tmp_path / "nan.json"))  # NaN survives the file
    assert math.isnan(reloaded["pairs"][0]["configs"][0]["alpha"])
    cells = _row(markdown_report(reloaded), 1)
    assert cells[1] == "-" and cells[9] == "-"
    assert "nan" not in markdown_report(reloaded).lower()


def test_report_without_divergences_or_peers(data):
    pair = data["pairs"][0]
    for prompt in pair["prompts"]:
        for run in prompt["runs"].values():
            run.update(identical=True, divergence=None)
    pair["peer_summary"] = []
    report = markdown_report(data)
    assert "logit gap" not in report and "### Peers" not in report


# --- load / save -------------------------------------------------------------------------------


def test_load_rejects_wrong_schema(tmp_path):
    raw = json.loads(DATA.read_text())
    raw["schema"] = "specdec.bench/0"
    path = tmp_path / "old.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="schema"):
        results_mod.load(path)


@pytest.mark.parametrize(
    "where, field",
    [
        (lambda r: r, "environment"),
        (lambda r: r["settings"], "ks"),
        (lambda r: r["pairs"][0]["costs"], "verify_ms"),
        (lambda r: r["pairs"][0]["prompts"][2], "runs"),
        (lambda r: r["pairs"][0]["configs"][1], "tau"),
    ],
)
def test_load_rejects_missing_field(tmp_path, where, field):
    raw = json.loads(DATA.read_text())
    del where(raw)[field]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=f"missing field '{field}'"):
        results_mod.load(path)


def test_load_rejects_unreadable_file(tmp_path):
    path = tmp_path / "cut.json"
    path.write_text(DATA.read_text()[:1000])
    with pytest.raises(ValueError, match="cannot read"):
        results_mod.load(path)
    with pytest.raises(ValueError, match="cannot read"):
        results_mod.load(tmp_path / "absent.json")


def test_save_round_trips_and_is_atomic(data, tmp_path, monkeypatch):
    path = tmp_path / "out" / "results.json"
    assert results_mod.save(data, path) == path
    assert _canonical(results_mod.load(path)) == _canonical(data)
    assert os.listdir(path.parent) == ["results.json"]
    before = path.read_bytes()

    changed = copy.deepcopy(data)
    changed["created"] = "2027-01-01T00:00:00+00:00"

    def fail(src, dst):
        raise OSError("disk full")

    with monkeypatch.context() as m:  # a crash before the rename leaves the old file whole
        m.setattr(os, "replace", fail)
        with pytest.raises(OSError, match="disk full"):
            results_mod.save(changed, path)
    assert path.read_bytes() == before
    assert os.listdir(path.parent) == ["results.json"]

    del changed["pairs"][0]["best_k"]  # an invalid results dict is refused before anything is written
    with pytest.raises(ValueError, match="best_k"):
        results_mod.save(changed, path)
    assert path.read_bytes() == before
