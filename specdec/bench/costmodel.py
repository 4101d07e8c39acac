"""Predicting the speed-up of speculative decoding, two ways.

textbook (Leviathan et al. 2023, Theorem 3.8 and Section 3.4): with acceptance rate alpha, draft
length k and cost ratio c = (draft step) / (target step), a round yields
E = (1 - alpha^(k+1)) / (1 - alpha) tokens and costs k*c + 1 target steps, so the speed-up is
E / (k*c + 1). It assumes a verify forward over k+1 tokens costs one target step.

ours: from costs measured on this machine (specdec.bench.measure.measure_costs):
  round time  = draft(k) + sum_j P(j drafted) * V(j + 1) + overhead
  draft(k)    = (1 - P(all accepted)) * D1(k) + P(all accepted) * D2(k)
  plain step  = V(1) + overhead
  speed-up    = (tokens per round / round time) * plain step
where V(n) is the measured time of one target forward over n new tokens, draft(k) the measured
time of one proposal, P(j drafted) and the tokens per round come from the acceptance per draft
position the run observed (a drafter such as prompt lookup often drafts fewer than k tokens).
D1(k) is one proposal of k tokens when the drafter lags the context by one token, D2(k) when it
lags by two: after a round that accepted everything, a draft model must first read its own last
token and the bonus token, a two-token forward that on a CPU costs about two one-token steps.
"""

from __future__ import annotations

import math

from specdec.adaptive.costs import interpolate


def textbook_speedup(alpha: float, k: int, c: float) -> float:
    """E / (k*c + 1) with E = (1 - alpha^(k+1)) / (1 - alpha) tokens per round (k + 1 at alpha = 1).
    alpha in [0, 1]; c >= 0 (draft step / target step). NaN alpha (nothing drafted) counts as 0."""
    if math.isnan(alpha):
        alpha = 0.0
    expected = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return expected / (k * c + 1)


def draft_length_distribution(run: dict) -> list[float]:
    """P(j tokens drafted and verified in a round) for j = 0..max, from a RunStats dict's
    k_per_round (exact, token trees included), else its drafted_at / rounds."""
    rounds = run["rounds"]
    if not rounds:
        return [1.0]
    if run.get("k_per_round"):
        counts = [0] * (max(run["k_per_round"]) + 1)
        for n in run["k_per_round"]:
            counts[n] += 1
        return [c / len(run["k_per_round"]) for c in counts]
    at_least = [rounds] + list(run["drafted_at"])  # rounds drafting >= j tokens, j = 0, 1, ...
    return [(at_least[j] - (at_least[j + 1] if j + 1 < len(at_least) else 0)) / rounds for j in range(len(at_least))]


def verify_ms(costs: dict, n: int) -> float:
    """V(n) in ms from the measured curve (keys are strings); beyond it, extrapolated linearly from
    the last two points."""
    curve = {int(key): value for key, value in costs["verify_ms"].items()}
    if n in curve:
        return curve[n]
    xs = sorted(curve)
    if len(xs) < 2:
        return curve[xs[-1]] * n / xs[-1]
    a, b = xs[-2], xs[-1]
    return curve[b] + (curve[b] - curve[a]) / (b - a) * (n - b)


def draft_ms_at(costs: dict, n: int) -> float:
    """One proposal of n tokens in ms, from the measured draft_ms (keys are strings): measured
    points as they are, linear in between, per-token beyond them (0 for n = 0)."""
    curve = {int(key): value for key, value in costs["draft_ms"].items()}
    if n <= 0 or not curve:
        return 0.0
    inside = interpolate(curve, n)
    if inside is not None:
        return inside
    edge = max(curve) if n > max(curve) else min(curve)
    return curve[edge] * n / edge


def our_speedup(run: dict, k: int | str, costs: dict) -> float:
    """Predicted speed-up of one speculative run over plain decoding, from the measured costs and
    the run's acceptance (tokens per round = tau, bonus included). For k = "auto" the round time
    is averaged over the draft lengths the run chose (run["k_per_round"]), each drafted length n
    costing one proposal of n tokens plus V(n + 1)."""
    if not run["rounds"]:
        return float("nan")
    if k == "auto":
        lengths = run["k_per_round"]
        round_ms = sum(draft_ms_at(costs, n) + verify_ms(costs, n + 1) for n in lengths) / len(lengths)
        return run["tau"] * (verify_ms(costs, 1) + costs["overhead_ms"]) / (round_ms + costs["overhead_ms"])
    dist = draft_length_distribution(run)
    all_accepted = run["accepted_at"][k - 1] / run["rounds"] if len(run["accepted_at"]) >= k else 0.0
    d1 = costs["draft_ms"].get(str(k), 0.0)
    d2 = costs.get("draft_catchup_ms", costs["draft_ms"]).get(str(k), d1)
    draft = (1 - all_accepted) * d1 + all_accepted * d2
    round_ms = draft + sum(p * verify_ms(costs, j + 1) for j, p in enumerate(dist)) + costs["overhead_ms"]
    plain_ms = verify_ms(costs, 1) + costs["overhead_ms"]
    return run["tau"] * plain_ms / round_ms


def cost_ratio(costs: dict, k: float) -> float:
    """c: the draft's cost per drafted token over one target step V(1), for proposals of k tokens
    (a mean draft length may be fractional: the cost is interpolated)."""
    if not k or math.isnan(k):
        return 0.0
    lo, hi = math.floor(k), math.ceil(k)
    ms = draft_ms_at(costs, lo) + (draft_ms_at(costs, hi) - draft_ms_at(costs, lo)) * (k - lo)
    return ms / k / verify_ms(costs, 1)


def relative_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured."""
    return (predicted - measured) / measured if measured else float("nan")
