"""Golden replays: the adaptive policy's decisions (the draft length of every round) for model-free
drafters and an incremental one, over SmolLM2-135M's recorded greedy outputs on the packaged
workloads, under the bench's recorded costs. A change meant to change no decision (a refactor)
must leave every round equal; a deliberate change re-records them (tests/golden/record.py)."""

import json
from pathlib import Path

import pytest

from .golden.cases import CASES, replay_case

GOLDEN = json.loads((Path(__file__).parent / "data" / "golden_rounds.json").read_text())


@pytest.mark.parametrize("case", CASES)
def test_the_policy_replays_the_recorded_rounds(case):
    expected = GOLDEN["rounds"][case]
    got = replay_case(GOLDEN, case)
    assert sum(map(len, expected)) > 100  # enough rounds to say something
    for i, (e, g) in enumerate(zip(expected, got)):
        assert g == e, f"{case}, prompt {i} ({GOLDEN['prompts'][i]['id']}): rounds differ from round {_first(e, g)}"
    assert len(got) == len(expected)


def test_the_cases_decide_differently():
    # auto chooses per round: its draft lengths vary and differ from a fixed k's
    lookup_auto = [k for r in GOLDEN["rounds"]["lookup-auto"] for k in r]
    assert len(set(lookup_auto)) > 3
    assert GOLDEN["rounds"]["oracle-auto"] != GOLDEN["rounds"]["oracle-k3"]


def _first(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
