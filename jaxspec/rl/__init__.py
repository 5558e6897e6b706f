"""GRPO / DAPO post-training: rollouts, group advantages, clipped policy loss, online draft adaptation."""

from jaxspec.rl.advantages import group_advantages
from jaxspec.rl.api import train
from jaxspec.rl.cli import main
from jaxspec.rl.config import GRPOConfig
from jaxspec.rl.loss import aggregate, policy_loss, response_logprobs

__all__ = ["GRPOConfig", "aggregate", "group_advantages", "main", "policy_loss", "response_logprobs", "train"]
