"""Every architecture of specdec.backends.arch on the quantized backend, on tiny random GGUF files written
here (gguf's writer, Q8_0 blocks): a forward over many tokens, a token tree included, has the bits of
one-token forwards, across sliding windows, q/k norms, post-norms, GELU, multipliers and layers without
rope; greedy speculative decoding equals plain greedy; files with a tensor or key the description does
not read are refused. Agreement with transformers and llama.cpp is tests/test_conformance.py's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from specdec import generate, make_drafter
from specdec.backends.arch import ARCHS, plan
from specdec.backends.quant import QuantModel
from specdec.errors import GGUFError
from specdec.models.gguf import QTensor, hf_config, read_gguf
from specdec.models.load import Model

from .conftest import make_byte_tokenizer
from .gguf_cases import D_MODEL, HEAD_DIM, VOCAB, write_tiny


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("arch")
    made = {name: write_tiny(folder / f"{name}.gguf", name) for name in ARCHS}
    made["llama3"] = write_tiny(
        folder / "llama3.gguf", "llama", extra={"rope_freqs.weight": np.linspace(1, 8, HEAD_DIM // 2)}
    )
    return made


def _forward(m: QuantModel, ids, keys, values, start: int, tree=None) -> torch.Tensor:
    return m.forward(torch.tensor(ids), keys, values, torch.empty(64, m.hidden_size), start, len(ids), tree=tree)


def _caches(m: QuantModel):
    return [torch.zeros(m.n_kv, 64, m.head_dim) for _ in m.layers], [
        torch.zeros(m.n_kv, 64, m.head_dim) for _ in m.layers
    ]


@pytest.mark.parametrize("name", [*ARCHS, "llama3"])
def test_many_tokens_and_trees_have_one_token_bits(files, name):
    m = QuantModel(read_gguf(files[name]), activations="fp32", kv_dtype=torch.float32)
    ids = [int(i) for i in torch.randint(3, VOCAB, (24,), generator=torch.Generator().manual_seed(1))]
    keys, values = _caches(m)
    torch.set_num_threads(2)
    together = _forward(m, ids, keys, values, 0)
    torch.set_num_threads(1)
    k1, v1 = _caches(m)
    singles = torch.cat([_forward(m, [t], k1, v1, i) for i, t in enumerate(ids)])
    assert torch.isfinite(together).all() and torch.equal(together, singles)
    # a tree after 20 tokens (past the window of 8): two branches of two tokens, each row its path's bits
    a, b, c, d = ids[20:24]
    positions = torch.tensor([20, 20, 21, 21])
    mask = torch.ones(4, 24, dtype=torch.bool)
    mask[:, 20:] = torch.tensor([[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)
    tree = _forward(m, [a, b, c, d], keys, values, 20, tree=(positions, mask))
    for row, path in ((0, [a]), (2, [a, c]), (1, [b]), (3, [b, d])):
        assert torch.equal(tree[row], _forward(m, path, keys, values, 20)[-1]), (name, row)


def test_the_window_and_the_frequency_factors_change_the_logits(files):
    ids = list(range(3, 27))

    def last_logits(path, **change):
        g = read_gguf(path)
        m = QuantModel(g, activations="fp32")
        for field, value in change.items():
            setattr(m.plan, field, value)
        keys, values = _caches(m)
        return _forward(m, ids, keys, values, 0)[-1]

    assert not torch.equal(last_logits(files["gemma3"]), last_logits(files["gemma3"], window=0))
    assert not torch.equal(last_logits(files["llama3"]), last_logits(files["llama"]))


@pytest.mark.parametrize("name", ["gemma3", "qwen3", "olmo2", "granite", "smollm3", "phi3", "llama3"])
def test_speculative_equals_plain_greedy(files, name, tmp_path):
    def model_of(path):
        g = read_gguf(path)
        return Model(None, make_byte_tokenizer(), name, gguf=g, config=hf_config(g))

    model = model_of(files[name])
    draft = model_of(write_tiny(tmp_path / "draft.gguf", "llama" if name == "llama3" else name, seed=1))
    ids = model.encode("abcabcabcabc: xyzxyz")
    plain = generate(model, ids, drafter=None, k=0, max_new_tokens=40, temperature=0.0)
    for drafter, k in ((make_drafter("prompt-lookup"), 4), (make_drafter("model", draft=draft), 3)):
        spec = generate(model, ids, drafter=drafter, k=k, max_new_tokens=40, temperature=0.0)
        assert spec.tokens == plain.tokens, (name, drafter)


def _refusal(path, **change) -> str:
    g = read_gguf(path)
    with pytest.raises(GGUFError) as e:
        QuantModel(dataclasses.replace(g, **change), activations="fp32")
    return str(e.value)


def test_what_the_description_does_not_read_is_refused(files, tmp_path):
    g = read_gguf(files["llama"])
    vector = QTensor("x", "F32", (8,), torch.ones(8))
    assert "'blk.0.attn_post_norm.weight' is not read" in _refusal(
        files["llama"], tensors={**g.tensors, "blk.0.attn_post_norm.weight": vector}
    )
    assert "'rope_freqs.weight' is not read by specdec's qwen3" in _refusal(
        files["qwen3"], tensors={**read_gguf(files["qwen3"]).tensors, "rope_freqs.weight": vector}
    )
    assert "'llama.final_logit_softcapping'" in _refusal(
        files["llama"], fields={**g.fields, "llama.final_logit_softcapping": 30.0}
    )
    assert "rope scaling 'yarn'" in _refusal(files["llama"], fields={**g.fields, "llama.rope.scaling.type": "yarn"})
    assert "llama.rope.dimension_count = 8" in _refusal(
        files["llama"], fields={**g.fields, "llama.rope.dimension_count": 8}
    )
    tensors = dict(g.tensors)
    del tensors["blk.2.ffn_gate.weight"]
    assert "no tensor 'blk.2.ffn_gate.weight'" in _refusal(files["llama"], tensors=tensors)
    wrong = dataclasses.replace(g.tensors["blk.1.attn_k.weight"], shape=(HEAD_DIM, D_MODEL))
    assert "'blk.1.attn_k.weight' has shape (16, 64), not (32, 64)" in _refusal(
        files["llama"], tensors={**g.tensors, "blk.1.attn_k.weight": wrong}
    )
    assert "'mamba' is not run" in _refusal(files["llama"], arch="mamba")
    gemma = read_gguf(files["gemma3"])
    assert "'gemma3.final_logit_softcapping'" in _refusal(
        files["gemma3"], fields={**gemma.fields, "gemma3.final_logit_softcapping": 30.0}
    )


def test_linear_rope_scaling_divides_the_frequencies(files):
    g = read_gguf(files["llama"])
    scaled = dataclasses.replace(
        g, fields={**g.fields, "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    )
    assert torch.allclose(plan(scaled).ropes[0] * 4, plan(g).ropes[0])
    three = read_gguf(files["llama3"])
    assert torch.allclose(plan(three).ropes[0] * torch.linspace(1, 8, HEAD_DIM // 2), plan(g).ropes[0])
    gemma = plan(read_gguf(files["gemma3"]))
    assert gemma.layer_window == [True, False, True, False] and gemma.layer_rope == [1, 0, 1, 0]
    assert plan(read_gguf(files["smollm3"])).layer_rope == [0, 0, 0, -1]
