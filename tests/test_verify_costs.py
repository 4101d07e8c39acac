"""The verify-cost curve's on-disk cache (specdec.adaptive.costs): timed once per model, backend,
thread count and processor, then loaded; a broken file is ignored and replaced."""

from __future__ import annotations

import json
import os

import pytest
import torch

from specdec import generate
from specdec.adaptive import AdaptiveK, VerifyCosts
from specdec.adaptive import costs as costs_module
from specdec.adaptive.costs import SCHEMA, cache_file, cache_key
from specdec.backends.quant import KV_DTYPES
from specdec.bench.measure import warm_verify_costs
from specdec.cache import new_cache
from specdec.models.load import Model
from specdec.models.quantize import quantize_model

from .conftest import make_model, prompt_ids, remake


def prefilled(target: Model, prompt: list[int]):
    """A target cache holding the prompt but its last token, as the engine calibrates on."""
    kv = new_cache(target)
    kv.extend(prompt[:-1], all_logits=False)
    return kv


def counting_extends(kv) -> list:
    """Record every forward run on kv from now on."""
    calls, real = [], kv.extend
    kv.extend = lambda *args, **kwargs: calls.append(args) or real(*args, **kwargs)
    return calls


def test_a_second_curve_for_the_same_model_loads_what_the_first_timed(verify_cost_cache):
    target, prompt = make_model("llama", seed=3), prompt_ids()
    first = VerifyCosts.for_model(target)
    assert not first.known() and not list(verify_cost_cache.iterdir())  # nothing cached yet
    first.calibrate(prefilled(target, prompt), prompt, 4, ahead=40)
    assert len(first.shapes) == 2 and [p.name for p in verify_cost_cache.iterdir()] == [first.path.name]

    second = VerifyCosts.for_model(target)
    assert second.shapes == first.shapes and second.ms == pytest.approx(first.ms)
    assert not second.needs(len(prompt) - 1) and not second.needs(len(prompt) - 1 + 40)
    kv = prefilled(target, prompt)
    calls = counting_extends(kv)
    second.calibrate(kv, prompt, 4, ahead=40)
    assert calls == []  # loaded counts as calibrated: no forward timed
    assert second.shape == first.shape and second(3) == pytest.approx(first(3))


def test_a_one_shot_generation_times_the_curve_only_the_first_time(monkeypatch):
    """`specdec generate -k auto` run twice on a machine: the second run's prefill times nothing."""
    target, prompt = make_model("qwen2", seed=4), prompt_ids()
    timed = []
    real = VerifyCosts._time
    monkeypatch.setattr(VerifyCosts, "_time", lambda self, *args: timed.append(1) or real(self, *args))
    first = generate(target, prompt, "prompt-lookup", k="auto", k_max=4, max_new_tokens=40)
    assert len(timed) == 2  # at the prompt (11 tokens) and where the output ends (51: more than 4x on)
    again = generate(target, prompt, "prompt-lookup", k="auto", k_max=4, max_new_tokens=40)
    assert len(timed) == 2 and again.tokens == first.tokens


def test_the_bench_times_the_curve_before_its_prompts_so_that_none_pays_it(monkeypatch):
    """specdec bench -k auto: every prompt's context is timed before the first prompt runs (a prompt
    more than 4x longer than another needs its own shape), and no generation times one after that."""
    target, short = make_model("qwen2", seed=4, n_ctx=320), prompt_ids()
    long = prompt_ids(n=220, seed=1)
    timed = []
    real = VerifyCosts._time
    monkeypatch.setattr(VerifyCosts, "_time", lambda self, *args: timed.append(1) or real(self, *args))
    policy = AdaptiveK(VerifyCosts.for_model(target), k_max=4)
    warm_verify_costs(target, policy, [short, long, short], max_new_tokens=40)
    assert len(timed) == 3  # at 11 and 51 tokens (short's prompt and its end), at 219 (more than 4x 51)
    assert sorted(policy.costs.shapes) == [11, 51, 219]
    for prompt in (short, long):
        generate(target, prompt, "prompt-lookup", k="auto", policy=policy, max_new_tokens=40)
    assert len(timed) == 3


