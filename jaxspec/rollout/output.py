"""What a rollout returns."""

from __future__ import annotations

from typing import NamedTuple

import jax


class RolloutOutput(NamedTuple):
    """Generated continuations of a batch of B prompts, N = max_new_tokens.

    tokens: int32 [B, N]; after a row's first eos the pad id (cfg.pad_token_id, or 0).
    lengths: int32 [B] tokens emitted per row, the eos included.
    logprobs: float32 [B, N] log p of each emitted token under the processed distribution
        (`processed_logprobs`); 0 past the row's length.
    stats: "steps" (decode-loop iterations; the first token comes from the prefill logits),
        "stage_rows" (the loop's batch sizes, `jaxspec.rollout.stages`) and "stage_steps" (the
        iterations run at each of them),
        "acceptance_length" (tokens per step per row: 1.0 without speculation),
        "acceptance_rate_per_position" (float32 [k], empty without speculation),
        "generated_tokens" (sum of lengths); speculative rollouts add "drafted_tokens" and
        "accepted_tokens" (definitions in `jaxspec.rollout.speculative.stats.summarize`).
    experts: None, or with `generate(..., record_experts=True)` the experts a mixture-of-experts
        policy's router chose at every position, [B, P + N, L_sparse, k] in
        `moe.expert_id_dtype(E)` (uint8 up to 256 experts, else int16), P the padded prompt width
        (the prompt bucket): entry [b, t, j] holds sparse layer j's top-k (descending probability)
        at position t of row b's own sequence, its prompt at [0, p_b) and response token i at
        p_b + i, whatever the other rows' prompt lengths. Positions [0, p_b + lengths[b] - 1) hold
        what the policy chose there; the others (the prompt bucket's padding, the last emitted
        token, past the response) hold unspecified ids in [0, E) (`jaxspec.rollout.experts`).
    """

    tokens: jax.Array
    lengths: jax.Array
    logprobs: jax.Array
    stats: dict
    experts: jax.Array | None = None
