"""The performance model: published values computed from the config and the H200 spec, and the structural
properties the physics implies (docs/perfmodel.md lists the formulas)."""

import dataclasses
import itertools
import types

import pytest

from glm53 import perfmodel as pm
from glm53.config import get_preset
from glm53.perfmodel.step import StepLayout, _mean_rows, step_cost
from kvcache.layout import kv_bytes_per_token

CFG = get_preset("glm-5.3")
HW = pm.H200


# ------------------------------------------------------------------------- published values (BRIEF §2-3)
def test_kv_bytes_per_token_and_per_gpu():
    by_component = pm.kv_bytes_by_component(CFG)
    assert sum(by_component.values()) == kv_bytes_per_token(CFG) == 54_728
    assert round(pm.kv_bytes_per_gpu(CFG, 1_048_576) / pm.GiB, 1) == 53.4
    assert round(pm.kv_bytes_per_gpu(CFG, 1_048_576, dcp=8) / pm.GiB, 1) == 6.7


def test_sparse_mla_intensity_for_8_and_64_heads():
    assert pm.sparse_mla_flops_per_row_head(CFG) == 2176
    assert pm.sparse_mla_qo_bytes_per_head(CFG) == 2176
    tp8 = pm.sparse_mla_intensity(CFG, 8)
    pcp = pm.sparse_mla_intensity(CFG, 64)
    assert round(tp8["useful_flops"] / 1e6, 1) == 35.7 and round(tp8["hbm_bytes"] / 1e6, 2) == 1.37
    assert round(pcp["useful_flops"] / 1e6) == 285 and round(pcp["hbm_bytes"] / 1e6, 2) == 1.49
    assert round(tp8["useful_flop_per_byte"]) == 26
    assert round(pcp["useful_flop_per_byte"]) == 191
    # Padding 8 heads to the fp8 kernel's 64: the hardware does the 64-head work (and moves its q/out).
    padded = pm.sparse_mla_intensity(CFG, 8, pad_heads=True)
    assert padded["flops"] == pcp["flops"] and padded["useful_flops"] == tp8["useful_flops"]


def test_ridge_point_and_clock():
    assert round(HW.ridge_point()) == 206
    assert HW.ridge_point(achievable=True) < HW.ridge_point()
    assert HW.ridge_point("fp8") == pytest.approx(2 * HW.ridge_point(), rel=1e-3)
    assert HW.clock_hz == pytest.approx(1.83e9, rel=1e-3)  # FlashMLA's 989e12 / 1830 MHz / 132 SMs
    assert HW.nvlink_bandwidth == 450e9


def test_context_limits_for_the_kv_budget():
    budget = pm.PUBLISHED_KV_BUDGET_BYTES_TP8
    pcp8_alone = pm.max_context_tokens(CFG, budget)
    # Published: "about 250K tokens" for PCP8 alone; the bare byte count gives an upper bound near it.
    assert 250_000 <= pcp8_alone <= 300_000
    assert pm.kv_bytes_per_gpu(CFG, pcp8_alone) <= budget < pm.kv_bytes_per_gpu(CFG, pcp8_alone + 1)
    assert pm.max_context_tokens(CFG, budget, dcp=8) >= 1_048_576 > pcp8_alone
    assert pm.max_context_tokens(CFG, budget, block_size=64) % 64 == 0


# ------------------------------------------------------------------------------------ structural checks
def test_indexer_quadratic_and_sparse_mla_linear_in_prompt_length():
    k = CFG.index_topk
    lengths = [4 * k, 8 * k, 16 * k]
    idx, mla = zip(*(pm.prefill_flops_per_gpu(CFG, n, "pcp") for n in lengths))
    assert idx[1] / idx[0] == pytest.approx(4, rel=1e-3) and idx[2] / idx[1] == pytest.approx(4, rel=1e-3)
    assert mla[2] - mla[1] == pytest.approx(2 * (mla[1] - mla[0]))  # constant slope past k
    assert pm.sparse_rows_total(k, k) == pm.causal_pairs(k)  # dense while the prompt is within top-k


