"""Self-speculation by layer skipping: the target, running only a subset of its decoder layers,
is its own draft model (Draft & Verify: Zhang et al. 2023, "Draft & Verify: Lossless Large Language
Model Acceleration via Self-Speculative Decoding"; LayerSkip: Elhoushi et al. 2024; SWIFT: Xia et
al. 2024, "SWIFT: On-the-Fly Self-Speculative Decoding for LLM Inference Acceleration").

No extra weights: the draft is a view of the target's Hugging Face model that shares every
parameter but whose decoder layer list is the kept subset. It drafts like a draft model (its own
KV cache, greedy or sampled tokens with their probabilities), so speculative sampling stays exact.
Which layers to keep comes from an explicit `layers=` list, or from a calibration
(specdec.train.calibrate): the one `specdec calibrate-skip` stored in the cache, the one shipped with
the package for a registry model, or one made at first use and cached.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdec.drafters.base import Drafter
from specdec.drafters.draft import Draft
from specdec.drafters.model import ModelDrafter
from specdec.models.load import Model
from specdec.models.skip import parse_layers, skip_view
from specdec.sampling import Sampler
from specdec.train.calibrate import skip_layers_for


class LayerSkipDrafter(Drafter):
    """Drafts with the target itself, running only some of its decoder layers.

    layers: the decoder layers to keep (a list or "0,1,2,5" / "0-9,12"); None takes the target's
    calibration (specdec.train.calibrate.skip_layers_for): stored in the cache by `specdec
    calibrate-skip --target NAME`, else shipped with the package, else made in prepare() the first
    time (with progress on stderr) and cached. cache: the specdec cache folder for that file
    (default: the usual cache). The draft view is built once per target and works as ModelDrafter
    does: its own KV cache, rolled back to the committed tokens before each proposal; greedy
    tokens, or sampled ones with their probabilities.

    prepare() raises ValueError on layer indices out of range, or on a model whose decoder layers
    it cannot find.
    """

    incremental = True

    def __init__(self, layers: Sequence[int] | str | None = None, cache=None):
        self.layers = None if layers is None else parse_layers(layers)
        self.cache = cache
        self.view: Model | None = None
        self._target: Model | None = None
        self._inner: ModelDrafter | None = None

    def prepare(self, target: Model) -> None:
        if self._target is not target:
            layers = self.layers if self.layers is not None else skip_layers_for(target, self.cache)
            self.view = skip_view(target, layers)
            self._inner = ModelDrafter(self.view)
            self._inner.checked[id(target)] = target  # the view shares the target's tokenizer: nothing to check
            self._target = target
        self._inner.prepare(target)

    def propose(self, context: list[int], k: int, sampler: Sampler, keep_going=None) -> Draft:
        """Up to k draft tokens after `context`, as ModelDrafter.propose (keep_going: the adaptive
        draft length's per-token stop test, passed through)."""
        if self._inner is None:
            raise ValueError("call prepare(target) before propose(): the draft is built from the target")
        if keep_going is not None:
            return self._inner.propose(context, k, sampler, keep_going=keep_going)
        return self._inner.propose(context, k, sampler)
