"""k = "auto": the per-round draft-length policy (specdec.adaptive) and its use by the engine."""

from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import generate
from specdec.adaptive import AdaptiveK, Outcome, RoundPlan, Share, VerifyCosts, best_length, match_class, values
from specdec.cache import new_cache
from specdec.drafters import ModelDrafter, PromptLookup

from .conftest import make_model, prompt_ids


def controller(v: dict[int, float], acceptance: list[float] | None = None, rounds: int = 1000, **kw) -> AdaptiveK:
    """A controller with a known verify curve and (when given) conditional acceptance per position,
    backed by `rounds` observations so the prior no longer matters."""
    ctl = AdaptiveK(VerifyCosts(ms=dict(v)), **kw)
    for j, a in enumerate(acceptance or []):
        ctl.estimates.reached[0][j], ctl.estimates.accepted[0][j] = rounds, rounds * a
    return ctl


def rate(ctl: AdaptiveK, plan: RoundPlan, m: int) -> float:
    """Tokens per ms of always drafting m tokens, under the controller's own estimates (plan: the
    round's, for its cap and batch share)."""
    tokens, p = 1.0, 1.0
    for j in range(1, m + 1):
        p *= ctl.acceptance(j)
        tokens += p
    verify = ctl.costs(1) + ctl.extra_verify_ms(plan, m)  # pinned in test_junk_is_verified_only...
    return tokens / (ctl.draft_ms(m, incremental=False) + verify + ctl.learned.overhead_ms)


def test_values_weigh_expected_tokens_against_their_cost_and_the_best_length_wins():
    """values(): P_1 + ... + P_m - rho * cost(m) for each draft length m (P_m: the first m drafted
    tokens all accepted); best_length: the most valuable, the shortest of equals, 0 (a plain round,
    worth 0) unless some length is worth more."""
    worth = values([0.5, 0.5, 0.0], [0.0, 2.0, 4.0, 6.0], rho=0.1)
    assert worth == pytest.approx([0.0, 0.5 - 0.2, 0.75 - 0.4, 0.75 - 0.6])
    assert best_length(worth) == 2
    assert values([0.5, 0.5], [0.0] * 3, 0.0, tokens=1.0) == [1.0, 1.5, 1.75]  # a round's tokens
    assert best_length([0.0, 0.25, 0.25]) == 1 and best_length([0.0, -0.1]) == 0 and best_length([0.0]) == 0


def test_verify_costs_interpolate_and_extrapolate_optimistically():
    v = VerifyCosts(ms={1: 10.0, 3: 20.0})
    assert v(1) == 10.0 and v(2) == 15.0  # between two tried lengths: linear
    assert v(5) == pytest.approx(20.0 + 2 * 0.25 * 10.0)  # beyond: the optimistic slope of V(1)
    v.observe(3, 30.0)
    assert v(3) == pytest.approx(0.7 * 20.0 + 0.3 * 30.0)  # a running average, not the last sample
    assert VerifyCosts()(4) == 0.0 and not VerifyCosts().known()
    only4 = VerifyCosts(ms={4: 17.5})
    assert only4(1) == pytest.approx(17.5 / (1 + 0.25 * 3))  # V(1) inferred from the one tried length


def test_calibrated_curve_keeps_its_shape_and_every_round_moves_its_level():
    v = VerifyCosts(ms={1: 10.0, 2: 12.0, 3: 9.0}, shape={1: 1.0, 2: 1.2, 3: 0.9})
    v.observe(3, 18.0)  # a slow round at n = 3: the level moves towards 18 / 0.9 = 20
    level = 0.7 * 10.0 + 0.3 * 20.0
    assert v(1) == pytest.approx(level) and v(2) == pytest.approx(1.2 * level) and v(3) == pytest.approx(0.9 * level)
    v.observe(5, 30.0)  # outside the calibrated lengths: an average of its own
    assert v(5) == 30.0 and v(1) == pytest.approx(level)


def test_deep_positions_borrow_the_previous_positions_estimate_lifted():
    ctl = AdaptiveK(VerifyCosts(ms={1: 10.0}), k_max=4, prior=0.5, prior_weight=1.0, lift=0.5)
    for _ in range(20):  # drafts that reach only position 1, accepted there half the time
        ctl.estimates.learn(0, 1, 0)
        ctl.estimates.learn(0, 1, 1)
    a1 = ctl.acceptance(1)
    assert a1 == pytest.approx(0.5, abs=0.05)
    assert ctl.acceptance(2) == pytest.approx(a1 + 0.5 * (1 - a1))  # no data at 2: the estimate at 1, lifted
    assert ctl.acceptance(3) == pytest.approx(ctl.acceptance(2) + 0.5 * (1 - ctl.acceptance(2)))
    assert AdaptiveK(VerifyCosts(ms={1: 10.0}), k_max=4, lift=0.0).acceptance(2) == 0.5  # no lift: the estimate before
    # a shadow-verified draft is seen at every position: no optimism needed
    assert ctl.acceptance(2, shadowed=True) == pytest.approx(a1)
    for _ in range(20):
        ctl.estimates.learn(0, 2, 1)  # now position 2 is reached and always rejected
    assert ctl.acceptance(2) < 0.2


