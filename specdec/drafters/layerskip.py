"""Self-speculation by layer skipping: the target, running only a subset of its decoder layers,
is its own draft model (Draft & Verify: Zhang et al. 2023, "Draft & Verify: Lossless Large Language
Model Acceleration via Self-Speculative Decoding"; LayerSkip: Elhoushi et al. 2024; SWIFT: Xia et
al. 2024, "SWIFT: On-the-Fly Self-Speculative Decoding for LLM Inference Acceleration").

No extra weights: the draft is a view of the target's Hugging Face model that shares every
parameter but whose decoder layer list is the kept subset. It drafts like a draft model (its own
KV cache, greedy or sampled tokens with their probabilities), so speculative sampling stays exact.
Which layers to keep comes from `specdec calibrate-skip` (specdec.calibrate), stored per model in
the cache, or from an explicit `layers=` list.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch

from ..models import Model
from ..sampling import Sampler
from .base import Draft
from .model import ModelDrafter


def decoder_layers(hf: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layer list of a transformers causal LM (`hf.model.layers`: Llama, Qwen2,
    Gemma 3, Mistral, ...). Raises ValueError for an architecture laid out otherwise."""
    layers = getattr(getattr(hf, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{type(hf).__name__} has no `.model.layers` decoder list; layer skipping supports "
                         "Llama-style models (Llama, SmolLM2, Qwen2, Gemma 3, Mistral)")
    return layers


def parse_layers(layers: Sequence[int] | str, n_layers: int | None = None) -> list[int]:
    """Layer indices from a list or a string such as "0,1,2,5" or "0-9,12" (ranges inclusive).
    Sorted, without duplicates. Raises ValueError on an empty list, a bad item, or (given n_layers)
    an index outside 0..n_layers-1."""
    if isinstance(layers, str):
        out: list[int] = []
        for item in filter(None, (s.strip() for s in layers.split(","))):
            try:
                if "-" in item:
                    lo, hi = (int(x) for x in item.split("-", 1))
                    out += range(lo, hi + 1)
                else:
                    out.append(int(item))
            except ValueError:
                raise ValueError(f"bad layer {item!r} in {layers!r}: use comma-separated indices or ranges, e.g. 0,1,2,5 or 0-9,12") from None
        layers = out
    result = sorted({int(i) for i in layers})
    if not result:
        raise ValueError("the layer list is empty: keep at least one decoder layer")
    if n_layers is not None and not 0 <= result[0] <= result[-1] < n_layers:
        raise ValueError(f"layer indices must be in 0..{n_layers - 1} (the model has {n_layers} decoder layers), got {result}")
    return result


def _shallow(module: torch.nn.Module) -> torch.nn.Module:
    """A new module object sharing `module`'s parameters and buffers, with its own child and hook
    tables, so that replacing a child (or hooking) the copy leaves the original untouched."""
    clone = copy.copy(module)
    for table in ("_modules", "_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs",
                  "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called"):
        if table in module.__dict__:
            clone.__dict__[table] = copy.copy(module.__dict__[table])
    return clone


def skip_view(model: Model, layers: Sequence[int] | str) -> Model:
    """A Model that runs only `layers` (indices into the decoder layer list) of `model`.

    Every parameter is shared with `model` (no copy: the same tensors, the same data_ptr). The view
    has its own config copy with num_hidden_layers (and layer_types, for models that mix sliding
    and full attention) cut to the kept layers, and the kept attention layers are renumbered 0..m-1
    so that a fresh KV cache of m layers (specdec.cache.new_cache on the view) lines up with them.
    On the lean backend the view runs the target's lean model over the kept layers.
    Raises ValueError on bad indices or an unsupported architecture.
    """
    return _build_view(model, parse_layers(layers, len(decoder_layers(model.hf))))


def _build_view(model: Model, kept: list[int]) -> Model:
    """skip_view without the checks; kept (sorted, valid) may be empty (calibration scores the
    output layer on a hidden state that way)."""
    hf = model.hf
    all_layers = decoder_layers(hf)
    config = copy.deepcopy(hf.config)
    config.num_hidden_layers = len(kept)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [hf.config.layer_types[i] for i in kept]
    new_layers = []
    for j, i in enumerate(kept):
        layer = _shallow(all_layers[i])
        if hasattr(layer, "layer_idx"):
            layer.layer_idx = j
        attn = getattr(layer, "self_attn", None)
        if attn is not None and hasattr(attn, "layer_idx"):
            attn = _shallow(attn)
            attn.layer_idx = j
            layer.self_attn = attn  # goes into the copy's own _modules table
        new_layers.append(layer)
    inner = _shallow(hf.model)
    inner.layers = torch.nn.ModuleList(new_layers)
    inner.config = config
    view = _shallow(hf)
    view.model = inner
    view.config = config
    lean = model.lean().subset(kept) if model.backend == "lean" else None
    return Model(view, model.tokenizer, f"{model.name}[layers {_ranges(kept) if kept else 'none'}]",
                 model.eos_token_ids, model.backend, lean)


def _ranges(kept: list[int]) -> str:
    """[0,1,2,5,7,8] -> "0-2,5,7-8"."""
    parts, start = [], kept[0]
    for a, b in zip(kept, kept[1:] + [None]):
        if b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(parts)


class LayerSkipDrafter:
    """Drafts with the target itself, running only some of its decoder layers.

    layers: the decoder layers to keep (a list or "0,1,2,5" / "0-9,12"); None loads the list that
    `specdec calibrate-skip --target NAME` stored for the target (specdec.calibrate). cache: the
    specdec cache folder holding that file (default: the usual cache). The draft view is built once
    per target and works as ModelDrafter does: its own KV cache, rolled back to the committed
    tokens before each proposal; greedy tokens, or sampled ones with their probabilities.

    prepare() raises ValueError when no layers were given and the target has no stored
    calibration (the message names the command that makes one), or on indices out of range.
    """

    def __init__(self, layers: Sequence[int] | str | None = None, cache=None):
        self.layers = None if layers is None else parse_layers(layers)
        self.cache = cache
        self.view: Model | None = None
        self._target: Model | None = None
        self._inner: ModelDrafter | None = None

    def prepare(self, target: Model) -> None:
        if self._target is not target:
            if self.layers is not None:
                layers = self.layers
            else:
                from ..calibrate import load_skip_layers

                layers = load_skip_layers(target, self.cache)
            self.view = skip_view(target, layers)
            self._inner = ModelDrafter(self.view)
            self._inner.checked = target  # the view shares the target's tokenizer: nothing to check
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
