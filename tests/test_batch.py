"""specdec.batch: many sequences decoded together, one forward per step. Every sequence's tokens,
stop reason and logprobs equal its generate() alone, whatever else is in the batch, on every
backend; sequences join and leave between steps; the goodput rule shrinks drafts as rows fill."""

from __future__ import annotations

import pytest
import torch

from specdec.adaptive import AdaptiveK, RoundPlan, Share, VerifyCosts
from specdec.adaptive.rowcosts import RowCosts
from specdec.batch import Batch, generate_batch
from specdec.decoding import Decoding
from specdec.engine import generate
from specdec.models.load import load_model
from specdec.models.quantize import quantize_model
from specdec.models.registry import REGISTRY
from specdec.models.weights import cache_dir, is_pulled
from specdec.options import GenerationOptions
from specdec.sampling import Penalties

from .conftest import make_model, prompt_ids, remake


def _quant(arch: str = "llama", seed: int = 3):
    fp32 = make_model(arch, seed=seed)
    return remake(fp32, hf=None, lean=None, gguf=quantize_model(fp32.hf, "q8_0", "tiny"), config=fp32.hf.config)


PROMPTS = [prompt_ids(5), prompt_ids(23, seed=1), prompt_ids(12, seed=2), prompt_ids(40, seed=3)[:37], [1]]


def _same(got, want) -> None:
    assert got.tokens == want.tokens
    assert got.text == want.text
    assert got.stats.stop_reason == want.stats.stop_reason
    assert got.logprobs == want.logprobs


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize(
    "run",
    [
        dict(drafter=None),
        dict(drafter="prompt-lookup", k=3),
        dict(drafter="prompt-lookup", k="auto"),
        dict(drafter="suffix", k=2, logprobs=3),
        dict(drafter="prompt-lookup", k=4, penalties=Penalties(0.5, 0.3, 1.2)),
        dict(drafter="prompt-lookup", k=3, temperature=0.8, top_p=0.9, seed=7),
    ],
)
def test_each_sequence_of_a_batch_equals_its_solo_run_quantized(arch, run):
    target = _quant(arch)
    kw = dict(run, max_new_tokens=20)
    got = generate_batch(target, PROMPTS, prefill_chunk=8, **kw)  # prompts over several steps
    for prompt, g in zip(PROMPTS, got):
        _same(g, generate(target, prompt, **kw))


@pytest.mark.parametrize("backend", ["lean", "hf"])
def test_each_sequence_of_a_batch_equals_its_solo_run_fp32(backend):
    target = make_model("llama", seed=4)
    if backend == "hf":
        target = remake(target, backend="hf")
    kw = dict(drafter="prompt-lookup", k=3, max_new_tokens=16, logprobs=2)
    got = generate_batch(target, PROMPTS, prefill_chunk=8, **kw)
    for prompt, g in zip(PROMPTS, got):
        want = generate(target, prompt, **kw)
        assert (g.tokens, g.text, g.stats.stop_reason) == (want.tokens, want.text, want.stats.stop_reason)
        # fp32 kernels are not batch-invariant: logprobs agree up to the last bits
        got_lp = torch.tensor([t.logprob for t in g.logprobs])
        assert torch.allclose(got_lp, torch.tensor([t.logprob for t in want.logprobs]), atol=1e-5)


