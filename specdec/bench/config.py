"""What one bench run is asked for, as values: the pairs (Pair) and the settings (BenchConfig), built
once at the edge (specdec.commands.bench, or a test) and passed down unchanged."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

QUICK_CATEGORIES = ["summarization", "translation", "qa", "math_reasoning", "writing"]


@dataclass(frozen=True)
class Pair:
    """target and drafter names as the CLI takes them; draft is the draft model for `model`."""

    target: str
    drafter: str = "prompt-lookup"
    draft: str | None = None

    @classmethod
    def parse(cls, text: str) -> Pair:
        """`target[:drafter[:draft]]`, e.g. `qwen2.5-coder-1.5b:model:qwen2.5-coder-0.5b`; for
        `layer-skip` the third part is the layers to keep, e.g. `smollm2-135m:layer-skip:0-9,12`; for
        `eagle` and `eagle-tree` a draft head file (default: the target's stored head); for `suffix` and
        `suffix-tree` a corpus file (drafters.suffix.load_corpus)."""
        parts = text.split(":")
        if not 1 <= len(parts) <= 3 or (len(parts) > 1 and parts[1] == "model" and len(parts) != 3):
            raise ValueError(f"--pair {text!r}: use TARGET[:DRAFTER[:DRAFT]], DRAFT required for the model drafter")
        return cls(*parts)


@dataclass(frozen=True)
class BenchConfig:
    """One bench run's settings (specdec.bench.run.run_bench); checked by run_bench, not here.

    pairs: the (target, drafter) pairs, benched one after another.
    workload: the workload's name, for the records.
    ks: draft lengths, each an int >= 1 or "auto"; plain decoding (k = 0) always runs too.
    max_new_tokens: new tokens per generation. temperature: 0 greedy (outputs checked token for
    token against plain decoding), else sampling.
    peers: the peers' names (specdec.bench.peer_rows), run on the same prompt ids; peer_k: the draft
    length of those that speculate.
    repeats: generations per prompt and config (plain, each k); a prompt's speed per config is its
    median run's.
    replay: also replay every config on the plain output under the measured costs, where possible
    (specdec.bench.replay). interleave: a repeat runs its configs together, round by round
    (measure.run_all), each with a drafter of its own; else one after another, the order rotated.
    quick, limit: recorded in the settings (the command's --quick and prompts per category).
    progress: show progress bars.
    load: load_model's keyword arguments (dtype, device, cache, backend, quantize, ...).
    draft_dtype: a draft model's dtype (None: load's). draft_quantize: the GGUF type a draft is
    requantized to at load (None: chosen by measurement, specdec.drafters.precision; "none": its own
    precision), or a head's type. draft_vocab: the drafter's
    vocabulary size (specdec.drafters.vocab; None: its own).
    """

    pairs: tuple[Pair, ...]
    workload: str
    ks: tuple[int | str, ...]
    max_new_tokens: int
    temperature: float = 0.0
    peers: tuple[str, ...] = ()
    peer_k: int = 4
    repeats: int = 1
    replay: bool = True
    interleave: bool = True
    quick: bool = False
    limit: int | None = None
    progress: bool = True
    load: dict = field(default_factory=dict)
    draft_dtype: torch.dtype | None = None
    draft_quantize: str | None = None
    draft_vocab: int | None = None

    @property
    def greedy(self) -> bool:
        """Temperature 0: greedy decoding."""
        return self.temperature == 0

    @property
    def run(self) -> dict:
        """generate's keyword arguments for one generation: max_new_tokens, temperature, seed 0."""
        return dict(max_new_tokens=self.max_new_tokens, temperature=self.temperature, seed=0)
