"""A GGUF file (llama.cpp's model format, https://github.com/ggml-org/ggml/blob/master/docs/gguf.md)
read without dequantizing it, so that a quantized backend can multiply its 4/5/6/8-bit blocks directly.

The header is parsed here rather than by `gguf.GGUFReader`, which turns every tokenizer string into
numpy objects and so takes seconds; `gguf` still supplies the type table and the dequantizers. Matrices
stay zero-copy views of the memory-mapped file, except llama's attn_q/attn_k, whose rows are put back
in Hugging Face's order (one copy). Everything is checked against the file size before any use.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import struct
import tempfile
import warnings
from dataclasses import dataclass, field
from math import prod
from pathlib import Path

import gguf
import numpy as np
import torch

from specdec.backends.arch import ARCHS
from specdec.errors import GGUFError
from specdec.models.registry import REGISTRY

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MISSING = object()


@dataclass(eq=False)
class QTensor:
    """One tensor of a GGUF file. shape is in torch order: (rows, cols) = (out_features, in_features)
    for a matrix, (n,) for a vector. data: for a matrix, uint8 (rows, row_bytes), each row its blocks
    as ggml lays them out (F32/F16/BF16 matrices too: their raw bytes), a read-only view of the file
    (never write to it); for a vector, float32 (n,)."""

    name: str
    qtype: str
    shape: tuple[int, ...]
    data: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """float32 of `shape`, via gguf.quants.dequantize (for tests and fallbacks)."""
        if len(self.shape) == 1:
            return self.data.clone()
        out = gguf.quants.dequantize(self.data.numpy(), gguf.GGMLQuantizationType[self.qtype])
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(self.shape)


@dataclass(eq=False)
class GGUFModel:
    """A read GGUF file. fields: its metadata as plain Python values, except the tokenizer's arrays
    (tokens, merges, token types, scores), which are left as their lengths."""

    path: Path
    arch: str
    tensors: dict[str, QTensor]
    file_bytes: int
    fields: dict = field(default_factory=dict, repr=False)
    data_offset: int = 0  # where the tensor data starts: everything before is metadata
    mapping: tuple[int, int] = (0, 0)  # (address, bytes) of the file's memory map in this process

    def mapped(self, t: torch.Tensor) -> bool:
        """Whether tensor t lies in the file's memory map (not a copy on the heap)."""
        address, size = self.mapping
        return address <= t.data_ptr() and t.data_ptr() + t.nbytes <= address + size

    @property
    def precision(self) -> str:
        """The GGML types of its matrices, e.g. "gguf Q4_1+Q8_0" (specdec.models.load.Model.precision)."""
        return "gguf " + "+".join(sorted({t.qtype for t in self.tensors.values() if len(t.shape) == 2}))

    def metadata(self, key: str, default=_MISSING):
        """The value under `key`; raises GGUFError naming the file when absent and no default is given."""
        if key in self.fields:
            return self.fields[key]
        if default is _MISSING:
            raise GGUFError(f"{self.path}: the GGUF metadata has no {key!r}; the file is not a model specdec can run")
        return default


def _fail(path: Path, what: str) -> GGUFError:
    names = [name for name, entry in REGISTRY.items() if entry.gguf_file == path.name]
    fix = f"delete it and run `specdec models pull {names[0]}` again" if names else "re-download it"
    return GGUFError(f"{path}: {what}. The file is damaged or incomplete: {fix}.")


