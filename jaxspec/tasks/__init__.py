"""The verifiable math workload: problem generator, prompt loader, tokenizer and chat format."""

from jaxspec.tasks.generator import (
    DEFAULT_KINDS,
    KINDS,
    MAX_LEVEL,
    generate_problems,
    generate_recorded,
    iter_problems,
    write_dataset,
    write_problems,
)
from jaxspec.tasks.loader import load_prompts
from jaxspec.tasks.tally import StepLaw, TallyConfig
from jaxspec.tasks.tokenizer import PROMPT_TEMPLATE, SPECIAL_TOKENS, ChatTokenizer, format_prompt, train_tokenizer

__all__ = [
    "DEFAULT_KINDS",
    "KINDS",
    "MAX_LEVEL",
    "PROMPT_TEMPLATE",
    "SPECIAL_TOKENS",
    "ChatTokenizer",
    "StepLaw",
    "TallyConfig",
    "format_prompt",
    "generate_problems",
    "generate_recorded",
    "iter_problems",
    "load_prompts",
    "train_tokenizer",
    "write_dataset",
    "write_problems",
]
