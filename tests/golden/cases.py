"""The golden replay cases (tests/golden/record.py writes them, tests/test_golden.py checks them):
each replays one drafter and k over every recorded prompt, one policy carried across the prompts
as the bench carries it, and gives the draft length of every round."""

from __future__ import annotations

from types import SimpleNamespace

from specdec.bench.replay import controller, replay
from specdec.drafters.base import Drafter, KeepGoing
from specdec.drafters.draft import Draft
from specdec.drafters.lookup import PromptLookup
from specdec.drafters.suffix import SuffixDrafter
from specdec.sampling import Sampler


class NoisyOracle(Drafter):
    """An incremental drafter (as a draft model is) with no model: it knows the target's outputs
    and drafts them, wrong wherever a fixed hash of the position says so, with a confidence that
    is high or low by another; so that the policy's confidence stops and step costs are exercised
    with decisions that are the same on every machine."""

    incremental = True

    def __init__(self, sequences: list[list[int]]):
        self.truth = {tuple(s[:i]): s[i] for s in sequences for i in range(1, len(s))}

    def propose(self, context: list[int], k: int, sampler: Sampler, keep_going: KeepGoing | None = None) -> Draft:
        tokens, ctx = [], list(context)
        for n in range(1, k + 1):
            t = self.truth.get(tuple(ctx), 0)
            wrong = (len(ctx) * 2654435761) % 7 == 0
            token = t + 1 if wrong else t
            tokens.append(token)
            ctx.append(token)
            confidence = 0.95 if (len(ctx) * 40503) % 5 else 0.35
            if keep_going is not None and not keep_going(n, confidence):
                break
        return Draft(tokens)


CASES = ("lookup-auto", "lookup-k4", "suffix-auto", "oracle-auto", "oracle-k3")


def replay_case(golden: dict, case: str) -> list[list[int]]:
    """The draft length of every round of `case`, one list per recorded prompt."""
    drafter_name, k = case.split("-")
    k = "auto" if k == "auto" else int(k[1:])
    prompts = golden["prompts"]
    if drafter_name == "lookup":
        drafter, costs = PromptLookup(), golden["costs"]["lookup"]
    elif drafter_name == "suffix":
        drafter, costs = SuffixDrafter(), golden["costs"]["lookup"]
    else:
        drafter, costs = NoisyOracle([p["prompt"] + p["output"] for p in prompts]), golden["costs"]["model"]
    costs = {
        "context_tokens": int(costs["context_tokens"]),
        "verify_ms": {int(n): ms for n, ms in costs["verify_ms"].items()},
        "draft_ms": {int(n): ms for n, ms in costs["draft_ms"].items()},
        "draft_catchup_ms": {int(n): ms for n, ms in costs.get("draft_catchup_ms", costs["draft_ms"]).items()},
        "overhead_ms": costs["overhead_ms"],
    }
    target = SimpleNamespace(backend="quant", vocab_size=1 << 20)
    policy = controller(costs) if k == "auto" else None
    return [replay(target, p["prompt"], p["output"], drafter, k, costs, policy=policy).k_per_round for p in prompts]
