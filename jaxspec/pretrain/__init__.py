"""Supervised pretraining of a small Qwen3 policy on the generated math task."""

from jaxspec.pretrain.cli import main
from jaxspec.pretrain.config import DataConfig, ModelShape, OptimConfig, PretrainConfig, PretrainTrainConfig
from jaxspec.pretrain.run import pretrain

__all__ = ["DataConfig", "ModelShape", "OptimConfig", "PretrainConfig", "PretrainTrainConfig", "main", "pretrain"]
