"""Tree verification: a token tree scored in one forward under a tree attention mask, the
longest path the target agrees with kept, and the cache compacted to it."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdec import generate
from specdec.backends.lean import tree_layout
from specdec.cache import LeanKVCache
from specdec.drafters import Draft, SuffixDrafter
from specdec.drafters.base import Drafter
from specdec.drafters.suffix import SuffixAutomaton
from specdec.rejection import verify_tree_greedy

from .conftest import VOCAB, make_model, prompt_ids, remake

TOL = dict(rtol=1e-4, atol=1e-4)
# node:      0   1   2   3   4   5   6
PARENTS = [-1, 0, 0, 1, 1, 3, 2]  # 0 -> {1, 2}, 1 -> {3, 4}, 3 -> 5, 2 -> 6


def path_to(node: int, parents: list[int]) -> list[int]:
    out = [node]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out[::-1]


def test_tree_layout_positions_and_mask():
    positions, mask = tree_layout(PARENTS, start=5)
    assert positions.tolist() == [5, 6, 6, 7, 7, 8, 7]
    assert mask.shape == (7, 12) and mask[:, :5].all()
    for i in range(7):
        assert sorted(torch.nonzero(mask[i, 5:]).flatten().tolist()) == sorted(path_to(i, PARENTS))
    for bad in ([], [0], [-1, 1], [-1, 0, 3, 0], [-1, -1]):
        with pytest.raises(ValueError, match="tree"):
            tree_layout(bad, start=0)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    m = make_model(request.param, seed=5)
    assert m.backend == "lean"
    return m


def test_every_node_scores_as_its_path_would(model):
    prompt = prompt_ids(14)
    tree = [prompt[-1], 10, 11, 12, 13, 14, 15]
    kv = LeanKVCache(model, capacity=8)  # small: the tree forward must grow it
    kv.extend(prompt[:-1])
    logits = kv.extend(tree, parents=PARENTS)
    for node in range(len(tree)):
        ref = LeanKVCache(model)
        ref.extend(prompt[:-1])
        chain = ref.extend([tree[i] for i in path_to(node, PARENTS)])
        torch.testing.assert_close(logits[node], chain[-1], **TOL)


@pytest.mark.parametrize("node", [0, 4, 5, 6])
def test_keep_path_leaves_the_cache_as_if_the_path_had_been_fed(model, node):
    prompt = prompt_ids(14)
    tree = [prompt[-1], 10, 11, 12, 13, 14, 15]
    path = path_to(node, PARENTS)
    kv, ref = LeanKVCache(model), LeanKVCache(model)
    for c in (kv, ref):
        c.extend(prompt[:-1])
    kv.extend(tree, parents=PARENTS)
    kv.keep_path(len(prompt) - 1, path)
    ref.extend([tree[i] for i in path])
    assert kv.tokens == ref.tokens
    n = len(kv)
    torch.testing.assert_close(kv.features[:n], ref.features[:n], **TOL)
    torch.testing.assert_close(kv.extend([20, 21]), ref.extend([20, 21]), **TOL)
    with pytest.raises(ValueError, match="path"):
        kv.keep_path(len(prompt) - 1, [1, 3])


def logits_choosing(choices: list[int], vocab: int = 40) -> torch.Tensor:
    out = torch.zeros(len(choices), vocab)
    out[torch.arange(len(choices)), torch.tensor(choices)] = 1.0
    return out


def test_verify_tree_greedy_follows_the_argmax_into_any_branch():
    tree = [9, 1, 2, 3, 4, 5, 6]
    # root picks 2 (node 2, the second branch), node 2 picks 6 (node 6, a leaf): bonus from node 6
    verdict, path = verify_tree_greedy(tree, PARENTS, logits_choosing([2, 0, 6, 0, 0, 0, 33]))
    assert path == [0, 2, 6] and (verdict.n_accepted, verdict.token, verdict.bonus) == (2, 33, True)
    # root picks 1, node 1 picks 7, which neither child (3, 4) holds: recovered token 7
    verdict, path = verify_tree_greedy(tree, PARENTS, logits_choosing([1, 7, 0, 0, 0, 0, 0]))
    assert path == [0, 1] and (verdict.n_accepted, verdict.token, verdict.bonus) == (1, 7, False)
    verdict, path = verify_tree_greedy(tree, PARENTS, logits_choosing([30, 0, 0, 0, 0, 0, 0]))
    assert path == [0] and (verdict.n_accepted, verdict.token, verdict.bonus) == (0, 30, False)
    with pytest.raises(ValueError, match="one parent and one target row"):
        verify_tree_greedy(tree, PARENTS, logits_choosing([1, 2]))


def test_draft_chain_depths_and_pruning():
    d = Draft([10, 11, 12, 13, 14, 15], parents=[-1, -1, 0, 0, 2, 1])
    assert d.depths() == [1, 1, 2, 2, 3, 2]
    assert d.chain().tokens == [10, 12, 14] and d.chain().parents is None
    p = d.pruned(2, vocab=100)
    assert (p.tokens, p.parents) == ([10, 11, 12, 13, 15], [-1, -1, 0, 0, 1])
    p = d.pruned(3, vocab=12)  # 12.. out of vocabulary: they and their subtrees go
    assert (p.tokens, p.parents) == ([10, 11], [-1, -1])
    p = d.pruned(3, vocab=100, max_tokens=3)
    assert (p.tokens, p.parents) == ([10, 11, 12], [-1, -1, 0])
    assert Draft([5, 6]).depths() == [1, 2] and Draft([5, 6]).chain().tokens == [5, 6]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=2, max_size=60), st.integers(1, 12))
def test_frequent_tree_is_a_tree_whose_main_chain_is_the_frequent_continuation(seq, n):
    sa = SuffixAutomaton()
    sa.extend(seq)
    length, state, end = sa.longest_repeat()
    tokens, parents = sa.frequent_tree(state, n)
    assert len(tokens) == len(parents) <= n
    assert all(-1 <= p < i for i, p in enumerate(parents))
    siblings = {}
    for t, p in zip(tokens, parents):
        assert t not in siblings.setdefault(p, set())  # no duplicate children
        siblings[p].add(t)
    chain = Draft(tokens, parents=parents).chain().tokens
    assert chain == sa.frequent_continuation(state, len(chain))
    if state > 0:
        assert tokens  # a match always offers something


def test_grafted_adds_another_guess_as_a_branch_within_the_size():
    d = Draft([5, 6, 7, 8], parents=[-1, 0, 1, 0])  # 5 -> 6 -> 7, 5 -> 8
    g = d.grafted([5, 8, 9], max_tokens=5)  # follows 5 -> 8, then 9 is new: the free room
    assert (g.tokens, g.parents) == ([5, 6, 7, 8, 9], [-1, 0, 1, 0, 3])
    assert d.grafted([5, 6, 7], max_tokens=4) is d  # nothing new
    g = d.grafted([1, 2, 3], max_tokens=4)  # no room: half of it, from the tree's last nodes
    assert (g.tokens, g.parents) == ([5, 6, 1, 2], [-1, 0, -1, 2])
    g = d.grafted([5, 8, 1, 2, 3], max_tokens=4)  # the graft point (8, node 3) would go: graft at 5
    assert (g.tokens, g.parents) == ([5, 6, 8, 1], [-1, 0, 0, 2])
    assert g.chain().tokens == [5, 6] and g.depths() == [1, 2, 2, 3]  # the main chain lost its tail


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=40), st.lists(st.integers(0, 3), max_size=10), st.integers(1, 10)
)
def test_grafted_is_a_tree_holding_the_guess_and_the_trees_best_nodes(seq, chain, n):
    sa = SuffixAutomaton()
    sa.extend(seq)
    tokens, parents = sa.frequent_tree(sa.longest_repeat()[1], n)
    tree = Draft(tokens, parents=parents)
    g = tree.grafted(chain, n)
    assert len(g.tokens) <= n and all(-1 <= p < i for i, p in enumerate(g.parents))
    kept = next(
        (i for i in range(len(g.tokens)) if i >= len(tokens) or g.tokens[i] != tokens[i] or g.parents[i] != parents[i]),
        len(g.tokens),
    )
    assert kept >= min(len(tokens), (n + 1) // 2)  # the tree's first nodes stay, in order
    node, covered = -1, 0  # the guess's first tokens form a path from the top
    for t in chain:
        nxt = next((i for i, (u, p) in enumerate(zip(g.tokens, g.parents)) if u == t and p == node), None)
        if nxt is None:
            break
        node, covered = nxt, covered + 1
    assert covered >= min(len(chain), n // 2)


class OracleTree(Drafter):
    """A tree drafter that knows the target's greedy output: each round its first branch is a
    decoy and its second the truth, so every accepted token comes off the main chain."""

    def __init__(self, reference: list[int], prompt_len: int):
        self.reference, self.prompt_len = reference, prompt_len

    def prepare(self, target):
        pass

    def propose(self, context, k, sampler):
        done = len(context) - self.prompt_len
        truth = self.reference[done : done + max(k // 2, 1)]
        decoy = [(t + 1) % VOCAB for t in truth]
        tokens = decoy + truth
        parents = [i - 1 for i in range(len(decoy))] + [-1 if i == 0 else len(decoy) + i - 1 for i in range(len(truth))]
        return Draft(tokens[:k], parents=parents[:k])


@pytest.mark.parametrize("k", [1, 4, 6, "auto"])
def test_tree_drafts_keep_greedy_output_identical(model, k):
    prompt = prompt_ids(12)
    plain = generate(model, prompt, None, max_new_tokens=40)
    run = generate(model, prompt, OracleTree(plain.tokens, len(prompt)), k=k, max_new_tokens=40)
    assert run.tokens == plain.tokens
    if k in (4, 6):  # the true branch fits: several tokens a round, all from the second branch
        assert run.stats.tau > 2.5


def test_off_the_lean_path_or_when_sampling_only_the_main_chain_is_verified(model):
    prompt = prompt_ids(12)
    plain = generate(model, prompt, None, max_new_tokens=30)
    hf = remake(model, backend="hf", lean=None)
    run = generate(hf, prompt, OracleTree(plain.tokens, len(prompt)), k=6, max_new_tokens=30)
    assert run.tokens == generate(hf, prompt, None, max_new_tokens=30).tokens
    assert run.stats.accepted == 0  # the decoy chain only
    assert max(run.stats.k_per_round) == 3  # 3 chain tokens verified a round, not the 6-node tree
    a = generate(model, prompt, OracleTree(plain.tokens, len(prompt)), k=6, max_new_tokens=30, temperature=1.0, seed=3)
    b = generate(model, prompt, OracleTree(plain.tokens, len(prompt)), k=6, max_new_tokens=30, temperature=1.0, seed=3)
    assert a.tokens == b.tokens and len(a.tokens) == 30
    assert max(a.stats.k_per_round) <= 3  # sampling: the main chain only


@pytest.mark.parametrize("k", [4, 8, "auto"])
def test_suffix_tree_drafter_keeps_greedy_output_identical(model, k):
    rng = random.Random(0)
    phrase = [rng.randrange(3, VOCAB) for _ in range(6)]
    prompt = [1] + phrase + [rng.randrange(3, VOCAB)] + phrase[:3] + [rng.randrange(3, VOCAB)] + phrase[:2]
    plain = generate(model, prompt, None, max_new_tokens=40)
    run = generate(model, prompt, SuffixDrafter(tree=True), k=k, max_new_tokens=40)
    assert run.tokens == plain.tokens
    assert run.stats.drafted > 0