def test_the_key_tells_threads_backends_processors_and_models_apart(monkeypatch):
    lean = make_model("llama", seed=3)
    hf = Model(lean.hf, lean.tokenizer, lean.name, lean.eos_token_ids, backend="hf")
    key = cache_key(lean)
    assert key["backend"] == "lean" and key["threads"] == torch.get_num_threads()
    assert key["parameters"] == sum(p.numel() for p in lean.hf.parameters()) and key["dtype"] == "float32"
    files = {
        cache_file(key),
        cache_file(cache_key(hf)),
        cache_file(cache_key(make_model("llama", seed=3, vocab_size=80))),
    }
    monkeypatch.setattr(torch, "get_num_threads", lambda: key["threads"] + 1)
    files.add(cache_file(cache_key(lean)))
    monkeypatch.setattr(costs_module, "processor", lambda device: "another CPU")
    files.add(cache_file(cache_key(lean)))
    assert len(files) == 5 and all(f.name.startswith("tiny-llama-3-") for f in files)

    prompt = prompt_ids()
    timed = VerifyCosts.for_model(lean)
    timed.calibrate(prefilled(lean, prompt), prompt, 3)
    assert VerifyCosts.for_model(lean).known() and not VerifyCosts.for_model(hf).known()


def test_the_processor_is_named():
    name = costs_module.processor(torch.device("cpu"))
    assert isinstance(name, str)
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        assert not names or name == names[0]


def _saved(target: Model) -> dict:
    """A valid cache file's content for target, timed once."""
    prompt = prompt_ids()
    costs = VerifyCosts.for_model(target)
    costs.calibrate(prefilled(target, prompt), prompt, 3)
    return json.loads(costs.path.read_text())


