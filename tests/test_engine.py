"""The engine on tiny random models: greedy speculative decoding is plain greedy decoding."""

from __future__ import annotations

import time

import pytest
import torch

import specdec.scoring as scoring_module
from specdec import ContextLengthError, TokenizerMismatchError, generate, make_drafter
from specdec.cache import new_cache
from specdec.drafters import Draft, ModelDrafter
from specdec.drafters.base import Drafter
from specdec.engine import stepwise

from .conftest import N_CTX, VOCAB, make_model, make_tokenizer, prompt_ids, remake

N_NEW = 40


class Oracle(Drafter):
    """Proposes the true continuation (always right) or, with wrong=True, a token that differs
    from it at every position (always wrong)."""

    def __init__(self, reference: list[int], wrong: bool = False):
        self.reference, self.wrong = reference, wrong
        self.calls = 0

    def prepare(self, target):
        pass

    def propose(self, context, k, sampler):
        self.calls += 1
        assert context == self.reference[: len(context)], "the engine's context left the committed tokens"
        nxt = self.reference[len(context) : len(context) + k]
        return Draft([(t + 1) % VOCAB for t in nxt] if self.wrong else nxt)


def plain(target, prompt, n=N_NEW, **kw):
    return generate(target, prompt, None, max_new_tokens=n, **kw)


def drafters_for(target, draft_model, reference):
    return {
        "prompt-lookup": make_drafter("prompt-lookup"),
        "model": ModelDrafter(draft_model),
        "always-right": Oracle(reference),
        "always-wrong": Oracle(reference, wrong=True),
        "random": make_drafter("random"),
    }


