"""Loading a causal LM with its tokenizer, from a registry name, a local folder, a local .gguf
file or a hub id; and the check that a draft and a target share a tokenizer."""

from __future__ import annotations

import os
import re
import socket
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch

from specdec.backends.quant import KV_DTYPES
from specdec.errors import GGUFError, ModelNotFoundError, SpecdecError, TokenizerMismatchError
from specdec.models.registry import REGISTRY
from specdec.models.weights import cache_dir, convert_gguf, converted_folder, gguf_path, is_pulled, pull, sha256_of

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


@dataclass(frozen=True)
class Quantized:
    """What a quantized model is made of: its GGUF blocks (a specdec.models.gguf.GGUFModel), the
    transformers config of its shapes, hf_loader (loads the fp32 dequantization as a transformers
    model, when something asks for one; None: never) and kv_dtype (its KV cache's dtype,
    specdec.backends.quant.QuantModel's; None: its default)."""

    gguf: object
    config: object
    hf_loader: Callable[[], torch.nn.Module] | None = None
    kv_dtype: torch.dtype | None = None


class Model:
    """A causal LM with its tokenizer: a transformers `PreTrainedModel`, or a GGUF file run at its own
    precision by specdec's quantized kernels.

    `name` is what it was loaded from. The KV cache lives outside, in `specdec.cache`, so one model
    can serve several runs. backend: how forwards run. "lean" is specdec's own forward over a
    preallocated cache (Llama and Qwen2 models): over the GGUF file's quantized blocks
    (specdec.backends.quant) when `gguf` is given, else over prepacked fp32/bf16 weights
    (specdec.backends.lean; built at first use, about one more copy of the linear weights); "hf" is
    the transformers model itself; "auto" (default) picks lean where it can run the model.

    gguf, config: a quantized model's blocks (a specdec.models.gguf.GGUFModel) and the config of its
    shapes (hf is then None), or gguf a Quantized that holds both and how to load more. It has no
    transformers model until something asks for `hf` (a transformers peer, training): the
    Quantized's hf_loader then loads the fp32 dequantization, once. Raises ValueError for backend="lean" on a
    model it cannot run, or an unknown backend.
    """

    def __init__(
        self,
        hf: torch.nn.Module | None,
        tokenizer,
        name: str,
        eos_token_ids: frozenset[int] = frozenset(),
        backend: str = "auto",
        lean=None,
        *,
        gguf=None,
        config=None,
    ):
        from specdec.backends.lean import unsupported_reason

        self._hf, self.tokenizer, self.name, self._lean = hf, tokenizer, name, lean
        self.eos_token_ids = frozenset(eos_token_ids)  # ids that end generation; empty: never stop on EOS
        q = gguf if isinstance(gguf, Quantized) else Quantized(gguf, config)
        self.gguf, self._config, self._hf_loader, self._kv_dtype = q.gguf, q.config, q.hf_loader, q.kv_dtype
        gguf = self.gguf
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if gguf is not None:
            if backend == "hf":
                raise ValueError(f"{name} runs at its GGUF precision on the lean backend; for hf, load it as float32")
            self.backend = "lean"
            return
        reason = unsupported_reason(hf) if backend != "hf" else None
        if backend == "lean" and reason:
            raise ValueError(f"the lean backend cannot run {name}: {reason}; use backend 'hf' or 'auto'")
        self.backend = ("hf" if reason else "lean") if backend == "auto" else backend

    def __repr__(self) -> str:
        return f"Model({self.name!r}, backend={self.backend!r}, precision={self.precision!r})"

    @property
    def hf(self) -> torch.nn.Module:
        """The transformers model; for a quantized model, its fp32 dequantization, loaded at the first
        access (seconds to minutes). Raises ValueError where there is none (a layer-skip view of a
        quantized model)."""
        if self._hf is None:
            if self._hf_loader is None:
                raise ValueError(f"{self.name} has no transformers model; load it with dtype float32")
            self._hf = self._hf_loader()
        return self._hf

    @property
    def config(self):
        """The transformers config (shapes, layer count, token ids)."""
        return self._config if self._config is not None else self.hf.config

    @property
    def precision(self) -> str:
        """What the weights are: "float32" or "bfloat16" (a transformers model), or the GGML types of a
        GGUF file run as they are, e.g. "gguf Q4_1+Q8_0"."""
        if self.gguf is not None:
            return self.gguf.precision
        return str(self.hf.dtype).removeprefix("torch.")

    def lean(self):
        """The lean forward of this model (specdec.backends.quant.QuantModel for a GGUF model, else
        specdec.backends.lean.LeanModel), built at the first call."""
        if self._lean is None:
            if self.gguf is not None:
                from specdec.backends.quant import QuantModel

                self._lean = QuantModel(self.gguf, self.config, kv_dtype=self._kv_dtype)
            else:
                from specdec.backends.lean import LeanModel

                self._lean = LeanModel(self.hf)
        return self._lean

    @property
    def device(self) -> torch.device:
        """Where the weights live (and the KV cache and logits of its forwards)."""
        return torch.device("cpu") if self.gguf is not None else self.hf.device

    @property
    def n_ctx(self) -> int:
        """Context length in tokens (the model's max_position_embeddings)."""
        return int(self.config.max_position_embeddings)

    @property
    def vocab_size(self) -> int:
        """Width of the logits (may exceed the tokenizer's size when the embedding is padded)."""
        if self.gguf is not None:
            return int(self.gguf.tensors["token_embd.weight"].shape[0])
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
    dtype: torch.dtype | None = None,
    pull_missing: bool = False,
    cache: str | os.PathLike | None = None,
    backend: str = "auto",
    device: str | torch.device = "cpu",
    quantize: str | None = None,
    kv_dtype: torch.dtype | None = None,
) -> Model:
    """Load a model and its tokenizer, in eval mode.

    spec: a registry name (`smollm2-135m`, `qwen2.5-coder-0.5b`, `qwen2.5-coder-1.5b`,
    `gemma-3-270m`), a local `.gguf` file, a local Hugging Face model folder, or a hub id such as
    `HuggingFaceTB/SmolLM2-360M`. dtype: None (default) runs a GGUF model (registry or file) at its
    own precision, its 4-8 bit blocks multiplied by specdec's batch-invariant kernels
    (specdec.backends.quant; Llama and Qwen2 on the CPU), and anything else in fp32; a torch dtype
    loads the weights in that dtype, a GGUF model's dequantized once to safetensors in the cache
    (keyed by its sha256). pull_missing: pull a registry model that is not in the cache yet instead
    of raising. device: "cpu" (default), "cuda", "cuda:N" or "auto" (a CUDA GPU when torch sees one),
    see resolve_device; the CLI's --device defaults to auto. quantize: quantize a Llama/Qwen2 model's
    matrices at load to this GGUF type (specdec.models.quantize.QUANTIZE, e.g. "q8_0") and run them
    on the quantized backend; a GGUF model is requantized from its dequantized weights (for a draft
    model: `--draft-quantize q4_0` makes its step cheaper, never the output different). kv_dtype:
    the KV cache's dtype on the quantized backend, torch.float16 (default: half the bytes attention
    reads) or torch.float32; the other backends keep their cache in the model's dtype.

    Raises ValueError for a device torch cannot use or a kv_dtype the backend cannot keep;
    ModelNotFoundError with the command that fixes it: a registry model not pulled, a path that
    does not exist, a hub id that cannot be reached (fails within seconds when offline); GGUFError
    (a ValueError) for a damaged GGUF file.
    """
    dev = resolve_device(device)
    if kv_dtype not in (None, *KV_DTYPES):
        raise ValueError(f"kv_dtype must be torch.float16 or torch.float32, not {kv_dtype!r}")
    root = cache_dir(cache)
    path = Path(spec).expanduser()
    gguf_file = None
    if spec in REGISTRY:
        if not is_pulled(spec, root):
            if not pull_missing:
                raise ModelNotFoundError(
                    f"model {spec!r} is not pulled yet: run `specdec models pull {spec}` (or pass --pull)"
                )
            pull(spec, root)
        gguf_file = gguf_path(REGISTRY[spec], root)
    elif path.is_file() and path.suffix == ".gguf":
        gguf_file = path
    elif not (path.is_dir() or (HUB_ID.match(spec) and not path.exists())):
        raise ModelNotFoundError(
            f"{spec!r} is not a registry name ({', '.join(REGISTRY)}), an existing folder or .gguf "
            "file, or a hub id of the form org/name"
        )
    if quantize is not None:
        if dev.type != "cpu" or backend == "hf" or dtype not in (None, torch.float32):
            raise ValueError(
                "--quantize runs on the CPU's quantized backend: use it with --device cpu, without --backend hf "
                "or another --dtype"
            )
        return _quantize_at_load(spec, gguf_file, root, quantize, backend, kv_dtype)
    if gguf_file is not None and dtype is None and dev.type == "cpu" and backend != "hf":
        from specdec.backends.qkernel import kernels
        from specdec.errors import KernelBuildError

        try:
            kernels()
        except KernelBuildError as e:
            print(f"{e}\nRunning {spec} dequantized to float32 instead.", file=sys.stderr)
        else:
            return _load_quantized(spec, gguf_file, root, backend, kv_dtype)
    dtype = dtype or torch.float32
    if kv_dtype not in (None, dtype):
        name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
        raise ValueError(
            f"a {name(kv_dtype)} KV cache needs the quantized backend (a GGUF model at its own precision, or "
            f"--quantize); {spec} runs in {name(dtype)} here and keeps its cache in it"
        )
    return _load_transformers(spec, gguf_file, root, dtype, backend, dev)


