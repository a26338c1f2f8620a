"""Checkpoint I/O: HF safetensors (single, sharded, fused or per-expert experts, fp8 blocks), clear errors
for bad checkpoints, orbax save/restore."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import glm53
from glm53.weights import expected_hf_tensors


def _params(model):
    return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _assert_same_params(a, b):
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=str(k))


@pytest.mark.parametrize("experts, shard", [("per_expert", None), ("fused", 200_000)])
def test_hf_round_trip(tiny_model, tmp_path, experts, shard):
    out = tmp_path / "ckpt"
    glm53.save_pretrained(tiny_model, out, experts=experts, max_shard_bytes=shard)
    assert (out / "model.safetensors.index.json").exists() == (shard is not None)
    names = set()
    for f in out.glob("*.safetensors"):
        names |= set(load_file(f))
    if experts == "per_expert":
        assert "model.layers.3.mlp.experts.7.down_proj.weight" in names
        assert "model.layers.8.mlp.experts.0.gate_proj.weight" in names  # the MTP layer
    else:
        assert "model.layers.3.mlp.experts.gate_up_proj" in names
    _assert_same_params(glm53.from_pretrained(out), tiny_model)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_expected_tensor_table_matches_fixture(hf_fixtures):
    cfg = glm53.from_pretrained(hf_fixtures / "grouped").cfg
    expected = expected_hf_tensors(cfg)
    index = json.loads((hf_fixtures / "grouped" / "model.safetensors.index.json").read_text())["weight_map"]
    non_expert = {n for n in index if ".mlp.experts." not in n}
    assert non_expert == {n for n in expected if ".mlp.experts." not in n}


def _copy_single(hf_fixtures, tmp_path):
    d = tmp_path / "base"
    shutil.copytree(hf_fixtures / "base", d)
    return d, load_file(d / "model.safetensors")


def test_missing_tensors_are_named(hf_fixtures, tmp_path):
    d, tensors = _copy_single(hf_fixtures, tmp_path)
    del tensors["model.layers.2.self_attn.kv_b_proj.weight"]
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError) as e:
        glm53.from_pretrained(d)
    msg = str(e.value)
    assert "missing tensor model.layers.2.self_attn.kv_b_proj.weight" in msg
    assert "missing tensor model.layers.1.mlp.experts.3.up_proj.weight" in msg


def test_misshaped_tensor_is_named(hf_fixtures, tmp_path):
    d, tensors = _copy_single(hf_fixtures, tmp_path)
    tensors["model.layers.0.self_attn.indexer.wk.weight"] = np.zeros((3, 64), np.float32)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.indexer.wk.weight has shape \[3, 64\], expected \[16, 64\]"):
        glm53.from_pretrained(d)


def test_missing_shard_and_config(hf_fixtures, tmp_path):
    d = tmp_path / "grouped"
    shutil.copytree(hf_fixtures / "grouped", d)
    next(d.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="shard"):
        glm53.from_pretrained(d)
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        glm53.from_pretrained(d)


def test_fp8_block_quantised_weights_are_dequantised(hf_fixtures, tmp_path):
    import ml_dtypes

    d, tensors = _copy_single(hf_fixtures, tmp_path)
    name = "model.layers.0.self_attn.q_b_proj.weight"  # [96, 48]
    w = tensors[name]
    scale = np.array([[0.01]], np.float32)  # one 128x128 block covers [96, 48]
    q = np.clip(w / scale[0, 0], -448, 448).astype(ml_dtypes.float8_e4m3fn)
    from safetensors.flax import save_file as save_jax  # numpy's writer has no float8

    tensors = {k: jnp.asarray(v) for k, v in tensors.items()}
    tensors[name] = jnp.asarray(q)
    tensors[name + "_scale_inv"] = jnp.asarray(scale)
    save_jax(tensors, d / "model.safetensors")
    model = glm53.from_pretrained(d)
    got = np.asarray(model.layers[0].self_attn.q_b_proj.weight[...]).T
    np.testing.assert_allclose(got, q.astype(np.float32) * scale[0, 0], rtol=0, atol=0)
    assert np.abs(got - w).max() < 0.1 * np.abs(w).max()


def test_bfloat16_load(hf_fixtures):
    """dtype="bfloat16" rounds weights to bf16 (router bias and indexer weights_proj stay float32). bf16
    compute is only sanity-checked: with sparse top-k selection, bf16 noise flips some selections, so its
    logits are not close to float32's (measured max error ~1.1 on logits of ~3)."""
    f32 = glm53.from_pretrained(hf_fixtures / "base")
    model = glm53.from_pretrained(hf_fixtures / "base", dtype="bfloat16")
    w = model.layers[1].self_attn.q_a_proj.weight[...]
    assert w.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(w), np.asarray(f32.layers[1].self_attn.q_a_proj.weight[...].astype(jnp.bfloat16)))
    assert model.layers[1].mlp.gate.e_score_correction_bias[...].dtype == jnp.float32
    assert model.layers[0].self_attn.indexer.weights_proj.weight[...].dtype == jnp.float32
    golden = np.load(hf_fixtures / "base" / "golden.npz")
    logits = glm53.score(model, golden["input_ids"])
    assert logits.dtype == np.float32 and np.isfinite(logits).all()
    assert (logits.argmax(-1) == golden["logits"].argmax(-1)).mean() >= 0.7