def test_a_deep_position_keeps_its_estimate_through_drafts_that_stop_short_of_it():
    ctl = AdaptiveK(VerifyCosts(ms={1: 10.0}), k_max=4, prior=0.5, prior_weight=1.0, lift=0.0)
    for _ in range(20):
        ctl.estimates.learn(0, 3, 3)  # long copies: positions 1..3 accepted
    for _ in range(50):
        ctl.estimates.learn(0, 1, 0)  # then many drafts rejected at position 1
    assert ctl.acceptance(1) < 0.1
    assert ctl.acceptance(2) > 0.9 and ctl.acceptance(3) > 0.9  # what follows an accepted token is still known


@settings(max_examples=200, deadline=None)
@given(
    acceptance=st.lists(st.floats(0.0, 1.0), min_size=8, max_size=8),
    steps=st.lists(st.floats(0.0, 3.0), min_size=8, max_size=8),
    cap=st.integers(1, 8),
)
def test_drafts_exactly_when_some_fixed_length_beats_plain_decoding(acceptance, steps, cap):
    """The Dinkelbach rule: speculate iff the best fixed draft length's rate beats plain decoding's,
    and then with the length of the best rate (an all-at-once drafter that is not free), the
    estimates taken at face value (explore=0: no optimism for uncertain ones)."""
    v = {1: 10.0}
    for n, step in enumerate(steps, start=2):
        v[n] = v[n - 1] + step
    ctl = controller(v, acceptance, explore=0.0)
    ctl.learned.draft_token_ms = 0.5
    plan = ctl.plan(cap, incremental=False)
    m = plan.k
    assert not plan.shadowing
    rates = [rate(ctl, plan, j) for j in range(cap + 1)]
    if max(rates[1:]) > rates[0] * (1 + 1e-9):
        assert m >= 1 and rates[m] == pytest.approx(max(rates), rel=1e-6)
    elif max(rates[1:]) < rates[0] * (1 - 1e-9):
        assert m == 0


def test_junk_is_verified_only_where_that_beats_a_plain_step():
    """Where oneDNN's 3-row kernel beats its 1-row one (V(3) < V(1)), verifying even a useless
    draft is faster than a plain step, so auto takes it (as a fixed k = 2 would); where the curve
    does not dip, the margin keeps a draft that is almost never right from being verified."""
    dip = controller({1: 10.0, 3: 9.0, 9: 10.5}, [0.0] * 8)
    plan = dip.plan(8, incremental=False)
    assert plan.k == 8 and plan.shadowing  # a free drafter drafts fully
    assert dip.cut(plan, [7] * 8, deterministic=True) == 2  # the cheapest forward: 3 rows
    flat = controller({1: 10.0, 3: 10.0, 9: 10.5}, [0.005] * 8)
    plan = flat.plan(8, incremental=False)
    assert flat.cut(plan, [7] * 8, deterministic=True) == 0
    useful = controller({1: 10.0, 3: 10.0, 9: 10.5}, [0.5] * 8)
    plan = useful.plan(8, incremental=False)
    assert useful.cut(plan, [7] * 8, deterministic=True) >= 2


def test_a_trees_depth_is_costed_by_the_tokens_it_verifies():
    """A token tree verifies more tokens than it is deep (eagle-tree: the head's chain, a sibling
    at each depth, lookup's branch). The rounds teach the controller how many per depth, and a
    depth is then costed as the forward over its tokens, so where the curve is steep the tree is
    kept shallower than a chain with the same acceptance by position."""
    v = {1: 10.0, 2: 10.5, 3: 11.0, 4: 11.5, 5: 16.0, 6: 17.0, 7: 18.0, 8: 19.0, 9: 20.0}
    learner = controller(v, [0.6] * 8)
    for _ in range(30):  # trees 3 deep of 6 tokens, timed at the curve's own V(7)
        learner.observe(RoundPlan(cap=8, incremental=False), Outcome(6, 1, v[7], 0.0, 0.0, requested=8, depth=3))
    assert learner.learned.nodes_per_depth == pytest.approx(2.0, abs=1e-3)
    chain, tree = controller(v, [0.6] * 8), controller(v, [0.6] * 8)
    tree.learned.nodes_per_depth = 2.0
    plans = {}
    for ctl in (chain, tree):
        plans[ctl] = plan = ctl.plan(8, incremental=False)
        assert plan.k == 8 and plan.shadowing  # a free drafter: cut() decides
    in_chain, in_tree = plans[chain], plans[tree]
    assert tree.extra_verify_ms(in_tree, 2) == pytest.approx(v[5] - v[1] + tree.margin * v[1])  # 2 deep: 4 tokens
    assert chain.extra_verify_ms(in_chain, 2) == pytest.approx(v[3] - v[1] + chain.margin * v[1])
    assert tree.nodes(in_tree, 8) == 8  # never more than the round's cap: the engine prunes the tree to it
    # gain of depth m: 0.6, 0.96, 1.18, 1.31; each ms of extra verify costs rho = 0.1 token (plain's rate)
    assert chain.cut(in_chain, [7] * 8, deterministic=True) == 3  # V(4) = 11.5; depth 4 would cost V(5) = 16
    assert tree.cut(in_tree, [7] * 8, deterministic=True) == 1  # 2 tokens, V(3) = 11; depth 2 would cost V(5)
    # an incremental drafter (eagle-tree drafts a depth per head step) is stopped at the same depths
    for ctl, stop in ((chain, 3), (tree, 1)):
        ctl.learned.draft_first_ms = ctl.learned.draft_step_ms = 0.2
        ctl.learned.fresh = False
        plan = ctl.plan(8, incremental=True)
        assert plan.k == 8
        assert next(d for d in range(1, 9) if not ctl.keep_going(plan, d, 0.9)) == stop


