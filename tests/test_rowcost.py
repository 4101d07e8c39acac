"""An added row's cost against the CPU's peak (specdec.bench.rowcost) and `specdec kernels`
(specdec.bench.kernels): the slope, the peak probe, the per-type table and its refusals. No timing
is asserted, only what the numbers mean."""

from __future__ import annotations

import pytest
import torch

from specdec.backends.qkernel import TYPES, kernels
from specdec.bench.kernels import FLOATS, FP16_FIELDS, measure, measure_tiles, random_matrix, table
from specdec.bench.rowcost import fit_slope, product_kernel, row_cost
from specdec.cli import main
from specdec.models.load import load_model
from specdec.models.weights import cache_dir, is_pulled


def test_fit_slope_is_the_least_squares_slope():
    assert fit_slope({1: 5.0, 2: 6.0, 4: 8.0, 8: 12.0}) == pytest.approx(1.0)
    assert fit_slope({1: 1.0, 3: 3.0, 2: 1.0}) == pytest.approx(1.0)  # (1,1), (2,1), (3,3): slope 1
    with pytest.raises(ValueError, match="two"):
        fit_slope({1: 5.0})


def test_peak_counts_multiply_adds_per_second():
    fp32 = kernels().peak("fp32", 200000)
    assert 1e8 < fp32 < 1e14  # 16-lane multiply-adds: some G/s on any CPU that runs this
    if kernels().int8_available():
        assert kernels().peak("int8", 200000) > fp32  # 64 (VNNI) or 32 (AVX2) int8 multiply-adds against 16
    else:
        with pytest.raises(RuntimeError, match="VNNI"):
            kernels().peak("int8", 1000)
    if kernels().amx_available():
        assert kernels().peak("amx", 200000) > kernels().peak("int8", 200000)  # 16 x 16 x 64 a tile product
    else:
        with pytest.raises(RuntimeError, match="no AMX"):
            kernels().peak("amx", 1000)
    with pytest.raises(RuntimeError, match="'int8', 'fp32' or 'amx'"):
        kernels().peak("bf16", 1000)


def test_row_cost_is_none_off_the_quantized_backend(model_dir):
    model = load_model(str(model_dir))  # a tiny Hugging Face model: the lean fp32 forward
    assert row_cost(model, {"1": 1.0, "2": 1.5}) is None


def test_row_cost_of_the_packaged_smollm2_counts_its_matrices():
    if not is_pulled("smollm2-135m", cache_dir()):
        pytest.skip("smollm2-135m is not pulled: run `specdec models pull smollm2-135m`")
    model = load_model("smollm2-135m")
    cost = row_cost(model, {"1": 5.0, "2": 6.0, "4": 8.0})
    # 30 layers of q, k, v (576 + 2 x 192 rows), o (576), gate and up (2 x 1536), down (576 x 1536), and the
    # tied output layer (49152 x 576): multiply-adds of one row
    layer = (576 + 2 * 192) * 576 + 576 * 576 + 2 * 1536 * 576 + 576 * 1536
    assert cost["macs_per_row"] == 30 * layer + 49152 * 576
    assert cost["kernel"] == (kernels().int8_kernels() if model.lean().int8 else "fp32")  # tiles: sixteen rows or more
    assert cost["marginal_ms"] == pytest.approx(1.0)
    assert cost["peak_ms"] == pytest.approx(cost["macs_per_row"] / (cost["peak_gmacs"] * 1e9) * 1e3)
    assert cost["fraction"] == pytest.approx(cost["peak_ms"] / 1.0)


def test_random_matrix_has_the_types_layout_and_finite_scales():
    w = random_matrix("Q4_K", 32, 512)
    assert w.shape == (32, 2 * 144) and w.dtype == torch.uint8
    ids = torch.arange(32)
    assert torch.isfinite(kernels().dequantize_rows(w, 12, 512, ids)).all()


def test_kernels_times_every_type_the_kernels_multiply(capsys):
    """Each of the kernels' types has a random matrix that decodes finite (F32, F16 and BF16: values), so
    `--types` takes it; where int8 activations run, a type without int8 kernels says its row ran the fp32 kernel."""
    assert set(TYPES) == {*FP16_FIELDS, *FLOATS}
    for name, kind in TYPES.items():
        w = random_matrix(name, 16, 256)
        assert torch.isfinite(kernels().dequantize_rows(w, kind, 256, torch.arange(16))).all(), name
    assert main(["kernels", "--types", "Q3_K,BF16,Q4_K", "--columns", "256", "--mb", "1"]) == 0
    out = capsys.readouterr().out
    fp32 = " (fp32 kernel)" if kernels().int8_available() else ""
    assert f"| Q3_K{fp32} |" in out and f"| BF16{fp32} |" in out and "| Q4_K |" in out


