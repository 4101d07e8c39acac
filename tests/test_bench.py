"""The cost model on hand-made numbers, and `specdec bench` end to end on a tiny model."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils import cpp_extension

from specdec.backends import gemv
from specdec.bench import costmodel, llama_worker, memory, peers, results
from specdec.bench.config import BenchConfig, Pair
from specdec.bench.environment import git_commit, instruction_set
from specdec.bench.fit import _auto_summary, fit, ratio_noise
from specdec.bench.loading import load_measured
from specdec.bench.measure import run_all
from specdec.bench.peer_rows import _agreement
from specdec.bench.report import markdown_report
from specdec.bench.run import run_bench
from specdec.bench.workloads import load_workload
from specdec.cli import main
from specdec.drafters import ModelDrafter, make_drafter
from specdec.engine import generate, stepwise
from specdec.stats import RunStats

from .conftest import prompt_ids

COSTS = {
    "context_tokens": 100,
    "verify_ms": {"1": 10.0, "2": 24.0, "3": 25.0},
    "draft_ms": {"2": 1.0},
    "overhead_ms": 2.0,
}


def test_textbook_formula():
    assert costmodel.textbook_speedup(0.0, 4, 0.0) == 1.0
    assert costmodel.textbook_speedup(1.0, 4, 0.0) == 5.0
    assert costmodel.textbook_speedup(0.5, 2, 0.0) == pytest.approx(1.75)
    assert costmodel.textbook_speedup(0.5, 2, 0.25) == pytest.approx(1.75 / 1.5)
    assert costmodel.textbook_speedup(float("nan"), 3, 0.0) == 1.0


def test_draft_length_distribution():
    run = {"rounds": 10, "drafted_at": [6, 3]}
    assert costmodel.draft_length_distribution(run) == pytest.approx([0.4, 0.3, 0.3])


def test_verify_curve_lookup_and_extrapolation():
    assert costmodel.verify_ms(COSTS, 2) == 24.0
    assert costmodel.verify_ms(COSTS, 5) == pytest.approx(27.0)


def simulated_run(k: int, accept: list[list[int]], costs: dict) -> dict:
    """A RunStats dict whose times follow the cost model exactly: each round drafts len(a) tokens
    and accepts sum(a) of them (a prefix)."""
    s = RunStats(k=k)
    for a in accept:
        n_acc = 0
        while n_acc < len(a) and a[n_acc]:
            n_acc += 1
        s.record_round(len(a), n_acc)
        s.new_tokens += n_acc + 1
        s.draft_s += costs["draft_ms"].get(str(k), 0.0) / 1e3
        s.verify_s += costmodel.verify_ms(costs, len(a) + 1) / 1e3
        s.total_s += (
            costs["draft_ms"].get(str(k), 0.0) + costmodel.verify_ms(costs, len(a) + 1) + costs["overhead_ms"]
        ) / 1e3
    return s.to_dict()


def test_our_prediction_matches_an_engine_that_follows_the_model():
    rounds = [[1, 1], [1, 0], [], [0, 1], [1, 1], [1]]  # mixed draft lengths, as prompt lookup gives
    spec = simulated_run(2, rounds, COSTS)
    plain = simulated_run(0, [[]] * spec["new_tokens"], COSTS)
    measured = spec["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
    assert costmodel.our_speedup(spec, 2, COSTS) == pytest.approx(measured)
    # The textbook formula assumes V(k+1) = V(1) and is far off on this steep curve.
    textbook = costmodel.textbook_speedup(spec["alpha"], 2, costmodel.cost_ratio(COSTS, 2))
    assert abs(costmodel.relative_error(textbook, measured)) > 0.5


def test_fit_on_the_stored_results_is_reproducible():
    stored = results.load(Path(__file__).parent / "data" / "quick_results.json")
    pair = stored["pairs"][0]
    again = fit(pair, stored["settings"]["ks"])
    for old, new in zip(pair["configs"], again["configs"]):
        assert new["k"] == old["k"]
        assert new["speedup"]["median"] == pytest.approx(old["speedup"]["median"], rel=1e-3)
        assert new["predicted"]["ours"] == pytest.approx(old["predicted"]["ours"], rel=1e-3)
    assert again["best_k"] == pair["best_k"]


def test_auto_is_compared_with_each_categorys_best_fixed_k_measured_and_replayed():
    def config(k, med, cats, replayed=None):
        c = {"k": k, "speedup": {"median": med}, "by_category": {cat: {"speedup": x} for cat, x in cats.items()}}
        if replayed:
            c["replayed"] = config(k, *replayed)
        return c

    configs = [
        config(2, 1.3, {"a": 1.1, "b": 1.5}, (1.2, {"a": 1.2, "b": 1.2})),
        config(4, 1.2, {"a": 0.9, "b": 2.2}, (1.25, {"a": 1.0, "b": 1.5})),
        config("auto", 1.4, {"a": 1.0, "b": 2.0}, (1.3, {"a": 1.2, "b": 1.5})),
    ]
    summary = _auto_summary(configs)
    assert summary["best_fixed_k"] == 2 and summary["vs_best_fixed"] == pytest.approx(1.4 / 1.3)
    assert summary["worst_category"] == "a" and summary["worst_category_vs_plain"] == 1.0
    assert summary["vs_best_fixed_by_category"] == pytest.approx({"a": 1.0 / 1.1, "b": 2.0 / 2.2})
    again = summary["replayed"]
    assert again["best_fixed_k"] == 4 and again["vs_best_fixed"] == pytest.approx(1.3 / 1.25)
    assert again["vs_best_fixed_by_category"] == pytest.approx({"a": 1.0, "b": 1.0})
    del configs[0]["replayed"]  # not every config replayed: no replayed summary
    assert _auto_summary(configs)["replayed"] is None


def _rounds(name, per_round, total, log):
    """A stand-in for engine.stepwise: logs its name at every step, commits per_round tokens a round."""
    log.append(name)
    made = 0
    yield made
    while made < total:
        log.append(name)
        made += per_round
        yield made
    log.append(name)
    return name.upper()


def test_run_all_steps_the_generation_furthest_behind():
    log = []
    done = run_all({"a": _rounds("a", 3, 6, log), "b": _rounds("b", 1, 3, log)})
    assert done == {"a": "A", "b": "B"}
    # a's prefill and first round (ties go in order), b's prefill and rounds up to a's 3 tokens,
    # a's second round (a tie at 3), b past its end (3 < 6), a's end
    assert log == ["a", "a", "b", "b", "b", "b", "a", "b", "a"]
    log.clear()
    assert run_all({"a": _rounds("a", 3, 6, log), "b": _rounds("b", 1, 3, log)}, interleave=False) == done
    assert log == ["a"] * 4 + ["b"] * 5


def test_interleaved_generations_are_each_what_it_makes_alone(target, draft_model):
    prompt, run = prompt_ids(), dict(max_new_tokens=24, seed=0)
    configs = {
        "plain": (None, 0),
        "2": (ModelDrafter(draft_model), 2),
        "auto": (ModelDrafter(draft_model), "auto"),
        "lookup": (make_drafter("prompt-lookup"), 3),
    }
    alone = {name: generate(target, prompt, d, k=k, **run) for name, (d, k) in configs.items()}
    together = run_all({name: stepwise(target, prompt, d, k=k, **run) for name, (d, k) in configs.items()})
    for name, gen in together.items():
        assert gen.tokens == alone[name].tokens == alone["plain"].tokens, name
        if name != "auto":  # auto's policy has learned from its first run: its rounds may differ
            assert gen.stats.k_per_round == alone[name].stats.k_per_round, name


def rec(plain: list[float], runs: dict[str, list[float]]) -> dict:
    """A bench record of one prompt with only its repeats' decode speeds: plain's, and each k's."""
    return {
        "plain": {"decode_tokens_per_s_repeats": plain},
        "runs": {k: {"decode_tokens_per_s_repeats": v} for k, v in runs.items()},
    }