def test_crossovers():
    tp8 = pm.crossover_prompt_len(CFG, "tp")
    pcp8 = pm.crossover_prompt_len(CFG, "pcp")
    assert CFG.index_topk < tp8 < pcp8
    assert 7 < pcp8 / tp8 < 9  # PCP8 splits the indexer 8 ways; TP8 repeats it on every GPU
    for layout, x in (("tp", tp8), ("pcp", pcp8)):
        idx, mla = pm.prefill_flops_per_gpu(CFG, x, layout)
        assert idx == pytest.approx(mla, rel=1e-9)
        before = pm.prefill_flops_per_gpu(CFG, 0.9 * x, layout)
        assert before[0] < before[1]
    # Padding TP8's 8 heads to 64 makes its per-GPU MLA work equal PCP8's, so the crossovers coincide.
    assert pm.crossover_prompt_len(CFG, "tp", padded=True) == pytest.approx(pcp8)
    assert pm.crossover_prompt_len(CFG, "pcp", padded=True) == pytest.approx(pcp8)


def test_dcp8_prefill_overhead_grows_with_context():
    fracs, prefetched = [], []
    for ctx in (8192, 65536, 262144, 1_048_576):
        base = pm.prefill_step(CFG, HW, 2048, ctx, pcp=8)
        dcp = pm.prefill_step(CFG, HW, 2048, ctx, pcp=8, dcp=8)
        assert base.total().flops == pytest.approx(dcp.total().flops)  # DCP moves bytes, adds no FLOPs
        fracs.append(dcp.time_s() / base.time_s() - 1)
        prefetched.append(dcp.time_s("dcp_prefetch") / base.time_s() - 1)
    # The gathered bytes grow linearly with the context; the step's other costs grow more slowly (only the
    # indexer and top-k depend on context; MoE, projections and sparse MLA's fixed k rows do not).
    assert all(0 < a < b for a, b in itertools.pairwise(fracs))
    assert all(-1e-9 <= p <= f for p, f in zip(prefetched, fracs))
    assert prefetched[0] < 0.01  # a short context's gather hides behind the previous layer's kernels


def test_overlap_modes_on_a_hand_built_two_layer_step():
    """Two layers by hand (seconds): layer 0 = kernels 3 + 1, DCP gather 2, a TP all-reduce 0.5; layer 1 =
    kernel 4, DCP gather 5, a copy 0.25. "none" (vLLM's schedule: every collective blocks the compute stream
    between its producer and consumer) shows everything: 15.75. "dcp_prefetch" runs layer 1's gather during
    layer 0's 4 s of kernels (the all-reduce and the copy are not kernels: they hide nothing), so 1 of its 5 s
    shows; layer 0's gather has no layer before it and shows whole: 3 + 1 + 0.5 + 4 + 0.25 + 2 + 1 = 11.75."""
    def c(name, kind, layer, t):
        return pm.Cost(name, kind=kind, layer=layer, time_s=t)

    step = pm.StepCost((c("mla_projections", "kernel", 0, 3.0), c(pm.DCP_GATHER, "collective", 0, 2.0),
                        c("sparse_mla", "kernel", 0, 1.0), c("tp_all_reduce", "collective", 0, 0.5),
                        c("kv_load", "copy", -1, 0.25), c(pm.DCP_GATHER, "collective", 1, 5.0),
                        c("sparse_mla", "kernel", 1, 4.0)))
    assert pm.OVERLAPS == ("none", "dcp_prefetch")
    assert step.time_s() == step.time_s("none") == 15.75
    assert step.time_s("dcp_prefetch") == 11.75
    # a gather shorter than the previous layer's kernels hides entirely
    short = pm.StepCost(step.parts[:5] + (c(pm.DCP_GATHER, "collective", 1, 3.5), step.parts[6]))
    assert short.time_s("dcp_prefetch") == 3 + 1 + 0.5 + 0.25 + 4 + 2