def test_sequences_join_and_leave_between_steps():
    target = _quant()
    batch = Batch(target, prefill_chunk=6, prefill_ratio=0)  # a fixed budget of 6 prompt tokens a step
    done, streamed = {}, {}
    kw = dict(drafter="prompt-lookup", k=3, max_new_tokens=12)

    def add(i: int) -> Decoding:
        options = GenerationOptions(k=kw["k"], max_new_tokens=kw["max_new_tokens"])
        seq = Decoding(target, PROMPTS[i], kw["drafter"], options)
        streamed[i] = []
        batch.add(
            seq,
            on_commit=lambda _s, tokens: streamed[i].extend(tokens),
            on_finish=lambda _s, g: done.__setitem__(i, g),
        )
        return seq

    add(0)
    steps = [batch.step(), batch.step()]
    gone = add(1)  # joins while 0 decodes
    add(2)
    steps.append(batch.step())
    batch.remove(gone)  # its client went away
    add(3)
    batch.run()
    assert sorted(done) == [0, 2, 3]
    for i in (0, 2, 3):
        _same(done[i], generate(target, PROMPTS[i], **kw))
        assert streamed[i] == done[i].tokens  # every round's tokens reached its stream, in order
    assert (steps[0].decoders, steps[0].prefilling, steps[0].rows) == (0, 1, 4)  # prompt 0 but its last token
    assert steps[1].decoders == 1 and steps[1].rows == 1 + steps[1].drafted[0]
    # the step's prefill budget (6) goes to the oldest joining sequence first
    assert steps[2].prefilling == 1 and steps[2].rows == 1 + steps[2].drafted[0] + 6
    with pytest.raises(ValueError, match="empty"):
        batch.step()


def test_the_prompt_budget_grows_with_the_decoders_and_is_cut_to_the_token():
    # budget max(4, 5 x decoding sequences): two decoders let 10 prompt tokens in, over the joining
    # sequences oldest first, the last one cut mid-prompt; every output is still its solo run's
    target = _quant()
    batch = Batch(target, prefill_chunk=4, prefill_ratio=5)
    assert [batch.prefill_budget(n) for n in (0, 1, 2, 3)] == [4, 5, 10, 15]
    kw = dict(drafter="prompt-lookup", k=2, max_new_tokens=10)
    done = {}
    for i in (0, 4):  # prompts of 5 and 1 tokens
        batch.add(Decoding(target, PROMPTS[i], kw["drafter"], GenerationOptions(k=2, max_new_tokens=10)),
                  on_finish=lambda _s, g, i=i: done.__setitem__(i, g))  # fmt: skip
    first = batch.step()
    # prompt 4 has nothing to feed and decodes at once; prompt 0's 4 tokens (but its last) fit the budget of 5
    assert (first.decoders, first.prefilling, first.rows) == (1, 1, 1 + sum(first.drafted) + 4)
    for i in (2, 1):  # 11 and 22 prompt tokens to feed
        batch.add(Decoding(target, PROMPTS[i], kw["drafter"], GenerationOptions(k=2, max_new_tokens=10)),
                  on_finish=lambda _s, g, i=i: done.__setitem__(i, g))  # fmt: skip
    second = batch.step()
    assert second.decoders == 2 and second.prefilling == 1
    assert second.rows == 2 + sum(second.drafted) + 10  # prompt 2's first 10 tokens, none of prompt 1's
    third = batch.step()  # prompt 2's last token, then 9 of prompt 1's
    assert third.prefilling == 2 and third.rows == third.decoders + sum(third.drafted) + 10
    batch.run()
    for i in (0, 4, 2, 1):
        _same(done[i], generate(target, PROMPTS[i], **kw))
    with pytest.raises(ValueError, match="prefill_ratio"):
        Batch(target, prefill_ratio=-1)


def test_a_batch_refuses_a_shared_drafter_object():
    target = _quant()
    from specdec.drafters.lookup import PromptLookup

    with pytest.raises(ValueError, match="several sequences"):
        generate_batch(target, PROMPTS, drafter=PromptLookup())
    with pytest.raises(ValueError, match="one per prompt"):
        generate_batch(target, PROMPTS, drafters=[PromptLookup()])


