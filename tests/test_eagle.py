"""The feature-level draft head (specdec.train.head), its drafter and `specdec train`, on tiny models."""

from __future__ import annotations

import json

import pytest
import torch

from specdec import generate
from specdec.adaptive import AdaptiveK, VerifyCosts, match_class
from specdec.bench.measure import measure_costs
from specdec.cache import LeanKVCache
from specdec.drafters import EagleDrafter
from specdec.sampling import Sampler, SamplingParams
from specdec.train.head import DraftHead, HeadCache, HeadError, load_head, save_head
from specdec.train.selfdistill import training_prompts
from specdec.train.train import TrainConfig, train_head

from .conftest import make_model, prompt_ids, remake


@pytest.fixture(scope="module")
def target():
    return make_model("llama", seed=1)


@pytest.fixture(scope="module")
def head(target):
    torch.manual_seed(0)
    return DraftHead.for_target(target, torch.arange(3, 50))


def full_forward_draft(target, head, context):
    """The first greedy draft token, computed from scratch: a fresh target forward for the
    features and the head over the whole context in training mode (no cache)."""
    kv = LeanKVCache(target)
    kv.extend(context[:-1])
    feats = kv.features[: len(context) - 1].float()
    with torch.no_grad():
        pred = head(feats, target.lean().embed[torch.tensor(context[1:])].float())[-1]
        sub = pred @ target.hf.lm_head.weight[head.vocab_ids].T
    return int(head.vocab_ids[sub.argmax()])


def test_incremental_head_cache_matches_a_full_forward(target, head):
    drafter = EagleDrafter(head)
    drafter.prepare(target)
    kv = LeanKVCache(target)
    drafter.attach(kv)
    greedy = Sampler(SamplingParams(), torch.Generator())
    context = prompt_ids(12)
    kv.extend(context[:-1])
    first = drafter.propose(context, 3, greedy)
    assert len(first.tokens) == 3 and first.tokens[0] == full_forward_draft(target, head, context)
    # the round commits two tokens that differ from the draft: the head must drop its draft positions
    context2 = context + [7, 9]
    kv.extend(context2[len(kv) : -1])
    second = drafter.propose(context2, 2, greedy)
    assert second.tokens[0] == full_forward_draft(target, head, context2)
    # a context that rewrites history (a rollback past what the head had seen)
    context3 = context[:5] + [11, 12, 13]
    kv.rollback(0)
    kv.extend(context3[:-1])
    assert drafter.propose(context3, 1, greedy).tokens[0] == full_forward_draft(target, head, context3)


def test_unrolled_steps_are_what_drafting_with_a_cache_computes(target, head):
    """Training-time test: step j of the unrolled forward at position t equals the head drafting
    its j-th token (its own predicted features fed back, over a HeadCache) after true features
    up to t - j."""
    torch.manual_seed(3)
    T, d = 11, head.config["hidden"]
    feats, embeds = torch.randn(T, d), torch.randn(T, d)
    with torch.no_grad():
        outs = head.unrolled(feats, embeds, 4)
        assert torch.allclose(outs[0], head(feats, embeds), atol=1e-5)
        checked = 0
        for p in (0, 3, 7):  # the last position with a true feature
            cache = HeadCache(head)
            pred = head(feats[: p + 1], embeds[: p + 1], 0, cache)[-1:]
            for j in range(1, 4):
                pred = head(pred, embeds[p + j][None], p + j, cache)
                assert torch.allclose(pred[0], outs[j][p + j], atol=1e-5), (p, j)
                checked += 1
        assert checked == 9
        # and the steps differ from teacher forcing: they read predicted features
        assert not torch.allclose(outs[1][5], outs[0][5], atol=1e-3)


def test_packed_head_drafts_what_the_module_computes(head):
    torch.manual_seed(4)
    feats, embeds = torch.randn(6, 64), torch.randn(6, 64)
    packed = head.packed()
    with torch.no_grad():
        a = head(feats, embeds, 0, HeadCache(head))
        b = packed(feats, embeds, 0, HeadCache(packed))
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    assert isinstance(head.fc, torch.nn.Linear)  # the trainable module is left as it was


