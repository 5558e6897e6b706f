"""The README's "Use from Python" snippet runs as written."""

import re
from pathlib import Path

import numpy as np

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(section: str) -> list[str]:
    """The ```python blocks of the README section titled `section` (a "## " heading)."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"## {section}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start : end if end > 0 else None], flags=re.S)


def test_use_from_python_snippet_runs(capsys):
    namespace: dict = {}
    exec(compile(python_blocks("Use from Python")[0], "README.md", "exec"), namespace)
    cfg, out, logits, prompts = (namespace[k] for k in ("cfg", "out", "logits", "prompts"))
    assert logits.shape == (1, len(prompts[0]), cfg.vocab_size)
    assert out.tokens.shape[0] == len(prompts) and np.isfinite(np.asarray(out.logprobs)).all()
    # The embedded head drafts for the embedded policy: more than one token per verification.
    assert out.stats["acceptance_length"] > 1.3, out.stats
    assert "\\boxed{" in capsys.readouterr().out  # the decoded answer of the tiny math policy
