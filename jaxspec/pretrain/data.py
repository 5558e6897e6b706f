"""Corpus preparation and batching for supervised pretraining.

`prepare_problems` / `prepare_tokenizer` write the generated train/held-out problem files and the
tokenizer into the run directory (reusing them when already there, so a resumed run sees identical
data); `pack` packs the tokenized training set into fixed-width rows of several examples each
(static shapes, little padding); batches of its rows are drawn by data position
(`jaxspec.run.Batcher`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from jaxspec.models.packed_attention import packing_cap
from jaxspec.pretrain.config import DataConfig
from jaxspec.tasks.generator import generate_problems, write_problems
from jaxspec.tasks.tokenizer import ChatTokenizer, train_tokenizer

# The held-out set is drawn from its own seed (and skips every training question).
_EVAL_SEED_OFFSET = 1_000_003


@dataclasses.dataclass(frozen=True)
class PackedSet:
    """Training examples packed into fixed-width rows (several chat examples per row).

    tokens: int32 [R, max_len + 1], pad id after the last example of a row. The model reads
        tokens[:, :-1] and predicts tokens[:, 1:], so inputs and targets are both max_len wide.
    segment_ids: int32 [R, max_len + 1], 1, 2, ... per example within its row, 0 on padding.
    weights: float32 [R, max_len], 1 where target tokens[:, t + 1] is a response token (solution or
        eos) of the same example as input t, else 0 (prompts, padding, example boundaries).
    """

    tokens: np.ndarray
    segment_ids: np.ndarray
    weights: np.ndarray
    num_examples: int
    dropped: int  # examples longer than max_len tokens

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def take(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """{"tokens", "segment_ids": [B, L+1], "weights": [B, L]} of the B row ids `rows`."""
        return {"tokens": self.tokens[rows], "segment_ids": self.segment_ids[rows], "weights": self.weights[rows]}


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def prepare_problems(cfg: DataConfig, data_dir: Path, reuse: bool = False) -> tuple[list[dict], list[dict]]:
    """(train, held-out) problem lists, generated into data_dir/{train,eval}.jsonl.

    reuse: read the files already there instead (a resumed run), when both exist.
    """
    train_file, eval_file = data_dir / "train.jsonl", data_dir / "eval.jsonl"
    if reuse and train_file.exists() and eval_file.exists():
        return _read_jsonl(train_file), _read_jsonl(eval_file)
    train = generate_problems(cfg.num_train, cfg.seed, cfg.levels, cfg.kinds, tally=cfg.tally)
    seen = {p["question"] for p in train}
    held_out = generate_problems(
        cfg.num_eval, cfg.seed + _EVAL_SEED_OFFSET, cfg.levels, cfg.kinds, exclude_questions=seen, tally=cfg.tally
    )
    write_problems(train_file, train)
    write_problems(eval_file, held_out)
    return train, held_out


def prepare_tokenizer(cfg: DataConfig, train: list[dict], path: Path, reuse: bool = False) -> ChatTokenizer:
    """Copies `cfg.tokenizer` or trains a BPE on the training corpus, saved at `path`.

    reuse: load the tokenizer already at `path` instead (a resumed run), when it exists.
    """
    if not (reuse and path.exists()):
        if cfg.tokenizer is not None:
            source = Path(cfg.tokenizer)
            if not source.is_file():
                raise FileNotFoundError(f"data.tokenizer: file not found: {source}")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(source.read_bytes())
        else:
            texts = (text for p in train for text in (p["question"], p["solution"]))
            train_tokenizer(texts, cfg.vocab_size, path)
    return ChatTokenizer.from_file(
        path,
        eos_token=cfg.eos_token,
        pad_token=cfg.pad_token,
        bos_token=cfg.bos_token,
        prompt_template=cfg.prompt_template,
    )


def encode_examples(problems: list[dict], tok: ChatTokenizer) -> list[tuple[list[int], int]]:
    """(prompt + solution + eos token ids, prompt length) per problem, in the chat format."""
    prompts = tok.tokenizer.encode_batch(
        [tok.prompt_template.format(question=p["question"]) for p in problems], add_special_tokens=False
    )
    responses = tok.tokenizer.encode_batch([p["solution"] for p in problems], add_special_tokens=False)
    return [(prompt.ids + response.ids + [tok.eos_id], len(prompt.ids)) for prompt, response in zip(prompts, responses)]


def pack(examples: list[tuple[list[int], int]], max_len: int, pad_id: int, seed: int) -> PackedSet:
    """Packs examples, in a seeded random order, greedily into rows of max_len + 1 tokens, at most
    `packed_attention.packing_cap(max_len)` per row (the bound of cuDNN's packed layout, where selected).

    An example of n tokens occupies n slots; examples with n > max_len are dropped (and counted).
    """
    order = np.random.default_rng(seed).permutation(len(examples))
    width = max_len + 1
    cap = packing_cap(max_len) or len(examples)
    rows: list[list[tuple[list[int], int]]] = [[]]
    used = 0
    dropped = 0
    for i in order:
        ids, prompt_len = examples[i]
        if len(ids) > max_len:
            dropped += 1
            continue
        if used + len(ids) > width or len(rows[-1]) == cap:
            rows.append([])
            used = 0
        rows[-1].append((ids, prompt_len))
        used += len(ids)
    if not rows[-1]:
        raise ValueError(f"data.max_len={max_len}: every training example is longer; raise data.max_len")
    tokens = np.full((len(rows), width), pad_id, np.int32)
    segment_ids = np.zeros((len(rows), width), np.int32)
    weights = np.zeros((len(rows), max_len), np.float32)
    for r, row in enumerate(rows):
        offset = 0
        for segment, (ids, prompt_len) in enumerate(row, start=1):
            n = len(ids)
            tokens[r, offset : offset + n] = ids
            segment_ids[r, offset : offset + n] = segment
            # input t predicts token t + 1: response tokens sit at [offset + prompt_len, offset + n)
            weights[r, offset + max(prompt_len, 1) - 1 : offset + n - 1] = 1.0
            offset += n
    return PackedSet(
        tokens=tokens, segment_ids=segment_ids, weights=weights, num_examples=len(examples) - dropped, dropped=dropped
    )