def test_eagle_greedy_is_plain_greedy_and_sampling_works(target, head):
    prompt = prompt_ids()
    plain = generate(target, prompt, None, max_new_tokens=30).tokens
    for k in (1, 4, "auto"):
        assert generate(target, prompt, EagleDrafter(head), k=k, max_new_tokens=30).tokens == plain
    out = generate(target, prompt, EagleDrafter(head), k=3, max_new_tokens=20, temperature=1.0, seed=0)
    again = generate(target, prompt, EagleDrafter(head), k=3, max_new_tokens=20, temperature=1.0, seed=0)
    assert out.tokens == again.tokens and all(0 <= t < target.vocab_size for t in out.tokens)
    assert out.stats.drafted > 0


def test_the_head_reads_the_prompt_with_the_prefill_not_in_the_first_round(target, head):
    from specdec.engine import stepwise

    drafter = EagleDrafter(head)
    prompt = prompt_ids(30)
    rounds = stepwise(target, prompt, drafter, k=3, max_new_tokens=20)
    assert next(rounds) == 0  # the prefill is done, the head's too
    assert drafter.seen == prompt[:-1]
    ran = []
    original = drafter._step
    drafter._step = lambda feats, tokens, start: ran.append((len(tokens), start)) or original(feats, tokens, start)
    next(rounds)
    assert ran[0] == (1, len(prompt) - 2)  # the first round runs the head over one position only
    for _ in rounds:
        pass
    plain = generate(target, prompt, None, k=0, max_new_tokens=20).tokens
    assert generate(target, prompt, EagleDrafter(head), k=3, max_new_tokens=20).tokens == plain


def test_eagle_tree_offers_the_next_best_tokens_as_siblings_and_stays_exact(target, head):
    kv = LeanKVCache(target)
    context = prompt_ids(12)
    kv.extend(context[:-1])
    greedy = Sampler(SamplingParams(), torch.Generator())
    drafts = []
    for alternatives, k in ((2, 7), (0, 3)):
        drafter = EagleDrafter(head, alternatives=alternatives)
        drafter.prepare(target)
        drafter.attach(kv)
        drafts.append(drafter.propose(context, k, greedy))
    tree, chain = drafts
    assert tree.parents == [-1, -1, -1, 0, 0, 0, 3] and chain.parents is None
    assert tree.chain().tokens == chain.tokens  # the main chain is what the chain drafter drafts
    assert tree.tokens[0] == full_forward_draft(target, head, context)
    assert len(set(tree.tokens[:3])) == 3 and len(set(tree.tokens[3:6])) == 3  # siblings differ
    prompt = prompt_ids()
    plain = generate(target, prompt, None, max_new_tokens=30).tokens
    for k in (2, 5, "auto"):
        out = generate(target, prompt, EagleDrafter(head, alternatives=1), k=k, max_new_tokens=30)
        assert out.tokens == plain and out.stats.drafted > 0
    sampled = generate(
        target, prompt, EagleDrafter(head, alternatives=1), k=4, max_new_tokens=12, temperature=1.0, seed=0
    )
    assert (
        sampled.tokens
        == generate(target, prompt, EagleDrafter(head), k=4, max_new_tokens=12, temperature=1.0, seed=0).tokens
    )  # sampling drafts a chain, with its probabilities
    with pytest.raises(ValueError, match="alternatives"):
        EagleDrafter(head, alternatives=-1)