def test_ratio_noise_is_the_spread_of_fixed_configs_speed_ratios_between_repeats():
    # plain and k=2 move together (a slow spell of the host): no noise in their ratio
    assert ratio_noise([rec([10.0, 5.0], {"2": [20.0, 10.0]})]) == pytest.approx(0.0)
    # a ratio of 2 then 1: log ratios 0 and ln 2, sd ln 2 / sqrt(2); auto's runs (not repeated exactly) are left out
    assert ratio_noise([rec([10.0, 10.0], {"2": [20.0, 10.0], "auto": [1.0, 99.0]})]) == pytest.approx(
        math.log(2) / math.sqrt(2)
    )
    # pooled over prompts: the mean of the variances
    both = ratio_noise([rec([10.0, 10.0], {"2": [20.0, 10.0]}), rec([10.0, 10.0], {"2": [10.0, 10.0]})])
    assert both == pytest.approx(math.log(2) / 2)
    assert ratio_noise([rec([10.0], {"2": [20.0]})]) is None  # one repeat: no spread to see


def spread_of_log_ratios(records: list[dict]) -> float:
    """ratio_noise written out another way: for each prompt, each pair of fixed configs (plain, and
    every k but auto) gives one log speed ratio per repeat; their sample variances, averaged over
    prompts and pairs, square-rooted."""
    variances = []
    for rec in records:
        fixed = [rec["plain"]["decode_tokens_per_s_repeats"]]
        fixed += [run["decode_tokens_per_s_repeats"] for k, run in rec["runs"].items() if k != "auto"]
        for i, a in enumerate(fixed):
            for b in fixed[i + 1 :]:
                logs = np.log(np.array(a) / np.array(b))
                variances.append(logs.var(ddof=1))
    return float(np.sqrt(np.mean(variances)))


