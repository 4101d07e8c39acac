"""Runs inside vLLM's own Python (it imports nothing from specdec): greedy generation with vLLM's
offline engine, plain or with an EAGLE draft, over prompts given as token ids.

Usage: python vllm_eagle_worker.py SPEC.json OUT.json. SPEC holds target (a Hugging Face folder),
prompts (lists of token ids), max_new_tokens, optionally dtype (default float32) and
memory_fraction, and, for EAGLE, draft (an exported head folder) and k. OUT gets outputs (token ids
per prompt, generated one prompt at a time), seconds (their wall time), and for EAGLE vLLM's
speculative counters: drafts, draft_tokens, accepted_tokens, accepted_per_position.
"""

import json
import sys
import time


def counters(metrics) -> dict:
    """vLLM's spec-decode counters from LLM.get_metrics(), summed over labels."""
    names = {
        "vllm:spec_decode_num_drafts": "drafts",
        "vllm:spec_decode_num_draft_tokens": "draft_tokens",
        "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
    }
    out = {v: 0 for v in names.values()}
    out["accepted_per_position"] = []
    for m in metrics:
        if m.name in names:
            out[names[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            values = [int(v) for v in m.values]
            acc = out["accepted_per_position"]
            out["accepted_per_position"] = [a + b for a, b in zip(acc + [0] * len(values), values)]
    return out


def main() -> None:
    from vllm import LLM, SamplingParams

    spec = json.loads(open(sys.argv[1]).read())
    kwargs = {
        "model": spec["target"],
        "dtype": spec.get("dtype", "float32"),
        "max_model_len": spec.get("max_model_len", 2048),
        "enforce_eager": True,
        "disable_log_stats": False,
        "seed": 0,
        "gpu_memory_utilization": spec.get("memory_fraction", 0.25),  # on CPU: the share of RAM reserved
    }
    if spec.get("draft"):
        kwargs["speculative_config"] = {"method": "eagle", "model": spec["draft"], "num_speculative_tokens": spec["k"]}
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_new_tokens"])
    outputs, start = [], time.perf_counter()
    for ids in spec["prompts"]:  # one at a time, as specdec's bench runs them
        result = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        outputs.append(list(result.outputs[0].token_ids))
    out = {"outputs": outputs, "seconds": time.perf_counter() - start}
    if spec.get("draft"):
        out.update(counters(llm.get_metrics()))
    with open(sys.argv[2], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