def test_verify_shape_follows_the_context_length():
    v = VerifyCosts(ms={1: 10.0, 4: 9.0}, shapes={100: {1: 1.0, 4: 0.9}, 900: {1: 1.0, 4: 1.3}})
    v.at(500)  # halfway: the shapes' mean, at the current level
    assert v(4) == pytest.approx(10.0 * 1.1)
    v.at(2000)  # past the longest timed context: its shape
    assert v(4) == pytest.approx(13.0)
    v.observe(4, 26.0)  # a round moves the level through the current shape
    assert v(1) == pytest.approx(0.7 * 10.0 + 0.3 * 20.0)
    v.at(50)
    assert v(4) == pytest.approx(0.9 * v(1))
    assert not v.needs(30) and not v.needs(3000) and v.needs(20) and v.needs(4000)  # within 4x of a timed one
    v.spacing = 2.0
    assert not v.needs(130) and not v.needs(640) and v.needs(300) and v.needs(2000)


def test_calibration_times_the_curve_where_the_output_will_end():
    target = make_model("llama", seed=7)
    prompt = prompt_ids()
    kv = new_cache(target)
    kv.extend(prompt[:-1], all_logits=False)
    before = kv.extend(prompt[-1:]).clone()
    kv.rollback(len(prompt) - 1)
    costs = VerifyCosts(spacing=1.5)
    costs.calibrate(kv, prompt, 4, ahead=40)
    assert sorted(costs.shapes) == [len(prompt) - 1, len(prompt) - 1 + 40]
    assert all(set(s) == {1, 2, 3, 4} and s[1] == 1.0 for s in costs.shapes.values())
    assert len(kv) == len(prompt) - 1 and torch.equal(kv.extend(prompt[-1:]), before)  # left as it was
    kv.rollback(len(prompt) - 1)
    costs.calibrate(kv, prompt, 4, ahead=3)  # both ends within the spacing of a timed length: nothing new
    assert len(costs.shapes) == 2
    capped = VerifyCosts(ahead_max=16, spacing=1.5)
    capped.calibrate(kv, prompt, 4, ahead=1000)  # a long generation: the fill is capped
    assert sorted(capped.shapes) == [len(prompt) - 1, len(prompt) - 1 + 16] and len(kv) == len(prompt) - 1


def test_a_useless_draft_model_is_probed_with_exponential_back_off():
    ctl = controller({1: 10.0, 2: 16.0, 3: 20.0}, [0.0] * 8)  # verifying 2 tokens costs 1.6x one
    asked = []
    for _ in range(400):
        plan = ctl.plan(4, incremental=True)
        m = plan.k
        asked.append(m)
        n = ctl.cut(plan, [7] * m, deterministic=True)
        ctl.observe(plan, Outcome(n, 0, 10.0 + 6.0 * n, 0.0, 0.0, requested=m))
    probes = [i for i, m in enumerate(asked) if m]
    assert all(asked[i] == 1 for i in probes)  # a probe is one token
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert probes[0] == 3 and gaps[:4] == [8, 16, 32, 64] and set(gaps[4:]) == {64}  # doubling up to the cap
    assert len(probes) <= 12  # about 1% of the rounds; the cost over plain stays ~0.6% here


def test_a_trees_probe_is_one_depth_and_rounds_learn_under_their_match_class():
    """eagle-tree drafts a tree (about 3 tokens a depth), or a long lookup match alone. A probe
    asks for one depth of its usual tree, not a single token, whose acceptance would be learned as
    the tree's; and a verified round's acceptance goes to its own match class, so the lookup
    chains' streaks do not raise the head trees' estimate nor the other way round."""
    ctl = controller({1: 10.0, 2: 16.0, 3: 20.0, 4: 24.0}, [0.0] * 8)
    ctl.learned.nodes_per_depth = 3.0
    plans = [ctl.plan(8, incremental=True) for _ in range(4)]
    assert [plan.k for plan in plans] == [0, 0, 0, 3] and plans[-1].probing
    fresh = controller({1: 10.0})
    plan = fresh.plan(8, incremental=True)
    for _ in range(50):  # lookup's 12-token matches: all 6 accepted
        fresh.observe(plan, Outcome(6, 6, 12.0, 0.0, 0.0, requested=8, match_length=12))
    assert fresh.acceptance(1, match_class(12)) > 0.9
    assert fresh.acceptance(1) == pytest.approx(fresh.estimates.prior)  # the head's trees (class 0): untouched


def test_a_long_match_is_judged_by_its_own_class_and_looked_for_only_when_the_head_does_not_pay():
    """plan(match=...): eagle-tree may propose a lookup match alone; when its head's trees do not
    pay, the match's class decides (and the match is looked for only then)."""
    v = {1: 10.0, 2: 10.5, 3: 11.0}
    looked = []

    def match():
        looked.append(12)
        return 12

    hopeless = controller(v, [0.0] * 8)  # the head's trees: never right
    for _ in range(100):
        hopeless.estimates.learn(match_class(12), 2, 2)  # 12-token matches: always right
    assert hopeless.plan(2, incremental=True, match=lambda: None).k == 0  # no long match: plain
    assert hopeless.plan(2, incremental=True, match=match).k == 2 and looked == [12]
    assert controller(v, [0.9] * 8).plan(2, incremental=True, match=match).k == 2 and looked == [12]


