"""A draft's vocabulary (specdec.drafters.vocab): the output layer cut to the N most frequent tokens,
a cheaper draft step and never another output."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specdec import generate
from specdec.drafters import EagleDrafter, ModelDrafter, vocab
from specdec.models.load import load_model

from .conftest import prompt_ids


@pytest.fixture
def quantized(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))  # rankings are cached there
    return load_model(str(model_dir), quantize="q8_0")


def test_the_ranking_is_by_frequency_then_id_and_cached(quantized, monkeypatch):
    counts = Counter({7: 5, 3: 5, 11: 9})
    monkeypatch.setattr(vocab, "_sharegpt_counts", lambda tokenizer: counts)
    ranking = vocab.token_ranking(quantized)
    assert ranking[:4].tolist() == [11, 3, 7, 0]  # ties by id, then the unseen by id
    assert sorted(ranking.tolist()) == list(range(quantized.vocab_size))
    monkeypatch.setattr(vocab, "_sharegpt_counts", lambda tokenizer: pytest.fail("not cached"))
    assert torch.equal(vocab.token_ranking(quantized), ranking)
    assert vocab.draft_vocab(quantized, 3).tolist() == [3, 7, 11]


def test_the_view_has_the_full_models_logits_on_its_rows_and_minus_infinity_elsewhere(quantized):
    ids = torch.tensor([2, 5, 9, 30] + list(range(40, 52)))  # sixteen rows: regrouped as the whole layer is
    view = vocab.vocab_view(quantized, ids)
    assert view.lean().lm_head.out_features == 16 and quantized.lean().lm_head.out_features == quantized.vocab_size
    x = torch.randn(3, quantized.lean().hidden_size)
    full, cut = quantized.lean().lm_head(x), view.lean().lm_head(x)
    assert cut.shape == full.shape
    assert torch.equal(cut[:, ids], full[:, ids])
    rest = torch.ones(quantized.vocab_size, dtype=torch.bool)
    rest[ids] = False
    assert bool((cut[:, rest] == float("-inf")).all())


def test_a_model_draft_over_a_cut_vocabulary_is_exact_and_drafts_only_there(quantized):
    ids = prompt_ids(10)
    plain = generate(quantized, ids, None, k=0, max_new_tokens=24)
    drafter = ModelDrafter(quantized, vocab=40)
    kept = set(vocab.draft_vocab(quantized, 40).tolist())
    drafted = []
    original = drafter.propose

    def spy(*args, **kwargs):
        draft = original(*args, **kwargs)
        drafted.extend(draft.tokens)
        return draft

    drafter.propose = spy
    spec = generate(quantized, ids, drafter, k=3, max_new_tokens=24)
    assert spec.tokens == plain.tokens
    assert drafted and set(drafted) <= kept


def test_bad_vocabularies_are_refused(quantized, draft_model):
    with pytest.raises(ValueError, match="quantized backend"):
        ModelDrafter(draft_model, vocab=8)  # an fp32 draft
    with pytest.raises(ValueError, match="give 1.."):
        ModelDrafter(quantized, vocab=0)


def test_a_head_over_another_vocabulary_drafts_there_exactly(smol):
    ids = smol.encode("Name three rivers in Europe and say where each one flows.", chat=True)
    plain = generate(smol, ids, None, k=0, max_new_tokens=24)
    drafter = EagleDrafter(vocab=2048)
    spec = generate(smol, ids, drafter, k=3, max_new_tokens=24)
    assert spec.tokens == plain.tokens
    assert len(drafter.ids) == 2048 and torch.equal(drafter.ids, vocab.draft_vocab(smol, 2048))
