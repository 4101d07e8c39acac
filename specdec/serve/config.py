"""ServeConfig: how a server serves, as one frozen value built once at the edge (the command
line, a test, a caller of create_app) and checked when made."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specdec.batch import PREFILL_CHUNK, PREFILL_RATIO
from specdec.options import parse_k

MAX_BATCH = 64  # sequences decoded at once


@dataclass(frozen=True)
class ServeConfig:
    """The settings of one server: its defaults, limits and access (the models and drafter objects
    are create_app's arguments, not settings).

    Defaults of a request:
    - drafter: the drafter of a request that names none (a registered name, a key of create_app's
      `drafters`, or "none"; None means "none"). Checked against the drafters by create_app.
    - k: the draft length, an int >= 0 or "auto" (text such as "4" is parsed).
    - max_tokens: a request's max_tokens when it sends none (>= 0).
    - model_name: the id clients send as "model" (None: the target's name).

    Limits:
    - max_batch: sequences decoded at once (>= 1; a request with n choices is n).
    - max_queue: requests that may wait beyond them (>= 1); past it the server answers 429.
    - prefill_chunk (>= 1), prefill_ratio (>= 0): while prompts wait, a step feeds the larger of
      prefill_chunk and prefill_ratio per decoding sequence of their tokens (chunked prefill,
      specdec.batch.Batch.prefill_budget).
    - max_body_bytes: larger request bodies get a 413 (>= 1).

    Drafters: max_ngram, min_ngram: prompt lookup's n-gram sizes. head_quantize: the GGUF type
    the eagle drafters' heads run in against a quantized target (None: q8_0). cache: the specdec
    cache folder (calibrations, draft heads, the verify-cost curve; None: the usual one).

    Access: api_key: when given, every /v1/ request must send `Authorization: Bearer <api_key>`
    (else 401).

    Raises ValueError naming the first bad setting.
    """

    drafter: str | None = "prompt-lookup"
    k: int | str = "auto"
    model_name: str | None = None
    max_tokens: int = 256
    max_queue: int = 64
    max_batch: int = MAX_BATCH
    prefill_chunk: int = PREFILL_CHUNK
    prefill_ratio: int = PREFILL_RATIO
    max_ngram: int = 3
    min_ngram: int = 1
    cache: str | Path | None = None
    head_quantize: str | None = None
    api_key: str | None = None
    max_body_bytes: int = 4 * 2**20

    def __post_init__(self) -> None:
        object.__setattr__(self, "drafter", self.drafter or "none")
        object.__setattr__(self, "k", parse_k(self.k))
        for name, least in [
            ("max_queue", 1), ("max_batch", 1), ("prefill_chunk", 1), ("prefill_ratio", 0), ("max_tokens", 0),
        ]:  # fmt: skip
            value = getattr(self, name)
            if value < least:
                raise ValueError(f"{name} must be >= {least}, got {value}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty (leave it out to serve without one)")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
