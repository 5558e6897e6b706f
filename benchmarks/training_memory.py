"""Device memory of the training programs, from XLA's analysis of their compilation (nothing runs).

Compiles the GRPO minibatch update (with and without the online EAGLE-3 loss) and the draft
head's train step on abstract arrays of the given shapes, for the backend JAX has, and prints
the temporaries and arguments of each. The policy shape is an HF config.json (default: the
`small` workload's, with its 758-token vocabulary):

    PYTHONPATH=. python3 benchmarks/training_memory.py --grpo 64x1152 32x1152 --draft 16x640 64x640
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from jaxspec.draft import init_eagle3, split_buffers
from jaxspec.draft.config import DraftConfig
from jaxspec.models import init_params
from jaxspec.models.config import ModelConfig

SMALL = ModelConfig(
    family="qwen3",
    vocab_size=758,
    hidden_size=1024,
    intermediate_size=3072,
    num_layers=16,
    num_heads=16,
    num_kv_heads=8,
    head_dim=64,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
DRAFT_VOCAB = 512
S = jax.ShapeDtypeStruct


def _shape(text: str) -> tuple[int, int]:
    rows, width = text.lower().split("x")
    return int(rows), int(width)


def _report(name: str, compiled, seconds: float, what: str = "compiled") -> None:
    analysis = compiled.memory_analysis()
    print(
        f"{name}: temporaries {analysis.temp_size_in_bytes / 2**30:.1f} GiB, arguments "
        f"{analysis.argument_size_in_bytes / 2**30:.1f} GiB ({what} in {seconds:.0f} s)",
        flush=True,
    )


def _compiled(compile_fn):
    """(compile_fn(), seconds it took)."""
    start = time.perf_counter()
    return compile_fn(), time.perf_counter() - start


def grpo_update(
    cfg: ModelConfig,
    rows: int,
    width: int,
    new_tokens: int,
    online: bool,
    draft_vocab: int = DRAFT_VOCAB,
    ttt_steps: int = 7,
) -> None:
    """The compiled update of `jaxspec.rl.step.update_fn` on packed rows [rows, width]; the online
    head has a `draft_vocab`-token vocabulary and unrolls `ttt_steps` steps."""
    from jaxspec.rl.batch import PackedRows
    from jaxspec.rl.config import GRPOLossConfig, PolicyOptimConfig
    from jaxspec.rl.config import OnlineDraftConfig as OnlineConfig
    from jaxspec.rl.online_draft import OnlineDraft, OnlineDraftState
    from jaxspec.rl.step import policy_optimizer, update_fn
    from jaxspec.rollout.sampling import Sampling

    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    optim = PolicyOptimConfig(learning_rate=1e-5, warmup_steps=10)
    opt_state = jax.eval_shape(lambda p: policy_optimizer(optim).init(p), params)
    draft = weights = buffers = draft_opt = None
    if online:
        dcfg = DraftConfig.for_policy(cfg, draft_vocab)
        draft = OnlineDraft(dcfg=dcfg, train=OnlineConfig(online=True, ttt_steps=ttt_steps))
        head = jax.eval_shape(lambda: OnlineDraftState.init(draft, init_eagle3(cfg, jax.random.key(0), draft_vocab)[1]))
        weights, buffers, draft_opt = head.update_args()
    sequences = rows  # the worst case: one rollout per packed row
    minibatch = PackedRows(
        tokens=S((rows, width), jnp.int32),
        segment_ids=S((rows, width), jnp.int32),
        seq_resp_mask=S((rows, width), bool) if online else None,
        resp_index=S((sequences, new_tokens), jnp.int32),
        resp_tokens=S((sequences, new_tokens), jnp.int32),
        advantages=S((sequences,), jnp.float32),
        prox_logp=S((sequences, new_tokens), jnp.float32),
        loss_mask=S((sequences, new_tokens), bool),
    )
    update = update_fn(
        cfg, Sampling(temperature=1.0, max_new_tokens=new_tokens), GRPOLossConfig(), optim, "bfloat16", True, draft
    )
    compiled, seconds = _compiled(lambda: update.compile(params, opt_state, weights, buffers, draft_opt, minibatch))
    for part, program in compiled.programs().items():
        _report(
            f"GRPO update {rows}x{width}, online draft {'on' if online else 'off'}: {part}",
            program,
            seconds,
            "all its programs compiled",
        )


def draft_step(cfg: ModelConfig, batch: int, width: int) -> None:
    """`jaxspec.draft_training.train.train_step` on rows [batch, width] (bf16 policy, 7 TTT steps)."""
    from jaxspec.draft_training.config import HeadLossConfig, HeadOptimConfig
    from jaxspec.draft_training.train import train_step
    from jaxspec.optim import make_optimizer

    dcfg = DraftConfig.for_policy(cfg, DRAFT_VOCAB)
    weights, buffers = split_buffers(jax.eval_shape(lambda: init_eagle3(cfg, jax.random.key(0), DRAFT_VOCAB)[1]))
    policy = jax.eval_shape(lambda: jax.tree.map(lambda x: x.astype(jnp.bfloat16), init_params(cfg, jax.random.key(0))))
    optim = HeadOptimConfig(learning_rate=3e-4)
    opt_state = jax.eval_shape(lambda w: make_optimizer(optim, 1000)[0].init(w), weights)
    rows = {
        "tokens": S((batch, width), jnp.int32),
        "loss_mask": S((batch, width), bool),
        "attn_mask": S((batch, width), bool),
    }
    _report(
        f"draft train step {batch}x{width}",
        *_compiled(
            lambda: train_step.lower(
                cfg, dcfg, optim, 1000, HeadLossConfig(), weights, opt_state, buffers, policy, rows
            ).compile()
        ),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default=None, help="HF config.json of the policy (default: the small workload's)")
    p.add_argument("--grpo", type=_shape, nargs="*", default=[], help="ROWSxWIDTH of GRPO minibatches")
    p.add_argument("--new-tokens", type=int, default=1024, help="max_new_tokens of the GRPO rollouts")
    p.add_argument("--draft-vocab", type=int, default=DRAFT_VOCAB, help="the online head's vocabulary")
    p.add_argument("--ttt-steps", type=int, default=7, help="the online head's unrolled steps")
    p.add_argument("--draft", type=_shape, nargs="*", default=[], help="BATCHxWIDTH of draft train steps")
    args = p.parse_args()
    cfg = SMALL if args.policy is None else ModelConfig.from_json(args.policy)
    print(f"backend: {jax.devices()[0].device_kind}")
    for rows, width in args.grpo:
        for online in (False, True):
            grpo_update(cfg, rows, width, args.new_tokens, online, args.draft_vocab, args.ttt_steps)
    for batch, width in args.draft:
        draft_step(cfg, batch, width)


if __name__ == "__main__":
    main()
