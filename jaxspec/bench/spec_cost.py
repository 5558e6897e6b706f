"""`jaxspec bench spec-cost`: what each piece of a speculative step costs on a larger policy, and
the speedup those costs imply.

Random bf16 weights in the shape of each `--model` (an HF config.json, as `bench decode`) and a
random EAGLE-3 head for it (`init_eagle3`: the policy's hidden size, `--draft-vocab` draft tokens,
the default aux layers). B rows whose KV caches hold `--context` tokens; the policy and head caches
have context + max(N) slots and are donated to every step, so they update in place as in the
rollout loops. Each piece is one jitted program, timed as the median of `--iters` runs after
warm-up (milliseconds):

  decode      one autoregressive step: `extend` of 1 token + `choose_tokens` (processed log-probs,
              sampling at temperature 1), as `jaxspec.rollout.engine` runs it.
  verify(N)   one policy `extend` of N chain nodes (ancestor tree mask, the head's 3 aux layers
              returned) + processed log-probs of all N nodes + `jaxspec.kernels.tree_verify`;
              kernel(N) is `tree_verify` alone on float32 log-probs [B, N, V].
  draft       one head step (`draft_extend` of 1 token) + processed log-probs over the draft
              vocabulary + top-1 mapped to policy ids.
  fuse        the head's fc of the 3 aux layers for 1 token.

verify(N) / decode: how much more one verification forward over N nodes costs than one decode step.
The adaptive depth's cost model (`SpecConfig.verify_token_cost`, `draft_token_cost`) at each batch:
verify_token_cost, the least-squares slope of verify(N) / decode - 1 against N - 1 (through 0),
and draft_token_cost = draft / decode; the verify_token_cost pairs [batch, cost] of each model are
printed as a config line.
PROJECTION (computed, not measured): chain drafting with k draft tokens and acceptance length
tau(k) (tokens emitted per step and row) read from a `jaxspec bench spec` JSON (`--acceptance`:
rows "eagle3 chain k=K", the same batch when present, else any) costs k*draft + fuse + verify(k+1)
per step and emits tau tokens, so projected speedup = decode * tau / (k*draft + fuse + verify(k+1))
and efficiency = speedup / tau. The node counts k + 1 it needs are timed besides `--nodes`.
Mixture-of-experts models (e.g. configs/models/qwen3-30b-a3b.json) also report the expected
distinct experts per sparse layer that decode (B tokens) and verify(N) (B * N tokens) run under
uniform routing, E * (1 - (1 - k/E)^tokens): `experts_decode` and `experts_verify`.
A (model, batch) whose weights + caches + activations (an estimate) exceed the device's free
memory is skipped with a note (no check where the device reports no limit, e.g. CPU).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import kernels
from jaxspec.bench.timing import median_seconds, out_of_memory, print_table, write_results
from jaxspec.draft import DraftConfig, draft_extend, fuse, init_draft_cache, init_eagle3, to_target_ids
from jaxspec.models import ModelConfig, cache_bytes, extend, init_cache, init_params
from jaxspec.models.moe import expected_distinct_experts
from jaxspec.rollout.compiler_options import rollout_compiler_options, splits_k
from jaxspec.rollout.memory import check_fits
from jaxspec.rollout.sampling import Sampling, choose_tokens, processed_logprobs
from jaxspec.rollout.speculative.tree import ancestor_mask
from jaxspec.rollout.weights import rollout_weights

CHAIN = re.compile(r"^eagle3 chain k=(\d+)$")
MAX_K = 7
SAMPLING = Sampling(temperature=1.0)
DTYPE = jnp.bfloat16
_F32 = 4


def load_acceptance(path) -> dict[int, dict[int, float]]:
    """k -> {batch: acceptance length} from the "eagle3 chain k=K" rows (1 <= K <= 7) of a
    `jaxspec bench spec` results JSON."""
    acc: dict[int, dict[int, float]] = {}
    for row in json.loads(Path(path).read_text())["rows"]:
        m = CHAIN.match(str(row.get("config", "")))
        if m and 1 <= int(m[1]) <= MAX_K and row.get("acceptance_length") is not None:
            acc.setdefault(int(m[1]), {})[int(row.get("batch", 0))] = float(row["acceptance_length"])
    return acc


def project(k: int, tau: float, decode_ms: float, draft_ms: float, fuse_ms: float, verify_ms: float) -> dict:
    """Projected chain-drafting cost: step_ms = k*draft + fuse + verify(k+1), ms_per_token =
    step_ms / tau, speedup = decode * tau / step_ms, efficiency = speedup / tau."""
    step = k * draft_ms + fuse_ms + verify_ms
    speedup = decode_ms * tau / step
    return {"step_ms": step, "ms_per_token": step / tau, "speedup": speedup, "efficiency": speedup / tau}


def needed_bytes(cfg: ModelConfig, dcfg, weights: int, batch: int, max_len: int, nodes: int) -> int:
    """Device bytes of one (model, batch): weights + bf16 policy and head caches [B, max_len] +
    float32 activations of the largest verification (logits, processed log-probs and kernel
    temporaries [B, N, V]; attention scores and probabilities [B, Nq, N, S]; MLP [B, N, 2F])."""
    caches = cache_bytes(cfg, batch, max_len, DTYPE) + cache_bytes(dcfg.layer_config, batch, max_len, DTYPE)
    act = _F32 * batch * nodes * (3 * cfg.vocab_size + 2 * cfg.num_heads * max_len + 2 * cfg.intermediate_size)
    return weights + caches + act


def build_steps(cfg: ModelConfig, dcfg):
    """The jitted pieces; each step takes its cache first (donated) and returns (outputs, cache).
    The policy's and head's steps compile with the rollout loops' options for `cfg`
    (`rollout_compiler_options`: split-K or not), as the loops that run them do."""
    aux = dcfg.aux_layer_ids
    step_jit = functools.partial(jax.jit, compiler_options=rollout_compiler_options(cfg))

    @functools.partial(step_jit, donate_argnums=(0,))
    def decode(cache, params, tokens, cache_len, key):  # tokens int32 [B]
        logits, _, cache = extend(cfg, params, cache, tokens[:, None], cache_len[:, None], cache_len)
        return choose_tokens(key, logits[:, 0], SAMPLING), cache

    def chain(batch: int, n: int):
        parents = jnp.broadcast_to(jnp.arange(-1, n - 1, dtype=jnp.int32), (batch, n))
        return parents, jnp.arange(n, dtype=jnp.int32), jnp.full((batch,), n, jnp.int32)

    @functools.partial(step_jit, donate_argnums=(0,))
    def verify(cache, params, tokens, cache_len, key):  # tokens int32 [B, N]
        n = tokens.shape[1]
        parents, depth, num_nodes = chain(*tokens.shape)
        logits, hidden, cache = extend(
            cfg,
            params,
            cache,
            tokens,
            cache_len[:, None] + depth,
            cache_len,
            tree_mask=ancestor_mask(parents, n - 1),
            hidden_layers=aux,
        )
        result = kernels.tree_verify(
            processed_logprobs(logits, SAMPLING), parents, tokens, num_nodes, key, temperature=1.0
        )
        return (result.path, result.next_token, result.logprobs, hidden), cache

    @jax.jit
    def kernel(logprobs, tokens, key):  # logprobs float32 [B, N, V]
        parents, _, num_nodes = chain(*tokens.shape)
        return kernels.tree_verify(logprobs, parents, tokens, num_nodes, key, temperature=1.0)

    @functools.partial(step_jit, donate_argnums=(0,))
    def draft(dcache, dparams, embed, tokens, hidden_in, head_len):  # tokens [B], hidden_in [B, H]
        logits, out, dcache = draft_extend(
            dcfg, dparams, embed, dcache, tokens[:, None], hidden_in[:, None], head_len[:, None], head_len
        )
        top = jnp.argmax(processed_logprobs(logits[:, 0], SAMPLING), axis=-1)
        return (to_target_ids(dparams, top), out), dcache

    fuse_step = step_jit(functools.partial(fuse, dcfg))  # (dparams, aux [3, B, 1, H]) -> [B, 1, H]
    return decode, verify, kernel, draft, fuse_step


def _stateful(step, state: dict, name: str, *args):
    """A call of `step(state[name], *args)` that keeps the returned cache for the next call."""

    def call():
        out, state[name] = step(state[name], *args)
        return out

    return call


def time_model(cfg, dcfg, params, dparams, batch: int, context: int, nodes: list[int], iters: int) -> dict:
    """Median milliseconds of every piece at one batch: decode, draft, fuse, verify {N}, kernel {N}."""
    decode, verify, kernel, draft, fuse_step = build_steps(cfg, dcfg)
    max_len = context + max(nodes)
    rng, key = np.random.default_rng(batch), jax.random.key(batch)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, max(nodes)), dtype=np.int32))
    cache_len = jnp.full((batch,), context, jnp.int32)
    state = {"cache": init_cache(cfg, batch, max_len, DTYPE), "dcache": init_draft_cache(dcfg, batch, max_len, DTYPE)}
    ms = lambda fn: 1e3 * median_seconds(fn, iters=iters)  # noqa: E731
    aux = jnp.asarray(0.02 * rng.standard_normal((3, batch, 1, cfg.hidden_size), np.float32), DTYPE)
    out = {
        "decode": ms(_stateful(decode, state, "cache", params, tokens[:, 0], cache_len, key)),
        "draft": ms(_stateful(draft, state, "dcache", dparams, params["embed"], tokens[:, 0], aux[0, :, 0], cache_len)),
        "fuse": ms(lambda: fuse_step(dparams, aux)),
        "verify": {},
        "kernel": {},
    }
    for n in nodes:
        out["verify"][n] = ms(_stateful(verify, state, "cache", params, tokens[:, :n], cache_len, key))
    del state
    logprobs = jax.nn.log_softmax(jax.random.normal(key, (batch, max(nodes), cfg.vocab_size), jnp.float32), -1)
    for n in nodes:
        node_logprobs = logprobs[:, :n]
        out["kernel"][n] = ms(lambda: kernel(node_logprobs, tokens[:, :n], key))  # noqa: B023
    return out


def device_memory_stats() -> dict | None:
    return jax.devices()[0].memory_stats()


def run_model(args, path: str, acceptance: dict[int, dict[int, float]], nodes: list[int]) -> list[dict]:
    """Result rows of one model, each with "model", "batch", "context" and "kind": "step" (decode_ms,
    draft_ms, fuse_ms), "verify" (one per N: verify_ms, kernel_ms, verify_over_decode), "projection"
    (one per k of `acceptance`, see `project`) or "skipped" (reason)."""
    cfg = ModelConfig.from_json(path)
    name = Path(path).stem
    vd = min(args.draft_vocab, cfg.vocab_size)
    head_shapes = jax.eval_shape(lambda: init_eagle3(cfg, jax.random.key(0), vd, dtype=DTYPE)[1])
    weights = cfg.num_params() * jnp.dtype(DTYPE).itemsize + sum(
        x.size * x.dtype.itemsize for x in jax.tree.leaves(head_shapes)
    )
    dcfg, rows, fits = DraftConfig.for_policy(cfg, vd), [], []
    for batch in args.batch:
        base = {"model": name, "batch": batch, "context": args.context}
        try:
            check_fits(
                needed_bytes(cfg, dcfg, weights, batch, args.context + max(nodes), max(nodes)),
                device_memory_stats(),
                batch=batch,
                prompt_len=args.context,
                max_new_tokens=max(nodes),
            )
            fits.append(batch)
        except ValueError as err:
            print(f"{name} batch {batch}: skipped, weights + caches would not fit ({err})")
            rows.append({**base, "kind": "skipped", "reason": str(err)})
    if not fits:
        return rows
    # tensor by tensor: one jit of the whole initialiser took minutes to compile on Qwen3 shapes
    params = init_params(cfg, jax.random.key(0), DTYPE)
    dcfg, dparams = init_eagle3(cfg, jax.random.key(1), vd, dtype=DTYPE)
    params, dparams = rollout_weights(params), rollout_weights(dparams)  # as `generate` reads them
    for batch in fits:
        base = {"model": name, "batch": batch, "context": args.context, "split_k": splits_k(cfg)}
        try:
            t = time_model(cfg, dcfg, params, dparams, batch, args.context, nodes, args.iters)
        except jax.errors.JaxRuntimeError as err:
            out_of_memory(err)  # raises any other error
            print(f"{name} batch {batch}: skipped, out of device memory")
            rows.append({**base, "kind": "skipped", "reason": "RESOURCE_EXHAUSTED"})
            continue
        rows.append(
            {
                **base,
                "kind": "step",
                "decode_ms": t["decode"],
                "draft_ms": t["draft"],
                "fuse_ms": t["fuse"],
                **token_costs(t["decode"], t["verify"], t["draft"]),
                **experts_touched(cfg, "experts_decode", batch),
            }
        )
        rows += [
            {
                **base,
                "kind": "verify",
                "nodes": n,
                "verify_ms": t["verify"][n],
                "kernel_ms": t["kernel"][n],
                "verify_over_decode": t["verify"][n] / t["decode"],
                **experts_touched(cfg, "experts_verify", batch * n),
            }
            for n in nodes
        ]
        for k in sorted(acceptance):
            acc_batch = batch if batch in acceptance[k] else next(iter(acceptance[k]))
            tau = acceptance[k][acc_batch]
            rows.append(
                {
                    **base,
                    "kind": "projection",
                    "k": k,
                    "acceptance_length": tau,
                    "acceptance_batch": acc_batch,
                    "decode_ms": t["decode"],
                    **project(k, tau, t["decode"], t["draft"], t["fuse"], t["verify"][k + 1]),
                }
            )
    del params, dparams
    return rows


def token_costs(decode_ms: float, verify_ms: dict[int, float], draft_ms: float) -> dict:
    """{"verify_token_cost", "draft_token_cost"}: the adaptive depth's cost model in decode steps
    (module docstring) from one batch's timings; verify_ms: {N: ms} of the verification of N nodes."""
    extra = [(n - 1, ms / decode_ms - 1.0) for n, ms in verify_ms.items() if n > 1]
    slope = sum(x * y for x, y in extra) / sum(x * x for x, _ in extra) if extra else 0.0
    return {"verify_token_cost": max(slope, 0.0), "draft_token_cost": draft_ms / decode_ms}


