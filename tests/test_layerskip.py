"""The layer-skip draft at first use: a stored calibration, else a shipped one, else one made now
(and cached); and the calibration's reference outputs, which are plain greedy decoding."""

from __future__ import annotations

import functools
import json
import re

import pytest

from specdec import generate
from specdec.cli import main
from specdec.drafters.layerskip import LayerSkipDrafter
from specdec.models.registry import REGISTRY
from specdec.train import calibrate
from specdec.train.calibrate import SCHEMA, greedy_reference, skip_file

from .conftest import make_model, prompt_ids

N_NEW = 30


@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # the lean backend's cache and transformers'
def test_reference_outputs_are_plain_greedy_decoding(arch):
    """greedy_reference stands in for generate(k=0): the same tokens, up to the length, an
    end-of-sequence token (kept) or the end of the context."""
    plain = make_model(arch, seed=1)
    ending = make_model(arch, seed=1, eos=frozenset(range(3, 20)))
    ends = set()
    for model, n, seed in [
        (plain, N_NEW, 0),
        (plain, N_NEW, 1),
        (plain, 1, 0),
        (plain, 0, 0),
        (plain, 500, 2),
        (ending, N_NEW, 0),
        (ending, N_NEW, 1),
    ]:
        prompt = prompt_ids(seed=seed)
        want = generate(model, prompt, None, max_new_tokens=n)
        assert greedy_reference(model, prompt, n) == want.tokens, (n, seed)
        ends.add(want.stats.stop_reason)
    assert ends == {"length", "context", "eos"}  # every way a reference output ends was checked


@pytest.fixture
def small(monkeypatch, tmp_path):
    """An empty shipped folder, and first-use calibrations made small (two prompts, short outputs,
    a given verify ratio) so they take a moment on a tiny model. Yields the shipped folder."""
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    monkeypatch.setattr(calibrate, "SHIPPED", shipped)
    monkeypatch.setattr(calibrate, "calibration_prompts", lambda: ["w1 w2 w3 w1 w2", "w9 w8 w7"])
    monkeypatch.setattr(
        calibrate,
        "calibrate_skip",
        functools.partial(
            calibrate.calibrate_skip, config=calibrate.CalibrateConfig(max_new_tokens=12, verify_ratio=1.5)
        ),
    )
    return shipped


def no_calibration(*args, **kwargs):
    raise AssertionError("calibrated although a calibration was there")


def kept_layers(drafter: LayerSkipDrafter, target) -> list[int]:
    """The target's layer indices the drafter's view runs."""
    ids = {id(layer.mlp): i for i, layer in enumerate(target.hf.model.layers)}
    return [ids[id(layer.mlp)] for layer in drafter.view.hf.model.layers]


def test_first_use_calibrates_caches_and_stays_exact(small, tmp_path, monkeypatch, capsys):
    target = make_model("qwen2", seed=1, name="tiny/qwen2")
    path = skip_file(target.name, tmp_path)
    prompt = prompt_ids()
    drafter = LayerSkipDrafter(cache=tmp_path)
    got = generate(target, prompt, drafter, k=4, max_new_tokens=N_NEW)
    assert got.tokens == generate(target, prompt, None, max_new_tokens=N_NEW).tokens
    assert got.stats.drafted > 0
    err = capsys.readouterr().err
    assert "calibrating layer-skip for tiny/qwen2" in err and str(path) in err
    assert "layer search" in err  # the progress bar
    stored = json.loads(path.read_text())
    assert stored["schema"] == SCHEMA and stored["n_layers"] == 2 and stored["max_new_tokens"] == 12
    assert kept_layers(drafter, target) == stored["layers"] and len(stored["layers"]) == 1

    # Once cached, a new drafter (a new process) reads it and says nothing.
    monkeypatch.setattr(calibrate, "calibrate_skip", no_calibration)
    again = LayerSkipDrafter(cache=tmp_path)
    again.prepare(target)
    assert kept_layers(again, target) == stored["layers"] and capsys.readouterr().err == ""


