"""Unit tests for the pure verification and sampling functions.

Everything here is built by hand: small vocabularies, distributions whose right answer is known,
and for the random verifier either a property that must hold for every seed or an empirical
frequency compared with its exact value at several standard deviations.
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from specdec.rejection import Verdict, verify_greedy, verify_sampling
from specdec.sampling import Sampler, SamplingParams, argmax_rows, processed_probs

SEEDS = range(300)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def probs(*rows: list[float]) -> torch.Tensor:
    """Rows of probabilities, checked to be distributions."""
    t = torch.tensor(rows, dtype=torch.float32)
    assert torch.allclose(t.sum(-1), torch.ones(len(rows))), t.sum(-1)
    return t


def within(observed: float, expected: float, n: int, sigmas: float = 5.0) -> bool:
    """An empirical frequency over n trials is within `sigmas` standard deviations of expected."""
    sd = math.sqrt(max(expected * (1 - expected), 1e-12) / n)
    return abs(observed - expected) <= sigmas * sd


# --------------------------------------------------------------------------------------------
# verify_greedy
# --------------------------------------------------------------------------------------------

# Argmax per row: row0 -> 2, row1 -> 0, row2 -> 3, row3 -> 1.
GREEDY_LOGITS = torch.tensor(
    [
        [0.1, 0.2, 3.0, -1.0, 0.5],
        [2.5, 0.0, 1.0, 1.5, -2.0],
        [0.0, 0.1, 0.2, 4.0, 0.3],
        [-1.0, 5.0, 0.0, 0.0, 4.9],
    ]
)


def test_greedy_all_accepted_gives_bonus_argmax_of_last_row():
    assert verify_greedy([2, 0, 3], GREEDY_LOGITS) == Verdict(3, 1, True)


def test_greedy_first_token_rejected_recovers_argmax_of_row_0():
    # Later drafted tokens that would match their rows must not be counted after a rejection.
    assert verify_greedy([4, 0, 3], GREEDY_LOGITS) == Verdict(0, 2, False)


def test_greedy_rejection_in_the_middle():
    assert verify_greedy([2, 3, 3], GREEDY_LOGITS) == Verdict(1, 0, False)
    assert verify_greedy([2, 0, 1], GREEDY_LOGITS) == Verdict(2, 3, False)


def test_greedy_empty_draft_gives_argmax_of_the_single_row():
    assert verify_greedy([], GREEDY_LOGITS[2:3]) == Verdict(0, 3, True)
    assert verify_greedy([], GREEDY_LOGITS[3:4]) == Verdict(0, 1, True)


def test_greedy_ties_go_to_the_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    assert verify_greedy([1], logits) == Verdict(1, 0, True)
    assert verify_greedy([2], logits) == Verdict(0, 1, False)


def test_argmax_rows_is_torchs_argmax_first_maximum_included():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(7, 4099, generator=g)
    logits[2, 100] = logits[2, 3000] = logits[2].max() + 1  # a tie: the lower id, as torch.argmax
    logits[5] = 0.0  # all equal: id 0
    logits[6, 17] = float("nan")  # NaN counts as the maximum, as in torch
    want = logits.argmax(dim=-1).tolist()
    assert argmax_rows(logits) == want and want[2] == 100 and want[5] == 0 and want[6] == 17
    assert argmax_rows(logits[3]) == [want[3]]  # one row (V,)
    assert argmax_rows(logits.double()) == want  # other dtypes: torch's own
    assert all(isinstance(i, int) for i in argmax_rows(logits))


@pytest.mark.parametrize("rows", [1, 2, 4, 5])
def test_greedy_wrong_number_of_rows_raises(rows):
    logits = torch.zeros(rows, 5)
    with pytest.raises(ValueError):
        verify_greedy([1, 2], logits)  # needs exactly 3 rows


# --------------------------------------------------------------------------------------------
# verify_sampling
# --------------------------------------------------------------------------------------------


def test_sampling_all_accepted_when_target_is_certain_of_the_drafted_tokens():
    # p_i(x_i) = 1 gives acceptance probability min(1, 1 / q_i(x_i)) = 1 whatever q is; p_k is
    # one-hot on 4, so the bonus token is known too.
    draft = [1, 3, 0]
    q = probs(
        [0.1, 0.2, 0.3, 0.1, 0.3],
        [0.05, 0.05, 0.1, 0.7, 0.1],
        [0.9, 0.025, 0.025, 0.025, 0.025],
    )
    p = torch.zeros(4, 5)
    p[0, 1] = p[1, 3] = p[2, 0] = p[3, 4] = 1.0
    for seed in SEEDS:
        assert verify_sampling(draft, q, p, gen(seed)) == Verdict(3, 4, True)
        assert verify_sampling(draft, None, p, gen(seed)) == Verdict(3, 4, True)


def test_sampling_all_accepted_when_p_equals_q_one_hot():
    draft = [2, 2]
    one_hot = torch.zeros(3, 4)
    one_hot[:, 2] = 1.0
    for seed in SEEDS:
        assert verify_sampling(draft, one_hot[:2], one_hot, gen(seed)) == Verdict(2, 2, True)


def test_sampling_first_token_rejected_when_target_gives_it_zero_probability():
    # x_0 = 0 has p_0(0) = 0: rejected for every seed. Residual max(0, p_0 - q_0) =
    # [0, 0, 0, 0.2, 0.1, 0.2]: token 1 (p 0.2 < q 0.3) and token 2 (p = q = 0.2) have p > 0 but
    # are not in its support; the recovered token is 3 (0.4), 4 (0.2) or 5 (0.4).
    draft = [0, 1]
    q = probs([0.4, 0.3, 0.2, 0.0, 0.0, 0.1], [0.2, 0.2, 0.2, 0.2, 0.1, 0.1])
    p = probs(
        [0.0, 0.2, 0.2, 0.2, 0.1, 0.3],
        [0.0, 1.0, 0.0, 0.0, 0.0, 0.0],  # x_1 would be accepted if reached
        [1 / 6] * 6,
    )
    support = {3, 4, 5}  # where p_0 > q_0
    counts = torch.zeros(6)
    for seed in SEEDS:
        v = verify_sampling(draft, q, p, gen(seed))
        assert v.n_accepted == 0 and not v.bonus, v
        assert v.token != 0
        assert v.token in support, v
        counts[v.token] += 1
    # Residual [0.2, 0.1, 0.2] / 0.5 on tokens 3, 4, 5.
    n = len(SEEDS)
    for tok, expected in {3: 0.4, 4: 0.2, 5: 0.4}.items():
        assert within(counts[tok].item() / n, expected, n), (tok, counts)


def test_sampling_rejected_token_with_p_zero_and_one_hot_draft():
    draft = [2]
    p = probs([0.5, 0.5, 0.0], [0.0, 0.0, 1.0])
    for seed in SEEDS:
        v = verify_sampling(draft, None, p, gen(seed))
        assert v.n_accepted == 0 and not v.bonus and v.token in {0, 1}, v


def test_sampling_draft_probability_zero_with_target_positive_is_always_accepted():
    # q(x) = 0 < p(x): the ratio p/q is infinite, so acceptance is certain (no division by zero,
    # no NaN comparison that would reject).
    draft = [3, 1]
    q = probs([0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5])
    p = probs([0.25, 0.25, 0.25, 0.25], [0.1, 0.2, 0.3, 0.4], [0.0, 0.0, 0.0, 1.0])
    for seed in SEEDS:
        assert verify_sampling(draft, q, p, gen(seed)) == Verdict(2, 3, True)


@pytest.mark.parametrize(
    "q, p, bonus, accept, recovered",
    [
        # p(x) = 0.2, q(x) = 0.5: accepted with probability 0.4; the recovered token comes from
        # max(0, p - q) = [0.3, 0, 0.1, 0] / 0.4 (x = 1 never; token 3 has p < q).
        (probs([0.1, 0.5, 0.2, 0.2]), probs([0.4, 0.2, 0.3, 0.1], [0.0, 0.0, 0.0, 1.0]), 3, 0.4, {0: 0.75, 2: 0.25}),
        # Deterministic drafter (prompt lookup): q one-hot on x, so accepted with probability p(x) = 0.3;
        # the recovered token comes from p with x removed, [0.2, 0, 0.4, 0.1] / 0.7.
        (None, probs([0.2, 0.3, 0.4, 0.1], [0.0, 0.0, 1.0, 0.0]), 2, 0.3, {0: 2 / 7, 2: 4 / 7, 3: 1 / 7}),
    ],
    ids=["min(1, p/q)", "one-hot q"],
)
def test_sampling_accepts_with_min_one_p_over_q_and_recovers_from_the_residual(q, p, bonus, accept, recovered):
    draft = [1]  # x
    g = gen(123)
    n = 6000
    accepted = 0
    counts = torch.zeros(4)
    for _ in range(n):
        v = verify_sampling(draft, q, p, g)
        if v.n_accepted == 1:
            assert v == Verdict(1, bonus, True)
            accepted += 1
        else:
            assert v.n_accepted == 0 and not v.bonus and v.token != 1, v
            counts[v.token] += 1
    assert within(accepted / n, accept, n), accepted / n
    r = n - accepted
    for tok in range(4):
        expected = recovered.get(tok, 0.0)
        if expected == 0:
            assert counts[tok] == 0, (tok, counts)
        else:
            assert within(counts[tok].item() / r, expected, r), (tok, counts)


@pytest.mark.parametrize("empty_q", [None, torch.zeros(0, 5)])
def test_sampling_empty_draft_samples_from_p0(empty_q):
    p0 = probs([0.1, 0.4, 0.0, 0.2, 0.3])
    g = gen(7)
    n = 5000
    counts = torch.zeros(5)
    for _ in range(n):
        v = verify_sampling([], empty_q, p0, g)
        assert v.n_accepted == 0 and v.bonus, v
        counts[v.token] += 1
    assert counts[2] == 0
    keep = p0[0] > 0
    res = stats.chisquare(counts[keep].numpy(), (p0[0][keep] * n).numpy())
    assert res.pvalue > 1e-3, (counts, res)
    for tok in range(5):
        assert within(counts[tok].item() / n, p0[0, tok].item(), n), counts


def test_sampling_one_hot_draft_equals_explicit_one_hot_q():
    # draft_probs=None is documented as a one-hot q: the two must give the same verdicts seed for seed.
    draft = [1, 0, 3]
    p = torch.softmax(
        torch.tensor([[0.0, 1.0, 0.5, -1.0], [2.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0], [1.0, 2.0, 3.0, 4.0]]), -1
    )
    one_hot = torch.nn.functional.one_hot(torch.tensor(draft), 4).float()
    for seed in SEEDS:
        assert verify_sampling(draft, None, p, gen(seed)) == verify_sampling(draft, one_hot, p, gen(seed))


def test_sampling_same_seed_same_verdict_and_seed_matters():
    draft = [0, 1, 2]
    q = torch.softmax(torch.tensor([[2.0, 0.0, 0.0, 1.0, 0.5]] * 3), -1)
    p = torch.softmax(torch.tensor([[0.0, 1.0, 0.5, 0.2, 1.5]] * 4), -1)
    verdicts = []
    for seed in range(100):
        a = verify_sampling(draft, q, p, gen(seed))
        b = verify_sampling(draft, q, p, gen(seed))
        assert a == b
        verdicts.append(a)
    # The generator is actually used: different seeds give different outcomes.
    assert len(set(verdicts)) > 3
    # ...and draws advance the generator's state, so consecutive calls on one generator differ too.
    g = gen(5)
    assert len({verify_sampling(draft, q, p, g) for _ in range(100)}) > 3


def test_sampling_does_not_modify_its_inputs():
    draft = [1, 2]
    q = torch.softmax(torch.tensor([[0.0, 3.0, 0.0, 1.0], [0.0, 0.0, 3.0, 1.0]]), -1)
    p = torch.softmax(torch.tensor([[1.0, 0.0, 0.0, 1.0]] * 3), -1)
    q0, p0 = q.clone(), p.clone()
    for seed in range(50):
        verify_sampling(draft, q, p, gen(seed))
        verify_sampling(draft, None, p, gen(seed))
    assert torch.equal(q, q0) and torch.equal(p, p0)
    assert draft == [1, 2]


@pytest.mark.parametrize(
    "draft, q_shape, p_shape",
    [
        ([1, 2], (2, 5), (2, 5)),  # target needs k+1 = 3 rows
        ([1, 2], (2, 5), (4, 5)),
        ([1, 2], None, (2, 5)),
        ([], None, (2, 5)),  # k = 0 needs exactly one row
        ([1, 2], (3, 5), (3, 5)),  # draft needs k rows
        ([1, 2], (1, 5), (3, 5)),
        ([1, 2], (2, 6), (3, 5)),  # vocabularies differ
        ([1, 2], (2, 4), (3, 5)),
        ([], (1, 5), (1, 5)),
    ],
)
def test_sampling_bad_shapes_raise(draft, q_shape, p_shape):
    q = None if q_shape is None else torch.full(q_shape, 1 / q_shape[1])
    p = torch.full(p_shape, 1 / p_shape[1])
    with pytest.raises(ValueError):
        verify_sampling(draft, q, p, gen(0))


# --------------------------------------------------------------------------------------------
# processed_probs and SamplingParams
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_top_k_keeps_exactly_k_tokens(k):
    logits = torch.tensor([[0.3, -1.0, 2.0, 1.1, 0.0, 2.5, -0.4], [5.0, 4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    out = processed_probs(logits, SamplingParams(temperature=1.0, top_k=k))
    for row, lg in zip(out, logits):
        kept = set(torch.nonzero(row).flatten().tolist())
        top = set(torch.topk(lg, k).indices.tolist())
        assert kept == top
        # The kept tokens keep their relative odds: softmax over the kept logits alone.
        idx = sorted(top)
        assert torch.allclose(row[idx], torch.softmax(lg[idx], -1), atol=1e-6)
        assert (row[[i for i in range(7) if i not in top]] == 0).all()
    assert torch.allclose(out.sum(-1), torch.ones(2))


def test_top_k_zero_or_at_least_vocab_keeps_everything():
    logits = torch.tensor([[0.3, -1.0, 2.0, 1.1]])
    expected = torch.softmax(logits, -1)
    for k in (0, 4, 10):
        assert torch.allclose(processed_probs(logits, SamplingParams(1.0, top_k=k)), expected, atol=1e-6)


# Vocabulary order deliberately unsorted, so the scatter back to vocabulary order is exercised.
TOP_P_PROBS = torch.tensor([[0.15, 0.5, 0.1, 0.25]])


@pytest.mark.parametrize(
    "top_p, expected",
    [
        # Sorted: 0.5 (id 1), 0.25 (id 3), 0.15 (id 0), 0.1 (id 2); cumulative 0.5, 0.75, 0.9, 1.0.
        (0.3, [0.0, 1.0, 0.0, 0.0]),  # 0.5 already reaches 0.3
        (0.6, [0.0, 2 / 3, 0.0, 1 / 3]),  # {1, 3}: 0.75 >= 0.6, 0.5 < 0.6
        (0.7, [0.0, 2 / 3, 0.0, 1 / 3]),
        (0.8, [0.15 / 0.9, 0.5 / 0.9, 0.0, 0.25 / 0.9]),  # {1, 3, 0}: 0.9 >= 0.8
        (0.95, [0.15, 0.5, 0.1, 0.25]),  # needs all four
        (1.0, [0.15, 0.5, 0.1, 0.25]),
    ],
)
def test_top_p_keeps_the_smallest_most_likely_set_reaching_top_p(top_p, expected):
    out = processed_probs(TOP_P_PROBS.log(), SamplingParams(temperature=1.0, top_p=top_p))
    assert torch.allclose(out, torch.tensor([expected]), atol=1e-6), out
    assert ((out == 0) == (torch.tensor([expected]) == 0)).all()  # removed tokens exactly 0


def test_temperature_is_applied_before_top_p():
    # probs [0.5, 0.25, 0.15, 0.1] at T = 0.5 become ∝ p^2 = [0.25, 0.0625, 0.0225, 0.01] / 0.345
    # = [0.7246, 0.1812, 0.0652, 0.0290]; top_p 0.8 keeps {0, 1} (0.7246 < 0.8 <= 0.9058). Applying
    # top_p to the untempered probs would keep {0, 1, 2} (0.75 < 0.8 <= 0.9).
    logits = torch.tensor([[0.5, 0.25, 0.15, 0.1]]).log()
    out = processed_probs(logits, SamplingParams(temperature=0.5, top_p=0.8))
    assert torch.allclose(out, torch.tensor([[0.8, 0.2, 0.0, 0.0]]), atol=1e-6), out


def test_top_k_then_top_p_on_the_renormalised_distribution():
    # Documented order: temperature, then top-k, then top-p. probs [0.4, 0.3, 0.2, 0.1] with
    # top_k 2 become [4/7, 3/7, 0, 0]; top_p 0.5 then keeps only token 0 (4/7 >= 0.5).
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    out = processed_probs(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.5))
    assert torch.allclose(out, torch.tensor([[1.0, 0.0, 0.0, 0.0]]), atol=1e-6), out
    out = processed_probs(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.6))
    # top_k 3: [4/9, 3/9, 2/9]; 4/9 < 0.6 <= 7/9: keeps {0, 1}.
    assert torch.allclose(out, torch.tensor([[4 / 7, 3 / 7, 0.0, 0.0]]), atol=1e-6), out


@pytest.mark.parametrize("temperature", [0.25, 0.7, 1.0, 1.3, 3.0])
def test_temperature_scaling_matches_softmax_of_logits_over_t(temperature):
    logits = torch.tensor([[0.3, -1.0, 2.0, 1.1, 0.0, 2.5], [10.0, 9.0, -3.0, 0.0, 0.5, 1.0]])
    out = processed_probs(logits, SamplingParams(temperature=temperature))
    expected = torch.softmax(logits.double() / temperature, -1).float()
    assert out.dtype == torch.float32
    assert out.shape == logits.shape
    assert torch.allclose(out, expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_processed_probs_any_float_dtype_gives_float32_rows_summing_to_one(dtype):
    logits = torch.tensor([[0.3, -1.0, 2.0, 1.1], [1.0, 1.0, 1.0, 1.0]], dtype=dtype)
    out = processed_probs(logits, SamplingParams(temperature=0.8, top_k=3, top_p=0.9))
    assert out.dtype == torch.float32
    assert torch.allclose(out.sum(-1), torch.ones(2), atol=1e-6)
    assert (out >= 0).all()


def test_processed_probs_greedy_params_raise():
    with pytest.raises(ValueError):
        processed_probs(torch.zeros(1, 4), SamplingParams(temperature=0.0))
    with pytest.raises(ValueError):
        processed_probs(torch.zeros(1, 4), SamplingParams())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": -1.0},
        {"temperature": float("nan")},
        {"temperature": 1.0, "top_k": -1},
        {"temperature": 1.0, "top_p": 0.0},
        {"temperature": 1.0, "top_p": -0.5},
        {"temperature": 1.0, "top_p": 1.01},
        {"temperature": 1.0, "top_p": 2.0},
        {"temperature": 1.0, "top_p": float("nan")},
    ],
)
def test_sampling_params_reject_bad_values(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_sampling_params_accept_edge_values():
    assert SamplingParams().greedy
    assert SamplingParams(temperature=0.0, top_k=0, top_p=1.0).greedy
    p = SamplingParams(temperature=1e-3, top_k=1, top_p=1e-6)
    assert not p.greedy


# --------------------------------------------------------------------------------------------
# Sampler
# --------------------------------------------------------------------------------------------


def test_sampler_greedy_is_argmax_ties_to_lowest_id():
    s = Sampler(SamplingParams())
    assert s.choose(torch.tensor([0.0, 2.0, 1.0, 2.0])) == (1, None)


def test_sampler_sample_returns_processed_probs_and_is_reproducible():
    params = SamplingParams(temperature=0.9, top_k=3)
    logits = torch.tensor([0.1, 2.0, -1.0, 1.5, 1.0])
    a = Sampler(params, gen(11))
    b = Sampler(params, gen(11))
    seen = set()
    for _ in range(200):
        ta, pa = a.choose(logits)
        tb, pb = b.choose(logits)
        assert ta == tb and torch.equal(pa, pb)
        assert torch.allclose(pa, processed_probs(logits[None], params)[0])
        assert pa[ta] > 0  # never a token top_k removed
        seen.add(ta)
    assert seen == {1, 3, 4}
