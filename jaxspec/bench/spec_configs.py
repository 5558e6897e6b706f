"""The configurations `jaxspec bench spec` compares, and the parsing of the options that choose them."""

from __future__ import annotations

import argparse

from jaxspec.generate_cli import slots


def slot_count(text: str) -> int | str:
    """--slots values: a positive integer or "auto", parsed as `jaxspec generate --slots` is."""
    try:
        return slots(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def stage_label(depths: tuple[int, ...]) -> str:
    return f"eagle3 chain k={'/'.join(map(str, depths))} by stage"


def stage_tree(text: str) -> tuple[int, int, tuple[int, ...]]:
    """--stage-trees values: "W,N:K1,K2,..." (tree width W, at most N nodes, K_i levels in stage i)."""
    try:
        shape, depths = text.split(":")
        width, budget = (int(x) for x in shape.split(","))
        return width, budget, tuple(int(x) for x in depths.split(","))
    except ValueError:
        message = f"expected width,budget:depth,depth,... such as 3,16:2,3,5, got {text!r}"
        raise argparse.ArgumentTypeError(message) from None


def stage_tree_label(width: int, budget: int, depths: tuple[int, ...]) -> str:
    return f"eagle3 tree w={width} n={budget} d={'/'.join(map(str, depths))} by stage"


def verify_token_cost(text: str) -> float | tuple[tuple[int, float], ...]:
    """--verify-token-cost: "0.1" (every batch size) or "1:0.01,64:0.1" ((rows, cost) pairs)."""
    try:
        if ":" not in text:
            return float(text)
        return tuple((int(rows), float(cost)) for rows, cost in (pair.split(":") for pair in text.split(",")))
    except ValueError:
        message = f"expected a number or rows:cost pairs such as 1:0.01,64:0.1, got {text!r}"
        raise argparse.ArgumentTypeError(message) from None


def add_stage_depths(parser: argparse.ArgumentParser) -> None:
    """--stage-k K1,K2,... and --stage-trees W,N:K1,K2,...: EAGLE-3 chains and trees drafting a depth per
    loop stage, one run per value."""
    parser.add_argument(
        "--stage-k",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        nargs="*",
        default=[],
        metavar="K1,K2,...",
        help="chains drafting a depth per loop stage (Spec.stage_draft_tokens)",
    )
    parser.add_argument(
        "--stage-trees",
        type=stage_tree,
        nargs="*",
        default=[],
        metavar="W,N:K1,K2,...",
        help="trees of width W and at most N nodes drafting K_i levels in loop stage i (on slots: while at "
        "most S / 2^i slots decode), e.g. 3,16:2,3,5 for deeper trees as the rows finish",
    )


def stage_configurations(args) -> list[tuple[str, dict]]:
    """(label, EAGLE-3 Spec kwargs) of every --stage-k chain and --stage-trees tree."""
    runs = []
    for depths in args.stage_k:
        staged = {"method": "eagle3", "num_draft_tokens": max(depths), "stage_draft_tokens": depths}
        runs.append((stage_label(depths), staged))
    for width, budget, depths in args.stage_trees:
        staged = {"method": "eagle3", "num_draft_tokens": max(depths), "stage_draft_tokens": depths}
        runs.append((stage_tree_label(width, budget, depths), staged | {"tree_width": width, "tree_budget": budget}))
    return runs


def configurations(args) -> list[tuple[str, dict]]:
    """(label, Spec kwargs) pairs; an empty dict is the autoregressive baseline."""
    runs = [("ar", {})]
    heads = ["eagle3"] + ["eagle3-ood"] * bool(args.draft_ood) + ["eagle3-random"] * args.random_draft
    costs = {
        name: value
        for name, value in (("verify_token_cost", args.verify_token_cost), ("draft_token_cost", args.draft_token_cost))
        if value is not None
    }
    for label in heads:
        for k in args.k:
            runs.append((f"{label} chain k={k}", {"method": label, "num_draft_tokens": k}))
            if args.adaptive:
                runs.append(
                    (
                        f"{label} chain k={k} adaptive",
                        {"method": label, "num_draft_tokens": k, "adaptive": True, **costs},
                    )
                )
    runs += stage_configurations(args)
    for width, depth, budget in args.trees:
        runs.append(
            (
                f"eagle3 tree w={width} d={depth} n={budget}",
                {"method": "eagle3", "num_draft_tokens": depth, "tree_width": width, "tree_budget": budget},
            )
        )
    if args.draft_model:
        for k in args.draft_model_k:
            runs.append((f"draft_model chain k={k}", {"method": "draft_model", "num_draft_tokens": k}))
    if args.stochastic:
        runs.append(
            ("eagle3 chain k=3 stochastic", {"method": "eagle3", "num_draft_tokens": 3, "draft_sampling": "stochastic"})
        )
    if not args.no_ngram:
        runs.append(("ngram chain k=3", {"method": "ngram", "num_draft_tokens": 3}))
    if args.suffix:
        runs.append(("suffix chain k=3", {"method": "suffix", "num_draft_tokens": 3}))
        runs.append(("hybrid eagle3+suffix k=3", {"method": "eagle3", "num_draft_tokens": 3, "suffix_branches": True}))
    return runs


def parse_args(argv: list[str], description: str) -> argparse.Namespace:
    """`jaxspec bench spec`'s options (`description`: its help text); ValueError for options that
    contradict each other."""
    p = argparse.ArgumentParser(prog="jaxspec bench spec", description=description)
    p.add_argument("--policy", required=True, help="HF folder of the policy (with tokenizer.json)")
    p.add_argument("--draft", required=True, help="EAGLE-3 head trained in-domain (public layout)")
    p.add_argument("--draft-ood", default=None, help="EAGLE-3 head trained out of domain")
    p.add_argument(
        "--draft-model",
        default=None,
        help="HF folder of a smaller policy with the policy's tokenizer (method draft_model)",
    )
    p.add_argument("--draft-model-k", type=int, nargs="+", default=[3], help="draft depths of the draft model")
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256], help="rollouts (rows) per batch")
    p.add_argument(
        "--samples",
        type=int,
        default=1,
        help="rollouts per prompt (GRPO's group size): batch / samples distinct prompts",
    )
    p.add_argument("--new", type=int, default=1024, help="max_new_tokens")
    p.add_argument(
        "--k", type=int, nargs="*", default=[1, 2, 3, 4, 5, 7], help="EAGLE-3 chain depths (none: no chains)"
    )
    p.add_argument(
        "--trees",
        type=lambda s: tuple(int(x) for x in s.split(",")),
        nargs="*",
        default=[(2, 4, 8), (3, 5, 16)],
        help="width,depth,budget triples",
    )
    add_stage_depths(p)
    p.add_argument(
        "--random-draft",
        action="store_true",
        help="also the EAGLE-3 chains drafted by a head of the trained head's shape with random weights "
        "(drafts are almost never accepted: speculation's floor)",
    )
    p.add_argument(
        "--adaptive",
        action="store_true",
        help="also every EAGLE-3 chain with Spec.adaptive (each iteration's depth, none included, chosen "
        "from the acceptance measured so far and the cost model)",
    )
    p.add_argument(
        "--verify-token-cost",
        type=verify_token_cost,
        default=None,
        metavar="COST|ROWS:COST,...",
        help="Spec.verify_token_cost of --adaptive: a number, or rows:cost pairs (e.g. 1:0.01,64:0.1,512:0.6)",
    )
    p.add_argument("--draft-token-cost", type=float, default=None, help="Spec.draft_token_cost of --adaptive")
    p.add_argument("--stochastic", action="store_true", help="also a stochastic-draft chain")
    p.add_argument("--no-ngram", action="store_true", help="skip the n-gram chain")
    p.add_argument(
        "--suffix",
        action="store_true",
        help="also group-suffix chains (drafts from the prompt and its group's rows so far) and hybrid trees "
        "(the EAGLE-3 chain and a suffix chain in one tree), k=3",
    )
    p.add_argument("--levels", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    p.add_argument(
        "--data-config",
        default=None,
        metavar="CONFIG",
        help="draw the problems from this pretraining config's data section (its kinds, levels and "
        "tally settings), e.g. configs/pretrain_long.yaml for the long-answer workload; default: the "
        "built-in task at --levels",
    )
    p.add_argument(
        "--slots",
        type=slot_count,
        nargs="*",
        default=[],
        metavar="S",
        help="also run every configuration on the slot engine with S decode slots (generate(..., slots=S); "
        "'auto': S and the pool from the device's free memory)",
    )
    p.add_argument(
        "--kv-pages",
        type=int,
        default=None,
        metavar="PAGES",
        help="the slot engine's page pool (default: every slot's longest sequence); a smaller pool "
        "preempts and resumes rows when it runs short",
    )
    p.add_argument(
        "--decode-steps",
        type=int,
        default=None,
        metavar="STEPS",
        help="the slot engine's decode steps between two rounds of scheduling (admissions, preemptions, "
        "releases; default: the engine's)",
    )
    p.add_argument(
        "--sub-batch",
        type=int,
        default=None,
        metavar="ROWS",
        help="run the staged engine's configurations as generate calls of ROWS rows, one after another "
        "(as rollout.sub_batch does; for batches whose dense KV cache does not fit at once)",
    )
    p.add_argument(
        "--staged-ar-only",
        action="store_true",
        help="with --slots: the staged engine runs the autoregressive baseline alone, the speculative "
        "configurations run on the slot engine only",
    )
    p.add_argument(
        "--coupled",
        action="store_true",
        help="coupled draws (Sampling.coupled): every configuration samples the autoregressive rows' tokens "
        "(all of them in float32; in bfloat16 until a near-tie), so the runs compare on the same answers; "
        "rows_as_ar is the share of rows equal to the staged autoregressive run's, prefix_as_ar the mean share "
        "of a row's positions before its first difference; a row 'ar default draws' times the staged "
        "autoregressive run with the default draws (jax.random.categorical) against it: what coupling costs",
    )
    p.add_argument("--seed", type=int, default=1234, help="seed of the held-out problems")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.coupled and args.stochastic:
        raise ValueError("--coupled needs deterministic drafts: leave out --stochastic")
    if args.staged_ar_only and not args.slots:
        raise ValueError("--staged-ar-only needs --slots (the speculative configurations run on the slot engine)")
    return args