def gguf_file_of(spec: str, root: Path, pull_missing: bool = False) -> Path | None:
    """The GGUF file load_model(spec) would read: a registry model's (pulled first with pull_missing),
    or a `.gguf` path; None for anything else (a folder, a hub id, a registry model not pulled)."""
    if spec in REGISTRY:
        if pull_missing and not is_pulled(spec, root):
            pull(spec, root)
        return gguf_path(REGISTRY[spec], root) if is_pulled(spec, root) else None
    path = Path(spec).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def _load_quantized(spec: str, gguf_file: Path, root: Path, backend: str, kv_dtype: torch.dtype | None) -> Model:
    """A GGUF model run at its own precision; its fp32 transformers model is loaded only if asked for."""
    from transformers import GenerationConfig

    from specdec.backends.quant import SUPPORTED
    from specdec.models.gguf import hf_config, hf_tokenizer, read_gguf

    gguf = read_gguf(gguf_file)
    if gguf.arch not in SUPPORTED:
        print(
            f"{spec}: the quantized backend runs {', '.join(SUPPORTED)} models, not {gguf.arch!r}; "
            "running its weights dequantized to float32 on transformers",
            file=sys.stderr,
        )
        try:
            return _load_transformers(spec, gguf_file, root, torch.float32, backend, torch.device("cpu"))
        except Exception as e:  # transformers' own error, from deep inside it: said in one line instead
            if isinstance(e, SpecdecError):
                raise
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise GGUFError(f"{spec}: transformers could not load this {gguf.arch!r} file either ({first})") from None
    config = hf_config(gguf)
    tokenizer = hf_tokenizer(gguf, root / "gguf-meta")
    marked = [gguf.fields.get(f"tokenizer.ggml.{n}_token_id") for n in ("eot", "eom")]  # end of turn, of message
    eos = default_eos_ids(GenerationConfig.from_model_config(config), tokenizer, [i for i in marked if i is not None])
    loader = lambda: _load_transformers(spec, gguf_file, root, torch.float32, "hf", torch.device("cpu")).hf  # noqa: E731
    return Model(None, tokenizer, spec, eos, backend, gguf=Quantized(gguf, config, loader, kv_dtype))


