"""Files shipped with the package: the tiny math policy used by the CPU demo (see README.md)."""

from __future__ import annotations

from pathlib import Path

TINY_POLICY = Path(__file__).resolve().parent / "tiny-policy"


def tiny_policy_path() -> Path:
    """HF folder of the embedded tiny policy (config.json, model.safetensors, tokenizer.json)."""
    if not (TINY_POLICY / "config.json").is_file():
        raise FileNotFoundError(f"embedded tiny policy missing: {TINY_POLICY} (see jaxspec/assets/README.md)")
    return TINY_POLICY
