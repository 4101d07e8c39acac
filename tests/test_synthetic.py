"""specdec.bench.synthetic: a GGUF file of a larger shape written from a template loads and runs on
the quantized backend with the template's types by relative depth; the cost model's prediction."""

from __future__ import annotations

import math

import gguf
import pytest
import torch

from specdec.backends.quant import QuantModel
from specdec.bench.synthetic import Shape, predicted_speedup, synthetic_file, write_synthetic
from specdec.models.gguf import read_gguf

from .gguf_cases import write_tiny


def test_a_synthetic_file_has_the_shape_and_the_templates_types_and_runs(tmp_path):
    template = write_tiny(tmp_path / "tiny.gguf", "qwen2")  # 4 layers of d 64, Q8_0 matrices
    shape = Shape(layers=8, d=128, ff=256, heads=8, kv_heads=2)
    path = write_synthetic(tmp_path / "big.gguf", template, shape)
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    assert len([n for n in tensors if n.endswith("ffn_down.weight")]) == 8
    assert tuple(tensors["blk.7.ffn_down.weight"].shape) == (256, 128)  # GGUF order: columns first
    assert tensors["blk.7.attn_k.weight"].shape[1] == 128 // 8 * 2
    assert tensors["blk.3.ffn_up.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert "output.weight" not in tensors  # the template ties its output layer to the embeddings
    m = QuantModel(read_gguf(path), activations="fp32", kv_dtype=torch.float32)
    assert (len(m.layers), m.hidden_size) == (8, 128)
    keys = [torch.zeros(m.n_kv, 16, m.head_dim) for _ in m.layers]
    values = [torch.zeros(m.n_kv, 16, m.head_dim) for _ in m.layers]
    logits = m.forward(torch.tensor([1, 2, 3]), keys, values, torch.empty(16, m.hidden_size), 0, 3)
    assert logits.shape == (3, 64) and torch.isfinite(logits).all()
    assert write_synthetic(tmp_path / "again.gguf", template, shape).read_bytes() == path.read_bytes()  # seeded


def test_synthetic_sizes_are_checked(tmp_path):
    with pytest.raises(ValueError, match="unknown size '70b'"):
        synthetic_file("70b", tmp_path)
    with pytest.raises(ValueError, match="specdec models pull qwen2.5-coder-1.5b"):
        synthetic_file("3b", tmp_path)  # an empty cache: no template


def test_predicted_speedup_is_the_textbook_formula_with_a_measured_verify():
    assert predicted_speedup(1.0, 3, 1.0, 0.0) == 4.0  # every draft accepted, verify and draft free
    assert math.isclose(predicted_speedup(0.5, 1, 1.5, 0.5), 1.5 / 2.0)  # 1 + 0.5 tokens for 1.5 + 0.5 steps
    assert predicted_speedup(0.8, 4, 2.0, 0.3) < predicted_speedup(0.8, 4, 1.2, 0.3)  # a dearer verify pays less