def test_ratio_noise_by_hand_over_three_configs_and_two_prompts():
    e = math.e
    # prompt 1: plain [1, 1], k=1 [e, 1], k=2 [1, 1]: log ratios (1, 0), (0, 0), (-1, 0): variances 1/2, 0, 1/2
    # prompt 2: plain [1, 1, 1], k=1 [1, 1, e**3], k=2 [1, 1, 1]: variances 3, 0, 3 (log ratios 0, 0, +-3)
    records = [
        rec([1.0, 1.0], {"1": [e, 1.0], "2": [1.0, 1.0], "auto": [5.0, 1.0]}),
        rec([1.0, 1.0, 1.0], {"1": [1.0, 1.0, e**3], "2": [1.0, 1.0, 1.0]}),
    ]
    expected = math.sqrt((0.5 + 0 + 0.5 + 3 + 0 + 3) / 6)
    assert ratio_noise(records) == pytest.approx(expected) == spread_of_log_ratios(records)


def test_report_prints_the_timing_noise_as_a_percentage():
    stored = results.load(Path(__file__).parent / "data" / "quick_results.json")
    stored["pairs"][0]["ratio_noise"] = 0.034
    assert "Timing noise of this run: 3.4% (the spread between repeats" in markdown_report(stored)
    stored["pairs"][0]["ratio_noise"] = None  # a single repeat: nothing to say
    assert "Timing noise" not in markdown_report(stored)


def test_report_names_a_draft_vocabulary():
    stored = results.load(Path(__file__).parent / "data" / "quick_results.json")
    assert "draft vocabulary" not in markdown_report(stored)
    stored["pairs"][0]["draft_vocab"] = 65536
    assert "; draft vocabulary 65,536 tokens." in markdown_report(stored)


def test_gemv_status_says_which_kernels_run_and_why(monkeypatch):
    """specdec.backends.gemv.status(), the bench's "products" line, in each of its three states;
    the loader is a stand-in, so this runs with or without a compiler."""

    def fresh(env: str, load) -> None:
        monkeypatch.setenv("SPECDEC_GEMV", env)
        monkeypatch.setattr(gemv, "_kernel", None)
        monkeypatch.setattr(gemv, "_status", "not built yet")
        monkeypatch.setattr(cpp_extension, "load", load)

    builds = []

    def broken(*args, **kwargs):
        builds.append(args)
        raise RuntimeError("Error building extension 'specdec_gemv'\nc++: not found")

    fresh("0", broken)
    assert gemv.status() == "not built yet"
    assert gemv.kernel() is None and not builds
    assert gemv.status() == "off (SPECDEC_GEMV=0): oneDNN for every product"

    fresh("1", broken)
    assert gemv.kernel() is None and gemv.kernel() is None and len(builds) == 1  # tried once per process
    assert gemv.status() == (
        "oneDNN for every product (the gemv kernel could not be built: Error building extension 'specdec_gemv')"
    )
    assert not gemv.usable(torch.zeros(2, 2))

    built = object()
    fresh("1", lambda name, sources, **kwargs: builds.append(name) or built)
    assert gemv.kernel() is built and gemv.kernel() is built and builds[1:] == ["specdec_gemv"]
    assert gemv.status() == "specdec gemv for 1-2 rows, oneDNN for more"
    assert gemv.usable(torch.zeros(2, 2)) and not gemv.usable(torch.zeros(2, 2, dtype=torch.bfloat16))


def test_pair_parsing():
    assert Pair.parse("a") == Pair("a", "prompt-lookup", None)
    assert Pair.parse("a:model:b") == Pair("a", "model", "b")
    with pytest.raises(ValueError, match="DRAFT required"):
        Pair.parse("a:model")


