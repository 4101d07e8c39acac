"""Structured output under speculation (specdec.grammar): every verified row is masked by the
grammar's state after that row's prefix and the state rolls back with the caches, so greedy output
equals plain constrained greedy decoding for every drafter and k, and speculative sampling draws
from the masked target distribution (a statistical test, with a negative control that forgets to
roll the grammar back)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from specdec.drafters.model import ModelDrafter
from specdec.engine import generate
from specdec.grammar import Constraint, Grammar, GrammarError
from specdec.models.quantize import quantize_model
from specdec.rejection import verify_sampling
from specdec.sampling import SamplingParams, processed_probs

from .conftest import BYTE_CHARS, make_byte_tokenizer, make_model, prompt_ids, remake

END = 2  # </s>
ID = {char: i + 3 for i, char in enumerate(BYTE_CHARS)}
SCHEMA = {
    "type": "object",
    "properties": {"name": {"enum": ["ab", "cd", "ok"]}, "ok": {"type": "boolean"}, "n": {"type": "integer"}},
    "required": ["name", "ok", "n"],
    "additionalProperties": False,
}
GRAMMARS = {
    "regex": (Grammar.regex("(ab|cd|ok)+(yes|no)"), lambda text: re.fullmatch("(ab|cd|ok)+(yes|no)", text)),
    "choice": (Grammar.choice(["true", "false", "null"]), lambda text: text in ("true", "false", "null")),
    "json_schema": (Grammar.json_schema(SCHEMA), lambda text: _valid(json.loads(text))),
}


def _valid(value) -> bool:
    return (
        set(value) == {"name", "ok", "n"}
        and value["name"] in ("ab", "cd", "ok")
        and isinstance(value["ok"], bool)
        and isinstance(value["n"], int)
    )


def _target(seed: int = 3):
    """A quantized (batch-invariant) toy model over the byte-level toy tokenizer, ending on </s>."""
    fp32 = make_model("llama", seed=seed, tokenizer=make_byte_tokenizer())
    gguf = quantize_model(fp32.hf, "q8_0", "tiny")
    return remake(fp32, hf=None, lean=None, gguf=gguf, config=fp32.hf.config, eos_token_ids=frozenset({END}))


def _drafter(name: str):
    if name == "model":  # the target's own fp32 weights: mostly right, so drafts get verified
        return ModelDrafter(make_model("llama", seed=3, tokenizer=make_byte_tokenizer()))
    return name


@pytest.mark.parametrize("grammar", list(GRAMMARS))
@pytest.mark.parametrize("drafter,k", [("prompt-lookup", 3), ("suffix", "auto"), ("model", 2), ("model", "auto")])
def test_constrained_speculation_equals_plain_constrained_greedy(grammar, drafter, k):
    target = _target()
    prompt = prompt_ids(16)
    spec, valid = GRAMMARS[grammar]
    plain = generate(target, prompt, k=0, max_new_tokens=40, grammar=spec)
    free = generate(target, prompt, k=0, max_new_tokens=40)
    assert plain.tokens != free.tokens  # the grammar bites
    if plain.stats.stop_reason == "eos":  # ended by the grammar: the text follows it
        assert valid(plain.text), plain.text
    got = generate(target, prompt, _drafter(drafter), k=k, max_new_tokens=40, grammar=spec)
    assert got.tokens == plain.tokens
    if grammar == "json_schema":  # keys and separators are forced: free drafts, verified
        assert got.stats.forced > 0 and plain.stats.forced == 0


def test_a_sampled_constrained_run_keeps_to_the_grammar():
    target = _target()
    spec, valid = GRAMMARS["json_schema"]
    ended = 0
    for seed in range(3):
        out = generate(
            target, prompt_ids(16), "prompt-lookup", k=3, max_new_tokens=60, grammar=spec, temperature=1.0, seed=seed
        )
        if out.stats.stop_reason == "eos":
            assert valid(out.text), out.text
            ended += 1
        else:
            assert out.stats.stop_reason == "length"
    assert ended > 0  # some run ended by the grammar, so its text was checked


def _fresh_mask(target, grammar: Grammar, prefix: list[int], row: torch.Tensor) -> torch.Tensor:
    """What plain constrained decoding masks after `prefix`: a new state fed the prefix, one row."""
    state = Constraint(grammar, target)
    for t in prefix:
        assert state.matcher.consume_token(t)
    return state.mask(row[None], [], greedy=False)[0]


class _Forgetful(Constraint):
    """A broken Constraint for the negative controls: it never rolls back rejected draft tokens
    (and takes the target's token only where the state it is left in allows it)."""

    def settle(self, n_accepted: int, token: int) -> None:
        self.pending = 0
        if self.matcher.validate_tokens([token]):
            self.matcher.consume_token(token)


@pytest.mark.parametrize("kind", [Constraint, _Forgetful])
def test_each_row_is_masked_by_its_prefixs_state_and_the_state_rolls_back(kind):
    target = _target()
    grammar = Grammar.regex("(ab|cd)+(yes|no)")
    g = torch.Generator().manual_seed(0)  # drafts: one forbidden at its third token, one at its second...
    state, committed = kind(grammar, target), []
    ok = True
    for draft in ([ID["a"], ID["b"], ID["e"]], [ID["c"], ID["d"], ID["y"]], [ID["a"], ID["x"]]):
        logits = torch.randn(len(draft) + 1, target.vocab_size, generator=g)
        masked = state.mask(logits, draft, greedy=False)
        for i in range(len(draft) + 1):  # rows up to the first forbidden draft token are read
            ok &= torch.equal(masked[i], _fresh_mask(target, grammar, committed + draft[:i], logits[i]))
            if i < len(draft) and not torch.isfinite(masked[i, draft[i]]):
                break
        n = 1  # the verdict: the first drafted token kept, then a token the grammar allows after it
        allowed = torch.isfinite(_fresh_mask(target, grammar, committed + draft[:n], logits[n]))
        token = next(t for t in (ID["a"], ID["b"], ID["c"], ID["d"], ID["y"]) if allowed[t])
        state.settle(n, token)
        committed += draft[:n] + [token]
        ok &= torch.equal(state.mask(logits[:1], [], False)[0], _fresh_mask(target, grammar, committed, logits[0]))
    assert ok == (kind is Constraint)  # the check catches a state that does not roll back


def test_the_greedy_shortcut_keeps_every_rows_masked_argmax():
    target = _target()
    grammar = Grammar.json_schema(SCHEMA)
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        logits = torch.randn(3, target.vocab_size, generator=g) * 3
        draft = [ID[c] for c in '{"n']
        fast = Constraint(grammar, target).mask(logits, draft, greedy=True)
        full = Constraint(grammar, target).mask(logits, draft, greedy=False)
        assert fast.argmax(-1).tolist() == full.argmax(-1).tolist()


def _joint(state_kind, target, grammar, p_logits, q_logits, params, n: int, seed: int) -> np.ndarray:
    """Empirical joint distribution of the first two tokens of speculative sampling with k = 2
    drafted from q (unconstrained), verified against the target's rows masked by the grammar."""
    gen = torch.Generator().manual_seed(seed)
    counts = np.zeros((target.vocab_size, target.vocab_size))
    state = state_kind(grammar, target)
    q = processed_probs(q_logits, params)
    for _ in range(n):
        state.matcher.reset()
        state.pending = 0
        out: list[int] = []
        while len(out) < 2:
            pos = len(out)
            draft = [int(torch.multinomial(q[pos + j], 1, generator=gen)) for j in range(2 - pos)]
            masked = state.mask(p_logits[pos : pos + len(draft) + 1], draft, greedy=False)
            verdict = verify_sampling(draft, q[pos : pos + len(draft)], processed_probs(masked, params), gen)
            state.settle(verdict.n_accepted, verdict.token)
            out += draft[: verdict.n_accepted] + [verdict.token]
        counts[out[0], out[1]] += 1
    return counts / n


def test_speculative_sampling_under_a_grammar_draws_the_masked_targets_distribution():
    target = _target()
    grammar = Grammar.regex("(a|b|c)(a|d|e)")  # after "b" or "c" the second token is d or e; after "a" any
    params = SamplingParams(temperature=1.0)
    g = torch.Generator().manual_seed(5)
    p_logits = torch.randn(3, target.vocab_size, generator=g)
    q_logits = torch.full((3, target.vocab_size), -9.0)
    for t, v in (("a", 1.0), ("b", 1.0), ("f", 1.5), ("d", 0.5), ("e", 0.5)):  # f: never allowed
        q_logits[:, ID[t]] = v
    want = np.zeros((target.vocab_size, target.vocab_size))  # plain constrained sampling, exactly
    p0 = processed_probs(_fresh_mask(target, grammar, [], p_logits[0])[None], params)[0]
    for t0 in (ID["a"], ID["b"], ID["c"]):
        p1 = processed_probs(_fresh_mask(target, grammar, [t0], p_logits[1])[None], params)[0]
        want[t0] = float(p0[t0]) * p1.numpy()
    n = 20_000
    got = _joint(Constraint, target, grammar, p_logits, q_logits, params, n, seed=0)
    tv = 0.5 * np.abs(got - want).sum()
    assert tv < 0.02, tv
    broken = _joint(_Forgetful, target, grammar, p_logits, q_logits, params, n, seed=0)
    assert 0.5 * np.abs(broken - want).sum() > 0.05  # the test has power: forgetting to roll back shows


def test_bad_grammars_are_clear_errors():
    target = _target()
    with pytest.raises(GrammarError, match="not valid JSON"):
        Grammar.json_schema("{not json")
    with pytest.raises(GrammarError, match="Invalid type"):
        generate(target, prompt_ids(), k=0, max_new_tokens=2, grammar=Grammar.json_schema({"type": "foo"}))
    with pytest.raises(GrammarError, match="admits no text"):
        Constraint(Grammar.lark("start: A\nA: /a/ & /b/"), target)
    with pytest.raises(GrammarError, match="choice"):
        Grammar.choice([])
    with pytest.raises(ValueError, match="grammar must be a specdec Grammar"):
        generate(target, prompt_ids(), k=0, max_new_tokens=2, grammar='{"type": "object"}')


def test_real_smollm2_json_schema_tasks_are_exact_and_valid_under_speculation():
    """SmolLM2's byte-level BPE has many tokenizations of the same text: the mask (llguidance's
    canonical tokens) is what plain constrained decoding follows, and what speculation must follow."""
    from specdec.bench.workloads import load_workload, workload_path
    from specdec.models.load import load_model
    from specdec.models.registry import REGISTRY
    from specdec.models.weights import cache_dir, is_pulled

    if not is_pulled("smollm2-135m", cache_dir()):
        pytest.skip("smollm2-135m is not pulled: run `specdec models pull smollm2-135m`")
    assert REGISTRY["smollm2-135m"]
    target = load_model("smollm2-135m")
    for task in load_workload(workload_path("json-schema"))[:3]:
        ids = target.encode(task.text, chat=True)
        grammar = Grammar.json_schema(task.schema)
        # a budget each document fits in (up to 214 tokens, with AVX2's int8 rounding) so that it ends by EOS
        plain = generate(target, ids, None, k=0, max_new_tokens=400, grammar=grammar)
        spec = generate(target, ids, "prompt-lookup", k="auto", max_new_tokens=400, grammar=grammar)
        assert spec.tokens == plain.tokens, task.id
        assert plain.stats.stop_reason == "eos" and isinstance(json.loads(plain.text), dict), task.id
        walk = Constraint(grammar, target)  # every token is one the mask allowed there, EOS included
        for t in plain.tokens:
            assert walk._allowed()[t], (task.id, t)
            assert walk.matcher.consume_token(t)
        assert spec.stats.forced > 0


def test_a_batch_keeps_one_grammar_state_per_sequence():
    from specdec.batch import generate_batch

    target = _target()
    prompts = [prompt_ids(16, seed=s) for s in range(3)]
    grammar = Grammar.json_schema(SCHEMA)
    got = generate_batch(target, prompts, "prompt-lookup", k="auto", max_new_tokens=40, grammar=grammar)
    for prompt, g in zip(prompts, got):
        assert g.tokens == generate(target, prompt, k=0, max_new_tokens=40, grammar=grammar).tokens