def test_a_long_match_class_seen_little_starts_from_the_next_shorter_ones_estimate():
    """Long lookup matches are rare, so their class has few rounds of its own: unseen, it reads as
    the class below it (not the flat prior, which cut a 17-token match's draft of 8 to 5), and one
    rejection at its first position leaves its deeper positions where the shorter match has them
    (not at 0.25 everywhere, which cut 12-token matches' drafts to 1 token)."""
    v = {n: 10.0 + 0.5 * n for n in range(1, 10)}
    ctl = controller(v)
    for _ in range(40):  # 6-9-token matches: all 8 tokens right
        ctl.estimates.learn(match_class(7), 8, 8)
    seven = ctl.acceptances(8, match_class(7))
    assert min(seven) > 0.9
    assert ctl.acceptances(8, match_class(20)) == pytest.approx(seven)  # 16+: never seen
    ctl.estimates.learn(match_class(12), 1, 0)  # one 12-token match rejected at once
    twelve = ctl.acceptances(8, match_class(12))
    assert twelve[0] == pytest.approx(seven[0] / 2)  # its own outcome beside the prior, equally weighted
    assert twelve[1:] == pytest.approx(seven[1:])  # positions it never reached: the shorter class's
    plan = RoundPlan(cap=8, rho=1 / 15.5)  # rho: plain decoding's rate on this curve
    assert ctl.cut(plan, list(range(8)), deterministic=True, match_length=12) == 8


def test_an_uncertain_first_position_is_given_the_benefit_of_the_doubt():
    """Near break-even, an estimate from a few drafted rounds is read optimistically (UCB): the
    same 0.25 acceptance drafts when it rests on 3 rounds and not when it rests on 1000, and a
    drafter never right in 1000 rounds stays plain."""
    v = {1: 10.0, 2: 13.0, 3: 16.0}  # the first drafted token costs 3 ms: pays at acceptance > ~0.3
    few, many, never = controller(v, [0.25] * 8, rounds=3), controller(v, [0.25] * 8), controller(v, [0.0] * 8)
    for ctl in (few, many, never):
        ctl.learned.draft_first_ms = ctl.learned.draft_step_ms = 0.0
    assert few.plan(2, incremental=True).k == 2
    assert many.plan(2, incremental=True).k == 0 and never.plan(2, incremental=True).k == 0
    assert controller(v, [0.25] * 8, rounds=3, explore=0.0).plan(2, incremental=True).k == 0


def test_probing_notices_when_drafts_start_paying_again():
    ctl = controller({1: 10.0, 2: 11.0, 3: 12.0, 4: 13.0, 5: 14.0}, [0.0] * 8, rounds=20)
    for _ in range(200):  # the draft model is useless: probes back off
        plan = ctl.plan(4, incremental=True)
        m = plan.k
        ctl.observe(plan, Outcome(ctl.cut(plan, [7] * m, deterministic=True), 0, 10.0, 0.0, 0.0, requested=m))
    for _ in range(200):  # now every drafted token is accepted
        plan = ctl.plan(4, incremental=True)
        m = plan.k
        n = ctl.cut(plan, [7] * m, deterministic=True)
        ctl.observe(plan, Outcome(n, n, 10.0 + n, 0.0, 0.0, requested=m))
    assert ctl.plan(4, incremental=True).k == 4 and ctl.acceptance(1) > 0.9


def test_free_drafts_are_learned_from_by_shadow_verification():
    """A free deterministic draft is always proposed in full, cut to what pays, and checked later
    against the committed tokens, verified or not, per match class."""
    ctl = controller({1: 10.0, 2: 16.0, 3: 17.0, 4: 18.0, 5: 19.0})
    plan = ctl.plan(4, incremental=False)
    assert plan.k == 4 and plan.shadowing
    assert match_class(None) == 0 and match_class(1) == 1 and match_class(5) == 4 and match_class(40) == 7
    seq = [1, 2, 3, 4, 5, 6, 7, 8]
    ctl.cut(plan, [4, 5, 9, 9], deterministic=True, position=3, match_length=5)  # 2 right, then wrong
    ctl.cut(plan, [8, 1], deterministic=True, position=7, match_length=1)  # 1 right, 1 not yet known
    ctl.resolve(seq[:5])  # covers the first draft up to its first 2 tokens only: still pending
    assert len(ctl.estimates.pending) == 2
    ctl.resolve(seq)
    assert ctl.estimates.reached[4][:4] == [1, 1, 1, 0] and ctl.estimates.accepted[4][:3] == [1, 1, 0]
    assert len(ctl.estimates.pending) == 1  # the second waits for its second token
    ctl.resolve(seq, final=True)
    assert ctl.estimates.reached[1][:2] == [1, 0] and ctl.estimates.accepted[1][:1] == [1] and not ctl.estimates.pending
    for _ in range(40):  # long matches always right, short ones never
        plan = ctl.plan(4, incremental=False)
        assert plan.k == 4
        ctl.cut(plan, [1, 2, 3, 4], True, 0, match_length=12)
        ctl.cut(plan, [7, 7, 7, 7], True, 0, match_length=1)
        ctl.resolve([1, 2, 3, 4], final=True)
    assert ctl.cut(plan, [1, 2, 3, 4], True, 0, match_length=12) == 4
    assert ctl.cut(plan, [7, 7, 7, 7], True, 0, match_length=1) == 0


