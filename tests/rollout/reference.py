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
        out[i, : len(seq)] = seq
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


def continuation_probs(logits, row: dict, prompt_len: int, eos: int, setting: dict) -> dict[tuple[int, ...], float]:
    """Exact probability of every continuation of up to 3 tokens (shorter when it ends in eos).

    logits [R, prompt_len + 2, V] from teacher-forced forwards of prompt + (a, b) for every pair;
    row[(a, b)] is the row of that pair. setting: reference_probs keyword arguments.
    """
    vocab, p = logits.shape[-1], prompt_len
    out = {}
    first = reference_probs(logits[0, p - 1], **setting)
    for a in range(vocab):
        if a == eos:
            out[(a,)] = first[a]
            continue
        second = reference_probs(logits[row[(a, 0)], p], **setting)
        for b in range(vocab):
            if b == eos:
                out[(a, b)] = first[a] * second[b]
                continue
            third = reference_probs(logits[row[(a, b)], p + 1], **setting)
            for c in range(vocab):
                out[(a, b, c)] = first[a] * second[b] * third[c]
    assert abs(sum(out.values()) - 1) < 1e-9
    return out


def one_step_law(p: np.ndarray, q: np.ndarray | None, accept_scale: float = 1.0) -> np.ndarray:
    """float64 [V]: law of the first token a speculative step emits at a node with policy p [V] and
    one draft child: the argmax of p (q None, deterministic) or a draw from q [V]. accept_scale != 1
    is a biased verifier that accepts the draft with min(1, s * p / q) (s * p for deterministic);
    the residual is what a correct verifier uses: p without the draft token, or norm((p - q)+)."""
    if q is None:
        d = int(np.argmax(p))
        taken = min(1.0, accept_scale * p[d])
        out = p * (1.0 - taken) / (1.0 - p[d]) if p[d] < 1 else np.zeros_like(p)
        out[d] = taken
        return out
    with np.errstate(divide="ignore", invalid="ignore"):
        accept = np.where(q > 0, np.minimum(1.0, accept_scale * p / q), 0.0)
    residual = np.maximum(p - q, 0.0)
    rejected = np.sum(q * (1.0 - accept))
    return q * accept + (rejected * residual / residual.sum() if residual.sum() > 0 else 0.0)


def speculative_chain_law(policy, draft, length: int, eos: int, accept_scale: float = 1.0) -> dict[tuple, float]:
    """Exact law of continuations of up to `length` tokens (ending at the first eos) sampled by the
    first token from the policy and then speculative chain steps: policy(prefix) -> p [V],
    draft(prefix) -> q [V] or None (deterministic drafts: the argmax of p). In a chain the token
    after an accepted draft is decided at the next node exactly as after a new step's root, so
    every later token follows `one_step_law` at its prefix."""
    out, frontier = {}, {(): 1.0}
    for i in range(length):
        nxt = {}
        for prefix, mass in frontier.items():
            p = policy(prefix)
            law = p if i == 0 else one_step_law(p, draft(prefix), accept_scale)
            for y in np.flatnonzero(law > 0):
                seq = prefix + (int(y),)
                (out if int(y) == eos or i == length - 1 else nxt)[seq] = mass * law[y]
        frontier = nxt
    return out
