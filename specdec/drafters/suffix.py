"""Model-free drafting from a suffix automaton over the prompt, the output so far and, optionally,
earlier outputs (SuffixDecoding: Oliaro et al. 2024, "SuffixDecoding: A Model-Free Approach to
Speeding Up Large Language Model Inference").

Each round the drafter finds the longest suffix of the context that occurred before, in the
context itself or in a corpus of earlier token sequences, and proposes the tokens that followed
it: by default, step by step, the token that followed the match most often (SuffixDecoding's
frequency score), else what followed its most recent occurrence. Unlike prompt lookup the match
is not capped at a few tokens: the longest earlier match is usually the best predictor, and a
long match is found in O(1) from the automaton.

The structure is the suffix automaton of Blumer et al. 1985 ("The smallest automaton recognizing
the subwords of a text"), built online: appending a token costs O(1) amortized, so the drafter
extends it by the tokens committed since its last call instead of rebuilding it.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from specdec.drafters.base import Drafter
from specdec.drafters.draft import Draft
from specdec.drafters.lookup import PromptLookup
from specdec.models.load import Model
from specdec.sampling import Sampler


class SuffixAutomaton:
    """The suffix automaton of one growing token sequence, with occurrence statistics per state.

    A state stands for a set of substrings that end at the same set of positions (their "endpos");
    `length[s]` is the longest of them, `link[s]` the state of the longest suffix that ends at more
    positions, `next[s]` the transitions by token. Each state also keeps `count` (how many positions
    its substrings end at), `recent` (the last such end position) and `prev` (the one before it).

    Appending a token (extend) is O(1) amortized for the automaton (Blumer et al. 1985). Updating
    the statistics walks the suffix links of the new state, which is as long as the number of
    distinct repeated suffixes; it is capped at `max_depth` states, so a long repetition (a model
    looping on one phrase) costs at most max_depth steps per token. States past the cap keep
    slightly stale statistics: `recent`/`prev` are still genuine earlier end positions, only perhaps
    not the latest, so a proposal stays a real earlier continuation.

    Tokens must be ints; negative ints are reserved for document separators (see `add_separator`),
    which never match anything, so no match crosses from one document into another.
    """

    def __init__(self, max_depth: int = 64):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self.tokens: list[int] = []
        self.length = [0]
        self.link = [-1]
        self.next: list[dict[int, int]] = [{}]
        self.count = [0]
        self.recent = [-1]
        self.prev = [-1]
        self.last = 0  # the state of the whole sequence
        self._separators = 0

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def n_states(self) -> int:
        return len(self.length)

    def _new_state(self, length: int, link: int, nxt: dict[int, int], count: int, recent: int, prev: int) -> int:
        self.length.append(length)
        self.link.append(link)
        self.next.append(nxt)
        self.count.append(count)
        self.recent.append(recent)
        self.prev.append(prev)
        return len(self.length) - 1

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens to the sequence, one at a time (O(1) amortized each, plus the capped
        statistics walk)."""
        for token in tokens:
            self._append(int(token))

    def add_separator(self) -> None:
        """Append a fresh negative token that occurs nowhere else: it ends a document."""
        self._separators += 1
        self._append(-self._separators)

    def _append(self, c: int) -> None:
        length, link, nxt = self.length, self.link, self.next
        pos = len(self.tokens)
        self.tokens.append(c)
        cur = self._new_state(length[self.last] + 1, 0, {}, 1, pos, -1)
        p = self.last
        while p != -1 and c not in nxt[p]:
            nxt[p][c] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][c]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:  # split q: the clone holds its substrings up to length[p] + 1
                clone = self._new_state(
                    length[p] + 1, link[q], dict(nxt[q]), self.count[q], self.recent[q], self.prev[q]
                )
                while p != -1 and nxt[p].get(c) == q:
                    nxt[p][c] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur
        # The new end position `pos` joins the endpos of every state on cur's suffix-link path.
        u, depth = link[cur], 0
        while u > 0 and depth < self.max_depth:
            self.count[u] += 1
            self.prev[u], self.recent[u] = self.recent[u], pos
            u, depth = link[u], depth + 1

    def longest_repeat(self) -> tuple[int, int, int]:
        """The longest suffix of the sequence that also ends earlier in it.

        Returns (length, state, end): its length in tokens (0 if none), its state, and the index of
        the last token of its most recent earlier occurrence (-1 if none). O(1)."""
        u = self.link[self.last] if self.tokens else -1
        if u <= 0:
            return 0, 0, -1
        end = self.recent[u] if self.recent[u] != len(self.tokens) - 1 else self.prev[u]
        return self.length[u], u, end

    def step(self, state: int, matched: int, token: int) -> tuple[int, int]:
        """Matching statistics (for a sequence that is not in the automaton): given the state and
        length of the longest suffix of some text that occurs in this sequence, return them after
        `token` is appended to that text. O(1) amortized."""
        while state > 0 and token not in self.next[state]:
            state = self.link[state]
            matched = self.length[state]
        if token in self.next[state]:
            return self.next[state][token], matched + 1
        return 0, 0

    def continuation(self, end: int, k: int) -> list[int]:
        """Up to k tokens that followed position `end` (stopping at a separator). When they run
        into the end of the sequence the draft continues periodically, reading its own tokens: an
        occurrence that overlaps the current suffix predicts the repetition goes on."""
        out: list[int] = []
        n = len(self.tokens)
        for j in range(k):
            i = end + 1 + j
            t = self.tokens[i] if i < n else out[i - n]
            if t < 0:
                break
            out.append(t)
        return out

    def frequent_continuation(self, state: int, k: int) -> list[int]:
        """Up to k tokens walking the automaton from `state`, each time to the token that followed
        the current match most often (ties: the most recently), as SuffixDecoding scores candidate
        continuations by frequency. Where the match has no continuation (it reached the end of the
        text) the walk goes on from its longest shorter suffix that has one."""
        out: list[int] = []
        count, recent, link = self.count, self.recent, self.link
        while len(out) < k and state > 0:
            best, token = -1, -1
            for t, v in self.next[state].items():
                if t >= 0 and (best < 0 or (count[v], recent[v]) > (count[best], recent[best])):
                    best, token = v, t
            if best < 0:
                state = link[state]
                continue
            out.append(token)
            state = best
        return out

    SHORTER = 0.25  # frequent_tree: weight of a one-step shorter match's continuations
    SHORTER_LEVELS = 2  # ... and how many shorter matches are asked

    def frequent_tree(self, state: int, n: int) -> tuple[list[int], list[int]]:
        """Up to n tokens as a tree of continuations of the match at `state` (after SuffixDecoding's
        speculation trees): best first, where a node's score is the product, along its path, of
        how often each token followed the match so far among everything that did; tokens that
        followed only a shorter suffix of the match (SHORTER_LEVELS suffix links down) are
        alternatives too, their scores discounted by SHORTER per level and kept below the best
        continuation of the longest match. So the main chain (each node's first child) is
        frequent_continuation(state, ...). Returns (tokens, parents), parents[i] the index of
        token i's parent, -1 at the top level."""
        count, recent, link, nxt = self.count, self.recent, self.link, self.next
        tokens: list[int] = []
        parents: list[int] = []
        heap: list[tuple] = []

        def offer(state: int, parent: int, score: float) -> None:
            seen: set[int] = set()
            weight = 1.0
            while state > 0 and weight >= self.SHORTER**self.SHORTER_LEVELS:
                kids = [(t, v) for t, v in nxt[state].items() if t >= 0 and t not in seen]
                total = sum(count[v] for _, v in kids)
                for t, v in kids:  # ties as in frequent_continuation: more often, then more recently
                    heapq.heappush(heap, (-score * weight * count[v] / total, -count[v], -recent[v], parent, t, v))
                if kids:  # shorter matches (suffix links) offer further alternatives, discounted
                    # below the best continuation of the longest match, which stays the first child
                    weight *= self.SHORTER * (max(count[v] for _, v in kids) / total if not seen else 1.0)
                    seen.update(t for t, _ in kids)
                state = link[state]  # (with no continuation, end of text: the shorter suffix's at full weight)

        offer(state, -1, 1.0)
        while heap and len(tokens) < n:
            score, _, _, parent, token, child = heapq.heappop(heap)
            tokens.append(token)
            parents.append(parent)
            offer(child, len(tokens) - 1, -score)
        return tokens, parents