@pytest.mark.parametrize(
    "broken", ["not json", "truncated", "list", "schema", "key", "negative", "no level", "strings"]
)
def test_a_broken_or_foreign_file_is_ignored_and_replaced(broken, verify_cost_cache):
    target, prompt = make_model("llama", seed=3), prompt_ids()
    good = _saved(target)
    path = cache_file(cache_key(target))
    text = json.dumps(good)
    content = {
        "not json": "\x00\xff garbage",
        "truncated": text[: len(text) // 2],
        "list": "[1, 2, 3]",
        "schema": json.dumps({**good, "schema": SCHEMA + 1}),
        "key": json.dumps({**good, "key": {**good["key"], "threads": good["key"]["threads"] + 1}}),
        "negative": json.dumps({**good, "ms": {**good["ms"], "2": -1.0}}),
        "no level": json.dumps({**good, "ms": {n: v for n, v in good["ms"].items() if n != "1"}}),
        "strings": json.dumps({**good, "shapes": {"x": {"1": "fast"}}}),
    }[broken]
    path.write_text(content)
    costs = VerifyCosts.for_model(target)  # no stack trace
    assert not costs.known() and not costs.shapes
    kv = prefilled(target, prompt)
    calls = counting_extends(kv)
    costs.calibrate(kv, prompt, 3)
    assert calls  # timed again
    replaced = json.loads(path.read_text())
    assert replaced["schema"] == SCHEMA and replaced["key"] == cache_key(target)
    assert VerifyCosts.for_model(target).shapes == costs.shapes
    assert [p.name for p in verify_cost_cache.iterdir()] == [path.name]


def test_the_write_is_atomic_and_a_failed_one_keeps_the_old_file(monkeypatch, verify_cost_cache):
    target, prompt = make_model("llama", seed=3), prompt_ids()
    good = _saved(target)
    path = cache_file(cache_key(target))
    assert [p.name for p in verify_cost_cache.iterdir()] == [path.name]  # no temporary file left

    def refuse(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", refuse)  # the rename that completes a write fails
    costs = VerifyCosts.for_model(target)
    with pytest.warns(UserWarning, match="could not cache"):
        costs.calibrate(prefilled(target, prompt), prompt, 3, ahead=40)  # times a new context
    assert len(costs.shapes) == 2  # kept in memory
    assert json.loads(path.read_text()) == good  # the old file, whole
    assert [p.name for p in verify_cost_cache.iterdir()] == [path.name]


def test_a_curve_built_in_memory_is_never_written(verify_cost_cache):
    target, prompt = make_model("llama", seed=3), prompt_ids()
    costs = VerifyCosts()
    costs.calibrate(prefilled(target, prompt), prompt, 3, ahead=40)
    assert costs.shapes and costs.path is None and not list(verify_cost_cache.iterdir())


def test_a_quantized_models_key_names_its_kernels_and_kv_cache(monkeypatch):
    """A curve timed with other kernels (another activation path, KV cache or kernel code) is not reused."""
    from specdec.backends import qkernel

    fp32 = make_model("llama", seed=3)
    gguf = quantize_model(fp32.hf, "q8_0", "tiny")
    models = [remake(fp32, hf=None, lean=None, gguf=gguf, config=fp32.hf.config, kv_dtype=kv) for kv in KV_DTYPES]
    keys = [cache_key(m) for m in models]
    for m, k in zip(models, keys):
        assert k["dtype"] == f"gguf Q8_0, {m.lean().kernel}, kernels {qkernel.source_digest()}"
    assert "fp16 KV cache" in keys[0]["dtype"] and "fp32 KV cache" in keys[1]["dtype"]
    assert cache_file(keys[0]) != cache_file(keys[1])
    monkeypatch.setattr(qkernel, "source_digest", lambda: "0123456789abcdef")  # the kernels' code changed
    assert cache_file(cache_key(models[0])) != cache_file(keys[0])


def _saved_curve(shape: dict[int, float], level: float = 5.0) -> VerifyCosts:
    """A curve with one shape timed at context 100, saved, in use at that context."""
    costs = VerifyCosts(path=costs_module.folder() / "m-0123456789abcdef.json", _key={"model": "m"})
    costs.shapes = {100: dict(shape)}
    costs.ms = {n: level * r for n, r in shape.items()}
    costs.save()
    costs.at(100)
    return costs


def test_rounds_that_drift_off_the_saved_shape_have_it_timed_again(verify_cost_cache):
    timed_under_load = {1: 1.0, 2: 1.3, 4: 2.0, 8: 3.0}  # V(8) / V(1) as a busy machine timed it
    costs = _saved_curve(timed_under_load)
    for _ in range(costs.drift_rounds):  # the machine now: V(1) 5 ms, V(8) 9 ms (a ratio of 1.8)
        costs.observe(1, 5.0)
        costs.observe(8, 9.0)
    assert costs.shapes == {} and costs.needs(100)  # the next calibrate() times it again
    again = VerifyCosts(path=costs.path, _key={"model": "m"})
    assert not again.load()  # and the file no longer holds it (a curve needs a shape)


def test_a_uniform_slow_down_moves_the_level_not_the_shape(verify_cost_cache):
    shape = {1: 1.0, 2: 1.3, 4: 2.0, 8: 3.0}
    costs = _saved_curve(shape)
    for _ in range(3 * costs.drift_rounds):  # every length twice as slow as saved, with some noise
        for n, jitter in ((1, 1.1), (2, 0.95), (8, 1.05)):
            costs.observe(n, 2 * 5.0 * shape[n] * jitter)
    assert costs.shapes == {100: shape} and not costs.needs(100)
    assert costs(1) == pytest.approx(10.0, rel=0.15) and costs(8) == pytest.approx(30.0, rel=0.15)


def test_forget_deletes_every_curve_of_a_model_and_no_other(verify_cost_cache):
    lean = make_model("llama", seed=3)
    mine = [cache_file(cache_key(lean))]
    for name in ("tiny-llama-3", "tiny-llama-3-b"):
        (verify_cost_cache / f"{name}-0123456789abcdef.json").write_text("{}")
    mine.append(verify_cost_cache / "tiny-llama-3-0123456789abcdef.json")
    mine[0].write_text("{}")
    assert sorted(costs_module.forget(lean.name)) == sorted(mine)
    assert [p.name for p in verify_cost_cache.iterdir()] == ["tiny-llama-3-b-0123456789abcdef.json"]
    assert costs_module.forget(lean.name) == []


def test_forks_keep_their_own_context_and_share_the_level_and_the_shapes():
    """The server's sequences plan over forks of one curve: a sequence at a long context must not
    move a short one's curve (it used to: one shared `shape`, rewritten by at()), while what a timed
    round or a calibration teaches is every fork's."""
    parent = VerifyCosts(ms={1: 10.0}, shapes={100: {1: 1.0, 4: 1.2}, 2000: {1: 1.0, 4: 2.0}})
    short, long = parent.fork(), parent.fork()
    short.at(100)
    long.at(2000)
    assert short(4) == pytest.approx(12.0) and long(4) == pytest.approx(20.0)
    short.at(110)  # the other fork's context changed nothing here
    assert short(4) == pytest.approx(12.0)
    long.observe(4, 30.0)  # a timed round at the long context moves the shared level
    level = 0.7 * 10.0 + 0.3 * 30.0 / 2.0
    assert parent.ms[1] == short.ms[1] == pytest.approx(level) and short(4) == pytest.approx(1.2 * level)
    parent.shapes[600] = {1: 1.0, 4: 1.5}  # a calibration through any fork lands in the shared shapes
    assert not short.needs(600) and not long.needs(600)
