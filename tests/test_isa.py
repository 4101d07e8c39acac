"""The kernels built for older instruction sets on a CPU that has more: x86-64-v3 (AVX2 + FMA + F16C,
no AVX-512, no VNNI: fp32 activations, the 8-lane halves of every 16-lane step, attention's per-key dot
products, F16C's widening of an fp16 cache) and x86-64-v2 (SSE4.2 only: every vector step, fused
multiply-add and fp16 conversion in its scalar fallback). Each compiles, stays batch-invariant bit for
bit, and gives the bits of this machine's own fp32 path. Skipped, with the reason, where the CPU lacks
the instruction set or there is no compiler.

And the AMX tiles (quant/amx.h): on a CPU with AMX the native build's tiles must give the VNNI
kernels' bits for every row count and thread count; everywhere with VNNI, a build that emulates
the tile instructions with loops checks the same of the data flow around them."""

from __future__ import annotations

import pytest
import torch

from specdec.backends import qkernel
from specdec.backends.qkernel import INT8_TYPES, TYPES, kernels
from specdec.bench.kernels import tile_types
from specdec.cache import new_cache
from specdec.models.load import load_model
from specdec.models.weights import cache_dir, is_pulled

from .quant_cases import assert_rows_invariant, attention_case, random_blocks

ISAS = {"x86-64-v3": ("avx2", "fma", "f16c"), "x86-64-v2": ("sse4_2", "popcnt")}  # -march: the flags it needs


def _cpu_flags() -> set[str]:
    return set(qkernel.cpu_field("flags").split())


