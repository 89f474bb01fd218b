"""`hkvm.sglang.keys`: object names exactly as SGLang's own Mooncake backend forms
them (sgl-project/sglang python/sglang/srt/mem_cache/storage/mooncake_store/
mooncake_store.py at 00fe477f32b3878f64d44cc36895e1de4a113afe). Pure: no cluster."""

from __future__ import annotations

import enum
import types

from hkvm.sglang.keys import PageKeys, pool_name


def keys(**config):
    extra = config.pop("extra", {})
    base = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, is_mla_model=False, model_name=None)
    base.update(config)
    return PageKeys(types.SimpleNamespace(**base), extra)


def test_mha_keys_carry_the_tp_rank_and_under_pp_the_pp_rank():
    assert keys(tp_rank=3, tp_size=4).objects(["H"], keys(tp_rank=3, tp_size=4).kv_parts()) == [
        "H_3_k", "H_3_v",
    ]
    pp = keys(tp_rank=3, tp_size=4, pp_rank=1, pp_size=2)
    assert pp.objects(["H"], pp.kv_parts()) == ["H_3_1_k", "H_3_1_v"]


def test_mla_keys_are_shared_by_every_tp_rank():
    for rank in range(4):
        mla = keys(tp_rank=rank, tp_size=4, is_mla_model=True)
        assert mla.objects(["H"], mla.kv_parts()) == ["H__k"]
    pp = keys(is_mla_model=True, pp_rank=1, pp_size=2)
    assert pp.objects(["H"], pp.kv_parts()) == ["H_1_k"]


def test_the_prefix_is_the_backend_tag_and_the_model_name():
    tagged = keys(model_name="Qwen/Qwen3-8B", extra={"extra_backend_tag": "deploy1"})
    assert tagged.objects(["H"], tagged.kv_parts()) == [
        "deploy1_Qwen-Qwen3-8B_H_0_k", "deploy1_Qwen-Qwen3-8B_H_0_v",
    ]
    assert keys(model_name="m").tagged("H") == "m_H"


def test_split_heads_give_one_pair_per_head_group():
    split = keys(tp_rank=1, tp_size=2, tp_lcm_size=8, should_split_heads=True)
    assert split.objects(["H"], split.kv_parts()) == [
        "H_4_k", "H_4_v", "H_5_k", "H_5_v", "H_6_k", "H_6_v", "H_7_k", "H_7_v",
    ]
    # Without the page_head layout's flag, the LCM changes nothing.
    plain = keys(tp_rank=1, tp_size=2, tp_lcm_size=8)
    assert plain.kv_parts() == ["_1_k", "_1_v"]


class PoolName(str, enum.Enum):
    """SGLang's pool names are a str enum."""

    MAMBA = "mamba"
    SWA = "swa"
    INDEXER = "indexer"


def test_side_pool_keys():
    mha = keys(tp_rank=2, tp_size=4)
    mla = keys(tp_rank=2, tp_size=4, is_mla_model=True)
    assert pool_name(PoolName.MAMBA) == "mamba"
    assert mha.side_parts(PoolName.MAMBA, 3) == ["_2_temporal", "_2_conv_0", "_2_conv_1"]
    assert mha.side_parts("mamba", 2, has_temporal=False) == ["_2_conv_0", "_2_conv_1"]
    # Mamba states are per rank even in an MLA model.
    assert mla.side_parts("mamba", 2) == ["_2_temporal", "_2_conv_0"]
    assert mha.side_parts(PoolName.SWA, 2) == ["_2_swa_k", "_2_swa_v"]
    assert mla.side_parts("swa", 1) == ["__swa"]
    assert mha.side_parts("draft", 2) == ["_2_draft_k", "_2_draft_v"]
    assert mla.side_parts("draft", 1) == ["__draft_k"]
    assert mha.side_parts("draft_swa", 2) == ["_2_draft_swa_k", "_2_draft_swa_v"]
    assert mla.side_parts("draft_swa", 1) == ["__draft_swa"]
    assert mla.side_parts(PoolName.INDEXER, 1) == ["__indexer"]
    assert mla.side_parts("deepseek_v4_c128", 1) == ["__deepseek_v4_c128"]