def test_prompt_lookup_reports_how_long_its_match_is():
    lookup = PromptLookup()
    draft = lookup.propose([1, 2, 3, 4, 9, 8, 1, 2, 3, 4], 3, None)
    assert draft.tokens == [9, 8, 1] and draft.match_length == 4  # 3-gram [2, 3, 4], extended to 4
    assert lookup.propose([5, 6, 7], 3, None).match_length is None


def test_draft_model_stops_at_low_confidence_and_cuts_a_greedy_draft():
    ctl = controller({n: 10.0 + n for n in range(1, 10)}, [0.8] * 8)
    ctl.learned.draft_first_ms, ctl.learned.draft_step_ms = 2.0, 2.0
    for b in range(len(ctl.estimates.bin_reached)):  # calibrated: acceptance equals the draft's confidence
        ctl.estimates.bin_reached[b] = 1000.0
        ctl.estimates.bin_accepted[b] = 1000.0 * [0.1, 0.3, 0.5, 0.7, 0.85, 0.93, 0.99][b]
    plan = ctl.plan(8, incremental=True)
    assert plan.k == 8
    assert ctl.keep_going(plan, 1, 0.99) and ctl.keep_going(plan, 2, 0.99)
    assert not ctl.keep_going(plan, 3, 0.05)  # a 5% token: the rest of the draft is not worth its cost
    assert ctl.learned.draft_first_ms is not None and len(plan.confidence) == 3
    assert ctl.cut(plan, [4, 5, 6], deterministic=True) == 2  # ...and the unlikely third token is not verified
    assert ctl.cut(plan, [4, 5, 6], deterministic=False) == 3  # a sampled draft is never cut by its contents


def test_a_rarely_reached_confidence_bin_keeps_its_estimate():
    """A good draft model's low-confidence tokens are rare: their bin's counts must not fade back to
    the prior (the confidence itself) through the many rounds that never reach it, or the policy
    stops drafting at tokens the target mostly accepts."""
    ctl = controller({n: 10.0 for n in range(1, 10)}, [0.9] * 8)
    for _ in range(10):  # tokens the draft gave 10% are accepted
        drafted = RoundPlan(cap=8, incremental=True, confidence=[0.99, 0.1])
        ctl.observe(drafted, Outcome(2, 2, 10.0, 2.0, 0.0, requested=2))
    for _ in range(60):  # then many confident drafts, all accepted
        drafted = RoundPlan(cap=8, incremental=True, confidence=[0.99] * 3)
        ctl.observe(drafted, Outcome(3, 3, 10.0, 3.0, 0.0, requested=3))
    assert ctl.estimates.given_confidence(0.1) > 0.85
    drafted = RoundPlan(cap=8, incremental=True, confidence=[0.99, 0.1])
    ctl.observe(drafted, Outcome(2, 1, 10.0, 2.0, 0.0, requested=2))  # one rejection moves it by a tenth
    assert 0.7 < ctl.estimates.given_confidence(0.1) < 0.85
    ctl.learned.draft_first_ms = ctl.learned.draft_step_ms = 1.0
    plan = ctl.plan(8, incremental=True)
    assert plan.k == 8
    assert ctl.keep_going(plan, 1, 0.99) and ctl.keep_going(plan, 2, 0.1)  # so a 10% token is drafted past


def test_a_confident_token_says_the_next_is_likely_accepted_too():
    """Deep positions learned on hard prompts (accepted 1 time in 4) would keep a streak of
    confident, accepted tokens 3 deep: the next token's acceptance is raised to what followed such
    confident tokens, so the draft goes on. It is only raised: after an unsure token the position's
    own estimate stands."""
    v = {n: 10.0 + 0.5 * (n - 1) for n in range(1, 10)}
    ctl = controller(v, [0.9, 0.9, 0.9] + [0.25] * 5)
    for _ in range(30):  # confident tokens were followed by accepted ones, a 30% one by a rejection
        ctl.observe(RoundPlan(cap=8, incremental=True, confidence=[0.99] * 3), Outcome(3, 3, v[4]))
        ctl.observe(RoundPlan(cap=8, incremental=True, confidence=[0.99, 0.3, 0.5]), Outcome(3, 2, v[4]))
    assert ctl.estimates.after_confidence(0.99, 0.25) > 0.95 and ctl.estimates.after_confidence(0.3, 0.5) < 0.1
    ctl.learned.draft_first_ms = ctl.learned.draft_step_ms = 1.0
    ctl.learned.fresh = False
    plan = ctl.plan(8, incremental=True)
    assert [ctl.keep_going(plan, n, 0.99) for n in (1, 2, 3)] == [True, True, True]  # position 4 learned 0.25
    unsure = ctl.plan(8, incremental=True)
    ctl.keep_going(unsure, 1, 0.99)
    ctl.keep_going(unsure, 2, 0.3)
    accept = ctl.acceptances(8, optimistic=True)
    assert ctl._given(unsure.confidence, accept)[2] == accept[2]  # not lowered to what followed 0.3 (0.03)