@pytest.fixture(scope="module", params=list(ISAS))
def older(request):
    """The kernels built for an older instruction set (the parameter, a -march level)."""
    isa = request.param
    missing = [f for f in ISAS[isa] if f not in _cpu_flags()]
    if missing:
        pytest.skip(f"the CPU lacks {', '.join(missing)}: {isa} kernels cannot run here")
    from torch.utils.cpp_extension import load

    digest = qkernel.source_digest()
    try:
        return load(
            f"specdec_quant_{isa.replace('-', '_')}",
            [str(qkernel.SOURCE)],
            extra_cflags=["-O3", f"-march={isa}", "-ffp-contract=off", "-fopenmp", f"-DSPECDEC_HEADERS={digest}"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:  # no compiler: the native build's tests skip the same way
        pytest.skip(f"the {isa} kernels could not be built: {str(e).splitlines()[0][:200]}")


@pytest.fixture(scope="module")
def amx_emulated():
    if kernels().int8_kernels() != "vnni":
        pytest.skip("the CPU lacks AVX512-VNNI: the int8 kernels, and the tiles beside them, cannot run here")
    from torch.utils.cpp_extension import load

    digest = qkernel.source_digest()
    flags = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-DSPECDEC_AMX_EMULATE"]
    try:
        return load(
            "specdec_quant_amx_emulated",
            [str(qkernel.SOURCE)],
            extra_cflags=[*flags, f"-DSPECDEC_HEADERS={digest}"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as e:
        pytest.skip(f"the emulated AMX kernels could not be built: {str(e).splitlines()[0][:200]}")


def test_an_older_builds_int8_path(older):
    """x86-64-v3 has AVX2's int8 kernels (rows regrouped, Q6_K's too, Q5_K's not); x86-64-v2 none, nothing regrouped."""
    x = torch.randn(2, 256)
    part = torch.from_numpy(random_blocks("Q4_1", 16, 256, seed=1))
    if older.int8_kernels() == "avx2":
        assert older.int8_available() and older.repack(part, TYPES["Q4_1"], 256) is not None
        assert older.repack(torch.from_numpy(random_blocks("Q6_K", 16, 256, seed=1)), TYPES["Q6_K"], 256) is not None
        assert older.repack(torch.from_numpy(random_blocks("Q5_K", 16, 256, seed=1)), TYPES["Q5_K"], 256) is None
        return
    assert older.repack(part, TYPES["Q4_1"], 256) is None
    assert not older.int8_available() and older.int8_kernels() == ""
    with pytest.raises(RuntimeError, match="AVX2 or AVX512-VNNI"):
        older.matmul(x, [part], [TYPES["Q4_1"]], None, True)


@pytest.mark.parametrize("qtype", INT8_TYPES)
def test_avx2_int8_products_are_batch_invariant_and_the_native_row_at_a_time_bits(older, qtype):
    """AVX2's int8 kernels: the integers of VNNI's (vpmaddubsw + vpmaddwd for vpdpbusd), the same fp32 steps in
    8-lane halves: on a VNNI CPU the native build's rows-as-they-are int8 products, bit for bit (on an AVX2 CPU the
    native build is this one); every row as alone, on 1 and 2 threads. K: an odd number of 32-blocks."""
    if older.int8_kernels() != "avx2":
        pytest.skip("x86-64-v2 has no int8 kernels")
    K = 1280 if qtype in ("Q4_K", "Q6_K", "Q5_K", "IQ4_XS") else 1184
    part = torch.from_numpy(random_blocks(qtype, 40, K, seed=7))
    x = torch.randn(11, K, generator=torch.Generator().manual_seed(8))
    x[:, 5] *= 40  # one block's scale set by an outlier, as activations have
    product = lambda rows: older.matmul(rows, [part], [TYPES[qtype]], None, True)  # noqa: E731
    assert_rows_invariant(product, x, max_n=11)
    if kernels().int8_available():
        assert torch.equal(product(x), kernels().matmul(x, [part], [TYPES[qtype]], None, True))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K", "IQ4_NL", "IQ4_XS"])
def test_avx2_regrouped_products_are_batch_invariant_and_the_native_regrouped_bits(older, qtype):
    """AVX2's kernels over rows regrouped sixteen at a time (their own layout of Q8_0 and of the fifth bits): on a
    VNNI CPU the native build's regrouped products, bit for bit (the same integers, the same fp32 steps per output
    row; IQ4_NL and IQ4_XS, which VNNI takes a row at a time, have only the second check); every row as alone.
    K: an odd number of 32-blocks (Q4_K, Q6_K, IQ4_XS: of super-blocks); 7 groups of 16 rows."""
    if older.int8_kernels() != "avx2":
        pytest.skip("x86-64-v2 has no int8 kernels")
    K, N = (1280 if qtype in ("Q4_K", "Q6_K", "IQ4_XS") else 1184), 112
    raw = torch.from_numpy(random_blocks(qtype, N, K, seed=23))
    packed, xtype = older.repack(raw, TYPES[qtype], K)
    x = torch.randn(11, K, generator=torch.Generator().manual_seed(24))
    x[:, 5] *= 40
    product = lambda rows: older.matmul(rows, [packed], [xtype], None, True)  # noqa: E731
    assert_rows_invariant(product, x, max_n=11)
    native = kernels().repack(raw, TYPES[qtype], K)
    if native is not None:
        assert torch.equal(product(x), kernels().matmul(x, [native[0]], [native[1]], None, True))


def test_an_older_builds_q8_screen_gives_the_native_screens_bits(older):
    """The greedy output layer's screen (quant/screen.h) on an older build: x86-64-v2, without int8 kernels, has none;
    x86-64-v3's screened logits are batch-invariant, their argmax entries have that build's full regrouped Q8_0
    product's bits, and the whole rows are the native build's (on this CPU's AVX2 or a VNNI CPU's native build)."""
    K, V = 640, 16 * 40
    rows = torch.from_numpy(random_blocks("Q8_0", V, K, seed=31))
    rows.view(V, -1, 34)[..., :2] = rows.view(V, -1, 34)[..., :2].view(torch.float16).abs().view(torch.uint8)  # d >= 0
    screen, c = older.q8_screen(rows, K)
    if older.int8_kernels() != "avx2":
        assert screen is None
        return
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(32))
    logits = lambda h: older.screened_logits(h, screen, rows, c)  # noqa: E731
    assert_rows_invariant(logits, x, max_n=9)
    packed, xtype = older.repack(rows, TYPES["Q8_0"], K)
    full = older.matmul(x, [packed], [xtype], None, True)
    picked = full.argmax(1, keepdim=True)
    assert torch.equal(logits(x).gather(1, picked), full.gather(1, picked))
    if kernels().int8_available():
        native, native_c = kernels().q8_screen(rows, K)
        assert native_c == c and torch.equal(kernels().screened_logits(x, native, rows, native_c), logits(x))


@pytest.mark.parametrize("qtype", [t for t in TYPES if t != "F32"])
def test_older_products_are_batch_invariant_and_the_native_fp32_paths_bits(older, qtype):
    K = 512
    part = torch.from_numpy(random_blocks(qtype, 40, K, seed=5))
    x = torch.randn(11, K, generator=torch.Generator().manual_seed(6))
    assert_rows_invariant(lambda rows: older.matmul(rows, [part], [TYPES[qtype]], None, False), x, max_n=11)
    native = kernels().matmul(x, [part], [TYPES[qtype]])
    assert torch.equal(older.matmul(x, [part], [TYPES[qtype]], None, False), native)


@pytest.mark.parametrize("cache", [torch.float32, torch.float16])
def test_older_attention_rows_equal_one_row_calls(older, cache):
    start, n = 9, 12
    q, kc, vc, scale = attention_case(start, n)
    kc, vc = kc.to(cache), vc.to(cache)
    y = older.attention(q, kc, vc, start, None, scale)
    if cache == torch.float16:  # widened by F16C or one by one: the bits of the same values in an fp32 cache
        assert torch.equal(y, older.attention(q, kc.float(), vc.float(), start, None, scale))
    assert torch.allclose(y, kernels().attention(q, kc, vc, start, None, scale), atol=1e-5)  # other score order
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for i in range(n):
            assert torch.equal(y[i : i + 1], older.attention(q[i : i + 1], kc, vc, start + i, None, scale)), i


AMX_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K"]  # the regrouped types the tiles take; Q6_K keeps VNNI


def _tiles_give_the_vnni_bits(module, qtype: str) -> None:
    """module's int8 products of a regrouped qtype part over 1..35 rows: with the tiles on, the bits of
    the same module's VNNI kernels and of the native build's, every row as alone, on 1 and 2 threads."""
    # 37 blocks of 32 (Q4_K: 5 super-blocks of 256); 7 groups of 16 weight rows: 3, 2 and 1 groups a tile step
    K, N = 1280 if qtype == "Q4_K" else 1184, 112
    raw = torch.from_numpy(random_blocks(qtype, N, K, seed=21))
    packed, xtype = module.repack(raw, TYPES[qtype], K)
    x = torch.randn(35, K, generator=torch.Generator().manual_seed(22))
    x[:, 7] *= 30
    product = lambda rows: module.matmul(rows, [packed], [xtype], None, True)  # noqa: E731
    was = module.use_amx(False)
    try:
        vnni = product(x)
        assert not module.amx_on()
        assert module.use_amx(True) is False and module.amx_on()
        assert torch.equal(product(x), vnni)
        # under 16 rows on VNNI; 16 at a time on tiles, the rest (up to 15) on VNNI
        assert_rows_invariant(product, x, max_n=35)
    finally:
        module.use_amx(was)
    native, native_type = kernels().repack(raw, TYPES[qtype], K)
    assert torch.equal(kernels().matmul(x, [native], [native_type], None, True), vnni)


@pytest.mark.parametrize("qtype", AMX_TYPES)
def test_emulated_amx_tiles_give_the_vnni_kernels_bits(amx_emulated, qtype):
    assert amx_emulated.amx_available()
    _tiles_give_the_vnni_bits(amx_emulated, qtype)


def test_the_tiles_take_the_types_tested_here():
    if kernels().int8_kernels() != "vnni":
        pytest.skip("no AVX512-VNNI build here: no tile kernels are compiled")
    assert tile_types() == AMX_TYPES  # a type the tiles take untested here, or one tested they do not take, fails


@pytest.mark.parametrize("qtype", AMX_TYPES)
def test_amx_tiles_give_the_vnni_kernels_bits(qtype):
    if not kernels().amx_available():
        pytest.skip(
            "no AMX here (amx_int8 absent from the CPU, or Linux refused the tile state): the tiles cannot run; "
            "their emulation is tested above"
        )
    _tiles_give_the_vnni_bits(kernels(), qtype)


def test_a_prompt_on_tiles_has_the_vnni_logits_on_the_packaged_smollm2():
    """A 40-token prompt (two tiles of sixteen rows and eight rows on VNNI in every product, the Q8_0
    output layer included) gives the same logits with the tiles on and off."""
    if not kernels().amx_available():
        pytest.skip("no AMX here: the tiles cannot run (their emulation is tested above)")
    if not is_pulled("smollm2-135m", cache_dir()):
        pytest.skip("smollm2-135m is not pulled: run `specdec models pull smollm2-135m`")
    model = load_model("smollm2-135m")
    prompt = list(range(300, 340))
    was = kernels().use_amx(False)
    try:
        logits = []
        for on in (False, True):
            kernels().use_amx(on)
            logits.append(new_cache(model).extend(prompt, all_logits=True))
    finally:
        kernels().use_amx(was)
    assert logits[0].shape == (40, model.vocab_size) and torch.equal(logits[0], logits[1])


def test_the_tiles_are_off_without_amx_and_stay_off():
    k = kernels()
    if k.amx_available():
        pytest.skip("this CPU has AMX: the tiles are on by default here")
    assert not k.amx_on() and k.use_amx(True) is False and not k.amx_on()


def _head_rows_equal_one_row_calls(module, int8: bool) -> None:
    """An EAGLE head's step (quant/head.h: embedding rows, fc, a decoder layer without its input
    norm, output rows) over T rows equals T one-row steps, at 1 and 2 threads, bit for bit."""
    d, H, KVH, D, F, V, T, q8 = 64, 2, 1, 32, 128, 50, 7, TYPES["Q8_0"]

    def blocks(rows: int, K: int, seed: int) -> list[torch.Tensor]:
        return [torch.from_numpy(random_blocks("Q8_0", rows, K, seed))]

    layer = module.Layer(
        torch.empty(0), torch.ones(d), blocks((H + 2 * KVH) * D, d, 1), [q8], None, blocks(d, H * D, 2), [q8],
        blocks(2 * F, d, 3), [q8], blocks(d, F, 4), [q8],
    )  # fmt: skip
    head = module.Head(blocks(d, 2 * d, 5), [q8], layer, blocks(32, d, 6), [q8], blocks(V, d, 7)[0], q8)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
    g = torch.Generator().manual_seed(8)
    feats, ids = torch.randn(T, d, generator=g), torch.randint(0, V, (T,), generator=g)

    def cache():
        return torch.zeros(KVH, 16, D), torch.zeros(KVH, 16, D)

    together, last = module.head_step(head, feats, ids, *cache(), 0, inv_freq, H, 1e-5, int8)
    assert torch.isfinite(together).all() and last.shape == (1, 32)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        k, v = cache()
        for t in range(T):
            h, logits = module.head_step(head, feats[t : t + 1], ids[t : t + 1], k, v, t, inv_freq, H, 1e-5, int8)
            assert torch.equal(h, together[t : t + 1]), (threads, t)
        assert torch.equal(logits, last)


def test_an_older_builds_head_step_rows_equal_one_row_calls(older):
    _head_rows_equal_one_row_calls(older, int8=False)


@pytest.mark.parametrize("int8", [False, True])
def test_the_native_head_step_rows_equal_one_row_calls(int8):
    if int8 and not kernels().int8_available():
        pytest.skip("int8 activations need AVX512-VNNI")
    _head_rows_equal_one_row_calls(kernels(), int8)
