"""Replay (specdec.bench.replay): the rounds of a real greedy run, without its target forwards or its clock."""

from __future__ import annotations

import pytest

from specdec.bench.replay import controller, replay
from specdec.drafters import Draft, make_drafter
from specdec.drafters.base import Drafter
from specdec.engine import generate

from .conftest import make_model, prompt_ids

# A steep verify curve (each drafted token verified costs 40% of a step) and a cheap draft step.
COSTS = {
    "context_tokens": 20,
    "verify_ms": {str(n): 10.0 + 4.0 * (n - 1) for n in range(1, 10)},
    "draft_ms": {"1": 1.0, "8": 8.0},
    "draft_catchup_ms": {"1": 2.0, "8": 9.0},
    "overhead_ms": 0.5,
}


@pytest.fixture(scope="module")
def run(target):
    prompt = prompt_ids(20)
    plain = generate(target, prompt, None, max_new_tokens=40, temperature=0.0).tokens
    return target, prompt, plain


@pytest.mark.parametrize("name", ["prompt-lookup", "model", "suffix-tree"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_a_fixed_k_replays_the_engines_rounds_exactly(run, draft_model, name, k):
    target, prompt, plain = run
    drafter = make_drafter(name, **({"draft": draft_model} if name == "model" else {}))
    real = generate(target, prompt, drafter, k=k, max_new_tokens=40, temperature=0.0).stats
    again = replay(target, prompt, plain, drafter, k, COSTS)
    assert again.k_per_round == real.k_per_round and again.accepted_at == real.accepted_at
    assert (again.new_tokens, again.drafted, again.accepted) == (real.new_tokens, real.drafted, real.accepted)


def test_replayed_time_is_the_measured_costs_of_the_rounds(run):
    target, prompt, plain = run
    stats = replay(target, prompt, plain, None, 0, COSTS)
    assert stats.rounds == len(plain) == stats.new_tokens
    assert stats.decode_tokens_per_s == pytest.approx(1e3 / (10.0 + 0.5))
    # a draft identical to the target is always right: every round drafts 3 and keeps them
    stats = replay(target, prompt, plain, make_drafter("model", draft=target), 3, COSTS)
    assert stats.accepted == stats.drafted
    full = len(plain) // 4
    first, later = 3.0, 2.0 + 1.0 * 2  # the first draft is 1 token behind, later ones 2 (catch-up cost)
    ms = (
        first
        + (full - 1) * later
        + full * (22.0 + 0.5)  # full rounds of 4 tokens
        + (len(plain) - 4 * full) * 10.5
    )  # the last tokens of the budget: plain rounds
    assert stats.total_s * 1e3 == pytest.approx(ms)


class Oracle(Drafter):
    """Proposes the target's own continuation: a free drafter that is always right."""

    def __init__(self, prompt: list[int], output: list[int]):
        self.sequence = prompt + output

    def prepare(self, target) -> None:
        pass

    def propose(self, context, k, sampler) -> Draft:
        return Draft(self.sequence[len(context) : len(context) + k])


def test_auto_drafts_nothing_for_a_never_right_drafter_and_everything_for_a_perfect_one(run):
    target, prompt, plain = run
    free = {**COSTS, "draft_ms": {"1": 0.01, "8": 0.02}, "draft_catchup_ms": {"1": 0.01, "8": 0.02}}
    plain_speed = replay(target, prompt, plain, None, 0, free).decode_tokens_per_s
    junk = replay(target, prompt, plain, make_drafter("random"), "auto", free)
    assert junk.accepted == 0 and junk.drafted <= 1  # shadow-verified: learned without verifying
    assert junk.decode_tokens_per_s >= 0.97 * plain_speed
    oracle = Oracle(prompt, plain)
    policy = controller(free)
    for _ in range(2):  # the second generation starts from what the first taught (in the first,
        auto = replay(target, prompt, plain, oracle, "auto", free, policy=policy)  # it learns from 0.5)
    best = max(replay(target, prompt, plain, oracle, k, free).decode_tokens_per_s for k in (1, 2, 4, 8))
    assert auto.accepted == auto.drafted and auto.decode_tokens_per_s >= 0.97 * best


def test_replay_refuses_what_it_cannot_run(run):
    target, prompt, plain = run
    with pytest.raises(ValueError, match=r"k \(draft length\) must be >= 0"):
        replay(target, prompt, plain, make_drafter("prompt-lookup"), -1, COSTS)
    with pytest.raises(ValueError, match="reads the target's KV cache"):
        replay(target, prompt, plain, make_drafter("eagle", head="no-such-head.safetensors"), 2, COSTS)


def test_auto_drafts_deep_again_after_prompts_that_left_deep_positions_looking_bad():
    """Deep positions' estimates change only when a draft reaches them. A policy that earlier
    prompts left believing positions 2..8 are accepted 1 time in 4 (8 drafts each) drafted 2
    tokens a round forever with an always-right draft model. Two things draft deep again, each
    alone, as a fresh policy does: the optimism of acceptances() (UCB at every position), and
    reading the next token's acceptance from the draft's confidence in the last one, which such a
    draft model keeps high while it is right. Flat verify curve."""
    target = make_model("llama", seed=1)
    prompt = prompt_ids(20)
    plain = generate(target, prompt, None, max_new_tokens=60, temperature=0.0).tokens
    flat = {**COSTS, "verify_ms": {str(n): 10.0 + 1.0 * (n - 1) for n in range(1, 10)}}

    def speed(explore: float, pessimistic: bool):
        policy = controller(flat, explore=explore)
        if pessimistic:
            policy.estimates.reached[0][0], policy.estimates.accepted[0][0] = 8.0, 6.0
            for j in range(1, 8):
                policy.estimates.reached[0][j], policy.estimates.accepted[0][j] = 8.0, 2.0
        stats = replay(target, prompt, plain, make_drafter("model", draft=target), "auto", flat, policy=policy)
        return stats.decode_tokens_per_s, len(stats.drafted_at)  # the deepest draft (a tree's second choices aside)

    fresh, _ = speed(1.0, pessimistic=False)
    for explore in (0.0, 1.0):  # the optimism off, then on
        recovered, recovered_k = speed(explore, pessimistic=True)
        assert recovered_k == 8 and recovered >= 0.95 * fresh