def test_a_draft_not_worth_verifying_is_not_drafted_deeper():
    """Going on drafting must beat what stopping now is worth, a plain round included: a first
    token the drafter barely believes (its one extra verified token costs 3 ms) is not worth
    verifying, and cheap further tokens (0.2 ms each) do not make the whole draft pay, so drafting
    stops there instead of drafting on to have it all cut."""
    v = {1: 10.0, 2: 13.0, 3: 13.2, 4: 13.4, 5: 13.6, 6: 13.8, 7: 14.0, 8: 14.2, 9: 14.4}
    ctl = controller(v, [0.8] * 8, margin=0.0)
    ctl.learned.draft_first_ms = ctl.learned.draft_step_ms = 0.2
    ctl.learned.fresh = False
    for b in range(len(ctl.estimates.bin_reached)):  # calibrated: acceptance equals the draft's confidence
        ctl.estimates.bin_reached[b] = 1000.0
        ctl.estimates.bin_accepted[b] = 1000.0 * [0.1, 0.3, 0.5, 0.7, 0.85, 0.93, 0.99][b]
    plan = ctl.plan(8, incremental=True)
    assert plan.k == 8
    plan.rho = 0.1  # tokens per ms: a token is worth 10 ms
    # depth 1 at confidence 0.05 is worth 0.1 - 0.1 x 3 < 0; depths 2 and 3 add 0.08 and 0.064
    # tokens for 0.4 ms each (verify and draft step), so the old marginal test went on
    assert not ctl.keep_going(plan, 1, 0.05)
    assert ctl.cut(plan, [4], deterministic=True) == 0
    plan = ctl.plan(8, incremental=True)
    plan.rho = 0.1
    assert ctl.keep_going(plan, 1, 0.99) and ctl.keep_going(plan, 2, 0.99)  # a draft that pays goes on


def test_the_policy_passed_to_generate_is_the_one_that_learns_and_carries_over():
    target = make_model("llama", seed=1)
    prompt = prompt_ids()
    policy = AdaptiveK(VerifyCosts(), k_max=4)
    first = generate(target, prompt, "prompt-lookup", k="auto", max_new_tokens=12, policy=policy)
    assert policy.costs.shapes and set(range(1, 6)) <= set(policy.costs.ms)  # calibrated up to k_max + 1
    learnt = sum(map(sum, policy.estimates.reached))
    assert learnt > 0  # shadow-verified lookup drafts were counted
    again = generate(target, prompt, "prompt-lookup", k="auto", max_new_tokens=12, policy=policy)
    assert (
        again.tokens == first.tokens and sum(map(sum, policy.estimates.reached)) > learnt
    )  # the same policy went on learning
    with pytest.raises(ValueError, match="k_max"):
        AdaptiveK(VerifyCosts(), k_max=0)


def test_a_generations_first_draft_step_is_not_taken_for_a_step_cost():
    """A draft model's first step in a generation also reads the whole prompt (seconds on a long
    one); counted as the cost of a step it would stop all drafting for many rounds."""
    ticks = iter([5.0, 5.02])  # a 5 s first step (the draft model's prefill), then a 20 ms one
    ctl = controller({1: 100.0, 2: 110.0}, [0.9] * 8, clock=lambda: next(ticks))
    ctl.begin()
    plan = RoundPlan(cap=8, incremental=True)  # not plan(): it would read the clock too
    ctl.keep_going(plan, 1, 0.9)
    assert ctl.learned.draft_first_ms is None
    ctl.keep_going(plan, 1, 0.9)
    assert ctl.learned.draft_first_ms == pytest.approx(20.0)


def test_verify_curve_is_timed_once_per_target_at_first_use():
    target = make_model("llama", seed=5)
    prompt = prompt_ids()
    policy = AdaptiveK(VerifyCosts(), k_max=5)
    first = generate(target, prompt, "prompt-lookup", k="auto", max_new_tokens=4, policy=policy)
    costs = policy.costs
    assert costs.shapes and set(range(1, 7)) <= set(costs.ms) and all(v > 0 for v in costs.ms.values())
    assert set(costs.shape) == set(range(1, 7)) and costs.shape[1] == 1.0
    costs.shape = {n: 1000.0 * n for n in costs.shape}  # a sentinel a second calibration would overwrite
    again = generate(target, prompt, "prompt-lookup", k="auto", max_new_tokens=4, policy=policy)
    assert again.tokens == first.tokens  # the calibration left the cache as it found it
    assert costs.shape[6] == 6000.0  # not re-timed
    assert costs(6) == pytest.approx(6000.0 * costs(1) / 1000.0)  # rounds moved the level, not the shape
    assert generate(target, prompt, None, k=0, max_new_tokens=4).tokens == first.tokens


def test_auto_records_its_choices_and_steers_a_draft_model(draft_model):
    target = make_model("qwen2", seed=5)  # fresh: no verify costs learned yet
    prompt = prompt_ids()
    base = generate(target, prompt, None, max_new_tokens=40)
    drafter = ModelDrafter(draft_model)
    calls = []
    real = drafter.propose

    def spy(context, k, sampler, keep_going=None, branch=None):
        calls.append((keep_going, branch))
        return real(context, k, sampler, keep_going=keep_going, branch=branch)

    drafter.propose = spy
    got = generate(target, prompt, drafter, k="auto", k_max=5, max_new_tokens=40)
    s = got.stats
    assert got.tokens == base.tokens
    assert s.k == "auto" and len(s.k_per_round) == s.rounds and sum(s.k_per_round) == s.drafted
    assert max(s.k_per_round) <= 5
    assert calls and all(c is not None for c, _ in calls)  # the draft model was asked after every token
    assert all(b is not None for _, b in calls)  # greedy on the lean backend: and where to branch
    assert "mean drafted" in s.summary()


