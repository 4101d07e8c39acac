"""An EAGLE draft head (specdec.train.head.DraftHead; Li et al. 2024) on the quantized kernels, one
C++ call a draft step.

Against a target on the quantized backend, a head run in fp32 through torch reads several times
the bytes the target's own layer does, in about twenty calls a step. Here its matrices are
quantized at load (fc, q/k/v, o, gate/up, down; `qtype`, Q8_0 by default), its output rows are
the target's own quantized output layer's rows of the head's vocabulary (the same blocks), and a
step (embedding rows, fc, the decoder layer with its cache, the output rows) is one call of the
kernels' `head_step`. A head drafts only: its precision changes the speed and the acceptance,
never the output (the target verifies every token).
"""

from __future__ import annotations

import torch

from specdec.backends.quant import QuantLinear, QuantModel, layer_weights
from specdec.models.quantize import quantize_matrix

HEAD_QUANTIZE = "q8_0"  # the type of the head's matrices when none is asked for (docs/draft-heads.md)


class QuantHead:
    """A DraftHead's weights laid out for the quantized kernels of `model` (the target's
    QuantModel: its int8 activations, embedding table and output layer). qtype: the GGUF type its
    matrices are quantized to (specdec.models.quantize.QUANTIZE). Raises ValueError for another
    qtype, or a head whose hidden size is not the target's."""

    def __init__(self, head, model: QuantModel, qtype: str = HEAD_QUANTIZE):
        if head.config["hidden"] != model.hidden_size:
            raise ValueError(f"a head of hidden size {head.config['hidden']} for a target of {model.hidden_size}")
        self.kernels, self.int8, self.qtype = model.kernels, model.int8, qtype
        self.n_heads, self.eps, self.inv_freq = head.n_heads, head.eps, head.inv_freq.float().cpu()

        def linear(name: str, bias: torch.Tensor | None = None) -> QuantLinear:
            matrix = quantize_matrix(getattr(head, name).weight, qtype, f"head.{name}")
            biases = None if bias is None else [bias.detach().float().contiguous()]
            return QuantLinear([matrix], biases, int8=self.int8)

        fc, qkv, o, gate_up, down = (
            linear(n, getattr(getattr(head, n), "bias", None)) for n in ("fc", "qkv", "o", "gate_up", "down")
        )
        norm_in = torch.empty(0) if head.norm_in is None else head.norm_in.detach().float().contiguous()
        layer = layer_weights(norm_in, head.norm_post.detach().float().contiguous(), qkv, o, gate_up, down)
        out = model.lm_head.select(head.vocab_ids)  # the target's blocks of the head's tokens
        embed = model.embedding
        self.weights = self.kernels.Head(
            fc=fc.data,
            fc_types=fc.types,
            layer=layer,
            out=out.data,
            out_types=out.types,
            embed=embed.raw[0],
            embed_type=embed.raw_types[0],
        )
        self.nbytes = sum(m.nbytes for m in (fc, qkv, o, gate_up, down, out))  # read by one draft step

    def step(self, features: torch.Tensor, ids: torch.Tensor, start: int, cache) -> tuple[torch.Tensor, torch.Tensor]:
        """features (T, d) fp32 at positions start..start+T-1 (the target's, fused, or the head's own
        prediction), ids (T,) the tokens after them -> (the predicted next features (T, d), the
        logits (N,) of the last one over the head's vocabulary). cache: the head's HeadCache
        (fp32), whose positions start..start+T-1 are written."""
        cache.reserve(start, start + len(ids))
        h, logits = self.kernels.head_step(
            head=self.weights,
            features=features.contiguous(),
            ids=ids,
            k_cache=cache.k,
            v_cache=cache.v,
            start=start,
            inv_freq=self.inv_freq,
            H=self.n_heads,
            eps=self.eps,
            int8=self.int8,
        )
        return h, logits[0]