def test_orbax_save_restore(tiny_model, tmp_path):
    glm53.save(tiny_model, tmp_path / "orbax")
    restored = glm53.restore(tmp_path / "orbax")
    assert restored.cfg == tiny_model.cfg
    _assert_same_params(restored, tiny_model)
    with pytest.raises(FileExistsError):
        glm53.save(tiny_model, tmp_path / "orbax")


def test_fp8_dequantisation_uses_128_blocks():
    import ml_dtypes

    from glm53.weights import _dequantize_fp8_blocks

    rng = np.random.default_rng(0)
    q = rng.uniform(-400, 400, (200, 300)).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.5, 2.0, (2, 3)).astype(np.float32)
    got = _dequantize_fp8_blocks(q, scale)
    qf = q.astype(np.float32)
    assert got[127, 255] == qf[127, 255] * scale[0, 1] and got[128, 256] == qf[128, 256] * scale[1, 2]
    assert got[199, 0] == qf[199, 0] * scale[1, 0]


def test_bfloat16_checkpoint(hf_fixtures, tmp_path):
    from safetensors.flax import save_file as save_jax

    d, tensors = _copy_single(hf_fixtures, tmp_path)
    save_jax({k: jnp.asarray(v, jnp.bfloat16) for k, v in tensors.items()}, d / "model.safetensors")
    model = glm53.from_pretrained(d)
    w = np.asarray(model.layers[0].self_attn.o_proj.weight[...]).T
    np.testing.assert_array_equal(w, tensors["model.layers.0.self_attn.o_proj.weight"].astype(jnp.bfloat16).astype(np.float32))


def test_hf_saved_checkpoint_without_mtp_tensors_loads_without_mtp(hf_fixtures, tmp_path, caplog):
    # transformers' save_pretrained keeps num_nextn_predict_layers in config.json but drops the MTP layer.
    d, tensors = _copy_single(hf_fixtures, tmp_path)
    save_file({k: v for k, v in tensors.items() if not k.startswith("model.layers.5.")}, d / "model.safetensors")
    model = glm53.from_pretrained(d)
    assert model.cfg.num_nextn_predict_layers == 0 and len(model.mtp) == 0
    assert "no model.layers.5.* tensors" in caplog.text


def test_partial_mtp_layer_is_an_error(hf_fixtures, tmp_path):
    d, tensors = _copy_single(hf_fixtures, tmp_path)
    del tensors["model.layers.5.eh_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match="missing tensor model.layers.5.eh_proj.weight"):
        glm53.from_pretrained(d)


def test_fp8_without_scale_or_with_wrong_scale_is_named(hf_fixtures, tmp_path):
    import ml_dtypes
    from safetensors.flax import save_file as save_jax

    d, tensors = _copy_single(hf_fixtures, tmp_path)
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors = {k: jnp.asarray(v) for k, v in tensors.items()}
    tensors[name] = jnp.asarray(np.asarray(tensors[name]).astype(ml_dtypes.float8_e4m3fn))
    save_jax(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match=f"{name} is float8_e4m3fn but the checkpoint has no {name}_scale_inv"):
        glm53.from_pretrained(d)
    tensors[name + "_scale_inv"] = jnp.ones((2, 2), jnp.float32)
    save_jax(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"_scale_inv has shape \[2, 2\], expected \[1, 1\]"):
        glm53.from_pretrained(d)


def test_unused_tensors_are_reported(hf_fixtures, tmp_path, caplog):
    d, tensors = _copy_single(hf_fixtures, tmp_path)
    tensors["model.layers.1.mlp.experts.99.up_proj.weight"] = np.zeros((2, 2), np.float32)
    save_file(tensors, d / "model.safetensors")
    glm53.from_pretrained(d)
    assert "experts.99.up_proj" in caplog.text


def test_save_pretrained_keeps_other_files(tiny_model, tmp_path):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")
    glm53.save_pretrained(tiny_model, out, max_shard_bytes=200_000)
    glm53.save_pretrained(tiny_model, out)  # now a single file: the old shards and index must go
    assert (out / "tokenizer.json").exists()
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]
    _assert_same_params(glm53.from_pretrained(out), tiny_model)