def test_eagle_tree_grafts_prompt_lookup_as_a_branch(target, head):
    from specdec.drafters import PromptLookup, make_drafter

    context = prompt_ids(6) * 3  # repeats itself: prompt lookup proposes what followed before
    kv = LeanKVCache(target)
    kv.extend(context[:-1])
    greedy = Sampler(SamplingParams(), torch.Generator())
    drafter = make_drafter("eagle-tree", head=head)
    drafter.prepare(target)
    drafter.attach(kv)
    draft = drafter.propose(context, 6, greedy)
    looked = PromptLookup().propose(context, 6, greedy).tokens
    assert looked and len(draft.tokens) <= 6
    assert draft.tokens == looked and draft.parents is None  # a 12-token match: lookup's draft alone
    short = prompt_ids(12)
    short = short + [short[4]]  # the last token occurred once before: a 1-token match
    kv.rollback(0)
    kv.extend(short[:-1])
    drafter.prepare(target)
    drafter.attach(kv)
    assert PromptLookup().propose(short, 6, greedy).match_length < EagleDrafter.LONG_MATCH
    tree = drafter.propose(short, 6, greedy)
    assert tree.tokens[0] == full_forward_draft(target, head, short)  # the head's chain leads
    # and some root-to-node path spells the start of lookup's draft (it takes up to half the room)
    looked = PromptLookup().propose(short, 6, greedy).tokens
    paths = {}
    for i, (t, p) in enumerate(zip(tree.tokens, tree.parents)):
        paths[i] = (paths[p] if p >= 0 else ()) + (t,)
    assert any(path == tuple(looked[: len(path)]) and len(path) >= min(3, len(looked)) for path in paths.values())
    prompt = prompt_ids() * 2
    plain = generate(target, prompt, None, max_new_tokens=30).tokens
    for k in (3, 6, "auto"):
        assert generate(target, prompt, make_drafter("eagle-tree", head=head), k=k, max_new_tokens=30).tokens == plain


def test_head_file_round_trip_and_errors(target, head, tmp_path):
    path = save_head(head, tmp_path / "h.safetensors", meta={"note": "x"})
    loaded, meta = load_head(path, hidden_size=64)
    assert meta == {"note": "x"} and torch.equal(loaded.vocab_ids, head.vocab_ids)
    for name, p in head.state_dict().items():
        if p.is_floating_point():
            torch.testing.assert_close(loaded.state_dict()[name], p.to(torch.bfloat16).float())
    with pytest.raises(HeadError, match="specdec train"):
        load_head(tmp_path / "missing.safetensors")
    with pytest.raises(HeadError, match="hidden size"):
        load_head(path, hidden_size=128)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(HeadError, match="not a readable draft head"):
        load_head(bad)
    with pytest.raises(ValueError, match="lean backend"):
        EagleDrafter(head).prepare(remake(target, backend="hf", lean=None))
    with pytest.raises(HeadError, match="specdec train"):
        EagleDrafter(cache=tmp_path).prepare(make_model("llama", seed=2, name="no-head-for-this"))


def test_training_prompts_are_distinct_and_deterministic():
    a = training_prompts(100)
    assert a == training_prompts(100) and len(set(a)) == 100 and a != training_prompts(100, seed=1)


def test_train_writes_everything_resumes_and_the_head_drafts(target, tmp_path):
    # the tiny word-level tokenizer knows none of the prompts' words: they become <unk>s, fine here
    out = tmp_path / "run"
    dest = tmp_path / "head.safetensors"
    s = train_head(target, out, TrainConfig(prompts=8, max_new_tokens=6, epochs=2, vocab=40, head_out=dest, batch=4))
    assert [h["epoch"] for h in s["history"]] == [1, 2] and s["sequences"] == 8 and s["steps"] == 3
    assert all(len(h["heldout_acc_by_step"]) == 3 for h in s["history"])
    for name in ("data.json", "checkpoint.pt", "loss.png", "summary.json"):
        assert (out / name).is_file()
    assert json.loads((out / "summary.json").read_text())["history"] == s["history"]
    resumed = train_head(
        target, out, TrainConfig(prompts=8, max_new_tokens=6, epochs=3, vocab=40, head_out=dest, batch=4)
    )
    assert resumed["history"][:2] == s["history"] and len(resumed["history"]) == 3
    fresh = train_head(
        target, out, TrainConfig(prompts=8, max_new_tokens=6, epochs=3, vocab=40, steps=1, head_out=dest, batch=4)
    )
    assert len(fresh["history"][0]["heldout_acc_by_step"]) == 1  # another unroll depth: no resuming
    head, meta = load_head(dest, hidden_size=64)
    assert len(head.vocab_ids) == 40 and meta["epochs"] == 3
    prompt = prompt_ids()
    assert (
        generate(target, prompt, EagleDrafter(dest), k=4, max_new_tokens=20).tokens
        == generate(target, prompt, None, max_new_tokens=20).tokens
    )