def _parse_header(blob: np.ndarray, path: Path):
    """(fields, [(name, torch-order shape, ggml type id, offset)], data start) of a GGUF v2/v3 header."""
    size = len(blob)

    def string(pos):
        (n,) = struct.unpack_from("<Q", blob, pos)
        if pos + 8 + n > size:
            raise struct.error("past the end")
        return bytes(blob[pos + 8 : pos + 8 + n]).decode("utf-8"), pos + 8 + n

    def value(pos, vtype, key):
        if vtype in _SCALARS:
            return struct.unpack_from(_SCALARS[vtype], blob, pos)[0], pos + struct.calcsize(_SCALARS[vtype])
        if vtype == _STRING:
            return string(pos)
        if vtype != _ARRAY:
            raise ValueError(f"metadata {key!r} has unknown type {vtype}")
        etype, count = struct.unpack_from("<IQ", blob, pos)
        pos += 12
        if count > size:
            raise ValueError(f"metadata {key!r} claims {count} elements")
        skip = key.startswith("tokenizer.ggml.")  # the vocabulary: kept as its length (hf_tokenizer reads it)
        if etype in _SCALARS:
            width = struct.calcsize(_SCALARS[etype])
            if pos + count * width > size:
                raise struct.error("past the end")
            items = count if skip else list(struct.unpack_from(f"<{count}{_SCALARS[etype][1]}", blob, pos))
            return items, pos + count * width
        if etype != _STRING:
            raise ValueError(f"metadata {key!r} is an array of type {etype}")
        if skip:
            for _ in range(count):
                pos += 8 + struct.unpack_from("<Q", blob, pos)[0]
            return count, pos
        items = []
        for _ in range(count):
            item, pos = string(pos)
            items.append(item)
        return items, pos

    version, n_tensors, n_kv = struct.unpack_from("<IQQ", blob, 4)
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version}; specdec reads versions 2 and 3")
    if n_tensors > size or n_kv > size:
        raise ValueError("impossible tensor or metadata count")
    pos, fields = 24, {}
    for _ in range(n_kv):
        key, pos = string(pos)
        (vtype,) = struct.unpack_from("<I", blob, pos)
        fields[key], pos = value(pos + 4, vtype, key)
    entries = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", blob, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", blob, pos + 4)
        qtype, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        entries.append((name, tuple(reversed(dims)), qtype, offset))  # ggml lists the fastest dim first
    align = int(fields.get("general.alignment", 32))
    return fields, entries, (pos + align - 1) // align * align


