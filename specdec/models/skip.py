"""Views of a model that run a subset of its decoder layers (the layer-skip draft's model).

No extra weights: a view shares every parameter of the target's transformers model; its decoder
layer list is the kept subset, renumbered so that a fresh KV cache of that many layers lines up.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

from specdec.models.load import Model


def decoder_layers(hf: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layer list of a transformers causal LM (`hf.model.layers`: Llama, Qwen2,
    Gemma 3, Mistral, ...). Raises ValueError for an architecture laid out otherwise."""
    layers = getattr(getattr(hf, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(
            f"{type(hf).__name__} has no `.model.layers` decoder list; layer skipping supports "
            "Llama-style models (Llama, SmolLM2, Qwen2, Gemma 3, Mistral)"
        )
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
                raise ValueError(
                    f"bad layer {item!r} in {layers!r}: use comma-separated indices or ranges, e.g. 0,1,2,5 or 0-9,12"
                ) from None
        layers = out
    result = sorted({int(i) for i in layers})
    if not result:
        raise ValueError("the layer list is empty: keep at least one decoder layer")
    if n_layers is not None and not 0 <= result[0] <= result[-1] < n_layers:
        raise ValueError(
            f"layer indices must be in 0..{n_layers - 1} (the model has {n_layers} decoder layers), got {result}"
        )
    return result


def _shallow(module: torch.nn.Module) -> torch.nn.Module:
    """A new module object sharing `module`'s parameters and buffers, with its own child and hook
    tables, so that replacing a child (or hooking) the copy leaves the original untouched."""
    clone = copy.copy(module)
    for table in (
        "_modules",
        "_forward_hooks",
        "_forward_pre_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_pre_hooks_with_kwargs",
        "_forward_hooks_always_called",
    ):
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
    return build_view(model, parse_layers(layers, model.config.num_hidden_layers))


def build_view(model: Model, kept: list[int]) -> Model:
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
    name = f"{model.name}[layers {_ranges(kept) if kept else 'none'}]"
    return Model(
        view,
        model.tokenizer,
        name,
        model.eos_token_ids,
        model.backend,
        lean,
    )


def _ranges(kept: list[int]) -> str:
    """[0,1,2,5,7,8] -> "0-2,5,7-8"."""
    parts, start = [], kept[0]
    for a, b in zip(kept, kept[1:] + [None]):
        if b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(parts)