def test_sampled_drafts_carry_the_full_vocabulary_distribution(target, head):
    """The head samples among its own vocabulary; the probabilities it hands the rejection rule
    must be a distribution over the target's whole vocabulary, zero outside the head's."""
    drafter = EagleDrafter(head)
    drafter.prepare(target)
    kv = LeanKVCache(target)
    drafter.attach(kv)
    context = prompt_ids(12)
    kv.extend(context[:-1])
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=5), torch.Generator().manual_seed(0))
    draft = drafter.propose(context, 3, sampler)
    assert draft.probs.shape == (3, target.vocab_size)
    torch.testing.assert_close(draft.probs.sum(-1), torch.ones(3))
    outside = torch.ones(target.vocab_size, dtype=torch.bool)
    outside[head.vocab_ids] = False
    assert draft.probs[:, outside].abs().max() == 0 and (draft.probs > 0).sum(-1).le(5).all()
    assert all(draft.probs[i, t] > 0 for i, t in enumerate(draft.tokens))


def test_cache_taps_keep_the_hidden_states_of_the_asked_layers(target):
    """EAGLE-3's fused features: a cache asked to tap layer 0 keeps, after the final feature,
    exactly transformers' hidden state after decoder layer 0, and the final feature is unchanged."""
    context = prompt_ids(10)
    plain, tapped = LeanKVCache(target), LeanKVCache(target, taps=(0,))
    plain.extend(context)
    tapped.extend(context)
    d = target.hf.config.hidden_size
    assert tapped.features.shape[1] == 2 * d
    torch.testing.assert_close(tapped.features[:10, :d], plain.features[:10])
    with torch.no_grad():
        hidden = target.hf(torch.tensor([context]), output_hidden_states=True).hidden_states[1][0]  # after layer 0
    torch.testing.assert_close(tapped.features[:10, d:], hidden, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="empty cache"):
        tapped.tap((1,))
    with pytest.raises(ValueError, match="decoder layers 0..1"):
        LeanKVCache(target, taps=(5,))


def test_a_head_with_taps_fuses_them_drafts_exactly_and_round_trips(target, tmp_path):
    torch.manual_seed(5)
    head = DraftHead.for_target(target, torch.arange(3, 50), taps=[0])
    d = head.config["hidden"]
    feats, embeds = torch.randn(9, 2 * d), torch.randn(9, d)
    with torch.no_grad():
        # at the start fuse passes the final feature through: the taps change nothing yet
        torch.testing.assert_close(head(feats, embeds), head(feats[:, :d], embeds))
        head.fuse.weight.add_(0.05 * torch.randn_like(head.fuse.weight))
        assert not torch.allclose(head(feats, embeds), head(feats[:, :d], embeds), atol=1e-3)
        # unrolled step j (the head's own features fed back, d wide) is what drafting over a cache computes
        outs = head.unrolled(feats, embeds, 3)
        cache = HeadCache(head)
        pred = head(feats[:5], embeds[:5], 0, cache)[-1:]
        for j in (1, 2):
            pred = head(pred, embeds[4 + j][None], 4 + j, cache)
            torch.testing.assert_close(pred[0], outs[j][4 + j], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            head.packed()(feats, embeds, 0, HeadCache(head)), head(feats, embeds), atol=1e-4, rtol=1e-4
        )
    with pytest.raises(HeadError, match="width"):
        head(torch.randn(3, 3 * d), torch.randn(3, d))
    loaded, _ = load_head(save_head(head, tmp_path / "t.safetensors"), hidden_size=d)
    assert loaded.taps == (0,) and loaded.fuse is not None
    drafter = EagleDrafter(loaded)  # the drafter asks the target's cache for the head's taps
    prompt = prompt_ids()
    out = generate(target, prompt, drafter, k=3, max_new_tokens=24)
    assert drafter.kv.taps == (0,) and out.stats.drafted > 0
    assert out.tokens == generate(target, prompt, None, max_new_tokens=24).tokens
    costs = measure_costs(target, drafter, prompt, [1, 2], repeats=1)  # bench attaches before the prompt's forward
    assert drafter.kv.taps == (0,) and set(costs["draft_ms"]) == {"1", "2"}


