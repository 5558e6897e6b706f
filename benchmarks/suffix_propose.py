"""What one step of group-suffix drafting costs on the device, by part, at the long workload's shapes.

    python3 benchmarks/suffix_propose.py [--rows 128 256] [--group 8] [--tokens 8448] [--history 0 4]
        [--history-len 8192] [--out suffix_propose.json]

Random token streams (vocabulary 529, the `tally` tokenizer's: matches of a few tokens are common),
every row's pool full to --tokens, --group rows per GRPO group, --history earlier responses of
--history-len tokens per group. Each part runs inside one compiled loop (`in_loop_seconds`), so the
figures are device time per step:
  match    gather the row's sources and compute every slot's match length (`match_lengths`)
  top_k    match + the former selection: `lax.top_k` over all T slots (int32, a sort on GPUs)
  firstN   match + `first_longest` (two small top-ks) over blocks of N slots (128: the drafter's)
  propose  the whole `SuffixDrafter.propose` (chain of depth 3: the long workload's suffix k=3)
The ratio top_k / first is the selection's gain in the same run.
"""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.bench.timing import device_description, in_loop_seconds
from jaxspec.rollout.speculative.drafter import Pooled
from jaxspec.rollout.speculative.suffix import (
    SuffixDrafter,
    SuffixHistory,
    SuffixPool,
    SuffixSources,
    _gather_sources,
    first_longest,
    match_lengths,
)

VOCAB = 529
MAX_MATCH = 8
CANDIDATES = 16


def case(rows: int, group: int, tokens: int, history: int, history_len: int) -> dict:
    rng = np.random.default_rng(0)
    groups = rows // group
    pool = SuffixPool(
        tokens=jnp.asarray(rng.integers(0, VOCAB, (rows, tokens)), jnp.int32),
        length=jnp.full((rows,), tokens, jnp.int32),
        prompt_length=jnp.full((rows,), 256, jnp.int32),
    )
    members = np.arange(rows).reshape(groups, group)
    siblings = np.stack([np.delete(members[r // group], r % group) for r in range(rows)]).astype(np.int32)
    sources = SuffixSources(
        history=SuffixHistory(
            jnp.asarray(rng.integers(0, VOCAB, (groups, history, history_len)), jnp.int32),
            jnp.full((groups, history), history_len, jnp.int32),
        ),
        row_group=jnp.asarray(np.arange(rows) // group, jnp.int32),
        siblings=jnp.asarray(siblings),
    )
    drafter = SuffixDrafter(max_match=MAX_MATCH, num_candidates=CANDIDATES, depth=3, width=1, num_nodes=3)
    row_ids = jnp.arange(rows, dtype=jnp.int32)
    root = jnp.zeros((rows,), jnp.int32)

    def matched(pool_tokens):
        p = pool._replace(tokens=pool_tokens)
        flat, start, _, can_end = _gather_sources(sources, p, row_ids)
        back = tokens - 1 - jnp.arange(MAX_MATCH, dtype=jnp.int32)
        context = jnp.broadcast_to(pool_tokens[:, back], (rows, MAX_MATCH))
        return match_lengths(flat, start, can_end, context)

    def top_k(pool_tokens):
        best, position = jax.lax.top_k(matched(pool_tokens), CANDIDATES)
        return (best >= 1) & (best == best[:, :1]), position

    parts = {
        "match": lambda t, i: matched(t),
        "top_k": lambda t, i: top_k(t),
        **{
            f"first{block}": lambda t, i, block=block: first_longest(matched(t), CANDIDATES, block)
            for block in (32, 64, 128, 256)
        },
        "propose": lambda t, i: drafter.propose(
            sources, Pooled(rows=row_ids, pool=pool._replace(tokens=t)), root, None, None, None
        )[1],
    }
    row = {"rows": rows, "group": group, "tokens": tokens, "history": history, "history_len": history_len}
    row["slots_per_row"] = group * tokens + history * history_len
    args = (pool.tokens,)
    for name, fn in parts.items():
        seconds, args = in_loop_seconds(fn, args)
        row[f"{name}_ms"] = seconds * 1e3
    row["top_k_over_first"] = row["top_k_ms"] / row["first128_ms"]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[128, 256])
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8448)
    p.add_argument("--history", type=int, nargs="+", default=[0, 4])
    p.add_argument("--history-len", type=int, default=8192)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    rows = []
    columns = ("rows", "history", "slots_per_row", "match_ms", "top_k_ms")
    columns += tuple(f"first{b}_ms" for b in (32, 64, 128, 256)) + ("propose_ms", "top_k_over_first")
    print(device_description())
    print("  ".join(f"{c:>16s}" for c in columns))
    for r in args.rows:
        for h in args.history:
            row = case(r, args.group, args.tokens, h, args.history_len)
            rows.append(row)
            print("  ".join(f"{row[c]:16.3f}" if isinstance(row[c], float) else f"{row[c]:16d}" for c in columns))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