def test_row_costs_fit_the_batchs_steps():
    curve = {n: 10.0 + 0.5 * n for n in range(1, 10)}
    costs = RowCosts(lambda n: curve.get(n, 15.0 - n))  # a noisy curve: falls past 9
    assert costs(12) == 14.5  # before the fit: the curve made non-decreasing
    asked = []
    counted = RowCosts(lambda n: asked.append(n) or curve.get(n, 15.0 - n))
    assert [counted(12), counted(12), counted(5)] == [14.5, 14.5, 12.5]
    assert asked == list(range(1, 13))  # a step asks for many row counts: the curve is read once each
    counted.observe(8, 20.0)
    assert counted(2) == 11.0 and asked[12:] == [1, 2]  # and again after a step, as it may have moved
    for rows in [8, 8, 9]:
        costs.observe(rows, 5.0 + 2.0 * rows)
    assert costs.line() is None  # the rows have not spread yet
    for rows in [16, 24, 30, 12]:
        costs.observe(rows, 5.0 + 2.0 * rows)
    a, b = costs.line()
    assert a == pytest.approx(5.0) and b == pytest.approx(2.0)
    falling = RowCosts(lambda n: 1.0)
    for rows in [4, 20, 40]:
        falling.observe(rows, 100.0 - rows)
    assert falling.line()[1] == 0.0  # a row never costs less than nothing