def _quantize_at_load(
    spec: str, gguf_file: Path | None, root: Path, qtype: str, backend: str, kv_dtype: torch.dtype | None
) -> Model:
    """A model with its matrices quantized to `qtype` (specdec.models.quantize): a Hugging Face model's
    fp32 weights, or a GGUF model's dequantized ones (requantized: meant for a draft model, whose
    precision changes only the speed); the fp32 model is dropped after quantizing and reloaded only
    if asked for."""
    from specdec.models.quantize import quantize_model

    fp32 = _load_transformers(spec, gguf_file, root, torch.float32, "hf", torch.device("cpu"))
    gguf = quantize_model(fp32.hf, qtype, spec)
    loader = lambda: _load_transformers(spec, gguf_file, root, torch.float32, "hf", torch.device("cpu")).hf  # noqa: E731
    return Model(
        None,
        fp32.tokenizer,
        spec,
        fp32.eos_token_ids,
        backend,
        gguf=Quantized(gguf, fp32.hf.config, loader, kv_dtype),
    )


def _load_transformers(
    spec: str, gguf_file: Path | None, root: Path, dtype: torch.dtype, backend: str, dev: torch.device
) -> Model:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {}
    if spec in REGISTRY:
        folder = converted_folder(spec, root)
    elif gguf_file is not None:
        folder = convert_gguf(gguf_file, sha256_of(gguf_file, progress=True), root, source=str(gguf_file))
    elif Path(spec).expanduser().is_dir():
        folder = Path(spec).expanduser()
    else:
        folder, kwargs = spec, _hub_kwargs(spec)
    try:
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    except OSError as e:
        raise ModelNotFoundError(f"could not load {spec!r}: {e}") from e
    hf.to(dev).eval()
    return Model(hf, tokenizer, spec, default_eos_ids(hf.generation_config, tokenizer), backend)


# The control tokens that end a generation wherever a vocabulary has them as special tokens: the
# ends of a text, turn or message, and the fill-in-the-middle separators a code model writes after
# its infill (the tokens llama.cpp also treats as end of generation).
END_TEXTS = frozenset(
    {
        "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|end|>",
        "<end_of_turn>", "<end_of_utterance>", "<EOT>", "_<EOT>",
        "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
        "<|file_sep|>", "<file_sep>",
    }
)  # fmt: skip


def default_eos_ids(generation_config, tokenizer, extra: Iterable[int] = ()) -> frozenset[int]:
    """The ids that end a generation: the generation config's eos ids, the tokenizer's eos id, `extra`
    (a GGUF file's end-of-turn and end-of-message ids), and the tokenizer's special tokens whose text
    is in END_TEXTS. Plain and speculative decoding stop on the same set, so it changes no exactness."""
    ids: set[int] = set(extra)
    gen = generation_config
    for source in (getattr(gen, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source is not None:
            ids.update(source)
    for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if token.special and token.content in END_TEXTS:
            ids.add(i)
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