def test_train_from_an_init_head_keeps_its_vocabulary_and_taps_and_starts_from_its_weights(target, tmp_path):
    start = DraftHead.for_target(target, torch.arange(5, 37), taps=[1])
    with torch.no_grad():
        start.fc.weight.add_(0.01)  # unlike any fresh head
    init = save_head(start, tmp_path / "init.safetensors")
    dest = tmp_path / "head.safetensors"
    s = train_head(
        target,
        tmp_path / "run",
        TrainConfig(prompts=6, max_new_tokens=5, epochs=1, vocab=40, head_out=dest, batch=3, init=init, lr=1e-9),
    )
    head, _ = load_head(dest, hidden_size=64)
    assert s["init"] == str(init) and s["vocab"] == 32 and s["taps"] == [1]
    assert torch.equal(head.vocab_ids, start.vocab_ids) and head.taps == (1,)
    fresh = DraftHead.for_target(target, head.vocab_ids, taps=[1])
    assert torch.allclose(head.fc.weight, load_head(init)[0].fc.weight, atol=1e-5)  # lr ~ 0: the init's weights
    assert not torch.allclose(head.fc.weight, fresh.fc.weight, atol=1e-3)


def test_train_with_taps_reads_the_tapped_layers(target, tmp_path):
    dest = tmp_path / "head.safetensors"
    config = TrainConfig(prompts=6, max_new_tokens=5, epochs=1, vocab=40, head_out=dest, batch=3, taps=(1, 0))
    s = train_head(target, tmp_path / "run", config)
    head, meta = load_head(dest, hidden_size=64)
    assert s["taps"] == [0, 1] and meta["taps"] == [0, 1] and head.taps == (0, 1)
    assert head.fuse.weight.shape == (64, 3 * 64)
    with pytest.raises(ValueError, match="decoder layers"):
        train_head(
            target,
            tmp_path / "run",
            TrainConfig(prompts=6, max_new_tokens=5, epochs=1, vocab=40, head_out=dest, taps=(7,)),
        )


def test_auto_proposes_a_long_lookup_match_even_when_the_heads_trees_do_not_pay(target, head):
    """k="auto" decides whether to draft at all before the drafter runs. eagle-tree proposes a
    lookup match of LONG_MATCH or more tokens alone, so that choice must read the match's own
    estimates (AdaptiveK.plan's match): a policy that has learnt the head's trees are never right
    used to leave a prompt that repeats itself to plain rounds."""
    prompt = [1] + list(range(3, 15)) * 3  # the end of the context matches earlier text 24 tokens long
    plain = generate(target, prompt, None, max_new_tokens=20).tokens
    drafter = EagleDrafter(head, alternatives=1, lookup=True)
    drafter.prepare(target)
    assert drafter.long_match(prompt) >= EagleDrafter.LONG_MATCH
    assert EagleDrafter(head, alternatives=1).long_match(prompt) is None  # no lookup: no match
    ctl = AdaptiveK(VerifyCosts(), k_max=8)
    generate(target, prompt, drafter, k="auto", max_new_tokens=2, policy=ctl)  # times the verify curve
    ctl.estimates.reached = [[0.0] * 8 for _ in ctl.estimates.reached]  # nothing known of lookup's matches
    ctl.estimates.accepted = [[0.0] * 8 for _ in ctl.estimates.accepted]
    ctl.estimates.reached[0] = [1000.0] * 8  # the head's trees (class 0): never right in 1000 rounds
    ctl.learned.probe_interval = ctl.probe_max  # and its probes backed off
    out = generate(target, prompt, drafter, k="auto", max_new_tokens=20, policy=ctl)
    assert out.tokens == plain
    long = range(match_class(EagleDrafter.LONG_MATCH), len(ctl.estimates.reached))
    assert out.stats.drafted > 0 and sum(ctl.estimates.reached[c][0] for c in long) > 0  # learned under its class


