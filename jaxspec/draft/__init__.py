"""EAGLE-3 draft heads: model, public checkpoint layout, training-time-test loss, cached drafting."""

from jaxspec.draft.checkpoint import load_eagle3, save_eagle3
from jaxspec.draft.config import DraftConfig, check_compatible, default_aux_layer_ids
from jaxspec.draft.drafting import draft_extend, draft_logprobs_on_target_vocab, init_draft_cache
from jaxspec.draft.loss import Eagle3Targets, eagle3_loss, eagle3_targets, ttt_attention, ttt_forward
from jaxspec.draft.model import (
    DraftParams,
    build_vocab_maps,
    fuse,
    fuse_stacked,
    init_eagle3,
    merge_buffers,
    split_buffers,
    stack_aux,
    target_ids,
    to_target_ids,
)

__all__ = [
    "DraftConfig",
    "DraftParams",
    "Eagle3Targets",
    "build_vocab_maps",
    "check_compatible",
    "default_aux_layer_ids",
    "draft_extend",
    "draft_logprobs_on_target_vocab",
    "eagle3_loss",
    "eagle3_targets",
    "fuse",
    "fuse_stacked",
    "init_draft_cache",
    "init_eagle3",
    "load_eagle3",
    "merge_buffers",
    "save_eagle3",
    "split_buffers",
    "stack_aux",
    "target_ids",
    "to_target_ids",
    "ttt_attention",
    "ttt_forward",
]
