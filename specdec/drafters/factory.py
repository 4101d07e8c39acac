"""Building drafters by name: the registry used by the Python API, and one factory from options
that cli, bench and serve share."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

from specdec.drafters.base import Drafter
from specdec.drafters.eagle import EagleDrafter
from specdec.drafters.layerskip import LayerSkipDrafter
from specdec.drafters.lookup import PromptLookup
from specdec.drafters.model import ModelDrafter
from specdec.drafters.random import RandomDrafter
from specdec.drafters.suffix import SuffixDrafter, load_corpus


@dataclass(frozen=True)
class Entry:
    """A registered drafter: `make` builds it; `options`, the options of drafter_from_options it
    takes; `required`, those it cannot do without; `main`, the option a one-word source fills (the
    DRAFT of `specdec bench --pair TARGET:DRAFTER:DRAFT`), None where it has none."""

    make: Callable[..., Drafter]
    options: tuple[str, ...] = ()
    required: tuple[str, ...] = ()
    main: str | None = None


REGISTERED: dict[str, Entry] = {
    "prompt-lookup": Entry(PromptLookup, ("max_ngram", "min_ngram")),
    "model": Entry(ModelDrafter, ("draft", "vocab"), required=("draft",), main="draft"),
    "model-lookup": Entry(partial(ModelDrafter, lookup=True), ("draft", "vocab"), required=("draft",), main="draft"),
    "random": Entry(RandomDrafter),
    "suffix": Entry(SuffixDrafter, ("corpus", "min_match"), main="corpus"),
    "suffix-tree": Entry(partial(SuffixDrafter, tree=True), ("corpus", "min_match"), main="corpus"),
    "layer-skip": Entry(LayerSkipDrafter, ("layers", "cache"), main="layers"),
    "eagle": Entry(EagleDrafter, ("head", "cache", "quantize", "vocab"), main="head"),
    "eagle-tree": Entry(
        partial(EagleDrafter, alternatives=1, lookup=True), ("head", "cache", "quantize", "vocab"), main="head"
    ),
}
DRAFTERS: dict[str, Callable[..., Drafter]] = {name: entry.make for name, entry in REGISTERED.items()}

# Each option's command-line flag and what it is, for the error messages.
_FLAGS: dict[str, tuple[str, str]] = {
    "draft": ("--draft MODEL", "a draft model"),
    "layers": ("--layers", "the decoder layers to keep"),
    "head": ("--head", "a draft head file"),
    "corpus": ("--corpus", "a corpus"),
    "cache": ("--cache-dir", "the specdec cache folder"),
    "quantize": ("--draft-quantize", "the draft head's quantization type"),
    "vocab": ("--draft-vocab", "the draft's vocabulary size"),
    "max_ngram": ("--max-ngram", "the longest n-gram"),
    "min_ngram": ("--min-ngram", "the shortest n-gram"),
    "min_match": ("--min-match", "the shortest match"),
}


def make_drafter(name: str, **kwargs) -> Drafter:
    """Build the drafter registered as `name` with its keyword arguments, e.g.
    make_drafter("prompt-lookup", max_ngram=3) or make_drafter("model", draft="qwen2.5-coder-0.5b").
    Raises ValueError for an unknown name, listing the known ones."""
    _known(name)
    return DRAFTERS[name](**kwargs)


def options_for(name: str, settings: Mapping[str, object]) -> dict:
    """The options in `settings` that drafter `name` takes and that are set (not None): for a
    caller holding settings for every drafter (the CLI's flags, a server's), which each drafter
    reads only where they apply. Raises ValueError for an unknown name."""
    _known(name)
    return {o: v for o, v in settings.items() if o in REGISTERED[name].options and v is not None}


def check_options(name: str, **options) -> None:
    """drafter_from_options' checks without building anything (the CLI runs them before loading
    any model): raises ValueError for an unknown name, an option (not None) that drafter `name`
    does not take, or a required one that is missing."""
    _known(name)
    for option, value in options.items():
        if value is None:
            continue
        if option not in _FLAGS:
            raise ValueError(f"unknown drafter option {option!r}; known: {', '.join(_FLAGS)}")
        takes_options = REGISTERED[name].options
        if option not in takes_options:
            takes = f"it takes {', '.join(takes_options)}" if takes_options else "it takes none"
            flag = _FLAGS[option][0]
            raise ValueError(f"the {name} drafter takes no {option} option ({flag}); {takes}")
    for option in REGISTERED[name].required:
        if options.get(option) is None:
            flag, what = _FLAGS[option]
            raise ValueError(f"the {name} drafter needs {what}: pass {flag}")


def drafter_from_options(name: str, **options) -> Drafter:
    """Build drafter `name` (a key of DRAFTERS) from the options the CLI, bench and serve offer.

    None means not given: the drafter's default. Which drafter takes which option, and which it
    cannot do without, is its REGISTERED entry.
    - draft (model, required): the draft model, a loaded Model or a spec for load_model.
    - layers (layer-skip): the decoder layers to keep, a list or "0-9,12"; default: the target's
      stored calibration.
    - head (eagle, eagle-tree): a draft head file or a DraftHead; default: the target's stored head.
    - corpus (suffix, suffix-tree): earlier outputs to match too, a file path (load_corpus: a JSON
      list of token-id lists or a `specdec train` data.json) or a list of token-id lists.
    - cache (layer-skip, eagle, eagle-tree): the specdec cache folder where the stored
      calibration or head is looked up; default: the usual cache.
    - quantize (eagle, eagle-tree): the GGUF type the head's matrices run in against a quantized
      target (specdec.drafters.quant_head; default q8_0). A draft model's is a load option
      (load_model's quantize), not this one.
    - vocab (model, eagle, eagle-tree): draft over only the `vocab` most frequent tokens
      (specdec.drafters.vocab); default: a draft model's whole vocabulary, a head's own.
    - max_ngram, min_ngram (prompt-lookup): the longest and shortest n-gram to match (3, 1).
    - min_match (suffix, suffix-tree): propose nothing below this match length (1).

    Raises ValueError for an unknown name, an unknown option, an option given to a drafter that does
    not take it, a missing required option (e.g. "the model drafter needs a draft model: pass --draft MODEL"),
    or, from the drafter itself, a bad value (min_ngram > max_ngram, an unreadable corpus, ...).
    """
    check_options(name, **options)
    if isinstance(options.get("corpus"), (str, os.PathLike)):
        options["corpus"] = load_corpus(options["corpus"])
    return DRAFTERS[name](**{o: v for o, v in options.items() if v is not None})


def _known(name: str) -> None:
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {name!r}; known: {', '.join(DRAFTERS)}")