@pytest.fixture(scope="module")
def workload(tmp_path_factory):
    path = tmp_path_factory.mktemp("wl") / "mini.jsonl"
    rows = [
        {"question_id": i, "category": cat, "turns": [" ".join(f"w{(3 * i + j) % 50 + 3}" for j in range(12)) * 2]}
        for i, cat in enumerate(["qa", "qa", "summarization", "summarization"])
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    return path


def test_bench_end_to_end_on_a_tiny_model(model_dir, workload, monkeypatch):
    # which kernels ran the fp32 products is gemv's to say (its status is pinned below); the bench records it
    monkeypatch.setattr(gemv, "status", lambda: "kernels named by a stand-in")
    prompts = load_workload(workload, limit=1)
    assert [p.category for p in prompts] == ["qa", "summarization"]
    config = BenchConfig(
        pairs=(Pair(str(model_dir)), Pair(str(model_dir), "model", str(model_dir))),
        workload=workload.name,
        ks=(1, 3),
        max_new_tokens=10,
        peers=("hf", "hf-lookup"),
        progress=False,
    )
    res = run_bench(config, prompts)
    results.validate(res)
    lookup, model = res["pairs"]
    for pair in (lookup, model):
        assert set(pair["costs"]["verify_ms"]) == {"1", "2", "3", "4"}
        for config in pair["configs"]:
            assert config["identical"] == [2, 2]
            assert not math.isnan(config["predicted"]["ours"])
            assert set(config["by_category"]) == {"qa", "summarization"}
    assert model["configs"][0]["alpha"] == 1.0  # a draft identical to the target is always right
    for pair in (lookup, model):  # replayed: the measured runs' rounds, timed by the measured costs
        for rec in pair["prompts"]:
            for k in ("1", "3"):
                assert rec["replay"][k]["rounds"] == rec["runs"][k]["rounds"]
                assert rec["replay"][k]["accepted"] == rec["runs"][k]["accepted"]
            assert rec["replay"]["plain"]["rounds"] == rec["plain"]["rounds"]
        for config in pair["configs"]:
            assert set(config["replayed"]["by_category"]) == {"qa", "summarization"}
            assert config["replayed"]["speedup"]["median"] > 0
    assert lookup["backend"] == "lean" and model["draft_precision"] == "float32"
    assert lookup["precision"] == "float32" and "dtype" not in lookup and "draft_dtype" not in model
    assert lookup["products"] == model["products"] == "kernels named by a stand-in"
    assert lookup["kernel"] == model["draft_kernel"] == "kernels named by a stand-in"
    report = markdown_report(res)
    assert "Matrix products (fp32, CPU): kernels named by a stand-in." in report
    assert "precision float32, backend lean" in report and "### Resident memory" in report
    for mem in (lookup["memory"], model["memory"], model["draft_memory"]):
        assert mem["rss_growth_mb"] == pytest.approx(mem["rss_after_mb"] - mem["rss_before_mb"])
        assert mem["peak_rss_mb"] >= mem["rss_after_mb"] > 0
        assert mem["file_mb"] is None and mem["growth_per_file_byte"] is None  # not a GGUF file
    assert lookup["draft_memory"] is None
    roof = lookup["costs"]["roofline"]
    assert roof["bandwidth_gbs"] == res["environment"]["memory_bandwidth_gbs"] > 0
    for n, frac in roof["fraction"].items():
        assert frac == pytest.approx(roof["floor_ms"] / lookup["costs"]["verify_ms"][n])
    peers = {p["name"]: p for p in lookup["peer_summary"]}
    assert peers["hf"]["identical"] == [2, 2] and peers["hf-lookup"]["identical"] == [2, 2]
    assert peers["hf"]["agreement"] == 1.0 and peers["hf"]["weights"] == "float32" and peers["hf"]["same_weights"]


def test_bench_cli_writes_results_report_and_plots(model_dir, workload, tmp_path, capsys):
    out = tmp_path / "out"
    args = [
        "bench",
        "--pair",
        str(model_dir),
        "--workload",
        str(workload),
        "--limit",
        "1",
        "--k",
        "1,2,auto",
        "--max-new-tokens",
        "6",
        "--peers",
        "none",
        "--out",
        str(out),
        "--backend",
        "hf",
        "--repeats",
        "3",
    ]
    assert main(args) == 0
    assert "identical" in capsys.readouterr().out
    res = results.load(out / "results.json")
    assert json.loads((out / "results.json").read_text())["schema_version"] == results.SCHEMA_VERSION
    report = (out / "report.md").read_text()
    assert res["settings"]["ks"] == [1, 2, "auto"] and report.startswith("#")
    # auto against the best fixed k, measured and replayed, on the median row of the replay table
    ratios = [line for line in report.splitlines() if line.startswith("| all (median)")][0].split("|")[-3:-1]
    assert all(cell.strip().endswith("x") for cell in ratios), ratios
    assert res["settings"]["repeats"] == 3 and res["settings"]["interleave"] is True
    noise = spread_of_log_ratios(res["pairs"][0]["prompts"])
    assert res["pairs"][0]["ratio_noise"] == pytest.approx(noise, rel=1e-9)
    assert f"Timing noise of this run: {noise * 100:.1f}%" in report
    for rec in res["pairs"][0]["prompts"]:
        for run in [rec["plain"], *rec["runs"].values()]:  # each config's speed is its median run's
            assert len(run["decode_tokens_per_s_repeats"]) == 3
            assert run["decode_tokens_per_s"] == sorted(run["decode_tokens_per_s_repeats"])[1]
    assert res["pairs"][0]["backend"] == "hf" and "Roofline (hf backend" in (out / "report.md").read_text()
    assert res["pairs"][0]["products"] is None  # transformers' forward: not ours to describe
    assert len(list(out.glob("*.png"))) == 5
    assert main(["plot", str(out / "results.json"), "--out", str(tmp_path / "again")]) == 0
    assert len(list((tmp_path / "again").glob("*.png"))) == 5


def test_fully_accepted_rounds_pay_the_catch_up_draft_cost():
    """After a round that accepted everything a draft model reads two new tokens; the model weighs
    D2(k) by the share of such rounds."""
    costs = {**COSTS, "draft_ms": {"2": 10.0}, "draft_catchup_ms": {"2": 30.0}}
    run = {"rounds": 4, "drafted_at": [4, 4], "accepted_at": [3, 1], "tau": 2.0}  # 1 of 4 fully accepted
    draft = 0.75 * 10.0 + 0.25 * 30.0
    expected = 2.0 * (10.0 + 2.0) / (draft + 25.0 + 2.0)
    assert costmodel.our_speedup(run, 2, costs) == pytest.approx(expected)
    without = {**COSTS, "draft_ms": {"2": 10.0}}  # an older results file: D2 falls back to D1
    assert costmodel.our_speedup(run, 2, without) == pytest.approx(2.0 * 12.0 / (10.0 + 25.0 + 2.0))


def test_draft_cost_between_and_beyond_the_measured_lengths():
    costs = {"draft_ms": {"2": 10.0, "4": 30.0}}
    assert costmodel.draft_ms_at(costs, 0) == 0.0
    assert costmodel.draft_ms_at(costs, 3) == 20.0  # linear between 2 and 4
    assert costmodel.draft_ms_at(costs, 8) == 60.0 and costmodel.draft_ms_at(costs, 1) == 5.0  # per token outside
    assert costmodel.interpolate({2: 10.0, 4: 30.0}, 5) is None


def test_the_cpu_is_named_with_the_widest_instruction_set_the_kernels_use():
    assert instruction_set({"avx2", "fma", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"}) == "AMX"
    assert instruction_set({"avx2", "avx512f", "avx512_vnni"}) == "AVX-512 VNNI"
    assert instruction_set({"avx2", "avx512f"}) == "AVX2"  # AVX-512 without VNNI runs the AVX2 kernels
    assert instruction_set({"sse4_2"}) == ""


def test_git_commit_says_when_the_code_differs_from_the_commit(tmp_path):
    git = lambda *args: subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)  # noqa: E731
    assert git_commit(tmp_path) is None  # not a checkout
    git("init", "-q")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "root")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    git("add", "pkg/a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "a")
    head = git("rev-parse", "HEAD").stdout.decode().strip()
    (tmp_path / "results.json").write_text("{}")  # untracked output elsewhere: still clean
    assert git_commit(tmp_path / "pkg") == head
    (tmp_path / "pkg" / "b.py").write_text("y = 1\n")  # a new module the run may import
    assert git_commit(tmp_path / "pkg") == head + "-dirty"
    (tmp_path / "pkg" / "b.py").unlink()
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    assert git_commit(tmp_path / "pkg") == head + "-dirty"


def test_agreement_is_the_share_of_our_output_a_peer_reproduced():
    assert _agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert _agreement([1, 2, 9, 4], [1, 2, 3, 4]) == 0.5
    assert _agreement([1, 2], [1, 2, 3, 4]) == 0.5  # stopped early
    assert _agreement([], []) == 1.0


# A stand-in llama_cpp package for the llama.cpp peer's process: Llama yields (the prompt's sum + i) % 50,
# its first token 1 when ggml's extra buffer types are on, else 0; a model path with "crash" in it ends the
# process with a segmentation fault on its first generation, as llama-cpp-python 0.3.36 does on AMX CPUs.
FAKE_LLAMA = {
    "__init__.py": """
import os, signal
from . import llama_cpp
class Llama:
    def __init__(self, model_path, **kwargs):
        self.path, self.extra = model_path, llama_cpp.llama_model_default_params().use_extra_bufts
    def reset(self):
        pass
    def generate(self, prompt, **kwargs):
        if "crash" in self.path:
            print("ggml_amx: about to fault", flush=True)
            os.kill(os.getpid(), signal.SIGSEGV)
        yield int(self.extra)
        i = 1
        while True:
            yield (sum(prompt) + i) % 50
            i += 1
""",
    "llama_cpp.py": """
class _Params:
    use_extra_bufts = True
def llama_model_default_params():
    return _Params()
""",
    "llama_speculative.py": """
class LlamaPromptLookupDecoding:
    def __init__(self, num_pred_tokens):
        self.k = num_pred_tokens
""",
}


@pytest.fixture
def fake_llama(tmp_path, monkeypatch):
    """Put a package `llama_cpp` (files: {name: source}) first on the llama.cpp process's path; a fresh
    process for the test, closed after it."""

    def install(files: dict[str, str]) -> None:
        package = tmp_path / "fake" / "llama_cpp"
        package.mkdir(parents=True)
        for name, source in files.items():
            (package / name).write_text(source)
        monkeypatch.setenv("PYTHONPATH", str(package.parent))

    monkeypatch.setattr(peers, "_WORKER", None)
    yield install
    if peers._WORKER is not None:
        peers._WORKER.close()


def test_llama_cpp_peer_says_how_to_install_it(fake_llama):
    fake_llama({"__init__.py": "raise ImportError('no llama_cpp here')"})  # an import of it fails
    with pytest.raises(RuntimeError, match=r"pip install llama-cpp-python==0\.3\.36 diskcache"):
        peers.llama_cpp_generate("any.gguf", [1, 2], 4, frozenset())


def test_llama_cpp_runs_in_its_own_process_and_its_crash_is_an_error(fake_llama):
    fake_llama(FAKE_LLAMA)
    run = peers.llama_cpp_generate("a.gguf", [3, 4], 6, frozenset({11}), n_ctx=256, extra_bufts=True)
    assert run.name == "llama-cpp" and run.tokens == [1, 8, 9, 10, 11]  # stopped at the end token 11
    assert run.tokens_per_s > 0 and run.n_ctx == 256 and run.rss_growth_bytes is not None
    again = peers.llama_cpp_generate("a.gguf", [3, 4], 3, frozenset(), n_ctx=256, extra_bufts=True)
    assert again.tokens == [1, 8, 9] and again.rss_growth_bytes is None  # the loaded model, in the same process
    pid = peers._WORKER.proc.pid
    off = peers.llama_cpp_generate("a.gguf", [3, 4], 2, frozenset(), n_ctx=256, k=2, extra_bufts=False)
    assert off.name == "llama-cpp-lookup" and off.tokens == [0, 8]  # extra buffer types off at load
    auto = peers.llama_cpp_generate("a.gguf", [3, 4], 1, frozenset(), n_ctx=256)  # None: off where the CPU has AMX
    assert auto.tokens == [0 if llama_worker.cpu_has_amx() else 1]
    assert peers._WORKER.proc.pid == pid and peers._WORKER.proc.poll() is None
    with pytest.raises(RuntimeError, match=r"died \(signal SIGSEGV\): ggml_amx: about to fault"):
        peers.llama_cpp_generate("crash.gguf", [3, 4], 4, frozenset())
    assert peers._WORKER.proc.pid == pid and peers._WORKER.proc.returncode == -signal.SIGSEGV  # that process died
    with pytest.raises(RuntimeError, match="SIGSEGV"):  # not tried again: no new process
        peers.llama_cpp_generate("a.gguf", [3, 4], 4, frozenset())
    assert peers._WORKER.proc.pid == pid


def test_a_crashing_llama_cpp_peer_is_reported_and_the_bench_goes_on(workload, fake_llama):
    from specdec.models.weights import cache_dir, is_pulled

    if not is_pulled("smollm2-135m", cache_dir()):
        pytest.skip("smollm2-135m is not pulled: run `specdec models pull smollm2-135m`")
    files = dict(FAKE_LLAMA)
    files["__init__.py"] = files["__init__.py"].replace('"crash" in self.path', "True")
    fake_llama(files)
    prompts = load_workload(workload, ["qa", "summarization"], 1)
    config = BenchConfig(
        (Pair("smollm2-135m"),), workload.name, (2,), 6, peers=("llama-cpp", "llama-cpp-lookup"), progress=False
    )
    res = run_bench(config, prompts)
    results.validate(res)
    pair = res["pairs"][0]
    assert len(pair["prompts"]) == 2 and all(r["runs"]["2"]["identical"] for r in pair["prompts"])
    rows = pair["peers"]
    assert [r["name"] for r in rows] == ["llama-cpp", "llama-cpp-lookup"] * 2
    assert all(math.isnan(r["tokens_per_s"]) and "SIGSEGV" in r["error"] for r in rows)


def test_memory_counts_the_pages_of_a_mapped_file_once_read(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\1" * (8 << 20))
    before = memory.rss_bytes()
    mapped = np.memmap(path, mode="r", dtype=np.uint8)
    assert memory.mapped_rss_bytes(path) == 0  # mapped, not read: nothing resident yet
    assert int(mapped.sum()) == 8 << 20  # read every page
    assert memory.mapped_rss_bytes(path) == 8 << 20
    file = SimpleNamespace(path=path, file_bytes=8 << 20)  # what footprint reads of a gguf.GGUFModel
    m = memory.footprint(before, file)
    assert m["file_mb"] == pytest.approx(8.388608) and m["file_resident_mb"] == pytest.approx(8.388608)
    assert m["rss_growth_mb"] == pytest.approx(m["file_resident_mb"] + m["other_mb"])
    assert m["growth_per_file_byte"] == pytest.approx(m["rss_growth_mb"] / m["file_mb"])
    assert 0.9 < m["growth_per_file_byte"] < 2  # the file, and little else
    assert m["peak_rss_mb"] >= m["rss_after_mb"]
    del mapped


def test_bench_runs_a_quantized_model_without_its_fp32_dequantization(workload, monkeypatch):
    """smollm2-135m at its own precision (the packaged GGUF, when pulled): precision, kernel, memory and
    roofline come from the quantized model, and nothing loads the transformers model."""
    from specdec.models import load
    from specdec.models.weights import cache_dir, is_pulled

    if not is_pulled("smollm2-135m", cache_dir()):
        pytest.skip("smollm2-135m is not pulled: run `specdec models pull smollm2-135m`")

    def refuse(*args, **kwargs):
        raise AssertionError("the bench loaded the fp32 dequantization of a quantized model")

    monkeypatch.setattr(load, "_load_transformers", refuse)
    config = BenchConfig((Pair("smollm2-135m"),), workload.name, (2,), 8, progress=False)
    res = run_bench(config, load_workload(workload, ["qa"], 1))
    results.validate(res)
    pair = res["pairs"][0]
    assert pair["precision"] == "gguf Q4_1+Q8_0" and pair["backend"] == "lean"
    target, _ = load_measured("smollm2-135m")
    assert pair["kernel"] == target.lean().kernel and pair["products"] is None
    assert pair["kernel"].startswith("specdec quant, ") and "batch-invariant" in pair["kernel"]
    roof = pair["costs"]["roofline"]
    quant = target.lean()  # a greedy bench reads the Q8_0 output layer through its 4-bit screen
    screened = quant.weight_bytes() - quant.lm_head.nbytes + quant.greedy_head.nbytes
    assert roof["weight_mb"] == screened / 1e6 and roof["screened_output_layer"] and roof["weights"] == "gguf Q4_1+Q8_0"
    assert roof["weight_mb"] < target.gguf.file_bytes / 1e6  # its blocks, not a dequantization
    mem = pair["memory"]
    assert mem["file_mb"] == target.gguf.file_bytes / 1e6
    # the growth splits into the file's pages mapped in and the rest (the copies regrouped at load, whose file
    # pages are released, and what the load touched first); RSS growth itself depends on what the process
    # freed before, so it is not bounded here
    assert 0 <= mem["file_resident_mb"] <= mem["file_mb"]
    assert mem["other_mb"] == pytest.approx(mem["rss_growth_mb"] - mem["file_resident_mb"], abs=0.01)
    assert mem["growth_per_file_byte"] == pytest.approx(mem["rss_growth_mb"] / mem["file_mb"])
    report = markdown_report(res)
    assert "precision gguf Q4_1+Q8_0" in report and f"Matrix products: {pair['kernel']}." in report


def test_costs_are_timed_where_a_hybrid_drafts_with_its_model():
    """cost_context: the prompts joined, longest first, cut to the length, then shortened until the
    drafter's free lookup branch (long_match) would not fire."""
    from specdec.bench.measure import cost_context
    from specdec.drafters.base import Drafter

    class Hybrid(Drafter):
        def long_match(self, context):
            return 6 if context[-1] == 7 else None  # lookup fires after token 7

    prompts = [[1, 2, 3], [4, 5, 6, 7, 7, 7, 7]]
    assert cost_context(Drafter(), prompts, 6) == [4, 5, 6, 7, 7, 7]
    assert cost_context(Hybrid(), prompts, 6) == [4, 5, 6]
    assert cost_context(Drafter(), prompts, 12) == [4, 5, 6, 7, 7, 7, 7, 1, 2, 3, 4, 5]  # all shorter: repeated
    with pytest.raises(ValueError, match="two tokens"):
        cost_context(Drafter(), [], 6)


FAKE_SERVER = """
import json, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
if args[args.index("-m") + 1] == "crash.gguf":
    print("llama_model_load: error loading model", flush=True)
    sys.exit(3)
with open(args[args.index("-m") + 1] + ".argv", "a") as f:
    f.write(json.dumps(args) + "\\n")

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _reply(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._reply({"status": "ok"})

    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert request["temperature"] == 0.0 and request["cache_prompt"] is False and request["return_tokens"]
        tokens = [len(request["prompt"]), 7, 8][: request["n_predict"]]
        self._reply({"tokens": tokens, "stop_type": "limit", "timings": {"predicted_per_second": 50.0}})

HTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), Handler).serve_forever()
"""


@pytest.fixture
def fake_server(tmp_path, monkeypatch):
    """A stand-in llama-server (a Python HTTP server answering /health and /completion) named by
    SPECDEC_LLAMA_SERVER; its arguments are appended to <model file>.argv."""
    from specdec.bench import llama_server

    script = tmp_path / "llama-server"
    script.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    script.chmod(0o755)
    monkeypatch.setenv("SPECDEC_LLAMA_SERVER", str(script))
    yield tmp_path
    llama_server._close()


def test_llama_server_peer_says_how_to_build_it(tmp_path, monkeypatch):
    from specdec.bench import llama_server

    monkeypatch.setenv("SPECDEC_LLAMA_SERVER", str(tmp_path / "nothing"))
    with pytest.raises(RuntimeError, match=r"bash scripts/llama_server\.sh"):
        llama_server.llama_server_generate("llama-server", "a.gguf", [1, 2], 4, 2)
    with pytest.raises(ValueError, match="unknown llama-server peer"):
        llama_server.server_args("llama-server-eagle", "a.gguf", None, 4, 2, 256)
    with pytest.raises(ValueError, match="needs a draft"):
        llama_server.server_args("llama-server-draft", "a.gguf", None, 4, 2, 256)


def test_llama_server_peer_runs_each_configuration_on_a_server_of_its_own(fake_server, monkeypatch):
    from specdec.bench import llama_server

    target, draft = str(fake_server / "t.gguf"), str(fake_server / "d.gguf")
    run = llama_server.llama_server_generate("llama-server", target, [3, 4, 5], 6, 2, n_ctx=256)
    assert run.name == "llama-server" and run.tokens == [3, 7, 8]
    assert run.tokens_per_s > 0 and run.decode_tokens_per_s == 50.0 and run.n_ctx == 256
    pid = llama_server._SERVER[1].process.pid
    assert llama_server.llama_server_generate("llama-server", target, [3], 2, 2, 256).tokens == [1, 7]
    assert llama_server._SERVER[1].process.pid == pid  # kept for the same configuration
    spec = llama_server.llama_server_generate("llama-server-draft", target, [3], 6, 2, 256, draft, k=5)
    assert spec.name == "llama-server-draft" and llama_server._SERVER[1].process.pid != pid
    started = [json.loads(line) for line in open(target + ".argv")]
    assert len(started) == 2 and "--spec-type" not in started[0]  # plain, then the draft configuration
    drafting = started[1]
    assert drafting[drafting.index("-md") + 1] == draft
    assert drafting[drafting.index("--spec-type") + 1] == "draft-simple"
    assert drafting[drafting.index("--spec-draft-n-max") + 1] == "5" and drafting[drafting.index("-t") + 1] == "2"
    assert ("--no-repack" in drafting) == llama_worker.cpu_has_amx()
    with pytest.raises(RuntimeError, match="llama-server exited .*error loading model"):
        llama_server.llama_server_generate("llama-server-ngram", "crash.gguf", [3], 2, 2, 256)


def test_peers_are_set_against_k_auto_when_no_fixed_k_ran_and_the_fastest_per_prompt_is_summed_up():
    from specdec.bench.fit import _best_peer, _peer_summary, _speculative

    records = [
        {"id": i, "plain": {"tokens_per_s": 10.0, "decode_tokens_per_s": 11.0}, "runs": {"auto": {"tokens_per_s": s}}}
        for i, s in (("a", 20.0), ("b", 30.0))
    ]
    peer = lambda name, pid, tps: {"name": name, "prompt_id": pid, "tokens_per_s": tps, "identical": None}  # noqa: E731
    peers = [peer("p1", "a", 8.0), peer("p2", "a", 12.0), peer("p1", "b", 5.0), peer("p2", "b", float("nan"))]
    assert _speculative(records, None) == "auto" and _speculative(records, 3) == "3"
    summary = {p["name"]: p for p in _peer_summary(peers, records, "auto")}
    assert summary["p1"]["vs_speculative"] == pytest.approx((8 / 20 + 5 / 30) / 2)
    best = _best_peer(peers, records, "auto")  # fastest: 12 on a, 5 on b (p2 failed there)
    assert best["peers"] == ["p1", "p2"]
    assert best["vs_plain"] == pytest.approx((1.2 + 0.5) / 2)
    assert best["speculative_over_best"] == pytest.approx((20 / 12 + 30 / 5) / 2)
    assert _best_peer([], records, "auto") is None
    assert _best_peer(peers, records, None)["speculative_over_best"] is None