@pytest.mark.parametrize("k", [1, 2, 4, 8, "auto"])
def test_greedy_speculative_equals_plain(target, draft_model, k):
    prompt = prompt_ids()
    base = plain(target, prompt)
    assert len(base.tokens) == N_NEW and base.stats.rounds == N_NEW  # k = 0: one token a round
    reference = prompt + base.tokens
    for name, drafter in drafters_for(target, draft_model, reference).items():
        got = generate(target, prompt, drafter, k=k, max_new_tokens=N_NEW)
        assert got.tokens == base.tokens, f"drafter {name}, k={k}"
        s = got.stats
        assert s.new_tokens == N_NEW and s.accepted + s.rounds == N_NEW
        if name == "always-right":
            assert s.accepted == s.drafted
            if k != "auto":
                assert s.rounds == -(-N_NEW // (k + 1))
        if name == "always-wrong":
            assert s.accepted == 0 and s.rounds == N_NEW


def test_stats_count_rounds_and_positions(target):
    prompt = prompt_ids()
    base = plain(target, prompt)
    got = generate(target, prompt, Oracle(prompt + base.tokens), k=3, max_new_tokens=N_NEW)
    s = got.stats
    assert s.alpha == 1.0 and s.tau == pytest.approx(N_NEW / s.rounds)
    assert s.acceptance_per_position == [1.0, 1.0, 1.0]
    assert s.total_s >= s.prefill_s + s.draft_s + s.verify_s > 0
    wrong = generate(target, prompt, Oracle(prompt + base.tokens, wrong=True), k=3, max_new_tokens=N_NEW).stats
    assert wrong.alpha == 0.0 and wrong.tau == 1.0 and wrong.acceptance_per_position == [0.0, 0.0, 0.0]


def test_stepwise_yields_progress_and_leaves_its_suspended_time_out(target):
    prompt = prompt_ids()
    base = plain(target, prompt, n=12)
    rounds = stepwise(target, prompt, Oracle(prompt + base.tokens), k=3, max_new_tokens=12)
    made, slept, start = [], 0.0, time.perf_counter()
    while True:
        try:
            made.append(next(rounds))
        except StopIteration as end:
            got = end.value
            break
        time.sleep(0.1)  # suspended: another generation's round would run here
        slept += 0.1
    wall = time.perf_counter() - start
    assert made == [0, 4, 8, 12]  # after the prefill, then after each round of 3 accepted + 1
    assert got.tokens == base.tokens and got.stats.rounds == 3
    assert got.stats.total_s < wall - 0.9 * slept  # the 0.4 s asleep is not the generation's time


def test_crop_then_reforward_equals_fresh_forward(target):
    prompt, x, y = prompt_ids(), [5, 9, 13, 17, 21], [6, 10, 14]
    kv = new_cache(target)
    kv.extend(prompt + x)
    kv.rollback(len(prompt))
    assert kv.tokens == prompt and len(kv) == len(prompt)
    if target.backend == "hf":
        assert kv.cache.get_seq_length() == len(prompt)
    again = kv.extend(y)
    fresh = new_cache(target).extend(prompt + y)[len(prompt) :]
    torch.testing.assert_close(again, fresh, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        kv.rollback(len(kv) + 1)


def test_eos_at_every_offset_of_a_block(target):
    prompt = prompt_ids()
    base = plain(target, prompt)
    k = 8
    for offset, eos_token in enumerate(base.tokens[: 2 * (k + 1)]):
        with_eos = remake(target, eos_token_ids=frozenset({eos_token}))
        end = base.tokens.index(eos_token) + 1  # plain greedy stops at the first occurrence
        expected = plain(with_eos, prompt)
        assert expected.tokens == base.tokens[:end] and expected.stats.stop_reason == "eos"
        streamed: list[int] = []
        got = generate(
            with_eos, prompt, Oracle(prompt + base.tokens), k=k, max_new_tokens=N_NEW, stream=streamed.extend
        )
        assert got.tokens == expected.tokens, f"eos at offset {offset}"
        assert streamed == expected.tokens  # nothing after the EOS was streamed
        assert got.stats.stop_reason == "eos"


@pytest.mark.parametrize("k", [1, 4])
def test_max_new_tokens_never_exceeded(target, k):
    prompt = prompt_ids()
    base = plain(target, prompt)
    for n in sorted({1, 2, k, k + 1}):
        got = generate(target, prompt, Oracle(prompt + base.tokens), k=k, max_new_tokens=n)
        assert got.tokens == base.tokens[:n] and got.stats.stop_reason == "length"
        assert got.stats.drafted <= max(n - 1, 0)  # k was clamped to the budget left
    assert generate(target, prompt, "prompt-lookup", k=k, max_new_tokens=0).tokens == []


def test_prompt_near_the_context_limit(target, draft_model):
    prompt = (prompt_ids() * 10)[: N_CTX - 3]
    base = plain(target, prompt, n=50)
    assert len(base.tokens) == 3 and base.stats.stop_reason == "context"
    for drafter in [make_drafter("prompt-lookup"), ModelDrafter(draft_model), Oracle(prompt + base.tokens)]:
        got = generate(target, prompt, drafter, k=8, max_new_tokens=50)
        assert got.tokens == base.tokens and got.stats.stop_reason == "context"
    with pytest.raises(ContextLengthError, match="shorten"):
        generate(target, (prompt_ids() * 10)[:N_CTX], "prompt-lookup")


def test_stop_string_ends_the_text(target):
    prompt = prompt_ids()
    base = plain(target, prompt)
    decode = lambda toks: target.tokenizer.decode(toks, skip_special_tokens=True)  # noqa: E731
    stop_word = decode(base.tokens).split()[5]
    n = next(n for n in range(1, N_NEW + 1) if stop_word in decode(base.tokens[:n]))  # the token completing it
    got = generate(target, prompt, Oracle(prompt + base.tokens), k=4, max_new_tokens=N_NEW, stop=[stop_word])
    assert got.stats.stop_reason == "stop"
    assert got.tokens == base.tokens[:n]
    text = decode(base.tokens[:n])
    assert got.text == text[: text.index(stop_word)] and stop_word not in got.text


def test_sampling_is_reproducible_and_seed_dependent(target, draft_model):
    prompt = prompt_ids()
    for drafter in ["prompt-lookup", ModelDrafter(draft_model)]:

        def run(seed, drafter=drafter):
            return generate(
                target, prompt, drafter, k=4, max_new_tokens=30, temperature=1.0, top_p=0.95, seed=seed
            ).tokens

        a, b, c = run(3), run(3), run(4)
        assert a == b and a != c and len(a) == 30


def test_bad_parameters_raise_clear_errors(target):
    prompt = prompt_ids()
    with pytest.raises(ValueError, match="k"):
        generate(target, prompt, "prompt-lookup", k=-1)
    with pytest.raises(ValueError, match="temperature"):
        generate(target, prompt, temperature=-0.5)
    with pytest.raises(ValueError, match="empty"):
        generate(target, [])
    with pytest.raises(ValueError, match="unknown drafter"):
        generate(target, prompt, "no-such-drafter")


def test_mismatched_tokenizers_raise_naming_the_token(target):
    words = [f"w{i}" for i in range(VOCAB - 3)]
    words[10], words[11] = words[11], words[10]
    other = make_model("llama", seed=7, tokenizer=make_tokenizer(words))
    with pytest.raises(TokenizerMismatchError, match="'w11'"):
        generate(target, prompt_ids(), ModelDrafter(other), k=2)


def test_padded_draft_vocabulary_is_accepted(draft_model, monkeypatch):
    """A target whose logits are wider than the tokenizer (padded embedding, as Qwen's) works with a
    draft of the plain width: greedy stays exact, sampling pads q with zeros."""
    wide = make_model("qwen2", seed=3, vocab_size=VOCAB + 16)
    prompt = prompt_ids()
    base = plain(wide, prompt)
    assert generate(wide, prompt, ModelDrafter(draft_model), k=3, max_new_tokens=N_NEW).tokens == base.tokens
    seen, real = [], scoring_module.verify_sampling
    monkeypatch.setattr(
        scoring_module, "verify_sampling", lambda tokens, q, p, g: seen.append((tokens, q, p)) or real(tokens, q, p, g)
    )
    sampled = generate(wide, prompt, ModelDrafter(draft_model), k=3, max_new_tokens=20, temperature=1.0, seed=0)
    assert len(sampled.tokens) == 20
    drafted = [(tokens, q, p) for tokens, q, p in seen if tokens]
    assert drafted
    for tokens, q, p in drafted:  # q over the target's width: the draft's distribution, then zeros
        assert q.shape == (len(tokens), VOCAB + 16) and p.shape == (len(tokens) + 1, VOCAB + 16)
        assert torch.all(q[:, VOCAB:] == 0) and torch.allclose(q.sum(-1), torch.ones(len(tokens)))
        assert all(q[i, t] > 0 for i, t in enumerate(tokens))  # each drafted token was drawn from its row
