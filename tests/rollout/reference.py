"""Independent references for the rollout tests: numpy processed distribution, full-forward decoding."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.models import forward


def reference_probs(logits, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """float64 probabilities [V] of the processed distribution for one logit vector [V].

    Written token by token from the definition (scale, keep the top_k largest, then walk tokens in
    descending probability until the kept mass reaches top_p) so it shares no code with
    `processed_logprobs`. Temperature 0 gives the unscaled softmax (what greedy reports).
    """
    x = np.asarray(logits, np.float64)
    if temperature == 0:
        e = np.exp(x - x.max())
        return e / e.sum()
    x = x / temperature
    order = np.argsort(-x, kind="stable")
    kept = list(order if top_k == 0 else order[:top_k])
    weights = {i: np.exp(x[i] - x[kept[0]]) for i in kept}
    total = sum(weights.values())
    probs = {i: w / total for i, w in weights.items()}
    if top_p < 1:
        nucleus, mass = [], 0.0
        for i in kept:
            nucleus.append(i)
            mass += probs[i]
            if mass >= top_p:
                break
        total = sum(probs[i] for i in nucleus)
        probs = {i: probs[i] / total for i in nucleus}
    out = np.zeros_like(x)
    for i, p in probs.items():
        out[i] = p
    return out


@functools.partial(jax.jit, static_argnums=0)
def full_forward(cfg, params, tokens):
    """Teacher-forced logits float32 [B, T, V] (jitted so fixed-shape calls compile once)."""
    return forward(cfg, params, tokens)


def padded(sequences, width: int) -> jnp.ndarray:
    """Right-pads token lists with 0 to int32 [len(sequences), width]."""
    out = np.zeros((len(sequences), width), np.int32)
    for i, seq in enumerate(sequences):
        out[i, :len(seq)] = seq
    return jnp.asarray(out)


def greedy_reference(cfg, params, prompts, max_new_tokens: int, eos_ids=()):
    """Greedy continuations by repeated full forwards (no cache): lists of (tokens, log-probs).

    Sequences are right-padded to one fixed width; causal attention makes the padding invisible
    to the positions read.
    """
    width = max(len(p) for p in prompts) + max_new_tokens
    seqs = [list(p) for p in prompts]
    outs = [([], []) for _ in prompts]
    running = [True] * len(prompts)
    for _ in range(max_new_tokens):
        logits = np.asarray(full_forward(cfg, params, padded(seqs, width)))
        for r, seq in enumerate(seqs):
            if not running[r]:
                continue
            row = logits[r, len(seq) - 1].astype(np.float64)
            token = int(np.argmax(row))
            logprob = row[token] - row.max() - np.log(np.exp(row - row.max()).sum())
            outs[r][0].append(token)
            outs[r][1].append(logprob)
            seq.append(token)
            running[r] = token not in eos_ids
    return outs
