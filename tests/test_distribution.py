"""Speculative sampling reproduces the target's distribution: a statistical test.

On a toy vocabulary the target and the draft have fixed distributions per position, independent of
the tokens before (p_i and q_i for output position i, after processed_probs with the run's
temperature / top-k / top-p). Plain sampling of the target then draws the first two output tokens
from the product p_0 x p_1, and speculative decoding must do exactly the same.

`simulate` runs the whole speculative procedure for each sample: draft k tokens from q at the
positions that follow the tokens produced so far, verify them against p at those positions, keep
the accepted drafted tokens plus the verdict's token, and start another round until two tokens
exist (a rejection at position 0 yields one token, so the second comes from a second round whose
positions start at 1). The draws of the drafted tokens are made up front, one independent table
per round, since they do not depend on anything the verifier does; each call to the verifier is
the real one, with a single explicit generator.

The empirical joint distribution of the first two tokens is compared with p_0 x p_1 by total
variation distance and by a chi-square goodness-of-fit test. Negative controls run wrong verifiers
through the same simulator and must fail the same check, so a pass means something.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from scipy import stats

from specdec.rejection import Verdict, verify_sampling
from specdec.sampling import SamplingParams, processed_probs

V = 6
N = 100_000
TV_BOUND = 0.01
P_VALUE_FLOOR = 1e-3

# Target logits per output position: prefers tokens 3, 4, 5.
TARGET_LOGITS = torch.tensor(
    [
        [0.0, -1.0, 0.5, 1.5, 2.0, 1.0],
        [0.3, 0.0, -0.5, 2.2, 1.0, 1.6],
        [1.0, -0.5, 0.0, 0.8, 2.0, 1.2],
        [0.5, 1.5, -1.0, 0.0, 1.0, 2.1],
        [0.2, 0.9, 1.7, -0.3, 0.4, 1.1],
        [1.3, 0.1, 0.6, 1.9, -0.7, 0.0],
    ]
)
# Draft logits per output position: far from the target, most of its mass on tokens 0, 1, 2 which
# the target rarely picks (total variation between p_i and q_i is 0.55 to 0.9 at positions 1 to 3
# in every setting), with some overlap so that acceptances happen too. Position 0 is nearer
# (total variation 0.3 to 0.4, still 28% on token 0 where the target has 6% or less): a rejection
# there costs a second verifier call per sample, and this keeps the run time down.
DRAFT_LOGITS = torch.tensor(
    [
        [1.5, 0.0, -1.0, 0.8, 2.0, -0.5],
        [1.2, 2.5, 0.4, 1.8, -1.0, 0.0],
        [2.2, 1.0, 1.6, -0.4, 0.3, -1.0],
        [1.9, 0.2, 1.1, -0.8, 0.0, 0.6],
        [-0.2, 1.4, 0.1, 2.0, 0.5, 0.9],
        [0.7, 2.1, -0.6, 0.3, 1.5, 0.0],
    ]
)
# A deterministic drafter (prompt lookup): the token proposed at each output position is fixed.
# With temperature 0.8 and top_k=4 below, token 4 at position 0 has p = 0.51, token 0 at position 1
# has p = 0.052 (rarely accepted) and token 1 at position 2 has p = 0 (always rejected).
FIXED_DRAFT = [4, 0, 1, 3, 5, 2]

Verifier = Callable[[list[int], "torch.Tensor | None", torch.Tensor, torch.Generator], Verdict]


def simulate(
    verify: Verifier,
    p: torch.Tensor,
    q: torch.Tensor | None,
    k: int,
    n: int,
    seed: int,
    fixed_draft: list[int] | None = None,
) -> np.ndarray:
    """Counts (V, V) of the first two output tokens over n speculative runs.

    p: (P, V) target distribution per output position; q: (P, V) draft distribution per output
    position, or None with fixed_draft (the drafter proposes fixed_draft[i] at position i).
    """
    generator = torch.Generator().manual_seed(seed)
    positions = p.shape[0]
    # Every round starts at position 0 (the first) or 1 (after a rejection at position 0), so it
    # needs rows pos .. pos + k of p: k + 2 positions in all.
    assert positions >= k + 2
    target_rows = [p[pos : pos + k + 1] for pos in range(2)]
    draft_rows = [None if q is None else q[pos : pos + k] for pos in range(2)]
    if q is None:
        assert fixed_draft is not None
        tables = None
    else:
        # tables[r][s][i]: the token round r of sample s drafts at output position i, drawn from q_i.
        # Two rounds at most: each round produces at least one token.
        tables = [torch.multinomial(q, n, replacement=True, generator=generator).T.tolist() for _ in range(2)]
    counts = np.zeros((V, V), dtype=np.int64)
    with torch.inference_mode():  # as the engine runs; also cuts torch's per-call overhead by ~20%
        _run(verify, k, n, generator, target_rows, draft_rows, tables, fixed_draft, counts)
    return counts


def _run(verify, k, n, generator, target_rows, draft_rows, tables, fixed_draft, counts) -> None:
    for s in range(n):
        out: list[int] = []
        pos = 0
        rnd = 0
        while len(out) < 2:
            drafted = fixed_draft[pos : pos + k] if tables is None else tables[rnd][s][pos : pos + k]
            verdict = verify(drafted, draft_rows[pos], target_rows[pos], generator)
            out.extend(drafted[: verdict.n_accepted])
            out.append(verdict.token)
            pos += verdict.n_accepted + 1
            rnd += 1
        counts[out[0], out[1]] += 1


def exact_joint(p: torch.Tensor) -> np.ndarray:
    """p_0 x p_1 as a (V, V) float64 array summing to 1."""
    p0 = p[0].double().numpy()
    p1 = p[1].double().numpy()
    joint = np.outer(p0 / p0.sum(), p1 / p1.sum())
    return joint / joint.sum()


def goodness_of_fit(counts: np.ndarray, joint: np.ndarray) -> tuple[float, float, int]:
    """(total variation distance, chi-square p-value, count observed where joint is 0)."""
    n = counts.sum()
    tv = 0.5 * np.abs(counts / n - joint).sum()
    support = joint > 0
    impossible = int(counts[~support].sum())
    expected = joint[support] * n
    assert expected.min() >= 5, "chi-square needs >= 5 expected per cell"
    observed = counts[support].astype(np.float64)
    expected = expected * observed.sum() / expected.sum()  # chisquare wants equal totals
    pvalue = stats.chisquare(observed, expected).pvalue
    return float(tv), float(pvalue), impossible


def processed(params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, q): the same temperature / top-k / top-p on target and draft logits."""
    return processed_probs(TARGET_LOGITS, params), processed_probs(DRAFT_LOGITS, params)


