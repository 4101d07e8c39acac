"""Records tests/data/golden_rounds.json: the rounds (draft length per round) that the replay
(specdec.bench.replay) runs for a few drafters and k over SmolLM2-135M's plain greedy outputs on
the packaged workloads, so that a change meant to change no decision can be checked to change none
(tests/test_golden.py). Run from the repository root after a deliberate change of the policy:

    .venv/bin/python -m tests.golden.record
"""

from __future__ import annotations

import json
from pathlib import Path

from specdec.bench.workloads import load_workload, workload_path
from specdec.engine import generate
from specdec.models.load import load_model
from tests.golden.cases import CASES, replay_case

OUT = Path(__file__).resolve().parents[1] / "data" / "golden_rounds.json"
RESULTS = Path(__file__).resolve().parents[2] / "results"
NEW_TOKENS = 96


def _costs(run: str) -> dict:
    """The measured costs of a results file's first pair (what the bench replays with)."""
    costs = json.loads((RESULTS / run / "results.json").read_text())["pairs"][0]["costs"]
    keep = ("context_tokens", "verify_ms", "draft_ms", "draft_catchup_ms", "overhead_ms")
    return {k: costs[k] for k in keep if k in costs}


def main() -> None:
    target = load_model("smollm2-135m")
    prompts = []
    for name, limit in (("spec-bench", 1), ("humaneval", 4)):
        for p in load_workload(workload_path(name), limit=limit):
            ids = target.encode(p.text, chat=p.chat)
            out = generate(target, ids, None, max_new_tokens=NEW_TOKENS).tokens
            prompts.append({"workload": name, "id": p.id, "prompt": ids, "output": out})
    golden = {
        "model": "smollm2-135m",
        "costs": {
            "lookup": _costs("smollm2-135m_prompt-lookup_spec-bench"),
            "model": _costs("qwen2.5-coder-1.5b_qwen2.5-coder-0.5b_humaneval"),
        },
        "prompts": prompts,
    }
    golden["rounds"] = {case: replay_case(golden, case) for case in CASES}
    OUT.write_text(json.dumps(golden) + "\n")
    print(f"wrote {OUT}: {len(prompts)} prompts, {len(CASES)} cases")


if __name__ == "__main__":
    main()