def experts_touched(cfg: ModelConfig, key: str, tokens: int) -> dict:
    """{key: expected distinct experts per sparse layer for `tokens` tokens} ({} for a dense model)."""
    if not cfg.num_experts:
        return {}
    return {key: expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_tok, tokens)}


def print_model(name: str, rows: list[dict]) -> None:
    pick = lambda kind: [r for r in rows if r["model"] == name and r["kind"] == kind]  # noqa: E731
    print(f"\n{name}: measured ms per step")
    if pick("step"):
        moe = "experts_decode" in pick("step")[0]
        columns = ["batch", "context", "decode_ms", "draft_ms", "fuse_ms", "verify_token_cost", "draft_token_cost"]
        print_table(pick("step"), columns + ["experts_decode"] * moe)
        pairs = ", ".join(f"[{r['batch']}, {r['verify_token_cost']:.3g}]" for r in pick("step"))
        print(f"{name}: spec.verify_token_cost: [{pairs}]  (the adaptive depth's cost by batch, at this context)")
        print_table(
            pick("verify"),
            ["batch", "nodes", "verify_ms", "kernel_ms", "verify_over_decode"] + ["experts_verify"] * moe,
        )
    if pick("projection"):
        print(f"{name}: PROJECTION (not measured): speedup = decode * tau / (k*draft + fuse + verify(k+1))")
        print_table(
            pick("projection"),
            [
                "batch",
                "k",
                "acceptance_length",
                "acceptance_batch",
                "step_ms",
                "ms_per_token",
                "decode_ms",
                "speedup",
                "efficiency",
            ],
        )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="jaxspec bench spec-cost", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model",
        nargs="+",
        default=["configs/models/qwen3-1.7b.json", "configs/models/qwen3-8b.json"],
        help="HF config.json files giving the policy shapes",
    )
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    p.add_argument("--context", type=int, default=1024, help="tokens already in every row's KV cache")
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 8, 16], help="verification node counts N")
    p.add_argument("--draft-vocab", type=int, default=32000, help="draft vocabulary (capped at the policy's)")
    p.add_argument("--acceptance", default=None, help="`jaxspec bench spec` results JSON for the projection")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=None, help="write JSON results here")
    args = p.parse_args(argv)
    if args.context < 1 or min(args.nodes) < 1 or min(args.batch) < 1 or args.draft_vocab < 1:
        raise ValueError("--context, --nodes, --batch and --draft-vocab must be >= 1")
    acceptance = load_acceptance(args.acceptance) if args.acceptance else {}
    if args.acceptance and not acceptance:
        print(f"{args.acceptance}: no 'eagle3 chain k=K' rows with 1 <= K <= {MAX_K}; no projection")
    nodes = sorted(set(args.nodes) | {k + 1 for k in acceptance})

    rows = []
    for path in args.model:
        rows += run_model(args, path, acceptance, nodes)
        print_model(Path(path).stem, rows)
    params = {Path(m).stem: ModelConfig.from_json(m).num_params() for m in args.model}
    baseline = {
        "models": args.model,
        "params": params,
        "dtype": "bfloat16",
        "context": args.context,
        "nodes": nodes,
        "draft_vocab": args.draft_vocab,
        "temperature": SAMPLING.temperature,
        "acceptance": args.acceptance,
        "iters": args.iters,
        "tree_verify": kernels.resolved_impl(),
        "device_bytes_limit": (device_memory_stats() or {}).get("bytes_limit"),
        "baseline": "decode: one autoregressive decode step at the same batch and context, same run",
        "projection": "computed, not measured: speedup = decode * tau / (k*draft + fuse + verify(k+1)), "
        "efficiency = speedup / tau",
    }
    write_results(args.out, "spec-cost", rows, baseline)
    return 0
