"""The verify-cost curve V(n) of adaptive k: what one target forward over n new tokens costs, in
ms, at the current context length; and its on-disk cache.

Timing the curve takes (k_max + 1) x 3 forwards at each of two contexts, paid inside the first
generation's prefill. It is cached per model, backend, torch thread count and processor under
`<specdec cache>/verify-costs/` (specdec.models.weights.cache_dir, which honours $SPECDEC_CACHE),
so a one-shot `specdec generate -k auto` pays it once per machine. The file, one per key:

    {"schema": 1, "key": {...what the key was built from...},
     "ms": {"1": V(1), "2": V(2), ...},                      the curve as last saved, in ms
     "shapes": {"<context>": {"1": 1.0, "2": V(2)/V(1), ...}, ...}}   shape timed per context

A file that cannot be read, or was written under another schema or key, is ignored (the curve is
timed again and the file replaced).
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import platform
import re
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from specdec.backends.qkernel import cpu_field
from specdec.models.load import synchronize
from specdec.models.weights import atomic_write, cache_dir

SCHEMA = 1  # of the cache file; a file with another one is ignored


def interpolate(curve: dict[int, float], n: int) -> float | None:
    """curve[n] if measured, else linear between the nearest measured points on either side;
    None when n lies outside them (each caller extrapolates its own way)."""
    if n in curve:
        return curve[n]
    lower = max((x for x in curve if x < n), default=None)
    upper = min((x for x in curve if x > n), default=None)
    if lower is None or upper is None:
        return None
    return curve[lower] + (curve[upper] - curve[lower]) * (n - lower) / (upper - lower)


def folder(cache: str | Path | None = None) -> Path:
    """Where verify-cost curves are cached: <cache>/verify-costs, `cache` as for
    specdec.models.weights.cache_dir (tests point it at a temporary folder)."""
    return cache_dir(cache) / "verify-costs"


def processor(device: torch.device) -> str:
    """The name of what runs the forwards: the GPU's on CUDA, else the CPU's model name."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_field("model name") or platform.processor() or platform.machine()


