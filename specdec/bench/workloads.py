"""Real prompts from workload files: Spec-Bench rows (first turn) and HumanEval rows (prompt)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str
    chat: bool  # conversational (Spec-Bench): wrap in the chat template where the model has one
    schema: dict | None = None  # a JSON schema the answer must follow (the json-schema workload)


def load_workload(path: str | Path, categories: list[str] | None = None, limit: int | None = None) -> list[Prompt]:
    """The rows of a workload .jsonl, in file order, at most `limit` per category (a stratified
    subset). Spec-Bench rows give their first turn (category from the row); HumanEval rows give
    their `prompt` (category "humaneval"); JSON-schema rows their `prompt` (a chat turn) and
    `schema`. Raises ValueError for a missing file, an unknown
    category or an unknown row format."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no workload file {path}")
    prompts, seen = [], {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if "schema" in row:  # an instruction answered in JSON under the schema (structured output)
            p = Prompt(
                str(row.get("task_id", len(prompts))), row.get("category", "json"), row["prompt"], True, row["schema"]
            )
        elif "turns" in row:
            p = Prompt(str(row.get("question_id", len(prompts))), row.get("category", "none"), row["turns"][0], True)
        elif "prompt" in row:
            p = Prompt(str(row.get("task_id", len(prompts))), row.get("category", "humaneval"), row["prompt"], False)
        else:
            raise ValueError(f"{path.name}: a row with neither 'turns' (Spec-Bench) nor 'prompt' (HumanEval)")
        seen[p.category] = seen.get(p.category, 0) + 1
        prompts.append(p)
    if categories:
        unknown = sorted(set(categories) - set(seen))
        if unknown:
            raise ValueError(f"{path.name} has no category {', '.join(unknown)}; it has {', '.join(seen)}")
        prompts = [p for p in prompts if p.category in categories]
    if limit is not None:
        count: dict[str, int] = {}
        kept = []
        for p in prompts:
            count[p.category] = count.get(p.category, 0) + 1
            if count[p.category] <= limit:
                kept.append(p)
        prompts = kept
    return prompts


MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")  # Spec-Bench's
PACKAGED = {  # specdec/data/workloads
    "spec-bench": "spec_bench_dev.jsonl",
    "humaneval": "humaneval_dev.jsonl",
    "json-schema": "json_schema_dev.jsonl",
}
WORKLOADS_DIR = Path(__file__).resolve().parents[1] / "data" / "workloads"


def workload_path(name_or_path: str | Path) -> Path:
    """A packaged workload by name (`spec-bench`: Spec-Bench dev rows, `humaneval`: HumanEval dev
    rows, `json-schema`: structured-output tasks; licences in specdec/data/workloads/README.md) or a
    .jsonl file by path. Raises ValueError when it is neither, naming the packaged ones."""
    if str(name_or_path) in PACKAGED:
        return WORKLOADS_DIR / PACKAGED[str(name_or_path)]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(
            f"no workload {str(name_or_path)!r}: give a .jsonl file or a packaged name ({', '.join(PACKAGED)})"
        )
    return path


def default_workload() -> Path:
    """The packaged Spec-Bench dev rows."""
    return workload_path("spec-bench")
