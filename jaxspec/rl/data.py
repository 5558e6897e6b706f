"""Prompts for a GRPO run: loading (or generating) the prompt files and tokenising them.

Training prompts are drawn by *data position* (prompts consumed so far, `jaxspec.run.Batcher`), so
the saved position alone pins down every later batch.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jaxspec.distributed import barrier, is_main
from jaxspec.rl.config import DataConfig, GRPOConfig
from jaxspec.tasks.generator import generate_problems, write_problems
from jaxspec.tasks.loader import load_prompts
from jaxspec.tasks.tokenizer import ChatTokenizer

# Held-out problems come from a separate stream so they never share a prefix of the train stream.
_EVAL_SEED_OFFSET = 1_000_003


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """Prompt records ({"prompt", "answer"}, as `load_prompts` returns them) and their token ids."""

    records: list[dict]
    token_ids: list[list[int]]

    def __len__(self) -> int:
        return len(self.records)


def prompt_files(cfg: DataConfig, run_dir: Path) -> tuple[Path, Path | None]:
    """(training file, held-out file or None); generated into run_dir/data/ when not configured.

    Generated files are written once, so a resumed run reads exactly the same prompts.
    """
    train = Path(cfg.train) if cfg.train is not None else run_dir / "data" / "train.jsonl"
    held_out = Path(cfg.eval) if cfg.eval is not None else (run_dir / "data" / "eval.jsonl" if cfg.num_eval else None)
    if cfg.train is None and not train.exists():
        problems = generate_problems(cfg.num_train, cfg.seed, cfg.levels, cfg.kinds, tally=cfg.tally)
        write_problems(train, problems)
    if cfg.eval is None and held_out is not None and not held_out.exists():
        seen = {r["prompt"] for r in load_prompts(train, cfg.prompt_field, cfg.answer_field)}
        write_problems(
            held_out,
            generate_problems(
                cfg.num_eval,
                cfg.seed + _EVAL_SEED_OFFSET,
                cfg.levels,
                cfg.kinds,
                exclude_questions=seen,
                tally=cfg.tally,
            ),
        )
    return train, held_out


def load_prompt_set(path: Path, cfg: DataConfig, tok: ChatTokenizer) -> PromptSet:
    """Reads a prompt file and chat-formats + tokenises every prompt."""
    records = load_prompts(path, cfg.prompt_field, cfg.answer_field)
    texts = [tok.prompt_template.format(question=r["prompt"]) for r in records]
    ids = [enc.ids for enc in tok.tokenizer.encode_batch(texts, add_special_tokens=False)]
    return PromptSet(records=records, token_ids=ids)


def check_prompt_lengths(prompts: PromptSet, source: Path, max_new_tokens: int, max_positions: int) -> None:
    """ValueError when the longest prompt plus max_new_tokens exceeds the policy's context."""
    longest = max(len(ids) for ids in prompts.token_ids)
    if longest + max_new_tokens > max_positions:
        raise ValueError(
            f"{source}: the longest prompt has {longest} tokens; with max_new_tokens={max_new_tokens} "
            f"that exceeds the policy's max_position_embeddings={max_positions}"
        )


def run_prompts(
    cfg: GRPOConfig, run_dir: Path, tok: ChatTokenizer, max_positions: int
) -> tuple[PromptSet, PromptSet | None]:
    """(the training prompts, the validation prompts or None without eval.every) of a run, checked
    to fit the policy's max_positions with their responses. Process 0 generates the prompt files
    once; the other processes read them."""
    if is_main():
        prompt_files(cfg.data, run_dir)
    barrier("prompt files")
    train_file, eval_file = prompt_files(cfg.data, run_dir)
    train_set = load_prompt_set(train_file, cfg.data, tok)
    check_prompt_lengths(train_set, train_file, cfg.rollout.max_new_tokens, max_positions)
    if eval_file is None or not cfg.eval.every:
        return train_set, None
    eval_set = load_prompt_set(eval_file, cfg.data, tok)
    check_prompt_lengths(eval_set, eval_file, cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens, max_positions)
    return train_set, eval_set
