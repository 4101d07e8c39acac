"""The one- and two-row fp32 product kernel (specdec.backends.gemv): it builds where a compiler is present,
computes x W^T (+ b) to fp32 rounding over weights given in parts, gives a row the same bits
whether it comes alone or with a second, and specdec.backends.lean routes only one- and two-row fp32
products on CPU to it."""

from __future__ import annotations

import shutil

import pytest
import torch

from specdec.backends import gemv
from specdec.backends.linear import Linear


def test_the_kernel_builds_where_a_compiler_is_present():
    if not shutil.which("c++"):  # ninja is a pinned dependency, found beside the venv's python if not on PATH
        pytest.skip("no C++ compiler: specdec runs its products through oneDNN")
    assert gemv.kernel() is not None, gemv.status()
    assert "specdec gemv" in gemv.status()


needs_kernel = pytest.mark.skipif(gemv.kernel() is None, reason="the gemv kernel is not built here")


@needs_kernel
@pytest.mark.parametrize("K", [576, 48, 40, 7])  # an even, an odd number of 16-float chunks, a tail, only a tail
@pytest.mark.parametrize("rows", [1, 2])
def test_products_match_float64_over_parts_with_bias(K, rows):
    g = torch.Generator().manual_seed(K + rows)
    parts = [torch.randn(n, K, generator=g) for n in (33, 5, 64)]
    bias = torch.randn(102, generator=g)
    x = torch.randn(rows, K, generator=g)
    y = gemv.kernel().gemv(x, parts, bias)
    exact = x.double() @ torch.cat(parts).double().T + bias.double()
    assert y.shape == (rows, 102) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), exact, rtol=1e-5, atol=1e-5 * K**0.5)
    no_bias = gemv.kernel().gemv(x, parts, None)
    torch.testing.assert_close(no_bias.double(), exact - bias.double(), rtol=1e-5, atol=1e-5 * K**0.5)


@needs_kernel
def test_a_row_gets_the_same_bits_alone_or_with_a_second():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 576, generator=g)
    x = torch.randn(2, 576, generator=g)
    pair = gemv.kernel().gemv(x, [w], None)
    assert torch.equal(pair[0], gemv.kernel().gemv(x[:1], [w], None)[0])
    assert torch.equal(pair[1], gemv.kernel().gemv(x[1:], [w], None)[0])


@needs_kernel
def test_bad_input_is_refused_with_a_message():
    w = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="1 or 2, K"):
        gemv.kernel().gemv(torch.randn(3, 16), [w], None)
    with pytest.raises(RuntimeError, match="contiguous"):
        gemv.kernel().gemv(torch.randn(1, 16), [w.T.contiguous().T], None)
    with pytest.raises(RuntimeError, match="fp32"):
        gemv.kernel().gemv(torch.randn(1, 16), [w.bfloat16()], None)


@needs_kernel
def test_lean_linear_uses_the_kernel_for_one_and_two_rows_only():
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(40, 64, generator=g), torch.randn(24, 64, generator=g)
    bias = torch.randn(64, generator=g)
    lin = Linear(torch.cat((q, k)), bias, parts=[q, k])
    assert lin.parts is not None
    for n in (1, 2):
        x = torch.randn(n, 64, generator=g)
        assert torch.equal(lin(x), gemv.kernel().gemv(x, [q, k], bias))
    x = torch.randn(5, 64, generator=g)
    torch.testing.assert_close(lin(x), x @ torch.cat((q, k)).T + bias, rtol=1e-5, atol=1e-5)
    assert Linear(q.bfloat16()).parts is None  # bf16 weights stay with oneDNN


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("SPECDEC_GEMV", "0")
    monkeypatch.setattr(gemv, "_kernel", None)
    monkeypatch.setattr(gemv, "_status", "not built yet")
    assert gemv.kernel() is None
    assert "off" in gemv.status()
    assert Linear(torch.randn(8, 16)).parts is None