def test_vllm_pcp_dcp_prefill_gathers_the_upconverted_shard():
    """vLLM's PCP x DCP prefill (FLASHMLA_SPARSE, docs/perfmodel.md), a 2,048-token chunk over 8,192 cached
    tokens on PCP8 x DCP8, by hand: each rank holds ceil(10,240 / 8) = 1,280 rows of the request; it
    up-converts them (reads 1,280 x 656 B fp8 rows, writes 1,280 x 576 bf16 values), then receives the other
    7 ranks' 1,280 bf16 rows (7 x 1,280 x 1,152 B = 10,321,920 B, no indexer keys) in each of the 79 layers;
    on the 22 indexer layers it gathers 7 x 1,280 candidates (fp32 score + int32 position) for each of its
    256 queries (its keys, fewer than top-k). The fp8_rows form gathers 7 x 1,024 cached rows with keys."""
    hw = pm.H200_CALIBRATED
    vllm = pm.prefill_step(CFG, hw, 2048, 8192, pcp=8, dcp=8, dcp_gather="bf16_shard").by_name()
    ours = pm.prefill_step(CFG, hw, 2048, 8192, pcp=8, dcp=8).by_name()
    assert vllm[pm.DCP_GATHER].nvlink_bytes == 79 * 10_321_920
    assert vllm["sparse_mla_upconvert"].hbm_bytes == 79 * 1280 * (656 + 1152)
    assert ours["sparse_mla_upconvert"].hbm_bytes == 79 * 10_240 * (656 + 1152)
    assert vllm["dcp_topk_gather"].nvlink_bytes == 22 * 7 * 256 * 1280 * 8
    assert "dcp_topk_gather" not in ours
    assert ours[pm.DCP_GATHER].nvlink_bytes == 7 * 1024 * (79 * 656 + 22 * 132)
    dep = StepLayout(pcp=8, dcp=8, expert_parallel=True, include_mtp=True, dcp_prefill_gather="bf16_shard")
    for per_layer in (False, True):
        got = step_cost(CFG, hw, dep, _plan(_row(8192, 2048)), per_layer=per_layer)
        assert got.time_s() == pytest.approx(sum(v.time_s for v in vllm.values()), rel=1e-12)
        assert got.by_name()[pm.DCP_GATHER].nvlink_bytes == pytest.approx(79 * 10_321_920)
    with pytest.raises(ValueError, match="dcp_prefill_gather"):
        StepLayout(pcp=8, dcp=8, dcp_prefill_gather="fp8_shard")
    with pytest.raises(ValueError, match="dcp_gather"):
        pm.prefill_step(CFG, hw, 2048, 8192, pcp=8, dcp=8, dcp_gather="bf16")


