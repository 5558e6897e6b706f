"""Speculative rollouts on the slot engine."""


def slot_speculative_generate(*args, **kwargs):
    raise ValueError("spec: not available with slots yet")
