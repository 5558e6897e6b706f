"""HF checkpoint folders: save_hf -> transformers, transformers -> load_hf, round trips, errors."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from jaxspec.models import ModelConfig, forward, load_hf, load_tokenizer, save_hf
from tests.models.hf_reference import hf_config, hf_logits, perturbed_model, random_params, random_tokens, rel_max_err

FP32_TOL = 1e-5  # relative to max |logit|
SEQ = 20

CONFIGS = {
    "qwen2_gqa": ModelConfig(
        family="qwen2",
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        rope_theta=1000.0,
        eos_token_id=(3, 5),
        pad_token_id=0,
    ),
    "qwen3_tied": ModelConfig(
        family="qwen3",
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "llama_yarn": ModelConfig(
        family="llama",
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        rope_scaling=(("factor", 4.0), ("original_max_position_embeddings", 64), ("rope_type", "yarn")),
    ),
    "llama_llama3_mha": ModelConfig(
        family="llama",
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        head_dim=8,
        max_position_embeddings=64,
        rope_theta=10000.0,
        rope_scaling=(
            ("factor", 8.0),
            ("high_freq_factor", 4.0),
            ("low_freq_factor", 1.0),
            ("original_max_position_embeddings", 64),
            ("rope_type", "llama3"),
        ),
    ),
}


def _hf_from(path, dtype=torch.float32):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()


def _assert_same_params(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32)))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def saved(request, tmp_path_factory):
    """(cfg, params, folder written by save_hf)."""
    cfg = CONFIGS[request.param]
    params = random_params(cfg, jax.random.key(sorted(CONFIGS).index(request.param)))
    path = tmp_path_factory.mktemp(request.param) / "checkpoint"
    save_hf(cfg, params, path)
    return cfg, params, path


def test_save_hf_loads_in_transformers_with_matching_logits(saved):
    cfg, params, path = saved
    model = _hf_from(path)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    tokens = random_tokens(0, (2, SEQ), cfg.vocab_size)
    assert rel_max_err(forward(cfg, params, tokens), hf_logits(model, tokens)) < FP32_TOL
    positions = np.broadcast_to(np.arange(SEQ) + 150, (2, SEQ)).astype(np.int32)  # past the rope's old context
    assert (
        rel_max_err(
            forward(cfg, params, tokens, positions=jnp.asarray(positions)),
            hf_logits(model, tokens, position_ids=positions),
        )
        < FP32_TOL
    )


def test_save_hf_round_trip_is_exact(saved):
    cfg, params, path = saved
    loaded_cfg, loaded = load_hf(path)
    assert loaded_cfg == cfg
    _assert_same_params(loaded, params)


def test_transformers_resave_loads_back_to_the_same_model(saved, tmp_path):
    cfg, params, path = saved
    _hf_from(path).save_pretrained(tmp_path)
    loaded_cfg, loaded = load_hf(tmp_path)
    assert loaded_cfg == cfg
    _assert_same_params(loaded, params)


def test_sharded_save_writes_an_index_loaded_by_both(tmp_path):
    cfg = CONFIGS["qwen2_gqa"]
    params = random_params(cfg, jax.random.key(7))
    save_hf(cfg, params, tmp_path / "sharded", max_shard_bytes=20_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == shards
    assert not (tmp_path / "sharded" / "model.safetensors").exists()
    total = 0
    for shard in shards:
        tensors = load_file(tmp_path / "sharded" / shard)
        total += sum(t.nbytes for t in tensors.values())
        assert all(index["weight_map"][name] == shard for name in tensors)
    assert index["metadata"]["total_size"] == total == 4 * cfg.num_params()

    loaded_cfg, loaded = load_hf(tmp_path / "sharded")
    assert loaded_cfg == cfg
    _assert_same_params(loaded, params)
    tokens = random_tokens(1, (2, SEQ), cfg.vocab_size)
    assert rel_max_err(forward(cfg, params, tokens), hf_logits(_hf_from(tmp_path / "sharded"), tokens)) < FP32_TOL


def test_bf16_save_load_round_trip_is_lossless(tmp_path):
    cfg = CONFIGS["qwen3_tied"]
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), random_params(cfg, jax.random.key(8)))
    save_hf(cfg, params, tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    _, loaded = load_hf(tmp_path / "bf16", dtype="bfloat16")
    _assert_same_params(loaded, params)
    _, upcast = load_hf(tmp_path / "bf16", dtype="float32")
    _assert_same_params(upcast, jax.tree.map(lambda x: x.astype(jnp.float32), params))


def test_save_hf_casts_to_the_requested_dtype(tmp_path):
    cfg = CONFIGS["qwen2_gqa"]
    params = random_params(cfg, jax.random.key(9))
    save_hf(cfg, params, tmp_path / "cast", dtype="bfloat16")
    _, loaded = load_hf(tmp_path / "cast", dtype=jnp.bfloat16)
    _assert_same_params(loaded, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))


@pytest.mark.parametrize("torch_dtype,name", [(torch.bfloat16, "bfloat16"), (torch.float16, "float16")])
def test_load_hf_of_a_half_precision_transformers_folder(tmp_path, torch_dtype, name):
    half = perturbed_model(hf_config("qwen3"), seed=31).to(torch_dtype)
    half.save_pretrained(tmp_path)
    # fp32 model holding exactly the saved values (a fresh one: casting the half model back would
    # also keep its rounded rope inverse frequencies, which no checkpoint stores).
    rounded = perturbed_model(hf_config("qwen3"), seed=31)
    rounded.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
    cfg, params = load_hf(tmp_path)
    tokens = random_tokens(2, (2, SEQ), cfg.vocab_size)
    assert rel_max_err(forward(cfg, params, tokens), hf_logits(rounded, tokens)) < FP32_TOL
    _, half = load_hf(tmp_path, dtype=name)
    assert all(leaf.dtype == jnp.dtype(name) for leaf in jax.tree.leaves(half))
    _assert_same_params(jax.tree.map(lambda x: x.astype(jnp.float32), half), params)


def test_save_hf_replaces_an_existing_folder(tmp_path):
    cfg = CONFIGS["qwen2_gqa"]
    first, second = (random_params(cfg, jax.random.key(k)) for k in (10, 11))
    save_hf(cfg, first, tmp_path / "ckpt", max_shard_bytes=20_000)
    save_hf(cfg, second, tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary folders left behind
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors"]
    _assert_same_params(load_hf(tmp_path / "ckpt")[1], second)


def test_tokenizer_travels_with_the_checkpoint(tmp_path):
    vocab = {w: i for i, w in enumerate(["<unk>", "the", "cat", "sat", "on", "mat"])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tok.json"))
    cfg = CONFIGS["qwen2_gqa"]
    save_hf(cfg, random_params(cfg, jax.random.key(12)), tmp_path / "ckpt", tokenizer_file=tmp_path / "tok.json")
    for source in (tmp_path / "ckpt", tmp_path / "ckpt" / "tokenizer.json", tmp_path / "tok.json"):
        assert load_tokenizer(source).encode("the cat sat on the dog").ids == [1, 2, 3, 4, 1, 0]


def test_load_tokenizer_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_tokenizer(tmp_path / "nope.json")


# ----------------------------------------------------------------------------- errors


@pytest.fixture()
def folder(tmp_path):
    """A fresh copy of a valid qwen2 checkpoint folder that a test may damage."""
    cfg = CONFIGS["qwen2_gqa"]
    save_hf(cfg, random_params(cfg, jax.random.key(13)), tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _edit_tensors(folder, edit):
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        load_hf(tmp_path / "no_such_model")


def test_folder_without_config(folder):
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf(folder)


def test_folder_without_weights(folder):
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_hf(folder)


@pytest.mark.parametrize("arch,model_type", [("GPT2LMHeadModel", "gpt2"), ("MistralForCausalLM", "mistral")])
def test_unsupported_architecture(folder, arch, model_type):
    _edit_config(folder, architectures=[arch], model_type=model_type)
    with pytest.raises(ValueError, match=arch):
        load_hf(folder)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_attention_bias_outside_qwen2_is_rejected(tmp_path, family):
    """transformers gives these families an o_proj bias too, which jaxspec does not implement."""
    perturbed_model(hf_config(family, attention_bias=True), seed=32).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="attention_bias"):
        load_hf(tmp_path)


def test_tensor_of_wrong_shape(folder):
    name = "model.layers.1.mlp.up_proj.weight"
    _edit_tensors(folder, lambda t: t.update({name: np.zeros((47, 32), np.float32)}))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\(47, 32\).*\(48, 32\)"):
        load_hf(folder)


def test_missing_tensor(folder):
    name = "model.layers.0.self_attn.k_proj.bias"
    _edit_tensors(folder, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.0\.self_attn\.k_proj\.bias"):
        load_hf(folder)


def test_unexpected_tensor(folder):
    _edit_tensors(folder, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": np.zeros((48, 32), np.float32)}))
    with pytest.raises(ValueError, match=r"unexpected.*model\.layers\.2\.mlp\.up_proj\.weight"):
        load_hf(folder)


def test_index_naming_a_missing_shard(folder):
    cfg, params = load_hf(folder)
    shutil.rmtree(folder)
    save_hf(cfg, params, folder, max_shard_bytes=20_000)
    last = sorted(folder.glob("model-*.safetensors"))[-1]
    last.unlink()
    with pytest.raises(FileNotFoundError, match=last.name):
        load_hf(folder)


@pytest.mark.parametrize("dtype", ["int8", "float64"])
def test_unsupported_dtype(folder, dtype):
    with pytest.raises(ValueError, match=dtype):
        load_hf(folder, dtype=dtype)
