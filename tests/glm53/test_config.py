import dataclasses
import json

import pytest

import glm53
from glm53.config import ModelConfig, from_hf_config, get_preset, indexer_pattern, make_config, to_hf_config
from kvcache.layout import kv_bytes_per_token


def test_glm53_indexshare_pattern():
    cfg = get_preset("glm-5.3")
    full = [i for i, t in enumerate(cfg.indexer_types) if t == "full"]
    assert full == [0, 1, 2] + list(range(6, 78, 4))
    assert len(full) == 21
    assert cfg.full_indexer_layers == tuple(full) + (78,)  # the MTP layer runs its own indexer
    assert cfg.topk_source_layer(5) == 2 and cfg.topk_source_layer(6) == 6 and cfg.topk_source_layer(77) == 74
    assert cfg.mlp_layer_types[:4] == ("dense", "dense", "dense", "sparse")
    assert cfg.softmax_scale == 256 ** -0.5


def test_glm53_kv_bytes_per_token():
    cfg = get_preset("glm-5.3")
    # 78 x 656 (fp8_ds_mla) + 21 x 132 (fp8 indexer keys) + 788 (MTP layer: both)
    assert kv_bytes_per_token(cfg) == 54_728
    assert kv_bytes_per_token(cfg, include_mtp=False) == 54_728 - 788
    assert kv_bytes_per_token(cfg, "bfloat16", "bfloat16") == 79 * 576 * 2 + 22 * 128 * 2


@pytest.fixture(scope="module")
def glm53_counts():
    from glm53.weights import active_param_count, param_count

    cfg = get_preset("glm-5.3")
    return param_count(cfg), param_count(cfg, include_mtp=False), active_param_count(cfg)


def test_glm53_param_counts(glm53_counts):
    total, no_mtp, active = glm53_counts
    assert round(total / 1e9, 1) == 753.3
    assert 743.0e9 < no_mtp < 744.0e9
    assert round(active / 1e9, 1) == 40.3


def test_tiny_has_the_full_structure():
    cfg = get_preset("tiny")
    assert {"full", "shared"} <= set(cfg.indexer_types)
    assert cfg.mlp_layer_types[0] == "dense" and cfg.mlp_layer_types[-1] == "sparse"
    assert cfg.num_nextn_predict_layers == 1


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset"):
        get_preset("glm-6")


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(index_topk=0), "index_topk"),
        (dict(num_attention_heads=0), "num_attention_heads"),
        (dict(n_group=3), "n_group"),  # 8 experts not divisible by 3
        (dict(topk_group=2), "topk_group"),  # more than n_group=1
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(qk_rope_head_dim=15), "qk_rope_head_dim"),
        (dict(qk_rope_head_dim=64), "index_head_dim"),
        (dict(rms_norm_eps=-1.0), "rms_norm_eps"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(indexer_types=("full",) * 7), "indexer_types"),
        (dict(indexer_types=("full",) * 7 + ("sparse",)), r"indexer_types\[7\]"),
        (dict(indexer_types=("shared",) + ("full",) * 7), r"indexer_types\[0\]"),
        (dict(mlp_layer_types=("dense",) * 7 + ("moe",)), r"mlp_layer_types\[7\]"),
    ],
)
def test_invalid_values_name_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(get_preset("tiny"), **change)


def test_invalid_schedule_values():
    with pytest.raises(ValueError, match="index_topk_freq"):
        indexer_pattern(8, 0, 3)
    with pytest.raises(ValueError, match="first_k_dense_replace"):
        make_config(**{**_tiny_fields(), "first_k_dense_replace": -1})


def _tiny_fields():
    d = dataclasses.asdict(get_preset("tiny"))
    d.pop("indexer_types"), d.pop("mlp_layer_types")
    return d


def test_from_hf_config_fixtures(hf_fixtures):
    base = from_hf_config(json.loads((hf_fixtures / "base" / "config.json").read_text()))
    assert base.indexer_types == ("full", "full", "shared", "full", "shared")
    assert base.mlp_layer_types == ("dense",) + ("sparse",) * 4
    assert base.num_nextn_predict_layers == 1 and base.rope_theta == 10_000.0
    assert base.qk_head_dim == 24  # HF's head_dim (8, the rope width) is not the attention head dim
    grouped = from_hf_config(json.loads((hf_fixtures / "grouped" / "config.json").read_text()))
    assert (grouped.n_group, grouped.topk_group, grouped.n_routed_experts) == (4, 2, 16)


def test_from_hf_config_schedule_and_pattern():
    hf = to_hf_config(get_preset("glm-5.3"))
    del hf["indexer_types"], hf["mlp_layer_types"]
    hf.update(index_topk_freq=4, index_skip_topk_offset=3, first_k_dense_replace=3)
    assert from_hf_config(hf) == get_preset("glm-5.3")
    hf2 = dict(hf, num_hidden_layers=4, index_topk_pattern="FSFS")
    assert from_hf_config(hf2).indexer_types == ("full", "shared", "full", "shared")
    with pytest.raises(ValueError, match="index_topk_pattern"):
        from_hf_config(dict(hf2, index_topk_pattern="FXFS"))


def test_hf_config_round_trip():
    for name in ("tiny", "glm-5.3", "mid"):
        cfg = get_preset(name)
        assert from_hf_config(json.loads(json.dumps(to_hf_config(cfg)))) == cfg


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(model_type="llama"), "model_type"),
        (dict(num_key_value_heads=1), "num_key_value_heads"),
        (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_type"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(index_topk=-5), "index_topk"),
        (dict(indexer_types=["full", "dense"] * 4), "indexer_types"),
    ],
)
def test_from_hf_config_rejects(change, field):
    hf = to_hf_config(get_preset("tiny"))
    hf.update(change)
    with pytest.raises(ValueError, match=field):
        from_hf_config(hf)


def test_config_is_hashable_and_frozen():
    cfg = get_preset("tiny")
    hash(cfg)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.vocab_size = 3
    assert isinstance(glm53.ModelConfig, type) and isinstance(cfg, ModelConfig)


def test_first_layers_keeps_each_layers_types_and_refuses_what_is_not_a_cut():
    tiny = get_preset("tiny")
    cut = tiny.first_layers(4)
    assert (cut.num_hidden_layers, cut.indexer_types, cut.mlp_layer_types) == (
        4, tiny.indexer_types[:4], tiny.mlp_layer_types[:4])
    assert cut.num_nextn_predict_layers == tiny.num_nextn_predict_layers and cut.hidden_size == tiny.hidden_size
    for n in (0, tiny.num_hidden_layers + 1):
        with pytest.raises(ValueError, match="first_layers"):
            tiny.first_layers(n)
