"""A specdec draft head in vLLM: the head exported as EAGLE-1 (specdec.train.export) and run by vLLM's
EAGLE proposer, beside specdec's own eagle drafter, on the same prompt token ids, greedy.

Both run the same fp32 weights (the safetensors folder specdec converts a GGUF model to; vLLM's CPU
backend does not run GGUF blocks). Each engine's speculative output is compared with its own plain
greedy output (speculative decoding must not change it), and the two engines' acceptance is put side
by side: τ, the mean tokens a round commits (the bonus token included: 1 + accepted / rounds), and
the acceptance rate at each draft position.

The two engines draft the same tokens from the same features, but count the ends of a generation
differently, by at most one round per prompt: vLLM's first token comes from the prefill and its
last round may accept drafted tokens past max_tokens (they are counted, then cut), while specdec's
prefill stops one token short and its first round verifies the prompt's last token with a draft,
and near max_new_tokens it drafts fewer tokens. vLLM runs in its own Python (`vllm_eagle_worker.py`,
started as a subprocess); `--vllm-python` names it.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

from specdec.bench.serving import VLLM_INSTALL
from specdec.engine import generate
from specdec.errors import SpecdecError
from specdec.train.export import export_head
from specdec.train.head import load_head

WORKER = Path(__file__).with_name("vllm_eagle_worker.py")


def run_vllm(python: str | Path, spec: dict, folder: Path, name: str, timeout: float = 3600) -> dict:
    """Run vllm_eagle_worker.py with `spec` under `python`; its output dict. The log goes to
    folder/<name>.log. Raises SpecdecError (with the log's end) when it fails."""
    if not Path(python).exists():
        raise SpecdecError(
            f"no Python at {python} for vLLM: {VLLM_INSTALL}, then pass --vllm-python vllm-venv/bin/python"
        )
    spec_file, out_file, log = folder / f"{name}.spec.json", folder / f"{name}.out.json", folder / f"{name}.log"
    spec_file.write_text(json.dumps(spec))
    with open(log, "w") as f:
        rc = subprocess.run(  # -I: the worker's folder off sys.path (bench/kernels.py would shadow a package)
            [str(python), "-I", str(WORKER), str(spec_file), str(out_file)],
            stdout=f,
            stderr=subprocess.STDOUT,
            timeout=timeout,
        ).returncode
    if rc != 0 or not out_file.exists():
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise SpecdecError(f"vLLM ({name}) failed with exit code {rc}; the end of {log}:\n{tail}")
    return json.loads(out_file.read_text())


def specdec_side(target, prompts: list[list[int]], head, k: int, max_new_tokens: int) -> dict:
    """specdec's plain greedy and eagle-chain outputs on `prompts` (token ids) at fixed k with
    `head` (a DraftHead), and the eagle runs' counters summed: rounds, accepted tokens at each draft
    position, tokens drafted at each."""
    from specdec.drafters.eagle import EagleDrafter

    plain, spec, rounds, drafted_at, accepted_at = [], [], 0, [0] * k, [0] * k
    for ids in prompts:
        plain.append(generate(target, ids, None, max_new_tokens=max_new_tokens).tokens)
        g = generate(target, ids, EagleDrafter(head=head), k=k, max_new_tokens=max_new_tokens)
        spec.append(g.tokens)
        rounds += g.stats.rounds
        for i, (d, a) in enumerate(zip(g.stats.drafted_at, g.stats.accepted_at)):
            drafted_at[i] += d
            accepted_at[i] += a
    return {"plain": plain, "eagle": spec, "rounds": rounds, "drafted_at": drafted_at, "accepted_at": accepted_at}


def _engine(equal: int, rounds: int, accepted_at: list[int], drafted_at: list[int]) -> dict:
    """One engine's side of the comparison, from its counters."""
    return {
        "eagle_equals_plain": equal,
        "rounds": rounds,
        "accepted_at": accepted_at,
        "tau": 1 + sum(accepted_at) / rounds if rounds else float("nan"),
        "acceptance_per_position": [a / d if d else float("nan") for a, d in zip(accepted_at, drafted_at)],
    }


def compare(
    target,
    target_folder: Path,
    head_path: Path,
    prompts: list[list[int]],
    vllm_python: str | Path,
    k: int = 4,
    max_new_tokens: int = 128,
    folder: Path | None = None,
) -> dict:
    """Export the head at head_path, run it in vLLM (plain, then EAGLE with k draft tokens) and in
    specdec (plain, then eagle at k) on `prompts` (lists of token ids), and return the comparison:
    per engine, how many speculative outputs equal the plain ones, rounds, accepted tokens at each
    draft position, τ (bonus included) and acceptance by draft position; the outputs themselves;
    vLLM's wall times. target: the specdec Model (fp32) of target_folder. folder: where the
    export, specs and vLLM logs go (default: a temporary one).
    Raises SpecdecError when vLLM fails."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(folder or tmp)
        folder.mkdir(parents=True, exist_ok=True)
        head, meta = load_head(head_path, hidden_size=target.config.hidden_size)
        export = export_head(head, target.config, folder / "eagle-export", meta={"head": str(head_path)})
        common = {
            "target": str(target_folder),
            "prompts": prompts,
            "max_new_tokens": max_new_tokens,
            "max_model_len": min(2048, target.n_ctx),
        }
        vllm_plain = run_vllm(vllm_python, common, folder, "vllm-plain")
        vllm_eagle = run_vllm(vllm_python, {**common, "draft": str(export), "k": k}, folder, "vllm-eagle")
        ours = specdec_side(target, prompts, head, k, max_new_tokens)
    drafts, accepted_at = vllm_eagle["drafts"], vllm_eagle["accepted_per_position"]
    return {
        "k": k,
        "max_new_tokens": max_new_tokens,
        "prompts": len(prompts),
        "head": str(head_path),
        "head_data": meta.get("data"),
        "vllm": {
            **_engine(
                sum(a == b for a, b in zip(vllm_eagle["outputs"], vllm_plain["outputs"])),
                drafts,
                accepted_at,
                [drafts] * len(accepted_at),
            ),
            "plain_seconds": vllm_plain["seconds"],
            "eagle_seconds": vllm_eagle["seconds"],
        },
        "specdec": _engine(
            sum(a == b for a, b in zip(ours["eagle"], ours["plain"])),
            ours["rounds"],
            ours["accepted_at"],
            ours["drafted_at"],
        ),
        "plain_equal_across_engines": sum(a == b for a, b in zip(ours["plain"], vllm_plain["outputs"])),
        "outputs": {
            "vllm_plain": vllm_plain["outputs"],
            "vllm_eagle": vllm_eagle["outputs"],
            "specdec_plain": ours["plain"],
            "specdec_eagle": ours["eagle"],
        },
    }


def report(result: dict, cpu: str, workload: str, target: str) -> str:
    """The markdown page of a compare() result (results/<entry>/README.md)."""
    n, v, s = result["prompts"], result["vllm"], result["specdec"]

    def pos(xs: list[float]) -> str:
        return " / ".join(f"{x:.2f}" for x in xs)

    return "\n".join(
        [
            f"# {target}: specdec's draft head in vLLM (EAGLE-1 export) and in specdec",
            "",
            f"{n} prompts of {workload}, greedy, {result['max_new_tokens']} new tokens, k = {result['k']} (chains), "
            f"fp32 weights in both engines. Head: `{Path(result['head']).name}` (data: {result['head_data']}). "
            f"CPU: {cpu}.",
            "",
            "| engine | speculative output = its plain output | rounds | τ (bonus included) "
            "| acceptance by draft position |",
            "|---|---:|---:|---:|---|",
            f"| vLLM (EagleLlamaForCausalLM) | {v['eagle_equals_plain']}/{n} | {v['rounds']} | {v['tau']:.2f} | "
            f"{pos(v['acceptance_per_position'])} |",
            f"| specdec (eagle) | {s['eagle_equals_plain']}/{n} | {s['rounds']} | {s['tau']:.2f} | "
            f"{pos(s['acceptance_per_position'])} |",
            "",
            f"Plain greedy outputs equal across the two engines: {result['plain_equal_across_engines']}/{n} "
            "(same weights, different kernels: fp32 rounding can tip a near-tie). The engines count the ends of a "
            "generation differently, by at most one round per prompt (specdec.bench.vllm_eagle).",
            "",
            f"vLLM's wall time over the prompts, one at a time: plain {v['plain_seconds']:.1f} s, with the head "
            f"{v['eagle_seconds']:.1f} s ({v['plain_seconds'] / v['eagle_seconds']:.2f}x).",
            "",
        ]
    )
