"""A pair's models as the bench loads them: each load measured in resident memory
(specdec.bench.memory), a maker of the pair's drafters, and the prompts' token ids."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from specdec.bench.config import BenchConfig, Pair
from specdec.bench.memory import footprint, rss_bytes
from specdec.bench.workloads import Prompt
from specdec.cache import new_cache
from specdec.drafters import Drafter
from specdec.drafters.factory import REGISTERED, drafter_from_options, options_for
from specdec.drafters.precision import draft_quantize
from specdec.models.load import Model, load_model


@dataclass(frozen=True)
class Models:
    """A pair's models as loaded (load_pair). memory, draft_memory: each load's resident memory
    (memory.footprint; draft_memory None without a draft model). new_drafter: a fresh drafter per
    call (drafters keep per-generation state)."""

    target: Model
    memory: dict
    new_drafter: Callable[[], Drafter]
    draft_model: Model | None
    draft_memory: dict | None


def load_pair(pair: Pair, config: BenchConfig) -> Models:
    """The pair's target (config.load), and its drafters' maker with their draft model if any
    (_drafters). Raises what load_model and the drafter's options raise (e.g. ValueError, OSError)."""
    target, memory = load_measured(pair.target, config.greedy, **config.load)
    new_drafter, draft_model, draft_memory = _drafters(pair, config, target)
    return Models(target, memory, new_drafter, draft_model, draft_memory)


def load_measured(spec: str, greedy: bool = True, **load_kwargs) -> tuple[Model, dict]:
    """load_model(spec, **load_kwargs) and the resident memory it took (specdec.bench.memory.footprint):
    measured after the backend's weights are built and a warm-up forward over one token (the BOS
    token, else id 0) has read every matrix (a GGUF model's memory map counts only once touched), its
    KV cache freed again. greedy: warm up greedy's forward (a lean fp32 model builds its bf16 screen
    of the output layer for it)."""
    before = rss_bytes()
    model = load_model(spec, **load_kwargs)
    kv = new_cache(model)
    kv.argmax_only = greedy
    kv.extend([getattr(model.config, "bos_token_id", None) or 0], all_logits=False)
    del kv
    return model, footprint(before, model.gguf)


def _drafters(
    pair: Pair, config: BenchConfig, target: Model
) -> tuple[Callable[[], Drafter], Model | None, dict | None]:
    """A maker of the pair's drafters (one per config when interleaved: drafters keep per-generation
    state), and its draft model with its load's resident memory (None, None without one). The pair's
    third part fills its drafter's main option (its REGISTERED entry's `main`): a draft model (loaded
    once, here, in config.draft_dtype, else config.load's dtype, else its own precision, quantized to
    config.draft_quantize, else as specdec.drafters.precision chooses for this target; the peers use
    it too), a corpus file, layers or a head file."""
    load_kwargs = {**config.load, "quantize": config.draft_quantize}
    main = REGISTERED[pair.drafter].main if pair.drafter in REGISTERED else None
    source = pair.draft if main else None
    draft_model, draft_memory = None, None
    if source and main == "draft":
        dtype = config.draft_dtype or load_kwargs.get("dtype")  # None: the draft's own precision (load_model)
        draft_kwargs = {**load_kwargs, "dtype": dtype}
        draft_kwargs["quantize"] = draft_quantize(target, source, draft_kwargs)  # measured where not given
        source, draft_memory = load_measured(source, config.greedy, **draft_kwargs)
        draft_model = source
    settings = {"cache": load_kwargs.get("cache"), "quantize": load_kwargs.get("quantize"), "vocab": config.draft_vocab}
    options = options_for(pair.drafter, {**settings, **({main: source} if main else {})})
    return functools.partial(drafter_from_options, pair.drafter, **options), draft_model, draft_memory


def encode_prompt(model: Model, prompt: Prompt) -> list[int]:
    """A workload prompt's token ids: in the model's chat template when the prompt is conversational
    and the model has one."""
    return model.encode(prompt.text, chat=prompt.chat and bool(getattr(model.tokenizer, "chat_template", None)))
