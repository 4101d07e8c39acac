"""Loading a causal LM with its tokenizer, from a registry name, a local folder, a local .gguf
file or a hub id; and the check that a draft and a target share a tokenizer."""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import torch

from specdec.errors import ModelNotFoundError, TokenizerMismatchError
from specdec.models.registry import REGISTRY
from specdec.models.weights import cache_dir, convert_gguf, converted_path, is_pulled, pull, sha256_of

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # org/name; "./x" and "../x" are paths


BACKENDS = ("auto", "lean", "hf")
DEVICES = ("auto", "cpu", "cuda")


def resolve_device(device: str | torch.device) -> torch.device:
    """The torch device a model runs on: "auto" is the first CUDA GPU when torch sees one, else the
    CPU; "cpu", "cuda" and "cuda:N" are taken as they are. Raises ValueError for "cuda" when torch
    sees no CUDA GPU (a CPU-only torch build, or no driver) and for a name torch does not know."""
    if str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"unknown device {device!r}: use auto, cpu or cuda ({e})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device {device!r} asked for, but this torch ({torch.__version__}) sees no CUDA GPU: "
            "use --device cpu (or auto)"
        )
    if dev.type == "cuda" and dev.index is None:  # as a tensor's .device names it
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (a CUDA GPU runs kernels asynchronously; a timer read
    without this measures the launch, not the work). Nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(eq=False)
class Model:
    """A causal LM (a transformers `PreTrainedModel`) with its tokenizer.

    `name` is what it was loaded from. The KV cache lives outside, in `specdec.cache`, so one model
    can serve several runs. backend: how forwards run. "lean" is specdec.backends.lean's forward over
    prepacked weights and a preallocated cache (Llama and Qwen2 models; built at first use, about
    one more copy of the linear weights); "hf" is the transformers model itself; "auto" (default)
    picks lean where it can run the model. Raises ValueError for backend="lean" on a model it
    cannot run, or an unknown backend.
    """

    hf: torch.nn.Module
    tokenizer: object
    name: str
    eos_token_ids: frozenset[int] = frozenset()  # ids that end generation; empty: never stop on EOS
    backend: str = "auto"
    _lean: object = field(default=None, repr=False)

    def __post_init__(self):
        from specdec.backends.lean import unsupported_reason

        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        reason = unsupported_reason(self.hf) if self.backend != "hf" else None
        if self.backend == "lean" and reason:
            raise ValueError(f"the lean backend cannot run {self.name}: {reason}; use backend 'hf' or 'auto'")
        if self.backend == "auto":
            self.backend = "hf" if reason else "lean"

    def lean(self):
        """The specdec.backends.lean.LeanModel of this model, built at the first call."""
        if self._lean is None:
            from specdec.backends.lean import LeanModel

            self._lean = LeanModel(self.hf)
        return self._lean

    @property
    def device(self) -> torch.device:
        """Where the weights live (and the KV cache and logits of its forwards)."""
        return self.hf.device

    @property
    def n_ctx(self) -> int:
        """Context length in tokens (the model's max_position_embeddings)."""
        return int(self.hf.config.max_position_embeddings)

    @property
    def vocab_size(self) -> int:
        """Width of the logits (may exceed the tokenizer's size when the embedding is padded)."""
        return int(self.hf.config.vocab_size)

    def encode(self, text: str, chat: bool = False) -> list[int]:
        """Token ids of `text`; with chat=True, of `text` as one user turn in the model's chat
        template, ready for the assistant's answer. Raises ValueError when there is no template."""
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError(f"{self.name} has no chat template; run without --chat")
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            if hasattr(ids, "keys"):  # a BatchEncoding
                ids = ids["input_ids"]
            return list(ids)
        return list(self.tokenizer(text)["input_ids"])