def cache_key(model) -> dict:
    """What a model's verify costs depend on: the model (its name, shape, dtypes and parameter
    count, which tell weights of another size apart cheaply; a quantized model's kernel path, KV cache
    dtype and the kernels' source digest),
    the backend, the device and its processor, torch's thread count and version."""
    config = model.config
    if model.gguf is not None:  # quantized: the file's types and size tell it apart
        dtype, parameters = model.precision, model.gguf.file_bytes
        from specdec.backends.qkernel import source_digest

        dtype += f", {model.lean().kernel}, kernels {source_digest()}"  # activations, KV cache, the kernels' code
    else:
        params = list(model.hf.parameters())
        dtype = ",".join(sorted({str(p.dtype).removeprefix("torch.") for p in params}))
        parameters = sum(p.numel() for p in params)
    return {
        "model": model.name,
        "arch": getattr(config, "model_type", None),
        "hidden_size": getattr(config, "hidden_size", None),
        "layers": getattr(config, "num_hidden_layers", None),
        "vocab": getattr(config, "vocab_size", None),
        "dtype": dtype,
        "parameters": parameters,
        "backend": model.backend,
        "device": model.device.type,
        "processor": processor(model.device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def cache_file(key: dict, cache: str | Path | None = None) -> Path:
    """The cache file of a key: the model's name (readable) and a hash of the whole key."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(str(key["model"])).name)[:64] or "model"
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return folder(cache) / f"{name}-{digest}.json"


def forget(name: str, cache: str | Path | None = None) -> list[Path]:
    """Delete every cached verify-cost curve of the model `name` (a registry name, path or hub id, as
    loaded: all its thread counts, dtypes and processors), so that the next run times it again.
    Returns the files deleted."""
    stem = cache_file({"model": name}, cache).name.rsplit("-", 1)[0]
    files = folder(cache).glob(f"{glob.escape(stem)}-*.json")
    gone = [f for f in files if re.fullmatch(r"[0-9a-f]{16}", f.stem[len(stem) + 1 :])]  # not another model's
    for f in gone:
        f.unlink(missing_ok=True)
    return gone


@dataclass
class VerifyCosts:
    """Estimates of V(n) in ms, n = new tokens in one target forward, at the current context length.

    The curve's shape V(n)/V(1) is timed back to back (calibrate) at a few context lengths, since
    attention over the cache makes it steeper as the context grows; between them the shape is
    interpolated linearly in the context length (at()). Every timed round moves one level, V(1),
    which scales the whole curve, so a length the policy rarely chooses is not left at its
    calibration time while the lengths it uses pick up every slow round. Lengths outside the
    calibrated ones (and everything before calibration) keep running averages of their own.

    A saved shape can be wrong for this machine now (timed while another process ran): when the
    rounds at a context run, relative to one another, a factor `drift` off it (V(n) measured over
    V(n) predicted, averaged per n, differing that much between two lengths n, each seen
    `drift_rounds` times), that shape is dropped from the curve and its file, and the next
    calibrate() times it again. A uniform slow-down only moves the level.

    Several sequences decoded at once (specdec.batch, the server) each plan over a fork(): the
    level and the timed shapes are shared, the current shape (their context's) is each one's own.

    path: the cache file (for_model); None keeps the curve in memory only.
    """

    ema: float = 0.3  # weight of the newest observation
    optimistic_slope: float = 0.25  # beyond the tried n: V(n + 1) - V(n) = slope * V(1)
    spacing: float = 4.0  # a context within this factor of a timed one needs no timing (docs/adaptive-k.md)
    ahead_max: int = 256  # calibrate() fills at most this many tokens to time the context ahead
    ms: dict[int, float] = field(default_factory=dict)  # V(1), the level; V(n) for n outside the shape
    shape: dict[int, float] = field(default_factory=dict)  # V(n) / V(1) at the current context
    shapes: dict[int, dict[int, float]] = field(default_factory=dict)  # context -> shape there
    step: int = 16  # at() redoes the interpolation after the context moved this many tokens
    drift: float = 1.5  # rounds this factor off the shape, relative to one another: time it again
    drift_rounds: int = 8  # observations of each of two lengths before drift is judged
    path: Path | None = field(default=None, repr=False, compare=False)
    _at: tuple[int, int] = (-1 << 30, 0)  # (context, number of shapes) of the last interpolation
    _off: dict[int, tuple[float, int]] = field(default_factory=dict, repr=False)  # n -> (mean log ratio, rounds)
    _key: dict | None = field(default=None, repr=False, compare=False)
    _version: list[int] = field(default_factory=lambda: [0], repr=False, compare=False)  # of ms; shared by forks
    _cached: tuple = field(default=(None, None, {}), repr=False, compare=False)  # (version, shape, points)

    @classmethod
    def for_model(cls, model, cache: str | Path | None = None) -> VerifyCosts:
        """The verify-cost curve of `model` on this machine: the cached one when there is one (it
        counts as calibrated at its contexts), else empty until calibrate() times and saves it.
        cache: the specdec cache folder (default: cache_dir()'s)."""
        key = cache_key(model)
        costs = cls(path=cache_file(key, cache), _key=key)
        costs.load()
        return costs

    def fork(self) -> VerifyCosts:
        """The same curve for another sequence decoded at the same time: it shares the level, the
        running averages and the timed shapes (a calibration or a timed round through one is
        every fork's, saved to the same file), and keeps its own current shape, context and drift
        statistics, so that one sequence's context never moves another's curve."""
        return replace(self, shape={}, _at=(-1 << 30, 0), _off={}, _cached=(None, None, {}))

    def load(self) -> bool:
        """Read the cached curve from `path`; False (nothing changed) when there is none or it
        cannot be used: unreadable, not JSON, another schema or key, or values out of range."""
        if self.path is None or not self.path.exists():
            return False
        try:
            data = json.loads(self.path.read_text())
            if data["schema"] != SCHEMA or (self._key is not None and data["key"] != self._key):
                return False
            ms = {int(n): float(v) for n, v in data["ms"].items()}
            shapes = {int(c): {int(n): float(r) for n, r in shape.items()} for c, shape in data["shapes"].items()}
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return False
        values = list(ms.values()) + [r for s in shapes.values() for r in s.values()]
        if 1 not in ms or not shapes or any(1 not in s for s in shapes.values()):
            return False
        if not all(math.isfinite(v) and v > 0 for v in values):
            return False
        self.ms.clear()
        self.ms.update(ms)
        self.shapes.clear()
        self.shapes.update(shapes)
        self.shape, self._at = {}, (-1 << 30, 0)
        self._version[0] += 1
        return True

    def save(self) -> None:
        """Write the curve to `path` (if any) atomically: a reader never sees half a file. A cache
        folder that cannot be written is warned about, and the curve stays in memory."""
        if self.path is None:
            return
        data = {
            "schema": SCHEMA,
            "key": self._key,
            "ms": {str(n): v for n, v in sorted(self._points().items())},
            "shapes": {
                str(c): {str(n): r for n, r in sorted(shape.items())} for c, shape in sorted(self.shapes.items())
            },
        }
        text = json.dumps(data, indent=1)
        try:
            atomic_write(self.path, lambda tmp: Path(tmp).write_text(text))
        except OSError as e:
            warnings.warn(f"could not cache the verify-cost curve in {self.path}: {e}", stacklevel=2)

    def observe(self, n: int, ms: float) -> None:
        """A timed forward over n new tokens took `ms`: moves the level through the current shape
        when n is in it, else the running average of V(n) itself."""
        if n in self.shape:
            if ms > 0:
                mean, rounds = self._off.get(n, (0.0, 0))
                off = math.log(ms / (self.ms[1] * self.shape[n]))
                self._off[n] = (off if not rounds else (1 - self.ema) * mean + self.ema * off, rounds + 1)
            self.ms[1] = (1 - self.ema) * self.ms[1] + self.ema * ms / self.shape[n]
            self._version[0] += 1
            self._check_drift()
            return
        old = self.ms.get(n)
        self.ms[n] = ms if old is None else (1 - self.ema) * old + self.ema * ms
        self._version[0] += 1

    def _check_drift(self) -> None:
        """Drop the shapes the current one comes from when the rounds drift off it (see the class)."""
        seen = [mean for mean, rounds in self._off.values() if rounds >= self.drift_rounds]
        if len(seen) < 2 or max(seen) - min(seen) <= math.log(self.drift):
            return
        context = self._at[0]
        below = max((c for c in self.shapes if c <= context), default=None)
        above = min((c for c in self.shapes if c >= context), default=None)
        for c in {below, above} - {None}:
            del self.shapes[c]
        self._off.clear()
        self.save()

    def known(self) -> bool:
        return bool(self.ms)

    def needs(self, context: int) -> bool:
        """Whether no shape has been timed within a factor `spacing` of this context length."""
        return not any(c / self.spacing <= context <= c * self.spacing for c in self.shapes)

    def calibrate(self, kv, context: list[int], n_max: int, ahead: int = 0, repeats: int = 3) -> None:
        """Time V(1..n_max) on kv (a target cache holding the prompt; left as it was), the fastest
        of `repeats` passes each, so that the choice of k rests on the measured curve rather than
        on an extrapolation (on a CPU the curve is not smooth: kernels are chosen by the number of
        rows). Times it at len(kv) and, with ahead > 0, at len(kv) + min(ahead, ahead_max) (the
        cache first filled with that many tokens of the context, then rolled back): the context a
        generation of `ahead` tokens reaches, or toward it (not on a cache with sliding-window
        layers, which can undo only its last forward). Skips a length within `spacing` of one
        already timed (or loaded). The first calibration also sets the level; rounds then move it.
        Each newly timed shape is saved to `path`."""
        keep = len(kv)
        if kv.sliding:  # a sliding-window cache can undo only its last forward
            ahead = 0
        for at in (keep, keep + min(ahead, self.ahead_max)) if ahead else (keep,):
            if not self.needs(at) or at >= kv.model.n_ctx - 1:
                continue
            if at > keep:
                kv.extend(_repeated(context, at - keep), all_logits=False)
            self._time(kv, context, min(n_max, kv.model.n_ctx - at), repeats)
            kv.rollback(keep)
            self.save()
        self.at(keep)

    def _time(self, kv, context: list[int], n_max: int, repeats: int) -> None:
        here = len(kv)
        block = _repeated(context, n_max)
        best: dict[int, float] = {}
        for _ in range(repeats):
            for n in range(1, n_max + 1):
                synchronize(kv.model.device)
                start = time.perf_counter()
                kv.extend(block[:n])
                synchronize(kv.model.device)
                best[n] = min(best.get(n, math.inf), (time.perf_counter() - start) * 1e3)
                kv.rollback(here)
        if not self.shapes:  # the first calibration also sets the level
            self.ms.update(best)
            self._version[0] += 1
        self.shapes[here] = {n: best[n] / best[1] for n in best}

    def at(self, context: int) -> None:
        """Use the shape at this context length: interpolated between the two nearest timed
        lengths, the nearest one's outside them. The level (V(1)) is kept. Cheap when called every
        round: redone only after the context moved by `step` tokens or a new calibration."""
        moved = abs(context - self._at[0]) >= self.step
        if not self.shapes or (not moved and self._at[1] == len(self.shapes)):
            return
        self._at = (context, len(self.shapes))
        below = max((c for c in self.shapes if c <= context), default=None)
        above = min((c for c in self.shapes if c >= context), default=None)
        if below is None or above is None or below == above:
            shape = self.shapes[below if above is None else above]
        else:
            w = (context - below) / (above - below)
            lo, hi = self.shapes[below], self.shapes[above]
            shape = {n: (1 - w) * lo[n] + w * hi[n] for n in lo.keys() & hi.keys()}
        if shape != self.shape:
            self.shape = shape
            self._off.clear()

    def _points(self) -> dict[int, float]:
        """The curve's measured points in ms: the level through the current shape, and the running
        averages of the lengths outside it (kept until ms or the shape changes: read every round)."""
        if not self.shape:
            return self.ms
        version, shape, points = self._cached
        if version != self._version[0] or shape is not self.shape:
            level = self.ms[1]
            points = {**self.ms, **{m: level * ratio for m, ratio in self.shape.items()}}
            self._cached = (self._version[0], self.shape, points)
        return points

    def __call__(self, n: int) -> float:
        """Estimated V(n) in ms (0 when nothing has been timed yet)."""
        points = self._points()
        if not points:
            return 0.0
        inside = interpolate(points, n)
        if inside is not None:
            return inside
        first, last = min(points), max(points)
        v1 = points.get(1, points[first] / (1 + self.optimistic_slope * (first - 1)))
        if n < first:
            return max(0.0, points[first] - self.optimistic_slope * v1 * (first - n))
        return points[last] + self.optimistic_slope * v1 * (n - last)


def _repeated(tokens: list[int], n: int) -> list[int]:
    """n tokens: `tokens` repeated (filler of a realistic kind for timing forwards)."""
    return (tokens * (n // max(len(tokens), 1) + 1))[:n]
