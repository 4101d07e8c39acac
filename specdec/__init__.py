"""specdec: exact speculative decoding for causal language models.

import specdec
target = specdec.load_model("smollm2-135m")
ids = target.encode("Summarize: ...", chat=True)
result = specdec.generate(target, ids, drafter=specdec.make_drafter("prompt-lookup"), k=4)
print(result.text, result.stats.summary())
"""

from specdec.drafters import DRAFTERS, Draft, Drafter, make_drafter
from specdec.engine import Generation, generate, stepwise
from specdec.errors import (
    ChecksumError,
    ContextLengthError,
    ModelNotFoundError,
    PullError,
    SpecdecError,
    TokenizerMismatchError,
)
from specdec.exactness import Divergence, first_divergence
from specdec.models.load import Model, check_same_tokenizer, load_model
from specdec.models.weights import pull
from specdec.sampling import SamplingParams
from specdec.stats import RunStats

__all__ = [
    "DRAFTERS",
    "ChecksumError",
    "ContextLengthError",
    "Divergence",
    "Draft",
    "Drafter",
    "Generation",
    "Model",
    "ModelNotFoundError",
    "PullError",
    "RunStats",
    "SamplingParams",
    "SpecdecError",
    "TokenizerMismatchError",
    "check_same_tokenizer",
    "first_divergence",
    "generate",
    "load_model",
    "make_drafter",
    "pull",
    "stepwise",
]