def test_row_costs_price_the_row_that_starts_a_new_tile():
    # the kernels read the weights once per tile of 8 input rows: V(9) - V(8) is a row and a pass
    curve = {n: 10.0 + 1.0 * n + (2.5 if n > 8 else 0.0) for n in range(1, 10)}
    tiled, flat = RowCosts(curve.__getitem__, tile=8), RowCosts(curve.__getitem__)
    assert tiled.step() == pytest.approx(2.5) and flat.step() == 0.0
    for rows in [8, 8, 12, 16, 8, 20, 9, 24, 8, 14] * 3:  # steps of a batch: 7 ms + 1 ms a row + 2.5 a further tile
        for costs in (tiled, flat):
            costs.observe(rows, 7.0 + rows + 2.5 * ((rows - 1) // 8))
    a, b = tiled.line()
    assert a == pytest.approx(7.0) and b == pytest.approx(1.0)
    assert tiled(9) - tiled(8) == pytest.approx(3.5)  # the ninth row starts a tile
    assert tiled(12) - tiled(11) == pytest.approx(1.0)  # the twelfth does not
    assert tiled(17) - tiled(16) == pytest.approx(3.5)
    assert flat(9) - flat(8) < 2.0  # a line through the same steps prices the ninth row as any other


def test_the_batch_rate_counts_a_step_with_prompt_chunks_at_its_decoding_rows_cost():
    batch = Batch(_quant("llama"))
    assert batch.tile == batch.target.lean().row_tile == 8  # the kernels' tile reaches the row costs
    assert batch._rate(4, 10.0, 132, 4) == 0.0  # no costs yet: a step with a chunk tells nothing
    batch.rate = batch._rate(4, 8.0, 4, 4)  # decoding rows alone: 4 tokens in 8 ms
    assert batch.rate == pytest.approx(0.5)
    batch.costs = RowCosts(lambda n: 2.5 * n)
    # 128 prompt rows made the forward 130 ms: its 4 decoding rows would have taken 10 ms alone
    assert batch._rate(4, 130.0, 132, 4) == pytest.approx(0.8 * 0.5 + 0.2 * 0.4)


def test_the_row_costs_learn_from_shared_steps_only():
    # a lone sequence's steps (one to nine rows, cheap while the weights' reading dominates) would
    # price the rows of a later batch of eight far too low
    target = _quant("llama")
    costs = VerifyCosts.for_model(target)
    options = GenerationOptions(k="auto", max_new_tokens=12)
    batch = Batch(target)
    batch.add(Decoding(target, PROMPTS[1], "prompt-lookup", options, AdaptiveK(costs.fork())))
    batch.run()
    assert batch.costs is not None and batch.costs.w == 0  # made for the lone sequence, fitted to none of its steps
    for prompt in PROMPTS[:2]:
        batch.add(Decoding(target, prompt, "prompt-lookup", options, AdaptiveK(costs.fork())))
    batch.run()
    assert batch.costs is not None and batch.costs.w > 0


def test_shared_rows_make_drafts_dearer():
    """The goodput rule: alone, a drafted row costs what the verify-cost curve adds (cheap while the
    weights' reading dominates); in a batch, what it adds to the batch's forward (the fitted slope)."""
    costs = VerifyCosts.__new__(VerifyCosts)
    costs.ms, costs.shapes, costs.shape, costs.optimistic_slope = {n: 10.0 + 0.2 * n for n in range(1, 10)}, {}, {}, 0.1
    policy = AdaptiveK(costs, k_max=6)
    alone = [policy.extra_verify_ms(RoundPlan(cap=6), m) for m in range(7)]
    batch = RowCosts(costs)
    for rows in range(8, 48, 4):
        batch.observe(rows, 4.0 + 1.5 * rows)
    shared = RoundPlan(cap=6, share=Share(rows=40, rate=0.0, cost=batch))
    full = [policy.extra_verify_ms(shared, m) for m in range(7)]
    assert full[0] == alone[0] == 0
    assert full[1:] == pytest.approx([1.5 * m + 0.02 * costs(1) for m in range(1, 7)])
    assert all(f > 3 * a for f, a in zip(full[1:], alone[1:]))


def test_a_batch_of_real_smollm2_gives_each_request_its_solo_tokens():
    spec = REGISTRY["smollm2-135m"]
    if not is_pulled(spec.name, cache_dir()):
        pytest.skip(f"{spec.name} is not pulled: run `specdec models pull {spec.name}`")
    target = load_model(spec.name)
    texts = ["Name three colours.", "Count to ten: one, two,", "Hi", "Write a haiku about the sea."] * 2
    prompts = [target.encode(t, chat=True) for t in texts]
    kw = dict(drafter="prompt-lookup", k="auto", max_new_tokens=24, logprobs=1)
    torch.manual_seed(0)
    got = generate_batch(target, prompts, prefill_chunk=16, **kw)
    for prompt, g in zip(prompts, got):
        _same(g, generate(target, prompt, **kw))


@pytest.mark.parametrize("drafter", [None, "prompt-lookup"])
def test_a_decoding_continues_from_an_earlier_ones_cache(drafter):
    """Decoding(cache=): a conversation's next turn from its previous turn's cache feeds only what
    the cache lacks, and on the batch-invariant backend gives a fresh cache's tokens and logprobs."""
    target = _quant("qwen2")
    opts = GenerationOptions(k=3 if drafter else 0, max_new_tokens=12, logprobs=2)
    first = Batch(target, prefill_chunk=8)
    done = {}
    first.add(Decoding(target, PROMPTS[1], drafter, opts), on_finish=lambda s, g: done.update(kv=s.kv, g=g))
    first.run()
    follow = PROMPTS[1] + done["g"].tokens + prompt_ids(9, seed=5)  # the next turn's context
    held = len(done["kv"])
    assert held >= len(PROMPTS[1])  # the first turn's prompt and output (all but its last token)
    continued = Decoding(target, follow, drafter, opts, cache=done["kv"])
    assert len(continued.unfed()) == len(follow) - 1 - held
    got = generate_batch(target, [follow], prefill_chunk=8, drafter=drafter, k=opts.k, max_new_tokens=12, logprobs=2)
    batch = Batch(target, prefill_chunk=8)
    out = {}
    batch.add(continued, on_finish=lambda s, g: out.update(g=g))
    batch.run()
    _same(out["g"], got[0])
    other = [t for t in prompt_ids(6, seed=8) if t != follow[0]] or [follow[0] + 1]
    moved = Decoding(target, other, None, opts, cache=continued.kv)  # shares nothing: starts over
    assert len(moved.kv) == 0 and len(moved.unfed()) == len(other) - 1


def test_a_head_reading_the_target_cache_refuses_a_given_cache():
    from specdec.drafters.eagle import EagleDrafter

    target = _quant("llama")
    kv = Decoding(target, prompt_ids(5), None, GenerationOptions(k=0)).kv
    with pytest.raises(ValueError, match="fresh one"):
        Decoding(target, prompt_ids(5), EagleDrafter(), GenerationOptions(k=2), cache=kv)
