"""GenerationOptions: what one generation is asked for (draft length, budget, sampling, stop rules,
penalties, logprobs), validated once, in one place, and passed as one value from the edges (CLI,
server, bench) to the Sequence that runs it. specdec.engine.generate keeps its keyword arguments
and builds one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace

from specdec.grammar import Grammar
from specdec.sampling import Penalties, SamplingParams

AUTO_K_MAX = 8  # the longest draft k = "auto" chooses by default
MAX_TOP_LOGPROBS = 20  # as OpenAI's API


def parse_k(value: int | str) -> int | str:
    """A draft length: an integer >= 0 (0 = plain decoding), or "auto" (chosen every round by
    specdec.adaptive). Takes the command line's text too ("4", "auto"). Returns the int or "auto".
    Raises ValueError naming the value otherwise (a bool, a negative number, other text)."""
    k = value
    if isinstance(value, str):
        text = value.strip()
        if text == "auto":
            return "auto"
        k = int(text) if text.isdigit() else None
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"k (draft length) must be >= 0 (a whole number; 0 = plain decoding) or 'auto', got {value!r}")
    return k


@dataclass(frozen=True)
class GenerationOptions:
    """One generation's options, checked when made.

    k: the draft length per round, an int >= 0 (0 = plain decoding) or "auto" (chosen every round
    up to k_max, >= 1). max_new_tokens: the budget (>= 0). temperature, top_k, top_p, min_p: the
    sampling (specdec.sampling.SamplingParams; temperature 0 is greedy). seed: of the run's one
    torch.Generator (None: a random seed). stop: strings that end the text. penalties: a Penalties
    (None: none). logprobs: None, or how many most likely tokens (0..20) to report beside each new
    token's log-probability. logit_bias: {token id: bias}, added to the target's logits before
    the penalties (OpenAI's semantics, each in [-100, 100]); stored as sorted (id, bias) pairs.
    stop_token_ids: ids that end the generation, besides the model's end tokens; ignore_eos: do not
    stop on the model's end tokens (vLLM's two extensions). grammar: a specdec.grammar.Grammar the
    output must follow (a JSON schema, a regex, ...), or None.

    Raises ValueError naming the first bad field (what parse_k, SamplingParams and Penalties raise,
    a k_max < 1, a negative budget, logprobs out of range, a stop that is not strings, a bias out
    of range or on a negative id, a negative stop token id).
    """

    k: int | str = "auto"
    k_max: int = AUTO_K_MAX
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    penalties: Penalties = field(default_factory=Penalties)
    logprobs: int | None = None
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        if parse_k(self.k) != self.k:  # text such as "4": parse_k turns it into the int first
            raise ValueError(f"k must be an int or 'auto', got the text {self.k!r}: pass it through parse_k")
        if isinstance(self.k_max, bool) or not isinstance(self.k_max, int) or self.k_max < 1:
            raise ValueError(f"k_max must be an integer >= 1, got {self.k_max!r}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {self.logprobs}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop must be strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        if self.penalties is None:
            object.__setattr__(self, "penalties", Penalties())
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        stop_ids = tuple(self.stop_token_ids or ())
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_ids):
            raise ValueError(f"stop_token_ids must be token ids (integers >= 0), got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stop_ids)
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise ValueError(f"grammar must be a specdec Grammar (Grammar.json_schema(...), ...), got {self.grammar!r}")
        self.sampling  # noqa: B018 -- checks temperature, top_k, top_p and min_p

    @property
    def sampling(self) -> SamplingParams:
        """The sampling parameters (temperature, top_k, top_p, min_p)."""
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.min_p)

    def replace(self, **changes) -> GenerationOptions:
        """A copy with these fields changed (checked again). Raises TypeError for an unknown field."""
        return replace(self, **changes)


def _bias_pairs(bias) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (id, bias) pairs, from a mapping or pairs. Raises ValueError for an id
    that is not an integer >= 0 or a bias that is not a number in [-100, 100]."""
    pairs = bias.items() if isinstance(bias, Mapping) else (bias or ())
    out = {}
    for token, value in pairs:
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {token}")
        out[token] = float(value)
    return tuple(sorted(out.items()))


OPTION_NAMES = tuple(f.name for f in fields(GenerationOptions))


def options_from(options: GenerationOptions | None, kwargs: dict) -> GenerationOptions:
    """The options of a call given either an options object or its fields as keyword arguments
    (generate's way), not both. Raises TypeError for an unknown keyword or both given."""
    unknown = set(kwargs) - set(OPTION_NAMES)
    if unknown:
        raise TypeError(f"unknown generation option(s): {', '.join(sorted(unknown))}; known: {', '.join(OPTION_NAMES)}")
    if options is not None and kwargs:
        raise TypeError(f"give options= or its fields ({', '.join(sorted(kwargs))}), not both")
    return options if options is not None else GenerationOptions(**kwargs)