class SteepCosts(VerifyCosts):
    """A fixed verify curve on which verifying a doubtful token does not pay (V(2) = 1.8 V(1))."""

    def __init__(self):
        super().__init__(ms={1: 10.0, 2: 18.0})

    def observe(self, n: int, ms: float) -> None:
        pass

    def calibrate(self, *args, **kwargs) -> None:
        pass


def test_auto_sampling_keeps_the_target_distribution(draft_model):
    """Under k = "auto" a sampled draft is never cut by its contents (that would bias the output:
    the rejection rule's residual assumes every drawn token is tested). The costs are set so that a
    doubtful greedy draft would be cut; here every first token must still go through the draft and
    the rejection rule, and the tokens follow the target's own distribution."""
    target = make_model("llama", seed=1)
    prompt = prompt_ids()
    with torch.no_grad():
        p = target.hf(torch.tensor([prompt])).logits[0, -1].softmax(-1)
    drafter = ModelDrafter(draft_model)

    def cut(confidence: float, deterministic: bool) -> int:
        """cut() of a one-token draft by a policy that has learnt nothing, at plain decoding's 0.1
        tokens/ms, whose draft's first token had this probability: verifying it costs V(2) - V(1)
        = 8 ms, 0.8 tokens' worth (plus the margin)."""
        plan = RoundPlan(cap=8, rho=0.1, incremental=True, confidence=[confidence])
        return AdaptiveK(SteepCosts()).cut(plan, [5], deterministic=deterministic)

    assert cut(0.5, deterministic=True) == 0  # the premise: a doubtful greedy draft is cut here
    assert cut(0.99, deterministic=True) == 1  # (by its doubt: a sure one is verified)
    assert cut(0.5, deterministic=False) == 1  # a sampled draft never is
    ctl = AdaptiveK(SteepCosts())

    def always_draft(cap: int, incremental: bool, match=None, share=None) -> RoundPlan:
        # rho: plain decoding's tokens/ms
        return RoundPlan(k=cap, cap=cap, rho=0.1, incremental=incremental, share=share, t_last=ctl.clock())

    ctl.plan = always_draft
    n = 1500
    counts = collections.Counter()
    for seed in range(n):
        got = generate(target, prompt, drafter, k="auto", max_new_tokens=2, temperature=1.0, seed=seed, policy=ctl)
        assert got.stats.k_per_round[0] == 1  # the first token went through the draft and the rejection rule
        counts[got.tokens[0]] += 1
    tv = 0.5 * sum(abs(counts.get(t, 0) / n - float(q)) for t, q in enumerate(p))
    assert tv < 0.08  # sampling noise alone: E[TV] ~ 0.03 for this distribution and n


def test_a_free_draft_in_a_batch_is_verified_only_where_a_lower_bound_of_its_acceptance_pays():
    """Shadow-verified drafts are learned from whether verified or not, so they need no
    exploration; in a batch, where a drafted row costs about a whole row, verifying wherever a noisy
    estimate happens to be high would pay for the noise (the winner's curse)."""
    v = {n: 10.0 + 0.2 * n for n in range(1, 10)}
    share = Share(rows=8, rate=0.4, cost=lambda rows: 10.0 + 1.0 * rows)  # a drafted row: 1.2 ms, 0.48 token
    for seen, verified in ((6, 0), (600, 1)):  # acceptance 0.6 from 6 drafts, or from 600
        ctl = controller(v, [0.6], rounds=seen)
        plan = ctl.plan(8, incremental=False, share=share)
        assert plan.shadowing
        assert ctl.cut(plan, [7] * 8, deterministic=True) == verified, seen
        alone = ctl.plan(8, incremental=False)
        assert ctl.cut(alone, [7] * 8, deterministic=True) >= 1  # alone a row is cheap: the estimate decides
    lower = controller(v, [0.6], rounds=6).acceptances(1, cautious=True)[0]
    assert lower == pytest.approx(
        0.6 * 6 / 7 + 0.5 / 7 - ((0.6 * 6 / 7 + 0.5 / 7) * (1 - 0.6 * 6 / 7 - 0.5 / 7) / 7) ** 0.5
    )


def test_a_second_choice_is_verified_where_its_chance_outweighs_its_row():
    """branch(): a second choice at depth d is worth P(tokens 1..d-1 accepted) x its probability,
    against rho x the row it adds at the tree's size so far; best first, up to the cap. Once the
    target has reached such choices and never taken them, their probabilities count for less."""
    v = {1: 10.0, 2: 10.5, 3: 11.0, 4: 11.5, 5: 16.0, 6: 17.0, 7: 18.0, 8: 19.0, 9: 20.0}
    ctl = controller(v, [0.6] * 8)
    for b in range(len(ctl.estimates.bin_reached)):  # acceptance by confidence: 0.5 in every bin
        ctl.estimates.bin_reached[b], ctl.estimates.bin_accepted[b] = 1000.0, 500.0

    def plan(depth: int):
        p = ctl.plan(8, incremental=True)
        p.confidence = [0.5] * depth
        return p

    rho = plan(1).rho  # a 3-token chain's rate, 2.18 tokens in 11.7 ms
    assert rho == pytest.approx(2.176 / 11.7, rel=1e-3)
    # 2 deep, worth 0.3 and 0.15: the first costs V(4) - V(3) + margin = 0.7 ms (0.13 tokens), the next 4.7
    p = plan(2)
    assert ctl.branch(p, [0.3, 0.3]) == [1] and p.branched == [(1, 0.3)]
    assert ctl.branch(plan(2), [0.05, 0.9]) == [2]  # best first: depth 2 is worth 0.45, depth 1 0.05
    assert ctl.branch(plan(3), [0.3, 0.3, 0.3]) == []  # after 3 the next row costs 4.7 ms: 0.87 tokens
    assert ctl.branch(plan(4), [0.3, 0.3, 0.3, 0.3]) == [1]  # after 4, 1.2 ms (0.22 tokens): only the 0.3
    p = plan(2)
    p.cap = 2
    assert ctl.branch(p, [0.9, 0.9]) == []  # no room left under the cap
    for _ in range(10):  # reached (the chain's first token rejected) and never taken
        p = plan(1)
        if not ctl.branch(p, [0.3]):
            break
        ctl.observe(p, Outcome(2, 0, v[3], depth=1, chain_accepted=0))
    assert ctl.branch(plan(1), [0.3]) == []
    assert ctl.learned.second_taken / ctl.learned.second_expected < 0.5  # from 1, the prior