def load_model(
    spec: str,
    dtype: torch.dtype = torch.float32,
    pull_missing: bool = False,
    cache: str | os.PathLike | None = None,
    backend: str = "auto",
    device: str | torch.device = "cpu",
) -> Model:
    """Load a model and its tokenizer, in eval mode.

    spec: a registry name (`smollm2-135m`, `qwen2.5-coder-0.5b`, `qwen2.5-coder-1.5b`,
    `gemma-3-270m`), a local Hugging Face model folder, a local `.gguf` file (converted once to
    safetensors in the cache, keyed by its sha256), or a hub id such as `HuggingFaceTB/SmolLM2-360M`.
    dtype: the weights' dtype (default fp32). pull_missing: pull a registry model that is not in the
    cache yet instead of raising. device: "cpu" (default), "cuda", "cuda:N" or "auto" (a CUDA GPU
    when torch sees one), see resolve_device; the CLI's --device defaults to auto.

    Raises ValueError for a device torch cannot use; ModelNotFoundError with the command that fixes
    it: a registry model not pulled, a path that does not exist, a hub id that cannot be reached
    (fails within seconds when offline).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    root = cache_dir(cache)
    path = Path(spec).expanduser()
    if spec in REGISTRY:
        if not is_pulled(spec, root):
            if not pull_missing:
                raise ModelNotFoundError(
                    f"model {spec!r} is not pulled yet: run `specdec models pull {spec}` (or pass --pull)"
                )
            pull(spec, root)
        folder, kwargs = converted_path(REGISTRY[spec].sha256, root), {}
    elif path.is_file() and path.suffix == ".gguf":
        folder, kwargs = convert_gguf(path, sha256_of(path, progress=True), root, source=str(path)), {}
    elif path.is_dir():
        folder, kwargs = path, {}
    elif HUB_ID.match(spec) and not path.exists():
        folder, kwargs = spec, _hub_kwargs(spec)
    else:
        raise ModelNotFoundError(
            f"{spec!r} is not a registry name ({', '.join(REGISTRY)}), an existing folder or .gguf "
            "file, or a hub id of the form org/name"
        )
    try:
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    except OSError as e:
        raise ModelNotFoundError(f"could not load {spec!r}: {e}") from e
    hf.to(dev).eval()
    return Model(hf, tokenizer, spec, default_eos_ids(hf, tokenizer), backend)


def default_eos_ids(hf, tokenizer) -> frozenset[int]:
    """The generation config's eos ids plus the tokenizer's eos id."""
    ids: set[int] = set()
    gen = getattr(hf, "generation_config", None)
    for source in (getattr(gen, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source is not None:
            ids.update(source)
    return frozenset(ids)


def _hub_kwargs(hub_id: str) -> dict:
    """Use the local hub cache when it has the model; otherwise fail fast if the hub is unreachable
    (transformers would retry for about 25 s before saying so)."""
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(hub_id, "config.json"), str):
        return {}
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    host = urlparse(endpoint).hostname or "huggingface.co"
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false")
    try:
        if offline:
            raise OSError("HF_HUB_OFFLINE is set")
        socket.create_connection((host, 443), timeout=5).close()
    except OSError as e:
        raise ModelNotFoundError(
            f"{hub_id!r} is a hub id, but {host} cannot be reached from here ({e}). Download it on a "
            "machine with internet and pass the local folder, or use a registry model: "
            f"{', '.join(REGISTRY)}"
        ) from None
    return {}


def check_same_tokenizer(target: Model, draft: Model) -> None:
    """Raise TokenizerMismatchError unless every token the draft can emit has the same id in the
    target. Extra target tokens are fine, and so is a logits width padded past the tokenizer
    (Qwen: 151936 vs 152064) since the shared ids agree."""
    t_vocab = target.tokenizer.get_vocab()  # token -> id
    d_by_id = sorted((i, tok) for tok, i in draft.tokenizer.get_vocab().items())
    t_by_id = {i: tok for tok, i in t_vocab.items()}
    for i, tok in d_by_id:
        if t_vocab.get(tok) != i:
            raise TokenizerMismatchError(
                f"draft {draft.name!r} and target {target.name!r} do not share a tokenizer: draft "
                f"token id {i} is {tok!r}, target id {i} is {t_by_id.get(i)!r}. Speculative decoding "
                "needs a draft with the target's tokenizer (e.g. a smaller model of the same family), "
                "or a model-free drafter such as prompt-lookup."
            )