def test_shipped_calibration_is_used_and_a_stored_one_wins(small, tmp_path, monkeypatch, capsys):
    target = make_model("llama", seed=1, name="tiny-registry-model")
    monkeypatch.setattr(calibrate, "calibrate_skip", no_calibration)
    (small / "tiny-registry-model.json").write_text(
        json.dumps({"schema": SCHEMA, "model": "tiny-registry-model", "n_layers": 2, "layers": [1]})
    )
    drafter = LayerSkipDrafter(cache=tmp_path)
    prompt = prompt_ids()
    got = generate(target, prompt, drafter, k=3, max_new_tokens=N_NEW)
    assert kept_layers(drafter, target) == [1]
    assert got.tokens == generate(target, prompt, None, max_new_tokens=N_NEW).tokens
    assert not skip_file(target.name, tmp_path).exists() and capsys.readouterr().err == ""

    calibrate.save_skip_layers(
        {"schema": SCHEMA, "model": "tiny-registry-model", "n_layers": 2, "layers": [0]}, tmp_path
    )
    stored = LayerSkipDrafter(cache=tmp_path)
    stored.prepare(target)
    assert kept_layers(stored, target) == [0]  # the user's own calibration (calibrate-skip) comes first


@pytest.mark.parametrize("stale", ["n_layers", "schema", "garbled"])
def test_a_stale_calibration_is_made_again(small, tmp_path, capsys, stale):
    """A cached or shipped file made for another model shape or format, or unreadable, counts as
    none: the drafter calibrates and overwrites the cached one instead of failing."""
    target = make_model("gemma3", seed=1, name="tiny-gemma")
    path = skip_file(target.name, tmp_path)
    bad = {
        "n_layers": {"schema": SCHEMA, "model": "tiny-gemma", "n_layers": 3, "layers": [0, 2]},
        "schema": {"schema": "specdec.layer-skip/0", "model": "tiny-gemma", "n_layers": 2, "layers": [1]},
    }
    text = json.dumps(bad[stale]) if stale in bad else '{"schema": "specdec.layer-sk'
    path.parent.mkdir(parents=True)
    for file in (path, small / path.name):
        file.write_text(text)
    prompt = prompt_ids()
    got = generate(target, prompt, LayerSkipDrafter(cache=tmp_path), k=4, max_new_tokens=N_NEW)
    assert got.tokens == generate(target, prompt, None, max_new_tokens=N_NEW).tokens
    assert "calibrating layer-skip for tiny-gemma" in capsys.readouterr().err
    stored = json.loads(path.read_text())
    assert stored["schema"] == SCHEMA and stored["n_layers"] == 2 and len(stored["layers"]) == 1


def test_cli_layer_skip_works_on_a_fresh_cache(small, model_dir, tmp_path, capsys):
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
        "--drafter",
        "layer-skip",
        "--cache-dir",
        str(tmp_path),
    ]
    assert main(base) == 0
    out, err = capsys.readouterr()
    assert "identical to plain greedy: yes" in out and "calibrating layer-skip" in err
    assert main(base) == 0  # the second run reads the cached choice
    out, err = capsys.readouterr()
    assert "identical to plain greedy: yes" in out and "calibrating" not in err


def test_shipped_calibrations_fit_their_registry_models():
    """Each shipped file is named after a registry model, in the current schema, for that model's
    number of decoder layers (as the registry describes it), and keeps fewer layers than it has."""
    files = [f for f in calibrate.SHIPPED.iterdir() if f.name.endswith(".json")]
    assert "smollm2-135m.json" in {f.name for f in files}
    for file in files:
        data = json.loads(file.read_text())
        name = file.name.removesuffix(".json")
        assert name in REGISTRY and data["model"] == name and data["schema"] == SCHEMA
        n_layers = int(re.search(r"(\d+) layers", REGISTRY[name].description).group(1))
        assert data["n_layers"] == n_layers
        assert calibrate.parse_layers(data["layers"], n_layers) == data["layers"] and len(data["layers"]) < n_layers
