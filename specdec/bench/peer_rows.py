"""The peers' runs of one pair (specdec.bench.peers, specdec.bench.llama_server) on the same prompt
ids, each a `peers[i]` row of the pair's record (results.PeerRun) with its output held against ours."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.bench.config import BenchConfig, Pair
from specdec.bench.llama_server import llama_server_generate
from specdec.bench.loading import Models
from specdec.bench.memory import MB
from specdec.bench.peers import PeerRun as Generated
from specdec.bench.peers import hf_generate, llama_cpp_generate
from specdec.bench.results import PeerRun
from specdec.bench.workloads import Prompt
from specdec.cache import common_prefix
from specdec.models.load import Model, gguf_file_of
from specdec.models.weights import cache_dir

DRAFT_PEERS = ("hf-assisted", "llama-server-draft")  # peers that run the pair's draft model: model pairs only


@dataclass(frozen=True)
class PeerRuns:
    """What one pair's peer runs share: the pair, the run's config, its loaded models, and n_ctx,
    the context llama.cpp allocates (of_pair)."""

    pair: Pair
    config: BenchConfig
    models: Models
    n_ctx: int

    @classmethod
    def of_pair(cls, pair: Pair, config: BenchConfig, models: Models, encoded: list[list[int]]) -> PeerRuns:
        """n_ctx: llama.cpp allocates its whole KV cache up front: room for the longest prompt and
        its output, in steps of 256 tokens, at most the target's context."""
        need = max(map(len, encoded)) + config.max_new_tokens + config.peer_k + 16
        return cls(pair, config, models, min(models.target.n_ctx, -(-need // 256) * 256))

    def runs(self, name: str, prompt: Prompt) -> bool:
        """Whether peer `name` runs `prompt`: not under a JSON schema (the peers run no grammar), and
        a peer of DRAFT_PEERS only with a draft model."""
        return not prompt.schema and (self.models.draft_model is not None or name not in DRAFT_PEERS)

    def row(self, name: str, prompt_id: str, ids: list[int], plain: list[int]) -> dict:
        """One peer's run of one prompt as a `peers[i]` row (results.PeerRun), its output held against
        ours (plain: our plain decoding's tokens). A peer that fails gives a row with its error and NaN
        tokens/s: a result to report, not a reason to stop."""
        try:
            peer, weights, same_weights = self._generate(name, ids)
            greedy = self.config.greedy
            return {
                "name": name,
                "prompt_id": prompt_id,
                "tokens_per_s": peer.tokens_per_s,
                "decode_tokens_per_s": peer.decode_tokens_per_s,
                "identical": peer.tokens == plain if greedy else None,
                "agreement": _agreement(peer.tokens, plain) if greedy else None,
                "weights": weights,
                "same_weights": same_weights,
                "rss_growth_mb": None if peer.rss_growth_bytes is None else peer.rss_growth_bytes / MB,
                "n_ctx": peer.n_ctx,
                "error": None,
            }
        except Exception as e:  # a peer failing is a result to report, not a reason to stop
            error = f"{type(e).__name__}: {e}"
            return {
                **dict.fromkeys(PeerRun.model_fields),
                "name": name,
                "prompt_id": prompt_id,
                "tokens_per_s": float("nan"),
                "error": error,
            }

    def _generate(self, name: str, ids: list[int]) -> tuple[Generated, str, bool]:
        """Peer `name`'s generation from ids, the weights it ran (a precision) and whether they are the
        ones our target runs."""
        target, cache = self.models.target, self.config.load.get("cache")
        max_new, k = self.config.max_new_tokens, self.config.peer_k
        if name.startswith("llama-server"):  # llama.cpp as users serve it, its own speculation included
            gguf = _gguf_of(target, self.pair.target, cache)
            draft = self.models.draft_model
            draft_gguf = _gguf_of(draft, self.pair.draft, cache) if draft is not None else None
            threads = torch.get_num_threads()
            peer = llama_server_generate(
                name, gguf, ids, max_new, threads, n_ctx=self.n_ctx, draft_gguf=draft_gguf, k=k
            )
        elif name.startswith("llama-cpp"):
            gguf = _gguf_of(target, self.pair.target, cache)
            lookup = k if name == "llama-cpp-lookup" else 0
            peer = llama_cpp_generate(gguf, ids, max_new, target.eos_token_ids, n_ctx=self.n_ctx, k=lookup)
        else:
            peer = hf_generate(name, target, ids, max_new, draft=self.models.draft_model, k=k)
            # transformers runs the model object's fp32 (or bf16) weights: a GGUF model's dequantization
            return peer, str(target.hf.dtype).removeprefix("torch."), target.gguf is None
        weights = target.precision if target.gguf is not None else _gguf_precision(gguf)
        return peer, weights, target.gguf is not None


def _agreement(peer: list[int], plain: list[int]) -> float:
    """The share of our plain greedy output a peer reproduced before its first differing token (1.0:
    the same tokens; both empty: 1.0)."""
    longest = max(len(peer), len(plain))
    return common_prefix(peer, plain) / longest if longest else 1.0


def _gguf_of(model: Model, spec: str, cache) -> str:
    """The GGUF file behind a model, for the llama.cpp peer: the one a GGUF model runs from (at its own
    precision), else the file of a registry name or a .gguf path (dequantized here: --dtype float32,
    or requantized at load: a draft's chosen precision, specdec.drafters.precision).
    Raises ValueError for a model with no GGUF file."""
    if model.gguf is not None and Path(model.gguf.path).is_file():
        return str(model.gguf.path)
    source = gguf_file_of(spec, cache_dir(cache))
    if source is not None:
        return str(source)
    raise ValueError(f"the llama.cpp peer needs a GGUF target (a registry name or a .gguf file), not {spec!r}")


@functools.cache
def _gguf_precision(path: str) -> str:
    """The GGML types of a GGUF file's matrices, as Model.precision names them ("gguf Q4_1+Q8_0"); read
    once per file, not once per prompt."""
    from specdec.models.gguf import read_gguf

    return read_gguf(Path(path)).precision
