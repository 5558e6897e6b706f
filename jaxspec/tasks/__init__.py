"""The verifiable math workload: problem generator, prompt loader, tokenizer and chat format."""

from jaxspec.tasks.generator import (KINDS, MAX_LEVEL, generate_problems, iter_problems, write_dataset,
                                     write_problems)
from jaxspec.tasks.loader import load_prompts
from jaxspec.tasks.tokenizer import (PROMPT_TEMPLATE, SPECIAL_TOKENS, ChatTokenizer, format_prompt,
                                     train_tokenizer)

__all__ = [
    "KINDS", "MAX_LEVEL", "PROMPT_TEMPLATE", "SPECIAL_TOKENS", "ChatTokenizer", "format_prompt",
    "generate_problems", "iter_problems", "load_prompts", "train_tokenizer", "write_dataset", "write_problems",
]