def load_corpus(path) -> list[list[int]]:
    """Token sequences for a SuffixDrafter corpus from a JSON file: a list of token-id lists, or
    the data.json that `specdec train` / `specdec distill` write (the target's own answers: each
    row's "answer"). Raises ValueError naming the file when it is neither."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(
            f"cannot read the corpus {path}: {e}; give a JSON list of token-id lists or a data.json "
            "written by `specdec train` / `specdec distill`"
        ) from None
    if isinstance(data, dict) and isinstance(data.get("rows"), list):
        data = [row.get("answer") for row in data["rows"]]
    if not isinstance(data, list) or not all(isinstance(doc, list) for doc in data):
        raise ValueError(f"the corpus {path} is not a list of token-id lists nor a `specdec train` data.json")
    return data


class SuffixDrafter(Drafter):
    """Proposes what followed the longest earlier occurrence of the context's suffix.

    Sources: the context itself (prompt + output so far, in a suffix automaton extended by the
    committed tokens each round), and a corpus of earlier token sequences (`corpus=`, a list of
    token-id lists; with remember=True each generation's output is added to it when the next
    generation starts). The longer match wins; on a tie the context's own (the more recent text).

    min_match: propose nothing when the longest match is shorter (a wrong draft costs a wider
    verify forward). max_depth: cap of the statistics walk per token (see SuffixAutomaton).
    frequent: choose each next token by how often it followed the match so far (SuffixDecoding's
    frequency score; ties: the most recent); False: take what followed the match's most recent
    earlier occurrence. tree: propose a token tree of up to k tokens (frequent_tree: several
    candidates where the match was followed by several tokens) instead of one chain; the engine
    verifies it in one forward on the lean backend under greedy decoding (elsewhere it verifies
    the tree's main chain, which is the chain draft). lookup (trees only): graft prompt lookup's
    draft onto the tree as a branch (Draft.grafted), so that where the most recent short match
    and the longest, most frequent one disagree both are verified.

    A context that does not extend the one seen last (a new generation) resets the context's
    automaton; prepare() does too. Deterministic: Draft.probs is None. Raises ValueError on
    min_match < 1 or a corpus entry that is not a list of non-negative ints.
    """

    def __init__(
        self,
        corpus: Sequence[Sequence[int]] = (),
        remember: bool = False,
        min_match: int = 1,
        max_depth: int = 64,
        frequent: bool = True,
        tree: bool = False,
        lookup: bool = True,
    ):
        if min_match < 1:
            raise ValueError(f"min_match must be >= 1 (tokens of context that must match), got {min_match}")
        self.min_match, self.max_depth, self.frequent, self.remember = min_match, max_depth, frequent, remember
        self.tree = tree
        self.lookup = PromptLookup() if tree and lookup else None
        self.corpus = SuffixAutomaton(max_depth)
        for i, doc in enumerate(corpus):
            self.add_document(doc, what=f"corpus[{i}]")
        self._reset()

    def add_document(self, tokens: Sequence[int], what: str = "document") -> None:
        """Add one earlier token sequence (e.g. an earlier output) to the corpus. O(len(tokens))."""
        if isinstance(tokens, (str, bytes)) or not all(isinstance(t, int) and t >= 0 for t in tokens):
            raise ValueError(
                f"{what} must be a list of token ids (non-negative ints); encode text with the target's tokenizer first"
            )
        if tokens:
            self.corpus.extend(tokens)
            self.corpus.add_separator()
            self._rematch = True  # new states may have split the one the context's match was in

    def _reset(self) -> None:
        self.ctx = SuffixAutomaton(self.max_depth)
        self.prompt_len: int | None = None
        self.corpus_state, self.corpus_match, self._rematch = 0, 0, False

    def fork(self) -> SuffixDrafter:
        """A copy sharing the corpus, with its own context automaton (Drafter.fork). A fork's
        output is not remembered: the corpus learns from generations run through this drafter."""
        other = super().fork()
        other._reset()
        other.remember = False
        return other

    def prepare(self, target: Model | None) -> None:
        """Start a new generation: remember the last one's output when remember=True, then reset."""
        if self.remember and self.prompt_len is not None:
            self.add_document(self.ctx.tokens[self.prompt_len :])
        self._reset()

    def _observe(self, context: list[int]) -> None:
        """Bring the automaton up to `context`: extend it by the new tokens, or rebuild when the
        context does not extend what it holds (a new generation). The extension check compares
        the held prefix (a C-speed list comparison); the automaton work is O(new tokens)."""
        seen = self.ctx.tokens
        if len(context) < len(seen) or context[: len(seen)] != seen:
            self._reset()
            seen = self.ctx.tokens
        if self.prompt_len is None:
            self.prompt_len = len(context)
        new = context[len(seen) :]
        self.ctx.extend(new)
        if self.corpus.tokens:
            state, matched = self.corpus_state, self.corpus_match
            if self._rematch:
                state, matched, new, self._rematch = 0, 0, context, False
            for t in new:
                state, matched = self.corpus.step(state, matched, t)
            self.corpus_state, self.corpus_match = state, matched

    def propose(self, context: list[int], k: int, sampler: Sampler | None = None) -> Draft:
        """Up to k tokens after `context` (prompt + committed output), or none when no suffix of at
        least min_match tokens occurred before. Draft.match_length: the matched suffix's length in
        tokens (the adaptive draft length learns acceptance per match length)."""
        self._observe(context)
        if k <= 0:
            return Draft([])
        length, state, end = self.ctx.longest_repeat()
        source = self.ctx
        if self.corpus_match > length:
            length, state, source = self.corpus_match, self.corpus_state, self.corpus
            end = self.corpus.recent[state]
        if length < self.min_match or end < 0:
            return Draft([])
        if self.tree:
            tokens, parents = source.frequent_tree(state, k)
            draft = Draft(tokens, match_length=length, parents=parents)
            return draft.grafted(self.lookup.propose(context, k, sampler).tokens, k) if self.lookup else draft
        tokens = source.frequent_continuation(state, k) if self.frequent else source.continuation(end, k)
        return Draft(tokens, match_length=length)
