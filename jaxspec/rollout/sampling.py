"""The policy's processed next-token distribution p, and drawing tokens from it.

`processed_logprobs` is the single definition of p (temperature, then top-k, then top-p): the
rollout samples from it, reports its log-probabilities, and the speculative verifier accepts or
rejects draft tokens against it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import kernels


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How each next token is chosen; hashable, so it can be a `jax.jit` static argument.

    temperature: >= 0; 0 means greedy (argmax of the raw logits).
    top_p: nucleus mass in (0, 1]; 1 disables nucleus filtering.
    top_k: keep the k most likely tokens (>= 0); 0 disables top-k filtering.
    max_new_tokens: >= 1, the most tokens generated per prompt (eos included).
    eos_id: token id or ids that end a sequence. None means the model config's `eos_token_id`
        (itself possibly several ids or none); an empty tuple means no eos (every row runs to
        max_new_tokens). A list is stored as a tuple.
    coupled: draw token i of row r as the Gumbel-max race of `jaxspec.kernels.tree_verify` under the
        key fold_in(fold_in(key, r), i) alone, in autoregressive and speculative rollouts alike,
        and verify drafts by that race (a child is accepted iff it is the race's winner). The law
        of every token and the acceptance of deterministic drafts are unchanged; what changes is
        that a speculative rollout then emits the autoregressive rollout's tokens under the same
        key, whatever the drafter, its depth or tree (in float32; in bfloat16 until logits that
        differ by rounding break a near-tie). Stochastic drafts (`Spec.draft_sampling`) are
        refused: their tokens follow their own noise. No effect on greedy sampling.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    eos_id: int | tuple[int, ...] | None = None
    coupled: bool = False

    def __post_init__(self):
        if not isinstance(self.coupled, (bool, np.bool_)):
            raise ValueError(f"Sampling.coupled must be True or False, got {self.coupled!r}")
        object.__setattr__(self, "coupled", bool(self.coupled))
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"Sampling.max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"Sampling.temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"Sampling.top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"Sampling.top_k must be an integer >= 0, got {self.top_k!r}")
        object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        eos = self.eos_id
        ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        if not all(_is_int(i) and i >= 0 for i in ids):
            raise ValueError(f"Sampling.eos_id must be non-negative integer token ids, got {self.eos_id!r}")
        if eos is not None:
            eos = tuple(int(i) for i in ids) if isinstance(eos, (list, tuple)) else int(eos)
        object.__setattr__(self, "eos_id", eos)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def eos_ids(self, default: int | tuple[int, ...] | None) -> tuple[int, ...]:
        """The eos ids in effect: `eos_id`, or `default` (the model config's) when it is None."""
        eos = self.eos_id if self.eos_id is not None else default
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def processed_logprobs(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """Log-probabilities of the processed distribution p over the last axis.

    logits: float32 [..., V] raw policy logits. Returns float32 [..., V]: log p, -inf for tokens
    p excludes, log-sum-exp 0 over the kept tokens.

    p is built in this order: divide the logits by `temperature`; keep the tokens whose scaled
    logit is >= the top_k-th largest (ties with it are kept; top_k = 0 or >= V keeps all); then
    keep the smallest prefix of the remaining tokens, sorted by descending probability, whose
    mass reaches `top_p` (the most likely token is always kept; tokens tied with the last kept
    probability are kept too); renormalise.

    Greedy (temperature 0) picks argmax of the logits, and the log-probability it reports is
    that of the temperature-1, unfiltered view: `log_softmax(logits)`. This function returns that
    view when temperature is 0 (its argmax is the greedy token).

    With top_k == 0 and top_p == 1 no sort is done.
    """
    logits = logits.astype(jnp.float32)
    if sampling.greedy:
        return jax.nn.log_softmax(logits, axis=-1)
    vocab = logits.shape[-1]
    top_k = sampling.top_k if 0 < sampling.top_k < vocab else 0
    x = logits / sampling.temperature
    if top_k:
        kth_largest = jax.lax.top_k(x, top_k)[0][..., -1:]
        x = jnp.where(x >= kth_largest, x, -jnp.inf)
    if sampling.top_p < 1.0:
        probs = jax.nn.softmax(x, axis=-1)
        if top_k:
            descending = jax.lax.top_k(probs, top_k)[0]
        else:
            descending = jnp.flip(jnp.sort(probs, axis=-1), axis=-1)
        cumulative = jnp.cumsum(descending, axis=-1)
        mass_before = jnp.concatenate([jnp.zeros_like(cumulative[..., :1]), cumulative[..., :-1]], axis=-1)
        in_prefix = mass_before < sampling.top_p  # a prefix: mass_before is non-decreasing
        smallest_kept = jnp.min(jnp.where(in_prefix, descending, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(probs >= smallest_kept, x, -jnp.inf)
    return jax.nn.log_softmax(x, axis=-1)


def sample(key: jax.Array, logprobs: jax.Array) -> jax.Array:
    """One token per row drawn from exp(logprobs) (Gumbel-max): [..., V] -> int32 [...]."""
    return jax.random.categorical(key, logprobs, axis=-1).astype(jnp.int32)


def choose_tokens(key: jax.Array, logits: jax.Array, sampling: Sampling) -> tuple[jax.Array, jax.Array]:
    """Next token of each row and its log-probability under p.

    logits float32 [B, V] -> (int32 tokens [B], float32 log p(token) [B]). Greedy takes the argmax
    (the key is unused) and reports log_softmax(logits) at it.
    """
    logprobs = processed_logprobs(logits, sampling)
    if sampling.greedy:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    else:
        tokens = sample(key, logprobs)
    return tokens, jnp.take_along_axis(logprobs, tokens[..., None], axis=-1)[..., 0]


def row_keys(key: jax.Array, rows: jax.Array, index: jax.Array) -> jax.Array:
    """Keys [S] of the draws for token `index` int32 [S] of rows int32 [S] (the call's row
    indices): they depend on the call's key, the row and the token's index only, so a row draws
    the same tokens in any batch, stage or slot."""
    return jax.vmap(lambda r, i: jax.random.fold_in(jax.random.fold_in(key, r), i))(rows, index)


def depth_keys(key: jax.Array, rows: jax.Array, index: jax.Array, max_depth: int) -> jax.Array:
    """Keys [S, max_depth + 1]: entry d is `row_keys`' key of token index + d of each row, the key
    of a coupled draft tree's nodes at depth d (`Sampling.coupled`)."""
    offsets = jnp.arange(max_depth + 1, dtype=jnp.int32)
    return jax.vmap(lambda d: row_keys(key, rows, index + d), out_axes=1)(offsets)


def choose_per_row(keys: jax.Array, logits: jax.Array, sampling: Sampling) -> tuple[jax.Array, jax.Array]:
    """`choose_tokens` with one key per row: keys [S], logits float32 [S, V] -> (int32 [S], float32
    log p [S]). Coupled sampling draws each row's token by the race that verifies a coupled draft
    tree's node under the same key (`kernels.tree_verify` of a lone root)."""
    logprobs = processed_logprobs(logits, sampling)
    if sampling.greedy:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    elif sampling.coupled:
        tokens = coupled_race(keys, logprobs)
    else:
        tokens = jax.vmap(sample)(keys, logprobs)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]


def coupled_race(keys: jax.Array, logprobs: jax.Array) -> jax.Array:
    """int32 [S]: each row's token drawn from exp(logprobs) float32 [S, V] by the race of a lone
    root under its key (keys [S]), as a coupled verification draws a node's token."""
    rows = logprobs.shape[0]
    column = jnp.zeros((rows, 1), jnp.int32)
    result = kernels.tree_verify(
        logprobs[:, None, :], column - 1, column, column[:, 0] + 1, keys[:, None], temperature=1.0
    )
    return result.next_token