def _tiny(arch: str):
    """make_model(arch, seed=1); a qwen2 one with random q/k/v biases (transformers starts them at zero)."""
    model = make_model(arch, seed=1)
    if arch == "qwen2":
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for layer in model.hf.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.copy_(torch.randn(proj.bias.shape, generator=g) * 0.5)
    return model


def _quantized(fp32):
    """fp32's matrices quantized to Q8_0 on the quantized backend, with no transformers model at all
    (anything that reads `.hf` raises)."""
    from specdec.models.quantize import quantize_model

    return remake(fp32, hf=None, lean=None, gguf=quantize_model(fp32.hf, "q8_0", "tiny"), config=fp32.hf.config)


def test_a_qwen2_head_copies_the_targets_qkv_biases_packs_and_round_trips_them(tmp_path):
    qwen = _tiny("qwen2")
    a = qwen.hf.model.layers[-1].self_attn
    head = DraftHead.for_target(qwen, torch.arange(3, 50))
    assert head.config["qkv_bias"] is True and head.qkv.bias.shape == ((4 + 2 * 2) * 16,)
    assert torch.equal(head.qkv.bias, torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]))  # not scaled
    torch.manual_seed(6)
    with torch.no_grad():
        head.o.weight.normal_(0, 0.1)  # for_target starts o at zero: attention (and its biases) would add nothing
    feats, embeds = torch.randn(7, 64), torch.randn(7, 64)
    packed = head.packed()
    assert type(packed.qkv.bias) is torch.Tensor and torch.equal(packed.qkv.bias, head.qkv.bias)
    with torch.no_grad():
        want = head(feats, embeds, 0, HeadCache(head))
        torch.testing.assert_close(packed(feats, embeds, 0, HeadCache(packed)), want, atol=1e-4, rtol=1e-4)
        one_row = packed(feats[:1], embeds[:1], 0, HeadCache(packed))  # a draft step's product: the gemv kernel's
        torch.testing.assert_close(one_row, want[:1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(head.unrolled(feats, embeds, 1)[0], want, atol=1e-5, rtol=1e-5)
        unbiased = head.packed()
        unbiased.qkv.bias = None
        assert not torch.allclose(unbiased(feats, embeds, 0, HeadCache(unbiased)), want, atol=1e-2)  # they matter
    loaded, _ = load_head(save_head(head, tmp_path / "q.safetensors"), hidden_size=64)
    assert loaded.config["qkv_bias"] is True
    torch.testing.assert_close(loaded.qkv.bias, head.qkv.bias.detach().to(torch.bfloat16).float())
    llama = DraftHead.for_target(make_model("llama", seed=1), torch.arange(3, 50))
    assert "qkv_bias" not in llama.config and llama.qkv.bias is None  # Llama heads' files are unchanged


def test_a_head_file_from_before_qkv_bias_loads_without_biases_and_a_mismatched_one_is_refused(tmp_path):
    head = DraftHead.for_target(_tiny("qwen2"), torch.arange(3, 50))
    old = DraftHead({k: v for k, v in head.config.items() if k != "qkv_bias"}, head.vocab_ids)
    loaded, _ = load_head(save_head(old, tmp_path / "old.safetensors"), hidden_size=64)
    assert loaded.qkv.bias is None and "qkv.bias" not in loaded.state_dict()
    from safetensors.torch import load_file, save_file

    path = save_head(head, tmp_path / "new.safetensors")
    tensors = {k: v for k, v in load_file(path).items() if k != "qkv.bias"}
    save_file(tensors, tmp_path / "damaged.safetensors", metadata={"config": json.dumps(head.config)})
    with pytest.raises(HeadError, match="does not hold the weights"):
        load_head(tmp_path / "damaged.safetensors")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_quantized_targets_head_starts_from_its_gguf_tensors_without_its_fp32_model(arch):
    fp32 = _tiny(arch)
    quant = _quantized(fp32)
    head = DraftHead.for_target(quant, torch.arange(3, 50))
    t = quant.gguf.tensors
    gate_up = torch.cat([t["blk.1.ffn_gate.weight"].dequantize(), t["blk.1.ffn_up.weight"].dequantize()])
    assert torch.equal(head.gate_up.weight, gate_up) and not torch.equal(head.gate_up.weight, torch.cat(
        [fp32.hf.model.layers[-1].mlp.gate_proj.weight, fp32.hf.model.layers[-1].mlp.up_proj.weight]
    ))  # fmt: skip
    reference = DraftHead.for_target(fp32, torch.arange(3, 50))
    assert head.config == {**reference.config, "target": quant.name}
    torch.testing.assert_close(head.qkv.weight, reference.qkv.weight, atol=0.02, rtol=0.05)  # the same start, rounded
    if arch == "qwen2":
        assert torch.equal(head.qkv.bias, reference.qkv.bias)  # Q8_0 keeps vectors in fp32
    assert quant._hf is None


def test_training_features_are_the_quantized_forwards():
    from specdec.train.train import features_and_labels

    fp32 = _tiny("qwen2")
    quant = _quantized(fp32)
    rows = [{"prompt": prompt_ids(10, seed=s), "answer": [5, 9, 11, 4]} for s in range(2)]
    for (tokens, feats, labels), row in zip(features_and_labels(quant, rows), rows):
        kv = LeanKVCache(quant)
        logits = kv.extend(row["prompt"] + row["answer"])
        assert torch.equal(feats, kv.features[: len(tokens)]) and torch.equal(labels, logits.argmax(-1))
        ref = LeanKVCache(fp32)
        ref.extend(tokens.tolist())
        assert not torch.equal(feats, ref.features[: len(tokens)].float())  # not the fp32 model's
        torch.testing.assert_close(feats, ref.features[: len(tokens)].float(), atol=0.1, rtol=0.1)  # but close


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_train_at_gguf_precision_never_loads_the_fp32_model_and_the_head_drafts_exactly(arch, tmp_path, monkeypatch):
    quant = _quantized(_tiny(arch))
    prompts = [prompt_ids(10, seed=s) for s in range(8)]
    rows = [{"text": str(i), "prompt": p, "answer": generate(quant, p, None, max_new_tokens=10).tokens}
            for i, p in enumerate(prompts)]  # fmt: skip
    monkeypatch.setattr("specdec.train.train.training_rows", lambda *args, **kwargs: rows)  # answers made above
    dest = tmp_path / "head.safetensors"
    s = train_head(
        quant, tmp_path / "run", TrainConfig(prompts=8, max_new_tokens=10, epochs=1, vocab=40, head_out=dest)
    )
    assert quant._hf is None  # embeddings, output rows, features and the head's start: all from the GGUF model
    head, _ = load_head(dest, hidden_size=64)
    assert len(s["history"]) == 1 and head.config.get("qkv_bias", False) == (arch == "qwen2")
    for ids in (prompt_ids(12, seed=20), prompts[0]):
        plain = generate(quant, ids, None, max_new_tokens=16)
        out = generate(quant, ids, EagleDrafter(head), k=3, max_new_tokens=16)
        assert out.tokens == plain.tokens and out.stats.drafted > 0


def test_train_runs_at_the_models_own_precision_by_default():
    from specdec.cli import _parser

    sub = next(a for a in _parser()._actions if a.dest == "command").choices
    assert sub["train"].parse_args([]).dtype == "auto"
    assert sub["calibrate-skip"].parse_args([]).dtype == "float32"  # calibration stays float32