def _traced_full_copy_bytes(context: int, n: int, row_bytes: int) -> float:
    """Bytes one rank sends building PCP x DCP's temporary full copy (`parallel.dcp.full_copy`, the code the
    engine runs) of a `context`-token request over DCP n, rows packed as `row_bytes` bytes, from the traced
    program's collectives (nothing runs)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AbstractMesh, AxisType
    from jax.sharding import PartitionSpec as P

    from parallel import comm, dcp
    from parallel.mesh import AXES

    mesh = AbstractMesh((1, 1, n), AXES, axis_types=(AxisType.Auto,) * 3)
    layout = dcp.DcpLayout(n, 64)
    blocks = layout.blocks_per_rank(context)
    copy = jax.shard_map(lambda t, bt: dcp.full_copy(t, bt, layout, axis="cp", num_positions=context), mesh=mesh,
                         in_specs=(P("cp"), P()), out_specs=P(), check_vma=False)
    return comm.collective_bytes(copy, jnp.zeros((n * blocks * 64, row_bytes), jnp.uint8),
                                 jnp.arange(blocks, dtype=jnp.int32)[None], axis_sizes=mesh.shape)["total"]


def test_dcp_gather_bytes():
    """The model's per-layer context all-gather against the traced implementation, with GLM-5.3's packed
    656 B rows and 132 B indexer keys (BRIEF §2): 8192 cached tokens over DCP8 is 1,024 tokens per rank,
    gathered from the 7 others: 7 x 1,024 x 656 = 4,702,208 B on a shared layer, 7 x 1,024 x 788 =
    5,648,384 B on a full layer (docs/parallel.md: 5.6 MB)."""
    rows, keys = _traced_full_copy_bytes(8192, 8, 656), _traced_full_copy_bytes(8192, 8, 132)
    assert (rows, rows + keys) == (4_702_208, 5_648_384)
    c = pm.dcp_context_allgather(CFG, HW, 8192, 8, layer=3)  # layer 3: shared indexer, MLA rows only
    assert c.nvlink_bytes == rows
    assert pm.dcp_context_allgather(CFG, HW, 8192, 8, layer=0).nvlink_bytes == rows + keys
    assert pm.dcp_context_allgather(CFG, HW, 8192, 1, layer=0).time_s == 0


def test_moe_memory_bound_at_batch_1_compute_bound_at_large_batch():
    for replicated in (True, False):
        experts = pm.moe(CFG, HW, 1, 8, replicated_tokens=replicated)[1]
        assert experts.bound == "memory" and experts.memory_s > 100 * experts.compute_s
    big = pm.moe(CFG, HW, 8192, 8)[1]  # 65,536 tokens over the EP group: ~256 tokens per expert
    assert big.bound == "compute"
    assert pm.expected_touched_experts(CFG, 1, 8) == pytest.approx(CFG.num_experts_per_tok / 8)
    assert pm.expected_touched_experts(CFG, 10**6, 8) == pytest.approx(CFG.n_routed_experts / 8)
    assert 0 < pm.expected_remote_ranks(CFG, 8) < min(7, CFG.num_experts_per_tok)


def test_head_padding_and_dequantisation():
    q, rows = 64, 2048
    plain8 = pm.sparse_mla(CFG, HW, q, rows, 8)
    padded8 = pm.sparse_mla(CFG, HW, q, rows, 8, pad_heads=True)
    full64 = pm.sparse_mla(CFG, HW, q, rows, 64)
    assert padded8.time_s == pytest.approx(full64.time_s) and padded8.time_s > plain8.time_s
    assert full64.bound == "compute"
    # Without dequantisation (bf16 rows, or ignoring it) 8 heads are memory bound. With fp8 rows the model
    # says the dequantisation (once per row per 64-head CTA, whatever the head count) outlasts the HBM reads
    # on an H200: FlashMLA's 50 cycles per row vs 660 B at 4.3 TB/s spread over 132 SMs (about 37 cycles).
    assert pm.sparse_mla(CFG, HW, q, rows, 8, dequant=False).bound == "memory"
    assert plain8.bound == "compute" and plain8.compute_s > plain8.memory_s
    # BRIEF §3 caveat: at 64 heads the fp8 kernel spends comparable time dequantising and multiplying.
    no_deq = pm.sparse_mla(CFG, HW, q, rows, 64, dequant=False)
    deq_s = full64.compute_s - no_deq.compute_s
    assert 0.5 < deq_s / no_deq.compute_s < 2
    assert pm.sparse_mla(CFG, HW, q, rows, 64, mla_format="bfloat16").compute_s == pytest.approx(no_deq.compute_s)


def test_sparse_decode_kernel_model_against_flashmla_published_numbers():
    # FlashMLA's fp8 sparse decode on H800 SXM5 (batch 128, 128 heads, s_q 2, top-k 2048): 250 TFLOP/s without
    # the two-CTA dequantisation sharing, 410 with it. The model was not fitted to these: it should land near.
    h800 = dataclasses.replace(HW, hbm_bandwidth=3.35e12)
    cfg128 = CFG.replace(num_attention_heads=128)
    for heads_per_dequant, published in ((64, 250e12), (128, 410e12)):
        c = pm.sparse_mla(cfg128, h800, 256, 2048, 128, heads_per_dequant=heads_per_dequant)
        assert c.bound == "compute"
        assert 0.9 < (c.useful_flops / c.time_s) / published < 1.35


def test_collectives_and_host_copies():
    ag = pm.all_gather(HW, 1e6, 8)
    # 7 MB over one direction of NVLink (900 GB/s both ways) at the assumed 80% NCCL bus efficiency, 360 GB/s:
    # 19.44 us, plus the assumed 15 us collective latency (docs/perfmodel.md's spec table)
    assert ag.nvlink_bytes == 7e6 and ag.time_s == pytest.approx(19.444e-6 + 15e-6, rel=1e-4)
    assert pm.all_gather(HW, 1e6, 1).time_s == 0
    assert pm.reduce_scatter(HW, 8e6, 8).nvlink_bytes == pytest.approx(7e6)
    assert pm.all_reduce(HW, 8e6, 8).nvlink_bytes == pytest.approx(14e6)
    copy = pm.host_copy(HW, 1e9)
    # 1 GB at the 50 GB/s pinned-memory PCIe rate (BRIEF §3) = 20 ms, plus the assumed 10 us per transfer
    assert copy.host_bytes == 1e9 and copy.time_s == pytest.approx(0.02001)
    assert pm.hisparse_row_copy(CFG, HW, 100, layers=4).host_bytes == 100 * 4 * 656
    # a2a: one collective fewer than ag_rs and no separate LSE gather.
    ag_rs = pm.dcp_decode_merge(CFG, HW, 32, 8, 64, backend="ag_rs")
    a2a = pm.dcp_decode_merge(CFG, HW, 32, 8, 64, backend="a2a")
    assert sum(c.kind == "collective" for c in ag_rs) == 3 and sum(c.kind == "collective" for c in a2a) == 2
    assert pm.total(a2a).time_s < pm.total(ag_rs).time_s
    with pytest.raises(ValueError, match="backend"):
        pm.dcp_decode_merge(CFG, HW, 32, 8, 64, backend="ring")


def test_decode_step_dcp_shards_the_indexer_reads():
    base = pm.decode_step(CFG, HW, 16, 131072, tp=8)
    dcp = pm.decode_step(CFG, HW, 16, 131072, tp=8, dcp=8)
    idx0, idx1 = base.by_name()["indexer_scores"], dcp.by_name()["indexer_scores"]
    assert idx1.flops == pytest.approx(idx0.flops / 8)
    assert "dcp_q_gather" in dcp.by_name() and "dcp_q_gather" not in base.by_name()
    # MTP verification (4 query tokens per request) costs less than 4 single-token steps: weights are shared.
    spec = pm.decode_step(CFG, HW, 16, 131072, tp=8, spec_tokens=3)
    assert base.time_s() < spec.time_s() < 4 * base.time_s()


def test_step_validation_and_overlap_names():
    with pytest.raises(ValueError, match="dcp"):
        pm.prefill_step(CFG, HW, 2048, 8192, pcp=8, dcp=3)
    with pytest.raises(ValueError, match="overlap"):
        pm.prefill_step(CFG, HW, 2048, 8192, pcp=8).time_s("magic")
    with pytest.raises(ValueError, match="efficiency"):
        pm.HardwareSpec(matmul_efficiency=1.2)
    with pytest.raises(ValueError, match="hbm_bandwidth"):
        pm.HardwareSpec(hbm_bandwidth=0)


def test_mean_rows_matches_brute_force():
    for k, first, count in ((16, 1, 40), (16, 20, 5), (16, 10, 10), (2048, 8193, 2048), (5, 1, 1)):
        brute = sum(min(k, first + i) for i in range(count)) / count
        assert _mean_rows(k, first, count) == pytest.approx(brute)


@pytest.mark.parametrize("preset", ["tiny", "mid"])
def test_param_counts_match_the_model_definition(preset):
    from glm53.weights import param_count

    cfg = get_preset(preset)
    assert sum(pm.param_counts(cfg).values()) == param_count(cfg)
    assert sum(pm.param_counts(cfg, include_mtp=False).values()) == param_count(cfg, include_mtp=False)


def test_weight_bytes_per_gpu():
    tp8 = pm.weight_bytes_per_gpu(CFG, tp=8, ep=8)
    total_fp8 = sum(pm.param_counts(CFG).values())
    assert total_fp8 / 8 < tp8 < total_fp8 / 8 * 1.1  # ~1 byte per parameter, mostly split 8 ways
    assert tp8 < HW.hbm_capacity_bytes < pm.weight_bytes_per_gpu(CFG)  # the model needs the 8-way split


def test_expected_remote_ranks_by_enumeration():
    cfg = get_preset("tiny")  # 8 experts, top-2
    for ep in (2, 4, 8):
        per_rank = cfg.n_routed_experts // ep
        choices = list(itertools.combinations(range(cfg.n_routed_experts), cfg.num_experts_per_tok))
        # a token on rank 0 goes once to every other rank that holds one of its experts
        remote = [len({e // per_rank for e in c} - {0}) for c in choices]
        assert pm.expected_remote_ranks(cfg, ep) == pytest.approx(sum(remote) / len(choices))


def test_dense_mha_form_is_cheaper_than_mqa_for_a_short_prompt():
    # Within top-k, DSA is dense causal attention. Per (query, key) pair and head the un-absorbed form does
    # QK over qk_head_dim 256 (nope 192 + rope 64) and PV over v_head_dim 256: 2 x 256 + 2 x 256 = 1,024
    # FLOPs, against the absorbed form's 2,176 (BRIEF §3). Measured as the change with the keys per query,
    # so the expansion drops out.
    n = 1024
    mean_keys = (n + 1) / 2
    mha = pm.dense_mha_prefill(CFG, HW, n, mean_keys, n, 64)
    mqa = pm.sparse_mla(CFG, HW, n, mean_keys, 64)
    per_pair_head = (pm.dense_mha_prefill(CFG, HW, n, mean_keys + 1, n, 64).flops - mha.flops) / (n * 64)
    assert per_pair_head == pytest.approx(1024)
    assert (pm.sparse_mla(CFG, HW, n, mean_keys + 1, 64).flops - mqa.flops) / (n * 64) == pytest.approx(2176)
    # The K/V expansion, per cached key: its 512-dim latent times W_kv_b [512, 64 heads x (k_nope 192 + v 256)],
    # 2 x 512 x 64 x 448 = 29,360,128 FLOPs, whatever the number of queries.
    assert pm.dense_mha_prefill(CFG, HW, n, mean_keys, n + 1, 64).flops - mha.flops == pytest.approx(29_360_128)
    assert mha.flops == pytest.approx(n * 29_360_128 + n * mean_keys * 64 * 1024)
    assert mha.time_s < mqa.time_s


# --------------------------------------------------------------------------- step_cost: a mixed plan
def _row(start, n, drafts=0, sample=True):
    return types.SimpleNamespace(start=start, num_tokens=n, num_draft_tokens=drafts, sample=sample)


def _plan(*rows):
    return types.SimpleNamespace(rows=rows)


@pytest.mark.parametrize("tp,dcp", [(1, 1), (8, 1), (8, 8)])
def test_step_cost_of_a_uniform_decode_batch_is_decode_step(tp, dcp):
    """decode_step prices a batch at one context; a plan of 32 rows at that context is the same work (a
    decode row at position c sees c + 1 keys: decode_step's context)."""
    got = step_cost(CFG, pm.H200, StepLayout(tp=tp, dcp=dcp), _plan(*[_row(9_999, 1)] * 32)).time_s()
    assert got == pytest.approx(pm.decode_step(CFG, pm.H200, 32, 10_000, tp=tp, dcp=dcp).time_s(), rel=1e-12)


@pytest.mark.parametrize("pcp,dcp,cached", [(1, 1, 5_000), (8, 1, 0), (8, 8, 100_000)])
def test_step_cost_of_one_chunk_is_prefill_step(pcp, dcp, cached):
    dep = StepLayout(pcp=pcp, dcp=dcp, expert_parallel=True, include_mtp=True)
    got = step_cost(CFG, pm.H200, dep, _plan(_row(cached, 2048))).time_s()
    assert got == pytest.approx(pm.prefill_step(CFG, pm.H200, 2048, cached, pcp=pcp, dcp=dcp).time_s(), rel=1e-12)


def test_step_cost_counts_every_query_of_a_mixed_batch():
    """Sparse-MLA useful FLOPs of a mixed batch, against a loop over every query token: a token at
    position p attends min(top-k, p + 1) rows with every head."""
    rows = [_row(0, 3000), _row(1500, 700, sample=False), _row(40_000, 1), _row(7, 1), _row(2047, 2)]
    c = step_cost(CFG, pm.H200, StepLayout(tp=8), _plan(*rows))
    per_row_head = 2 * (CFG.kv_lora_rank + CFG.qk_rope_head_dim) + 2 * CFG.kv_lora_rank
    brute = sum(min(CFG.index_topk, p + 1) for r in rows for p in range(r.start, r.start + r.num_tokens))
    mla = sum(v.useful_flops for k, v in c.by_name().items() if k.startswith("sparse_mla"))
    assert mla == pytest.approx(brute * (CFG.num_attention_heads // 8) * per_row_head * CFG.num_hidden_layers)
    # indexer pairs: every query scores every key up to itself, on every full layer (TP repeats it)
    pairs = sum(p + 1 for r in rows for p in range(r.start, r.start + r.num_tokens))
    n_full = sum(CFG.layer_indexer_type(i) == "full" for i in range(CFG.num_hidden_layers))
    assert c.by_name()["indexer_scores"].flops == pytest.approx(pairs * n_full * pm.indexer_pair_flops(CFG))
    # one lm_head row per sampling row: 4 of the 5
    assert c.by_name()["lm_head"].flops == pytest.approx(4 * 2 * CFG.hidden_size * CFG.vocab_size / 8)


def test_step_cost_per_layer_and_per_kind_agree_and_transfers_add_link_time():
    rows = [_row(50_000, 1)] * 8 + [_row(0, 4096)]
    dep = StepLayout(pcp=8, dcp=8, expert_parallel=True)
    fast = step_cost(CFG, pm.H200, dep, _plan(*rows))
    slow = step_cost(CFG, pm.H200, dep, _plan(*rows), per_layer=True)
    assert fast.time_s() == pytest.approx(slow.time_s(), rel=1e-12)
    assert slow.time_s("dcp_prefetch") <= slow.time_s()
    with pytest.raises(ValueError, match="per-layer"):
        fast.time_s("dcp_prefetch")
    moved = step_cost(CFG, pm.H200, dep, _plan(*rows), h2d_bytes=5e9, d2h_bytes=1e9, host_transfers=3)
    extra = moved.time_s() - fast.time_s()
    assert extra == pytest.approx(6e9 / pm.H200.host_link_bandwidth + 2 * 3 * pm.H200.host_copy_latency_s)
    assert step_cost(CFG, pm.H200, dep, _plan()).time_s() == 0.0
    with pytest.raises(ValueError, match="dcp=3"):
        StepLayout(tp=8, dcp=3)


@pytest.mark.parametrize("n", [2, 8])
def test_a_collective_priced_from_its_sent_bytes_is_the_one_priced_from_its_operand(n):
    """cost.collective takes the bytes traffic's formulas count (sent per rank); the operand-based
    constructors must give the same Cost for the operand that sends that many bytes."""
    from glm53.perfmodel.cost import collective
    from glm53.perfmodel.traffic import sent_bytes

    s = 3_000_000.0
    for kind, make in (("all_gather", pm.all_gather), ("reduce_scatter", pm.reduce_scatter),
                       ("psum", pm.all_reduce), ("all_to_all", None)):
        sent = sent_bytes(kind, s, n) if kind != "all_to_all" else s
        want = make(pm.H200_CALIBRATED, s, n) if make else pm.all_to_all(pm.H200_CALIBRATED, s, n)
        got = collective(pm.H200_CALIBRATED, kind, sent, n, want.name)
        assert (got.name, got.kind) == (want.name, want.kind)
        assert [getattr(got, f) for f in pm.cost._ADDITIVE] == pytest.approx([getattr(want, f) for f in pm.cost._ADDITIVE])
    with pytest.raises(ValueError, match="kind"):
        collective(HW, "broadcast", 1.0, 2)


# -------------------------------------------------------- FlashMLA kernels on the calibrated spec
@pytest.mark.parametrize("tp,dcp", [(1, 1), (8, 1), (8, 8)])
def test_calibrated_step_cost_of_a_uniform_decode_batch_is_decode_step(tp, dcp):
    got = step_cost(CFG, pm.H200_CALIBRATED, StepLayout(tp=tp, dcp=dcp), _plan(*[_row(9_999, 1)] * 32)).time_s()
    assert got == pytest.approx(pm.decode_step(CFG, pm.H200_CALIBRATED, 32, 10_000, tp=tp, dcp=dcp).time_s(), rel=1e-12)


@pytest.mark.parametrize("pcp,tp,dcp,cached", [(1, 1, 1, 5_000), (1, 8, 1, 70_000), (8, 1, 1, 0), (8, 1, 8, 100_000)])
def test_calibrated_step_cost_of_one_chunk_is_prefill_step(pcp, tp, dcp, cached):
    dep = StepLayout(pcp=pcp, tp=tp, dcp=dcp, expert_parallel=True, include_mtp=True)
    got = step_cost(CFG, pm.H200_CALIBRATED, dep, _plan(_row(cached, 2048)))
    want = pm.prefill_step(CFG, pm.H200_CALIBRATED, 2048, cached, pcp=pcp, tp=tp, dcp=dcp)
    assert got.time_s() == pytest.approx(want.time_s(), rel=1e-12)
    # vLLM's FLASHMLA_SPARSE: 8 heads per GPU take the fp8 decode kernel (no up-convert); 64 the bf16 prefill
    # kernel over an up-converted workspace of the request's whole context
    upconvert = got.by_name().get("sparse_mla_upconvert")
    if tp == 8:
        assert upconvert is None
    else:
        n_layers = CFG.num_hidden_layers + 1
        assert upconvert.hbm_bytes == pytest.approx(n_layers * (cached + 2048) * (656 + 1152))


def test_vllm_kernel_choice_and_the_mixed_batch_call():
    assert pm.sparse_prefill_kernel("fp8_ds_mla", 8) == "decode"
    assert pm.sparse_prefill_kernel("fp8_ds_mla", 8, hisparse=True) == "prefill"
    assert pm.sparse_prefill_kernel("fp8_ds_mla", 64) == "prefill"
    assert pm.sparse_prefill_kernel("bfloat16", 8) == "prefill"
    hw = pm.H200_CALIBRATED
    rows = [_row(80_000, 1)] * 8 + [_row(70_000, 2048)]
    mixed = step_cost(CFG, hw, StepLayout(tp=8), _plan(*rows)).by_name()
    dec = step_cost(CFG, hw, StepLayout(tp=8), _plan(*rows[:8])).by_name()["sparse_mla_decode"]
    pre = step_cost(CFG, hw, StepLayout(tp=8), _plan(rows[8])).by_name()["sparse_mla_prefill"]
    together = mixed["sparse_mla_decode"].time_s + mixed["sparse_mla_prefill"].time_s
    # one kernel call: one fixed time per layer instead of two, the work shared
    assert together == pytest.approx(dec.time_s + pre.time_s - CFG.num_hidden_layers * hw.sparse_decode_latency_s,
                                     rel=0.01)
    assert mixed["sparse_mla_prefill"].useful_flops == pytest.approx(pre.useful_flops)
    sep = step_cost(CFG, hw, StepLayout(tp=8, hisparse=True), _plan(*rows)).by_name()
    assert "sparse_mla_upconvert" in sep and sep["sparse_mla_decode"].time_s == pytest.approx(dec.time_s)


def test_expert_load_imbalance_prices_the_busiest_ranks_experts_and_all_to_alls():
    """A hand-built PCP8 x EP8 prefill step (one row of 2,048 tokens): under a skew of 2 the busiest rank
    computes twice the mean's expert assignments (twice the FLOPs and compute time; the weights it
    reads grow less) and receives twice the dispatch bytes, so every all-to-all's link time doubles; a TP8 step (experts width-sharded, every GPU holds a slice of each) does not move, nor does a
    skew of 1."""
    import dataclasses
    import types

    from glm53.config import get_preset
    from glm53.perfmodel import H200_CALIBRATED as HW
    from glm53.perfmodel.step import StepLayout, step_cost

    cfg = get_preset("glm-5.3")
    row = types.SimpleNamespace(start=0, num_tokens=2048, num_draft_tokens=0, sample=True)
    rows = types.SimpleNamespace(rows=(row,))

    def by_name(dep):
        out = {}
        for c in step_cost(cfg, HW, dep, rows).parts:
            out.setdefault(c.name, []).append(c)
        return out

    ep = StepLayout(pcp=8, dcp=8, expert_parallel=True)
    flat, skew = by_name(ep), by_name(dataclasses.replace(ep, expert_load_imbalance=2.0))
    assert sum(c.flops for c in skew["moe_experts"]) == pytest.approx(2 * sum(c.flops for c in flat["moe_experts"]))
    assert sum(c.compute_s for c in skew["moe_experts"]) == pytest.approx(
        2 * sum(c.compute_s for c in flat["moe_experts"]))
    assert sum(c.time_s for c in skew["moe_experts"]) > 1.1 * sum(c.time_s for c in flat["moe_experts"])
    for name in ("moe_dispatch", "moe_combine"):
        assert [c.link_s for c in skew[name]] == pytest.approx([2 * c.link_s for c in flat[name]])
    assert by_name(dataclasses.replace(ep, expert_load_imbalance=1.0)) == flat
    tp = StepLayout(tp=8)
    assert step_cost(cfg, HW, dataclasses.replace(tp, expert_load_imbalance=2.0), rows).time_s() == pytest.approx(
        step_cost(cfg, HW, tp, rows).time_s())
    with pytest.raises(ValueError, match="expert_load_imbalance"):
        StepLayout(expert_load_imbalance=0.5)
