"""Files shipped with the package: the tiny math policy and its EAGLE-3 head used by the CPU demo
(see README.md)."""

from __future__ import annotations

from pathlib import Path

TINY_POLICY = Path(__file__).resolve().parent / "tiny-policy"
TINY_EAGLE3 = Path(__file__).resolve().parent / "tiny-eagle3"


def tiny_policy_path() -> Path:
    """HF folder of the embedded tiny policy (config.json, model.safetensors, tokenizer.json)."""
    return _present(TINY_POLICY, "embedded tiny policy")


def tiny_eagle3_path() -> Path:
    """Folder of the embedded tiny policy's EAGLE-3 head in the public layout (config.json,
    model.safetensors), for `jaxspec.draft.load_eagle3`."""
    return _present(TINY_EAGLE3, "embedded EAGLE-3 head")


def _present(folder: Path, what: str) -> Path:
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{what} missing: {folder} (see jaxspec/assets/README.md)")
    return folder