def read_gguf(path: str | os.PathLike) -> GGUFModel:
    """Read a GGUF file's metadata and map its tensors (see QTensor), checking every tensor lies within
    the file. For the architectures whose converter interleaves q and k for ggml's rope (llama,
    granite, smollm3: specdec.backends.arch.Arch.rope_interleaved), attn_q/attn_k rows (and biases)
    are un-permuted as transformers' GGUF loader does, undoing convert_hf_to_gguf.py's permute.

    Raises GGUFError (a ValueError) naming the file and the fix: missing, not GGUF, unsupported version,
    truncated, or malformed (unknown tensor type, more than 2 dimensions, a row length that is not a
    multiple of its type's block size, heads that do not divide the rows)."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such file; give the path of a .gguf file, or pull a model: `specdec models pull`")
    file_bytes = path.stat().st_size
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFError(f"{path}: not a GGUF file (it does not start with b'GGUF'); give a llama.cpp .gguf file")
    blob = np.memmap(path, mode="r", dtype=np.uint8)
    try:
        fields, entries, data_start = _parse_header(blob, path)
    except (struct.error, ValueError, UnicodeDecodeError, OverflowError) as e:
        if isinstance(e, GGUFError):
            raise
        if isinstance(e, struct.error):  # a read past the end
            raise _fail(path, f"its header is truncated (the file ends at byte {len(blob)}, inside it)") from None
        raise _fail(path, f"its header is malformed ({e})") from None
    arch = fields.get("general.architecture")
    if not isinstance(arch, str):
        raise _fail(path, "its metadata has no general.architecture")
    heads = {}  # the row permutation of q and k for ggml's interleaved rope (llama, granite, smollm3)
    if arch in ARCHS and ARCHS[arch].rope_interleaved:
        n_head = fields.get(f"{arch}.attention.head_count")
        if not isinstance(n_head, int) or n_head < 1:
            raise _fail(path, f"its metadata has no {arch}.attention.head_count")
        heads = {".attn_q.": n_head, ".attn_k.": fields.get(f"{arch}.attention.head_count_kv", n_head)}
    tensors = {}
    for name, shape, type_id, offset in entries:
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            raise _fail(path, f"tensor {name} has unknown ggml type {type_id}") from None
        block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
        if not 1 <= len(shape) <= 2:
            raise _fail(path, f"tensor {name} has {len(shape)} dimensions; specdec reads vectors and matrices")
        if shape[-1] % block:
            raise _fail(
                path, f"tensor {name}: row length {shape[-1]} is not a multiple of {qtype.name}'s block {block}"
            )
        rows, row_bytes = prod(shape[:-1]), shape[-1] // block * type_bytes
        start, end = data_start + offset, data_start + offset + rows * row_bytes
        if end > file_bytes:
            raise _fail(path, f"tensor {name} needs bytes {start}..{end} but the file has {file_bytes} (truncated)")
        raw = blob[start:end]
        if len(shape) == 1:
            array = np.array(gguf.quants.dequantize(raw, qtype), dtype=np.float32)
        else:
            array = raw.reshape(rows, row_bytes)
        if (n_head := next((n for part, n in heads.items() if part in name), None)) is not None:
            if shape[0] % (2 * n_head):
                raise _fail(path, f"tensor {name} has {shape[0]} rows, not a multiple of 2 x {n_head} heads")
            array = _unpermute(array, n_head)
        with warnings.catch_warnings():  # the file's pages are mapped read-only, and nothing writes to them
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            data = torch.from_numpy(array)
        tensors[name] = QTensor(name, qtype.name, tuple(int(d) for d in shape), data)
    return GGUFModel(
        path, arch, tensors, file_bytes, fields, data_offset=data_start, mapping=(blob.ctypes.data, len(blob))
    )


def _unpermute(a: np.ndarray, n_head: int) -> np.ndarray:
    """Rows from llama.cpp's interleaved-pair rope order back to rotate-half order (the inverse of
    `w.reshape(n_head, 2, rows // n_head // 2, ...).swapaxes(1, 2)`); a contiguous copy."""
    rows = a.shape[0]
    return np.ascontiguousarray(a.reshape(n_head, rows // n_head // 2, 2, *a.shape[1:]).swapaxes(1, 2)).reshape(a.shape)


# transformers' model type for each architecture the quantized backend runs (its config gives shapes)
_HF_TYPES = {"gemma3": "gemma3_text"}


def hf_config(model: GGUFModel):
    """A transformers config of the file's architecture with its shapes (layers, heads, widths, vocabulary,
    special tokens), read from the metadata (llama.cpp's `<arch>.*` and `tokenizer.ggml.*` keys) as
    specdec.backends.arch.plan reads them. Raises GGUFError for an architecture the quantized backend does
    not run or a file it refuses."""
    from transformers import AutoConfig

    from specdec.backends.arch import plan

    p = plan(model)
    config = {
        "hidden_size": p.hidden,
        "intermediate_size": model.metadata(f"{model.arch}.feed_forward_length"),
        "num_hidden_layers": p.n_layers,
        "num_attention_heads": p.n_heads,
        "num_key_value_heads": p.n_kv,
        "head_dim": p.head_dim,
        "rms_norm_eps": p.eps,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(model.fields.get(f"{model.arch}.rope.freq_base", 10000.0)),
        },
        "max_position_embeddings": model.metadata(f"{model.arch}.context_length"),
        "vocab_size": model.tensors["token_embd.weight"].shape[0],  # the logits' width
        "tie_word_embeddings": "output.weight" not in model.tensors,
        "_model_name_or_path": model.fields.get("general.name", ""),
    }
    for name in ("bos", "eos", "unknown", "padding"):
        if (token := model.fields.get(f"tokenizer.ggml.{name}_token_id")) is not None:
            config[{"unknown": "unk", "padding": "pad"}.get(name, name) + "_token_id"] = token
    return AutoConfig.for_model(_HF_TYPES.get(model.arch, model.arch), **config)


def hf_tokenizer(model: GGUFModel, cache_folder: str | os.PathLike | None = None):
    """The transformers tokenizer of the file, as AutoTokenizer.from_pretrained(folder, gguf_file=name)
    builds it (slow). With cache_folder, it is saved once to cache_folder/<sha256 of the file's metadata
    bytes>/ (written under a temporary name and renamed) and loaded from there afterwards."""
    from transformers import AutoTokenizer

    if cache_folder is None:
        return AutoTokenizer.from_pretrained(model.path.parent, gguf_file=model.path.name)
    with open(model.path, "rb") as f:
        key = hashlib.sha256(f.read(model.data_offset)).hexdigest()
    final = Path(cache_folder) / key
    if (final / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(model.path.parent, gguf_file=model.path.name)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{key[:12]}-"))
    try:
        tokenizer.save_pretrained(tmp)
        os.chmod(tmp, 0o755)
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / "tokenizer_config.json").exists():  # else another process finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer
