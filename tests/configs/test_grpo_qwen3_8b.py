"""configs/grpo_qwen3_8b.yaml parses and validates, and its memory plan's figures follow from the
Qwen3-8B shapes and the rollout's own memory estimate."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config_io import load_config
from jaxspec.draft import init_eagle3
from jaxspec.models import ModelConfig, cache_bytes
from jaxspec.rl.config import GRPOConfig
from jaxspec.rl.loss import LOGPROB_CHUNK
from jaxspec.rl.validation import validate
from jaxspec.rollout.memory import rollout_memory_bytes

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "grpo_qwen3_8b.yaml"


def test_the_8b_config_is_valid():
    cfg = load_config(GRPOConfig, CONFIG)
    validate(cfg, str(CONFIG))
    assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (1, 2, 1)
    assert cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt == 256
    assert cfg.rollout.max_new_tokens == 1024 and cfg.rollout.dtype == "bfloat16" and cfg.rollout.sub_batch == 64
    assert cfg.rollout.gather_weights  # the plan fits the gathered copy next to the rollouts on 80 GB cards
    assert cfg.optim.state_dtype == "bfloat16" and cfg.train.remat and cfg.train.compute_dtype == "bfloat16"
    assert cfg.spec.method == "eagle3" and cfg.spec.draft == "random"


def test_the_memory_plan_follows_from_the_shapes():
    text = CONFIG.read_text()
    cfg = ModelConfig.from_json(ROOT / "configs" / "models" / "qwen3-8b.json")
    per_gpu = lambda n: f"{n / 2 / 1e9:.1f} GB"  # noqa: E731  fsdp=2
    params = cfg.num_params()
    assert f"{params / 1e9:.2f}e9 params" in text
    assert f"master params          {per_gpu(4 * params)}" in text
    assert f"the\n#     whole policy on each GPU                {2 * params / 1e9:.1f} GB" in text  # gathered
    assert f"(false: the fsdp-sharded copy, {per_gpu(2 * params)}" in text
    assert cache_bytes(cfg, 1, 1, jnp.bfloat16) == 144 * 1024
    assert f"cache {cache_bytes(cfg, 256, 1152, jnp.bfloat16) / 1e9:.1f} GB over both GPUs" in text
    rollout = rollout_memory_bytes(cfg, 256, 128, 1024, jnp.bfloat16, num_distinct=32, stage_rows=128 + 64)
    assert f"`rollout_memory_bytes`) {rollout / 1e9:.1f} GB" in text and per_gpu(rollout) in text
    small = rollout_memory_bytes(cfg, 64, 128, 1024, jnp.bfloat16, num_distinct=8, stage_rows=32)
    assert f"sub-batches of 64 rows: {small / 1e9:.1f} GB over both, {per_gpu(small)} per GPU" in text
    head_bytes = (3 * 4 + 2) * sum(
        int(np.prod(x.shape))
        for x in jax.tree.leaves(jax.eval_shape(lambda: init_eagle3(cfg, jax.random.key(0), 32000)[1]))
        if x.dtype.kind == "f"
    )
    resident = (4 + 2 + 4) * params / 2 + head_bytes  # master, bf16 mu, nu over fsdp=2; the head replicated
    assert f"= resident                              {resident / 1e9:.1f} GB" in text
    gathered, sharded = (resident + copy + small / 2 for copy in (2 * params, params))
    assert f"-> {gathered / 1e9:.1f} GB ({sharded / 1e9:.1f} GB with gather_weights: false)" in text
    head = jax.eval_shape(lambda: init_eagle3(cfg, jax.random.key(0), 32000)[1])
    head_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(head) if x.dtype.kind == "f")
    assert f"EAGLE-3 head ({head_params / 1e9:.2f}e9 params" in text
    assert f"weights + mu + nu, bf16 copy {(3 * 4 + 2) * head_params / 1e9:.1f} GB" in text
    chunk = LOGPROB_CHUNK * cfg.vocab_size * 4  # the chunked log-prob head's logits
    assert f"(float32 logits {LOGPROB_CHUNK} x {cfg.vocab_size},\n#           {chunk / 1e9:.1f} GB a copy)" in text
    targets, logits = 9216 * 32000 * 4 / 1e9, 9216 * cfg.vocab_size * 4 / 1e9  # the head's chunked targets
    assert f"9216 x 32000 float32: {targets:.1f} GB, not\n#           the {logits:.1f} GB" in text