def test_kernels_table_for_one_type(capsys):
    row = measure("Q4_1", K=256, megabytes=1, rounds=2, int8=kernels().int8_available())
    assert row["rows"] % 16 == 0 and set(row["ratio"]) == {1, 2, 4, 8, 9}
    assert row["mb"] == pytest.approx(row["rows"] * 256 // 32 * 20 / 1e6)  # regrouped: the file's bytes
    assert row["gbs"] == pytest.approx(row["mb"] / row["v1_ms"])  # MB per ms is GB per s
    if row["marginal_ms"] > 0:  # a timed marginal's sign is the machine's, not the code's: both cases checked
        assert row["gmacs"] == pytest.approx(row["rows"] * 256 / row["marginal_ms"] / 1e6)
    else:
        assert row["gmacs"] == float("inf")
    result = {"kernel": "fp32", "threads": 2, "peak_gmacs": 10.0, "peak_one_thread_gmacs": 8.0}
    text = table({**result, "types": [{**row, "fraction": 0.5}]})
    assert "| Q4_1 |" in text and "50%" in text and "10 G multiply-adds/s (8 G on one thread: 1.25x with 2)" in text
    assert main(["kernels", "--types", "Q8_0", "--columns", "256", "--mb", "1"]) == 0
    assert "| Q8_0 |" in capsys.readouterr().out


def test_kernels_refuses_what_it_cannot_time():
    with pytest.raises(SystemExit, match="no kernel for IQ2_XXS"):
        main(["kernels", "--types", "IQ2_XXS", "--mb", "1"])
    with pytest.raises(SystemExit, match="multiple of 256"):
        main(["kernels", "--columns", "100"])


def test_report_gives_the_verify_floor_the_peak_allows():
    from specdec.bench.report import _costs

    row = {"kernel": "vnni", "marginal_ms": 1.0, "macs_per_row": 135e6, "peak_ms": 0.5, "peak_gmacs": 270.0}
    costs = {"verify_ms": {"1": 5.0, "2": 6.0, "8": 12.0}, "context_tokens": 64, "draft_ms": {}, "overhead_ms": 0.1}
    text = "\n".join(_costs({"costs": {**costs, "row_cost": row | {"fraction": 0.5}}}))
    assert "At that peak V(8)/V(1) can be no less than 1.70 at this V(1)." in text  # 1 + 7 x 0.5 / 5


def test_the_product_kernel_is_amx_only_for_a_tile_of_rows():
    if not kernels().int8_available():
        pytest.skip("no AVX2 or AVX512-VNNI here: the int8 products do not run")
    tile, isa = kernels().amx_rows(), kernels().int8_kernels()
    assert tile == 16 and isa in ("vnni", "avx2")
    assert product_kernel(False, 32) == "fp32"
    assert product_kernel(True, tile - 1) == isa  # verify blocks of up to fifteen rows keep VNNI
    assert product_kernel(True, tile) == ("amx" if kernels().amx_on() else isa)


def test_the_kernels_table_gives_the_tiles_prompt_chunk_times():
    result = {"kernel": "vnni", "threads": 2, "peak_gmacs": 10.0, "peak_one_thread_gmacs": 8.0, "types": []}
    tiles = [{"type": "Q4_1", "rows": 128, "tiles_ms": 4.0, "vnni_ms": 5.0}]
    assert "AMX" not in table({**result, "tiles": []})
    text = table({**result, "tiles": tiles})
    assert "128 input rows" in text and "- Q4_1: 4.00 ms on tiles, 5.00 on VNNI (1.25x)" in text


def test_measure_tiles_times_both_paths_or_says_why_it_cannot():
    if not kernels().amx_available():
        with pytest.raises(RuntimeError, match="no AMX tiles here"):
            measure_tiles("Q4_1", K=256, megabytes=1, rounds=1)
        return
    with pytest.raises(ValueError, match="do not take Q6_K"):
        measure_tiles("Q6_K", K=256, megabytes=1)
    was = kernels().use_amx(False)
    try:
        row = measure_tiles("Q4_1", K=256, megabytes=1, rounds=2)
        assert not kernels().amx_on()  # the switch is left as it was
    finally:
        kernels().use_amx(was)
    assert row["type"] == "Q4_1" and row["rows"] == 128 and row["tiles_ms"] > 0 and row["vnni_ms"] > 0
