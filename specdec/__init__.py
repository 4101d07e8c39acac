"""specdec: exact speculative decoding for causal language models.

import specdec
target = specdec.load_model("smollm2-135m")
ids = target.encode("Summarize: ...", chat=True)
result = specdec.generate(target, ids, drafter=specdec.make_drafter("prompt-lookup"), k=4)
print(result.text, result.stats.summary())
results = specdec.generate_batch(target, [ids, ids2], drafter="prompt-lookup")  # one forward per step
"""

from specdec.batch import Batch, generate_batch
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
from specdec.options import GenerationOptions
from specdec.sampling import Penalties, SamplingParams, TokenLogprob
from specdec.stats import RunStats

__all__ = [
    "DRAFTERS",
    "Batch",
    "ChecksumError",
    "ContextLengthError",
    "Divergence",
    "Draft",
    "Drafter",
    "Generation",
    "GenerationOptions",
    "Model",
    "ModelNotFoundError",
    "Penalties",
    "PullError",
    "RunStats",
    "SamplingParams",
    "SpecdecError",
    "TokenLogprob",
    "TokenizerMismatchError",
    "check_same_tokenizer",
    "first_divergence",
    "generate",
    "generate_batch",
    "load_model",
    "make_drafter",
    "pull",
    "stepwise",
]