SETTINGS = {
    # id: (params, k, deterministic drafter, seed)
    "T1.0": (SamplingParams(temperature=1.0), 2, False, 1),
    "T0.7-topk3": (SamplingParams(temperature=0.7, top_k=3), 3, False, 2),
    "T1.3-topp0.8": (SamplingParams(temperature=1.3, top_p=0.8), 2, False, 3),
    "fixed-draft-T0.8-topk4": (SamplingParams(temperature=0.8, top_k=4), 2, True, 4),
    "T1.0-minp0.3": (SamplingParams(temperature=1.0, min_p=0.3), 2, False, 5),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_speculative_sampling_reproduces_the_target_joint_distribution(setting):
    params, k, deterministic, seed = SETTINGS[setting]
    p, q = processed(params)
    if deterministic:
        counts = simulate(verify_sampling, p, None, k, N, seed, fixed_draft=FIXED_DRAFT)
    else:
        counts = simulate(verify_sampling, p, q, k, N, seed)
    assert counts.sum() == N
    tv, pvalue, impossible = goodness_of_fit(counts, exact_joint(p))
    assert impossible == 0, f"{impossible} samples of token pairs the target gives probability 0"
    assert tv < TV_BOUND, f"TV {tv:.4f} >= {TV_BOUND}"
    assert pvalue > P_VALUE_FLOOR, f"chi-square p-value {pvalue:.2e} (TV {tv:.4f})"


# ---------------------------------------------------------------------------------------------
# Negative controls: wrong verifiers, same simulator, same check. They must fail it.
# ---------------------------------------------------------------------------------------------


def always_accept(draft_tokens, draft_probs, target_probs, generator) -> Verdict:
    """Keeps every drafted token: the output is the draft's distribution."""
    k = len(draft_tokens)
    return Verdict(k, int(torch.multinomial(target_probs[k], 1, generator=generator)), True)


def resample_from_target(draft_tokens, draft_probs, target_probs, generator) -> Verdict:
    """The right accept test, but the recovered token is drawn from p instead of max(0, p - q):
    a subtle, classic mistake that over-weights tokens the draft already proposes often."""
    k = len(draft_tokens)
    idx = torch.tensor(draft_tokens)[:, None]
    p = target_probs[:-1].gather(1, idx)[:, 0]
    q = draft_probs.gather(1, idx)[:, 0]
    r = torch.rand(k, generator=generator)
    for i, ok in enumerate((r * q < p).tolist()):
        if not ok:
            return Verdict(i, int(torch.multinomial(target_probs[i], 1, generator=generator)), False)
    return Verdict(k, int(torch.multinomial(target_probs[k], 1, generator=generator)), True)


def test_the_check_has_power_against_always_accepting():
    p, q = processed(SamplingParams(temperature=1.0))
    counts = simulate(always_accept, p, q, 2, N, seed=5)
    # Against the target's joint distribution the same check fails by a wide margin...
    tv, pvalue, _ = goodness_of_fit(counts, exact_joint(p))
    assert tv > 0.3, tv
    assert pvalue < 1e-100, pvalue
    assert not (tv < TV_BOUND and pvalue > P_VALUE_FLOOR)
    # ...while against q_0 x q_1, which always accepting does produce, it passes: the simulator and
    # the check are not themselves biased.
    tv, pvalue, impossible = goodness_of_fit(counts, exact_joint(q))
    assert impossible == 0
    assert tv < TV_BOUND and pvalue > P_VALUE_FLOOR, (tv, pvalue)


def test_the_check_has_power_against_resampling_from_the_target():
    # Costs as much per call as the real verifier, so fewer samples; chi-square power only grows
    # with the number of samples.
    p, q = processed(SamplingParams(temperature=1.0))
    counts = simulate(resample_from_target, p, q, 2, 20_000, seed=7)
    tv, pvalue, _ = goodness_of_fit(counts, exact_joint(p))
    assert tv > 0.03, tv
    assert pvalue < 1e-10, pvalue
    assert not (tv < TV_BOUND and pvalue > P_VALUE_FLOOR)
