"""Byte-level BPE for the math task and the chat convention around it.

Conversation layout (one prompt, one response):

    <|bos|><|user|>\\n{question}\\n<|assistant|>\\n{solution}<|eos|>

`format_prompt` renders everything up to and including the assistant header; the response is the
solution text followed by the eos token. Digits are split one per token, which makes arithmetic
far easier for small models. Any HF `tokenizer.json` can stand in: `ChatTokenizer.from_file` only
needs the eos/pad token strings (and a prompt template using that tokenizer's own markers).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

PAD, BOS, EOS, USER, ASSISTANT = "<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = (PAD, BOS, EOS, USER, ASSISTANT)
PROMPT_TEMPLATE = BOS + USER + "\n{question}\n" + ASSISTANT + "\n"


def format_prompt(question: str, template: str = PROMPT_TEMPLATE) -> str:
    """Chat-formatted prompt text; the model's response follows it directly."""
    return template.format(question=question)


def train_tokenizer(texts: Iterable[str], vocab_size: int, path=None) -> Tokenizer:
    """Trains a byte-level BPE (one digit per token, no prefix space) on `texts`.

    The five SPECIAL_TOKENS take ids 0..4 (pad=0). vocab_size must leave room for the 256 byte
    symbols and the specials. Saves to `path` (a tokenizer.json file) when given.
    """
    minimum = 256 + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ValueError(f"vocab_size={vocab_size} is below the byte-level minimum {minimum}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            # one digit per pre-token, keeping a leading space with it (" 12" -> " 1", "2")
            pre_tokenizers.Split(Regex(r" ?\d"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tokenizer.save(str(path))
    return tokenizer


@dataclasses.dataclass(frozen=True)
class ChatTokenizer:
    """A `tokenizers.Tokenizer` plus the ids and template the chat convention needs."""

    tokenizer: Tokenizer
    eos_id: int
    pad_id: int
    bos_id: int | None = None
    prompt_template: str = PROMPT_TEMPLATE

    @classmethod
    def from_file(
        cls,
        path,
        eos_token: str = EOS,
        pad_token: str = PAD,
        bos_token: str | None = BOS,
        prompt_template: str = PROMPT_TEMPLATE,
    ) -> ChatTokenizer:
        """Loads a tokenizer.json (or a folder holding one); token strings must be in its vocab."""
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {file}")
        tokenizer = Tokenizer.from_file(str(file))
        if "{question}" not in prompt_template:
            raise ValueError(f"prompt_template must contain '{{question}}', got {prompt_template!r}")

        def token_id(name: str, token: str) -> int:
            tid = tokenizer.token_to_id(token)
            if tid is None:
                raise ValueError(f"{file}: {name} {token!r} is not in the vocabulary")
            return tid

        return cls(
            tokenizer=tokenizer,
            eos_id=token_id("eos_token", eos_token),
            pad_id=token_id("pad_token", pad_token),
            bos_id=None if bos_token is None else token_id("bos_token", bos_token),
            prompt_template=prompt_template,
        )

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, question: str) -> list[int]:
        return self.encode(format_prompt(question, self.prompt_template))

    def encode_response(self, solution: str) -> list[int]:
        """Solution tokens followed by eos."""
        return self.encode(solution) + [self.eos_id]

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` up to (not including) the first eos; special tokens are dropped."""
        ids = [int(i) for i in ids]
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self.tokenizer.decode(ids, skip_special_tokens=True)
