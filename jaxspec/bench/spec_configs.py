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


def verify_token_cost(text: str) -> float | tuple[tuple[int, float], ...]:
    """--verify-token-cost: "0.1" (every batch size) or "1:0.01,64:0.1" ((rows, cost) pairs)."""
    try:
        if ":" not in text:
            return float(text)
        return tuple((int(rows), float(cost)) for rows, cost in (pair.split(":") for pair in text.split(",")))
    except ValueError:
        message = f"expected a number or rows:cost pairs such as 1:0.01,64:0.1, got {text!r}"
        raise argparse.ArgumentTypeError(message) from None


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
    for depths in args.stage_k:
        runs.append(
            (stage_label(depths), {"method": "eagle3", "num_draft_tokens": max(depths), "stage_draft_tokens": depths})
        )
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
