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
        assert cells[5].startswith(f"{speedup['median']:.2f}x ")
        assert f"[{speedup['min']:.2f}..{speedup['max']:.2f}]" in cells[5]
        assert cells[1] == f"{config['alpha']:.2f}"
        k = config["k"] if config["k"] != "auto" else max(1, round(config["mean_k"]))
        draft_ms = pair["costs"]["draft_ms"]
        if str(k) in draft_ms:  # c: a drafted token's ms over V(1), at that k
            assert cells[3] == f"{draft_ms[str(k)] / k / pair['costs']['verify_ms']['1']:.3g}"
        assert cells[6] == f"{config['identical'][0]}/{config['identical'][1]}"
        assert cells[7] == f"{config['predicted']['textbook']:.2f}x"
        assert cells[8] == f"{round(config['error']['textbook'] * 100):+d}%"
        assert cells[10] == f"{round(config['error']['ours'] * 100):+d}%"
        assert len(cells[4].split()) == len(config["acceptance_per_position"])  # acceptance at each draft position
        if config["k"] != "auto":
            assert len(cells[4].split()) == config["k"]
    assert _row(report, 4)[6] == "3/4"
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
    assert cells[1] == "-" and cells[10] == "-"
    assert "nan" not in markdown_report(reloaded).lower()


def test_report_without_divergences_or_peers(data):
    pair = data["pairs"][0]
    for prompt in pair["prompts"]:
        for run in prompt["runs"].values():
            run.update(identical=True, divergence=None)
    pair["peer_summary"] = []
    report = markdown_report(data)
    assert "logit gap" not in report and "### Peers" not in report
    assert "## tiny-llama" in report and _row(report, 4)[6] == "3/4"  # the rest is still reported


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


def _write(tmp_path, raw: dict, name: str = "results.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize(
    "where, field, value, named",
    [
        (lambda r: r["pairs"][0]["configs"][1], "tau", "high", "pairs[0].configs[1].tau"),
        (lambda r: r["pairs"][0]["configs"][1], "k", True, "pairs[0].configs[1].k"),
        (lambda r: r["settings"], "limit", "1", "settings.limit"),  # no coercion of "1" to 1
        (lambda r: r["pairs"][0]["costs"]["verify_ms"], "2", None, "pairs[0].costs.verify_ms.2"),
        (lambda r: r["pairs"][0]["configs"][0], "identical", [3], "pairs[0].configs[0].identical"),
        (lambda r: r["pairs"][0]["prompts"][1]["plain"], "rounds", 2.5, "pairs[0].prompts[1].plain.rounds"),
    ],
)
def test_load_refuses_a_wrong_typed_field_naming_file_and_field(tmp_path, where, field, value, named):
    raw = json.loads(DATA.read_text())
    where(raw)[field] = value
    path = _write(tmp_path, raw)
    with pytest.raises(ValueError) as refused:
        results_mod.load(path)
    assert str(refused.value).startswith(f"{path}: field '{named}': ")
    assert refused.value.__cause__ is None and refused.value.__suppress_context__  # one line, no pydantic trace


def test_the_cli_reports_a_malformed_file_in_one_line(tmp_path, capsys):
    from specdec.cli import main

    raw = json.loads(DATA.read_text())
    raw["pairs"][0]["costs"]["overhead_ms"] = "fast"
    path = _write(tmp_path, raw)
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: field 'pairs[0].costs.overhead_ms'" in err and "Traceback" not in err


def test_a_version_1_file_is_migrated_on_read():
    raw = json.loads(DATA.read_text())
    assert raw["schema"] == "specdec.bench/1" and "schema_version" not in raw
    pair = raw["pairs"][0]
    assert pair["dtype"] == "float32" and "precision" not in pair and "backend" not in pair
    data = results_mod.load(DATA)
    assert (
        (data["schema"], data["schema_version"])
        == (results_mod.SCHEMA, results_mod.SCHEMA_VERSION)
        == (
            "specdec.bench",
            2,
        )
    )
    migrated = data["pairs"][0]
    assert migrated["precision"] == "float32" and migrated["draft_precision"] is None
    assert "dtype" not in migrated and "draft_dtype" not in migrated  # the duplicate keys are gone
    assert (migrated["backend"], migrated["device"]) == ("hf", "cpu")  # what ran before either was recorded
    assert migrated["memory"] is None and migrated["kernel"] is None  # not recorded
    assert migrated["costs"]["draft_catchup_ms"] == migrated["costs"]["draft_ms"] == pair["costs"]["draft_ms"]
    assert data["settings"]["interleave"] is None and data["settings"]["replay"] is False
    assert data["environment"]["memory_bandwidth_gbs"] is None
    for k, run in migrated["prompts"][0]["runs"].items():  # the measured numbers as they were
        assert run["decode_tokens_per_s"] == pair["prompts"][0]["runs"][k]["decode_tokens_per_s"]
    quick = results_mod.load(DATA.parent / "quick_results.json")["pairs"][0]  # older still: no mean_k, no D2
    assert quick["prompts"][0]["plain"]["mean_k"] is None and quick["prompts"][0]["plain"]["k_per_round"] is None


def test_a_version_1_pair_with_both_keys_keeps_its_precision(tmp_path):
    raw = json.loads(DATA.read_text())
    raw["pairs"][0].update(dtype="torch.float32", precision="gguf Q4_1+Q8_0", draft_dtype="bfloat16")
    pair = results_mod.load(_write(tmp_path, raw))["pairs"][0]
    assert pair["precision"] == "gguf Q4_1+Q8_0" and pair["draft_precision"] == "bfloat16"


@pytest.mark.parametrize("schema, version", [("specdec.bench/0", None), ("specdec.bench", 3), ("specdec.bench", "2")])
def test_other_versions_are_refused_saying_how_to_regenerate(tmp_path, schema, version):
    raw = results_mod.load(DATA)
    raw.update(schema=schema, schema_version=version)
    path = _write(tmp_path, raw)
    with pytest.raises(ValueError, match=r"version 2 .*regenerate it with `specdec bench`") as refused:
        results_mod.load(path)
    assert str(refused.value).startswith(f"{path}: results schema {schema!r} version {version!r}")


def test_a_version_2_file_with_a_removed_duplicate_key_is_refused(data, tmp_path):
    data["pairs"][0]["dtype"] = data["pairs"][0]["precision"]
    with pytest.raises(ValueError, match=r"field 'pairs\[0\]\.dtype' is not in schema version 2"):
        results_mod.load(_write(tmp_path, data))
    with pytest.raises(ValueError, match="is not in schema version 2"):  # nor written
        results_mod.save(data, tmp_path / "out.json")
    assert not (tmp_path / "out.json").exists()


def _without_nan(obj):
    """obj with every NaN replaced by 0.0 (NaN != NaN would defeat an equality test)."""
    if isinstance(obj, dict):
        return {k: _without_nan(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_without_nan(v) for v in obj]
    return 0.0 if isinstance(obj, float) and math.isnan(obj) else obj


def test_a_record_written_then_read_round_trips_equal(data, tmp_path):
    record = results_mod.validate(_without_nan(data), "data")
    assert isinstance(record.pairs[0], results_mod.PairRecord) and record.pairs[0].precision == "float32"
    path = results_mod.save(record, tmp_path / "results.json")
    assert json.loads(path.read_text())["schema_version"] == 2  # the file carries its version
    again = results_mod.load(path)
    assert results_mod.validate(again, str(path)) == record
    assert again == record.to_dict()
    results_mod.save(again, path)  # and once more
    assert results_mod.load(path) == again