def test_a_second_choice_taken_is_not_learned_as_the_chains_acceptance():
    """A path through a second choice at depth 2 accepts 2 tokens, but the chain's second token
    was rejected: the estimates learn 1 of 2, and the second choices' record one taken."""
    ctl = controller({n: 10.0 + n for n in range(1, 10)})
    plan = ctl.plan(8, incremental=True)
    plan.confidence, plan.branched = [0.9, 0.5, 0.5], [(2, 0.4)]
    before = ctl.learned.second_taken
    ctl.observe(plan, Outcome(4, 2, 14.0, depth=3, chain_accepted=1))
    assert ctl.estimates.accepted[0][:3] == [1.0, 0.0, 0.0] and ctl.estimates.reached[0][:3] == [1.0, 1.0, 0.0]
    assert ctl.learned.second_taken == pytest.approx(0.9 * before + 1)
    assert ctl.learned.nodes_per_depth == pytest.approx(0.7 + 0.3 * 1.0)  # the chain's 3 tokens, 3 deep


def test_a_draft_models_tree_is_its_chain_then_its_second_choices_and_stays_exact(draft_model):
    """With branch, ModelDrafter offers its chain unchanged, then its second choice (by its own
    logits) at the depths branch returns, each a leaf beside that depth's token; greedy decoding
    through such trees is still plain greedy decoding, and some rounds take a second choice."""
    from specdec.drafters.draft import Draft
    from specdec.sampling import Sampler, SamplingParams

    sampler = Sampler(SamplingParams())
    context = prompt_ids(12)
    drafter = ModelDrafter(draft_model)
    drafter.prepare(draft_model)
    drafter.prefill(context)
    chain = drafter.propose(context, 4, sampler, keep_going=lambda n, c: True)
    offered = []

    def branch(second):
        offered.append(second)
        return [3, 1]

    tree = drafter.propose(context, 6, sampler, keep_going=lambda n, c: n < 4, branch=branch)
    assert tree.tokens[:4] == chain.tokens and tree.parents == [-1, 0, 1, 2, 1, -1]
    assert tree.chain() == Draft(chain.tokens)
    kv = new_cache(draft_model)
    kv.argmax_only = True  # as the drafter's greedy steps: its other entries are the output layer's screen
    logits = torch.stack(
        [kv.extend(context if d == 1 else [chain.tokens[d - 2]], all_logits=False)[-1] for d in (1, 2, 3)]
    )
    for d, t in ((3, tree.tokens[4]), (1, tree.tokens[5])):
        second = logits[d - 1].topk(2).indices[1]
        assert t == int(second) and offered[0][d - 1] == pytest.approx(float(logits[d - 1].softmax(-1)[second]))

    class Eager(AdaptiveK):  # drafts half of k_max deep and offers every second choice: trees are verified
        def plan(self, cap, incremental, match=None, share=None):
            plan = super().plan(cap, incremental, match, share)
            plan.k = cap
            return plan

        def keep_going(self, plan, n_drafted, confidence):
            super().keep_going(plan, n_drafted, confidence)
            return n_drafted < plan.cap // 2

        def cut(self, plan, drafted, deterministic, position=0, match_length=None):
            return len(drafted)

        def branch(self, plan, second):
            plan.branched = [(d, p) for d, p in enumerate(second, 1)]
            return list(range(1, len(second) + 1))

    target = make_model("qwen2", seed=5)
    noisy = make_model("qwen2", seed=5, name="noisy")  # the target, its weights perturbed: often right, not always
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for w in noisy.hf.parameters():
            w.add_(0.2 * w.std() * torch.randn(w.shape, generator=g))
    prompt = prompt_ids()
    plain = generate(target, prompt, None, max_new_tokens=60)
    eager = Eager(VerifyCosts(ms={n: 10.0 for n in range(1, 10)}), k_max=4)
    taken = []  # rounds whose accepted path went through a second choice
    observe = eager.observe
    eager.observe = lambda plan, o: (
        taken.append(o.chain_accepted is not None and o.n_accepted > o.chain_accepted),
        observe(plan, o),
    )
    got = generate(target, prompt, ModelDrafter(noisy), k="auto", max_new_tokens=60, policy=eager)
    assert got.tokens == plain.tokens
    assert any(taken) and got.stats.drafted > sum(got.stats.drafted_at)  # trees: more tokens than depths
