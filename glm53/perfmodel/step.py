"""Step costs: one prefill chunk (`prefill_step`) or one decode batch at one context (`decode_step`)."""

from __future__ import annotations

import dataclasses
import math
import typing

from glm53.config import ModelConfig
from glm53.perfmodel.cost import Cost, StepCost, _kernel, all_reduce, host_copy
from glm53.perfmodel.hardware import BF16, FP8_WEIGHT_BYTES, FP32, INDEX_BYTES, HardwareSpec
from glm53.perfmodel.ops import (DCP_PREFILL_GATHERS, FLASHMLA_ROW_BLOCK, _layers, dcp_context_allgather,
                                 dcp_decode_merge, dcp_topk_merge,
                                 dense_mlp, hisparse_row_copy, indexer_scores, indexer_topk, lm_head, mla_projections,
                                 moe, pcp_kv_allgather, sparse_mla, sparse_mla_upconvert)

# vLLM's FLASHMLA_SPARSE backend (vllm/v1/attention/backends/mla/flashmla_sparse.py): with an fp8 cache and
# fewer heads per GPU than this it runs every token, prefill ones too, through the fp8 decode kernel as one
# batch ("mixed batch"), avoiding the bf16 prefill kernel's head padding; otherwise prefill rows take the bf16
# prefill kernel over an up-converted workspace (also with HiSparse, and under PCP x DCP)
MIN_HEADS_FOR_BF16_PREFILL = 32


def sparse_prefill_kernel(mla_format: str, heads: int, *, pcp: int = 1, dcp: int = 1, hisparse: bool = False) -> str:
    """The FlashMLA kernel vLLM runs sparse-MLA prefill rows on, as `ops.sparse_mla`'s `kernel`: "decode" (the
    fp8 decode kernel, mixed batch) or "prefill" (up-convert, then the bf16 prefill kernel). Only the FlashMLA
    kernel model (calibrated specs) reads it."""
    if mla_format != "fp8_ds_mla":
        return "prefill"
    mixed = heads < MIN_HEADS_FOR_BF16_PREFILL and not hisparse and not (pcp > 1 and dcp > 1)
    return "decode" if mixed else "prefill"


def _mean_rows(k: int, first_visible: float, count: float) -> float:
    """Mean of min(k, first_visible + i) over i = 0..count-1 (rows a query at each of `count` consecutive
    positions attends, the first seeing `first_visible` keys)."""
    n = int(count)
    if n <= 0:
        return 0.0
    a = int(first_visible)
    last = a + n - 1
    if last <= k:
        return (a + last) / 2
    if a >= k:
        return float(k)
    below = k - a  # positions with fewer than k visible keys: a .. k-1
    return ((a + k - 1) * below / 2 + k * (n - below)) / n



def prefill_step(cfg: ModelConfig, hw: HardwareSpec, chunk_tokens: int, cached_context: int, *, pcp: int = 1,
                 tp: int = 1, dcp: int = 1, ep: int | None = None, include_mtp: bool = True, pad_heads: bool = False,
                 dequant: bool = True, weight_bytes: float = FP8_WEIGHT_BYTES, hisparse: bool = False,
                 dcp_gather: str = "fp8_rows") -> StepCost:
    """One prefill step of one request: `chunk_tokens` new tokens against `cached_context` cached tokens,
    on an engine of pcp * tp GPUs (one GPU's costs). Layers: the main model and (include_mtp) the MTP
    layer, which prefills the prompt too so its KV exists for drafting.

    - PCP (pcp > 1): each rank takes chunk_tokens / pcp query tokens (2N-chunk load balance, so each rank's
      mean causal key count equals the chunk's), all heads; attention weights replicated; the new KV of
      every layer is all-gathered. MoE: EP over all pcp * tp GPUs with all-to-all dispatch.
    - TP (tp > 1): every rank has all chunk tokens and heads / tp heads; the indexer is replicated (not
      split); o_proj, dense MLP and MoE outputs are all-reduced.
    - DCP (dcp > 1; dcp <= pcp * tp): the persistent cache is sharded, so each layer all-gathers the
      context (`dcp_context_allgather`), in the form `dcp_gather` names (`ops.DCP_PREFILL_GATHERS`):
      "fp8_rows", the cached context's cache rows and indexer keys before the indexer (the new chunk's
      KV arrives with the PCP gather), then the whole context's up-convert; "bf16_shard" (vLLM, PCP x
      DCP), the indexer over the rank's key shard with the DCP top-k merge, the up-convert of the rank's
      shard of the request (cached + new tokens), the all-gather of those bf16 rows, then attention.
    Per layer: projections, [TP all-reduce], [PCP KV gather], [DCP context gather], indexer scores and
    top-k on full layers, sparse MLA, dense MLP or MoE (+ its collectives); then the lm_head for the
    request's last token. On a calibrated spec sparse MLA runs on the FlashMLA kernel vLLM picks
    (`sparse_prefill_kernel`; `hisparse`: the HiSparse policy is on), with the fp8 cache's up-conversion
    (`sparse_mla_upconvert`) before the bf16 prefill kernel.
    """
    n_gpus = pcp * tp
    ep = n_gpus if ep is None else ep
    if min(pcp, tp, dcp, ep) < 1 or n_gpus % dcp or cfg.num_attention_heads % tp or (pcp > 1 and tp > 1):
        raise ValueError(f"need pcp, tp, dcp, ep >= 1, not both pcp and tp > 1, dcp dividing pcp*tp and tp "
                         f"dividing the heads; got pcp={pcp} tp={tp} dcp={dcp} ep={ep}")
    q = chunk_tokens / pcp
    heads = cfg.num_attention_heads // tp
    keys_per_query = cached_context + (chunk_tokens + 1) / 2
    rows = _mean_rows(cfg.index_topk, cached_context + 1, chunk_tokens)
    kernel = sparse_prefill_kernel("fp8_ds_mla", heads, pcp=pcp, dcp=dcp, hisparse=hisparse)
    if dcp_gather not in DCP_PREFILL_GATHERS:
        raise ValueError(f"dcp_gather must be one of {DCP_PREFILL_GATHERS}, got {dcp_gather!r}")
    shard = pcp > 1 and dcp > 1 and dcp_gather == "bf16_shard"
    seq = cached_context + chunk_tokens
    upconvert_rows = math.ceil(seq / dcp) if shard else seq
    parts: list[Cost] = []
    for layer in _layers(cfg, include_mtp):
        parts.append(mla_projections(cfg, hw, q, layer, tp=tp, weight_bytes=weight_bytes))
        if tp > 1:
            parts.append(all_reduce(hw, q * cfg.hidden_size * BF16, tp, name="tp_all_reduce").at_layer(layer))
        if pcp > 1:
            parts.append(pcp_kv_allgather(cfg, hw, chunk_tokens, pcp, layer))
        if dcp > 1 and cached_context > 0 and not shard:
            parts.append(dcp_context_allgather(cfg, hw, cached_context, dcp, layer))
        if cfg.layer_indexer_type(layer) == "full":
            # bf16_shard: the rank's 1/dcp of the keys is read; its score pairs are priced as before (at
            # pcp == dcp scoring all queries over a shard is as many pairs as a rank's queries over all keys)
            read = seq / dcp if shard else seq
            parts.append(indexer_scores(cfg, hw, q, keys_per_query, keys_read=read).at_layer(layer))
            parts.append(indexer_topk(cfg, hw, q, keys_per_query).at_layer(layer))
            if shard:
                parts.extend(dcp_topk_merge(cfg, hw, q, dcp, layer, local_k=min(cfg.index_topk, math.ceil(seq / dcp))))
        if hw.flashmla_kernels and kernel == "prefill":
            parts.append(sparse_mla_upconvert(cfg, hw, upconvert_rows).at_layer(layer))
        if shard:
            parts.append(dcp_context_allgather(cfg, hw, seq, dcp, layer, form="bf16_shard"))
        parts.append(sparse_mla(cfg, hw, q, rows, heads, pad_heads=pad_heads, dequant=dequant,
                                kernel=kernel).at_layer(layer))
        if cfg.layer_mlp_type(layer) == "dense":
            parts.append(dense_mlp(cfg, hw, q, tp=tp, weight_bytes=weight_bytes).at_layer(layer))
            if tp > 1:
                parts.append(all_reduce(hw, q * cfg.hidden_size * BF16, tp, name="tp_all_reduce").at_layer(layer))
        else:
            parts.extend(moe(cfg, hw, q, ep, replicated_tokens=tp > 1, weight_bytes=weight_bytes,
                             layer=layer))
    parts.append(lm_head(cfg, hw, 1, shards=n_gpus))
    return StepCost(tuple(p for p in parts if p.time_s > 0))


def decode_step(cfg: ModelConfig, hw: HardwareSpec, batch: int, context: int, *, tp: int = 1, dp: int = 1,
                dcp: int = 1, spec_tokens: int = 0, dcp_backend: str = "ag_rs", pad_heads: bool = True,
                dequant: bool = True, include_mtp: bool = False, weight_bytes: float = FP8_WEIGHT_BYTES,
                hisparse: bool = False) -> StepCost:
    """One decode (or MTP verification) step of the target model on one GPU: `batch` requests on this
    rank group, each with `context` cached tokens and 1 + spec_tokens query tokens.

    - TP (tp > 1): heads / tp per GPU (padded to 64 for the fp8 kernel when `pad_heads`), replicated
      indexer, all-reduces; MoE EP over the tp GPUs with replicated tokens.
    - DP (dp > 1, tp = 1): `batch` is per rank; attention is local; MoE EP over the dp ranks (all-to-all).
    - DCP (dcp > 1, dcp dividing tp): KV sharded by token; each rank scores its context/dcp local keys,
      local top-k, global top-k merge; attention runs (heads/tp) * dcp heads over about index_topk/dcp
      selected local rows per query; outputs merge with LSE (`dcp_backend`).
    `include_mtp` adds the MTP layer (a draft pass over the same query tokens; default off: the draft
    steps are separate). On a calibrated spec sparse MLA is FlashMLA's fp8 decode kernel, its requests of
    1 + spec_tokens query tokens (one token each in vLLM's mixed-batch mode, `sparse_prefill_kernel`).
    """
    if tp > 1 and dp > 1:
        raise ValueError("decode_step models TP or DP attention, not both (tp > 1 and dp > 1)")
    if tp % dcp or cfg.num_attention_heads % tp:
        raise ValueError(f"dcp ({dcp}) must divide tp ({tp}) and tp must divide the heads")
    q = batch * (1 + spec_tokens)
    heads = cfg.num_attention_heads // tp * dcp
    local_keys = math.ceil(context / dcp)
    rows = min(cfg.index_topk, context) / dcp
    ep = tp * dp
    mixed = sparse_prefill_kernel("fp8_ds_mla", cfg.num_attention_heads // tp, dcp=dcp, hisparse=hisparse) == "decode"
    s_q = 1 if mixed else 1 + spec_tokens
    parts: list[Cost] = []
    for layer in _layers(cfg, include_mtp):
        parts.append(mla_projections(cfg, hw, q, layer, tp=tp, weight_bytes=weight_bytes))
        if tp > 1:
            parts.append(all_reduce(hw, q * cfg.hidden_size * BF16, tp, name="tp_all_reduce").at_layer(layer))
        if cfg.layer_indexer_type(layer) == "full":
            parts.append(indexer_scores(cfg, hw, q, local_keys, keys_read=batch * local_keys).at_layer(layer))
            parts.append(indexer_topk(cfg, hw, q, local_keys).at_layer(layer))
            if dcp > 1:
                parts.extend(dcp_topk_merge(cfg, hw, q, dcp, layer))
        parts.append(sparse_mla(cfg, hw, q, rows, heads, pad_heads=pad_heads, dequant=dequant,
                                tokens_per_request=s_q).at_layer(layer))
        if dcp > 1:
            parts.extend(dcp_decode_merge(cfg, hw, q, dcp, heads, backend=dcp_backend, layer=layer))
        if cfg.layer_mlp_type(layer) == "dense":
            parts.append(dense_mlp(cfg, hw, q, tp=tp, weight_bytes=weight_bytes).at_layer(layer))
            if tp > 1:
                parts.append(all_reduce(hw, q * cfg.hidden_size * BF16, tp, name="tp_all_reduce").at_layer(layer))
        else:
            parts.extend(moe(cfg, hw, q, ep, replicated_tokens=tp > 1, weight_bytes=weight_bytes, layer=layer))
    parts.append(lm_head(cfg, hw, q, shards=tp))
    return StepCost(tuple(p for p in parts if p.time_s > 0))



# ------------------------------------------------------------------------------------ a scheduler's plan
@dataclasses.dataclass(frozen=True)
class StepLayout:
    """How one replica's GPUs share a step: the performance model's view of a DeployConfig.

    tp: tensor parallel (heads and dense weights split; tokens replicated). pcp: prefill context
    parallel (a step's tokens split over the ranks; attention weights replicated). dcp: decode context
    parallel (KV sharded round-robin by token; dcp must divide tp * pcp, or tp = pcp = 1: DCP on its own
    axis, as this project's engine runs it). expert_parallel: routed experts split over the replica's
    GPUs (TP alone splits them too: vLLM shards each expert's width, the same weight bytes per GPU).
    dcp_backend: "ag_rs" | "a2a". mla_format / index_format: KV formats (kvcache.layout).
    weight_bytes: bytes per matmul weight parameter. include_mtp: the MTP layer runs in every step (it
    does when speculative decoding is on: it prefills with the prompt and drafts after each decode).
    hisparse: the HiSparse KV policy is on (vLLM then runs sparse-MLA prefill rows on the bf16 prefill
    kernel: `sparse_prefill_kernel`).
    dcp_prefill_gather: what a PCP x DCP prefill all-gathers to attend over the whole context
    (`ops.DCP_PREFILL_GATHERS`, `prefill_step`'s dcp_gather): "fp8_rows" (this project's engine) or
    "bf16_shard" (vLLM's FLASHMLA_SPARSE path).
    verify: how an MTP verify row (1 + k tokens) is computed (glm53.engine.spec_decode, `verify_form`):
    "batched", one forward over its tokens (the weights read once), or "sequential", its positions as
    one-token passes of the target model one after another in one program (the MTP layer then runs once
    over the step's tokens, or per position under HiSparse, which resolves each position's selection).
    dp: data-parallel attention ranks of one GPU each that split the routed experts (DP x EP, vLLM's
    `--data-parallel-size N --enable-expert-parallel`): a step's tokens are one rank's, its MoE runs the
    rank's 1/dp of the experts, and step_cost leaves out the MoE's all-to-alls, whose bytes depend on every
    rank's rows (the caller prices them from the lock-step's padded rows: glm53.engine.sim).
    expert_load_imbalance: routing skew, the busiest rank's routed tokens over the mean (>= 1; 1: balanced,
    the default). It prices the busiest rank's experts and all-to-alls (`ops.moe`) wherever whole experts
    sit on ranks (expert_parallel, or dp > 1: `moe_load_imbalance`); under TP alone each GPU holds a slice
    of every expert, so a skew between experts leaves the GPUs balanced.
    """

    tp: int = 1
    pcp: int = 1
    dcp: int = 1
    expert_parallel: bool = False
    dcp_backend: str = "ag_rs"
    mla_format: str = "fp8_ds_mla"
    index_format: str = "fp8"
    weight_bytes: float = FP8_WEIGHT_BYTES
    include_mtp: bool = False
    hisparse: bool = False
    verify: str = "batched"
    dcp_prefill_gather: str = "fp8_rows"
    dp: int = 1
    expert_load_imbalance: float = 1.0

    def __post_init__(self):
        if not self.expert_load_imbalance >= 1:
            raise ValueError(f"StepLayout.expert_load_imbalance must be >= 1 (the busiest rank's routed tokens over "
                             f"the mean), got {self.expert_load_imbalance!r}")
        if self.dp < 1 or (self.dp > 1 and (not self.expert_parallel or max(self.tp, self.pcp, self.dcp) > 1)):
            raise ValueError(f"StepLayout.dp={self.dp}: DP x EP ranks need expert_parallel and one GPU each "
                             f"(tp = pcp = dcp = 1), got expert_parallel={self.expert_parallel}, tp={self.tp}, "
                             f"pcp={self.pcp}, dcp={self.dcp}")
        if min(self.tp, self.pcp, self.dcp) < 1:
            raise ValueError(f"StepLayout: tp, pcp, dcp must be >= 1, got {self.tp}, {self.pcp}, {self.dcp}")
        if self.tp > 1 and self.pcp > 1:
            raise ValueError("StepLayout: TP and PCP together are not modelled (tp > 1 and pcp > 1)")
        if self.dcp > 1 and (self.tp * self.pcp) % self.dcp and self.tp * self.pcp != 1:
            raise ValueError(f"StepLayout: dcp={self.dcp} must divide tp x pcp = {self.tp * self.pcp} (or run alone)")
        if self.dcp_backend not in ("ag_rs", "a2a"):
            raise ValueError(f"StepLayout.dcp_backend must be 'ag_rs' or 'a2a', got {self.dcp_backend!r}")
        if self.verify not in ("batched", "sequential"):
            raise ValueError(f"StepLayout.verify must be 'batched' or 'sequential', got {self.verify!r}")
        if self.dcp_prefill_gather not in DCP_PREFILL_GATHERS:
            raise ValueError(f"StepLayout.dcp_prefill_gather must be one of {DCP_PREFILL_GATHERS}, "
                             f"got {self.dcp_prefill_gather!r}")

    @property
    def gpus(self) -> int:
        """GPUs of one replica."""
        return max(self.tp * self.pcp, self.dcp)

    @property
    def moe_load_imbalance(self) -> float:
        """The routing skew the MoE is priced at: expert_load_imbalance where whole experts sit on ranks."""
        return self.expert_load_imbalance if (self.expert_parallel or self.dp > 1) and self.ep > 1 else 1.0

    @property
    def ep(self) -> int:
        """Ranks the routed experts are split over."""
        if self.dp > 1:
            return self.dp
        return self.gpus if (self.expert_parallel or self.tp > 1) else 1


# step_cost's parts that depend on the step's token count only (projections, TP all-reduce, MLP / MoE),
# per (cfg, hw, dep) and (part, layer, tokens): a simulator prices the same token counts again and again
# (a decode batch of n rows is n tokens). The entry holds cfg, hw and dep, so their ids stay theirs.
_TOKEN_PARTS: dict[tuple[int, int, int], tuple] = {}
_LAYER_KINDS: dict[tuple[int, bool], tuple] = {}


def _token_parts(cfg: ModelConfig, hw: HardwareSpec, dep: StepLayout, key: tuple, make) -> tuple[Cost, ...]:
    ids = (id(cfg), id(hw), id(dep))
    entry = _TOKEN_PARTS.get(ids)
    if entry is None:
        if len(_TOKEN_PARTS) >= 64:
            _TOKEN_PARTS.clear()
        entry = _TOKEN_PARTS[ids] = (cfg, hw, dep, {})
    memo = entry[3]
    out = memo.get(key)
    if out is None:
        if len(memo) >= 1 << 14:
            memo.clear()
        out = memo[key] = tuple(make())
    return out


def _layer_kinds(cfg: ModelConfig, include_mtp: bool) -> tuple[tuple[tuple, int, int], ...]:
    """(kind, first layer of that kind, layers of that kind) in order of first appearance; kind = (indexer
    type, MLP type, MTP layer)."""
    entry = _LAYER_KINDS.get((id(cfg), include_mtp))
    if entry is None or entry[0] is not cfg:
        first: dict[tuple, int] = {}
        count: dict[tuple, int] = {}
        for layer in _layers(cfg, include_mtp):
            kind = (cfg.layer_indexer_type(layer), cfg.layer_mlp_type(layer), layer >= cfg.num_hidden_layers)
            first.setdefault(kind, layer)
            count[kind] = count.get(kind, 0) + 1
        entry = _LAYER_KINDS[(id(cfg), include_mtp)] = (cfg, tuple((k, first[k], count[k]) for k in first))
    return entry[1]


def moe_layers(cfg: ModelConfig, include_mtp: bool) -> int:
    """Layers with a routed-expert MLP (the MTP layers too where include_mtp)."""
    return sum(n for kind, _, n in _layer_kinds(cfg, include_mtp) if kind[1] != "dense")


def step_cost(cfg: ModelConfig, hw: HardwareSpec, dep: StepLayout, plan, *, d2h_bytes: float = 0,
              h2d_bytes: float = 0, host_transfers: int = 0, hot_miss_rows: float = 0,
              per_layer: bool = False, only_mtp: bool = False) -> StepCost:
    """One GPU's costs for a scheduler's mixed step: `plan.rows` (anything with `start`, `num_tokens`,
    `num_draft_tokens` and `sample`, e.g. a glm53.engine.plan.StepPlan), each row at its own cached
    context; the plan's KV transfers (d2h_bytes / h2d_bytes over `host_transfers` copy calls, serial
    before the forward as the runners execute them); HiSparse misses (`hot_miss_rows` latent rows per
    layer copied host -> device inside the decode forward).

    A row of 1 + num_draft_tokens tokens is a decode row (the decode kernel, heads padded for the fp8
    format), a longer one a prefill chunk. Per layer: the projections over every token of the step
    (one GEMM per weight: M = the step's tokens on this GPU), TP all-reduces, the PCP KV gather of the
    chunks' new tokens, the PCP x DCP context gather of each chunk's cached context, the indexer and
    top-k on full layers (each row against its own keys), sparse MLA as two batched kernels (decode
    rows, prefill rows), the DCP top-k merge and output merge, the MLP or MoE over every token; then the
    lm_head for the sampled rows. Tokens split over PCP ranks evenly (2N-chunk balance). Layer costs
    are computed once per layer kind (indexer full / shared x dense / MoE x MTP); per_layer=True repeats
    them per layer (for `StepCost.time_s`'s overlap options), else each is scaled by its layer count
    (what a simulator needs, ~20x cheaper). The rows run as one forward program (hw.forward_latency_s
    once). only_mtp (with include_mtp): the MTP layers alone, as a draft pass runs them (`mtp_draft_cost`).
    """
    if dep.verify == "sequential" and not only_mtp and any(r.num_draft_tokens for r in plan.rows):
        return _sequential_verify(cfg, hw, dep, plan, per_layer, dict(d2h_bytes=d2h_bytes, h2d_bytes=h2d_bytes,
                                                                       host_transfers=host_transfers,
                                                                       hot_miss_rows=hot_miss_rows))
    # (start, tokens, drafts, samples, prefill) per row: plain tuples, cheap to loop over per layer kind
    rows = [(r.start, r.num_tokens, r.num_draft_tokens, bool(r.sample), r.num_tokens != 1 + r.num_draft_tokens)
            for r in plan.rows if r.num_tokens > 0]
    pcp, tp, dcp = dep.pcp, dep.tp, dep.dcp
    if cfg.num_attention_heads % tp:
        raise ValueError(f"tp={tp} must divide the {cfg.num_attention_heads} heads")
    heads = cfg.num_attention_heads // tp
    k = cfg.index_topk
    dec = [r for r in rows if not r[4]]
    pre = [r for r in rows if r[4]]
    tokens = sum(r[1] for r in rows) / pcp  # this GPU's query tokens
    pre_tokens = sum(r[1] for r in pre)
    replicated = tp > 1 or (pcp == 1 and dep.gpus > 1)  # every GPU runs every token through the MoE
    # DCP decode attends the heads of a DCP group over the rank's shard (vLLM: H/tp x dcp heads; DCP alone:
    # every head); a PCP x DCP prefill attends over a gathered full copy, a DCP-alone prefill like decode
    dcp_heads = min(cfg.num_attention_heads, heads * dcp) if dcp > 1 else heads
    sharded_pre = dcp > 1 and pcp == 1  # prefill over the rank's shard, merged like decode
    # vLLM's PCP x DCP prefill: up-convert the rank's shard of each request, all-gather the bf16 rows
    bf16_shard = dcp > 1 and pcp > 1 and dep.dcp_prefill_gather == "bf16_shard"
    shard_rows = sum(math.ceil((r[0] + r[1]) / dcp) for r in pre) if bf16_shard else 0
    # candidates per query in the top-k merge: a rank's keys, at most top-k (the gather's shape is the widest row's)
    merge_k = min(k, max((math.ceil((r[0] + r[1]) / dcp) for r in pre), default=0))
    fmt = (dep.mla_format, dep.index_format)

    def indexer(group: list, shard: int, read_shard: int = 1) -> list[Cost]:
        # one batched kernel per op; its counts are linear in each row's q and q x keys, so one call with
        # the batch's q and its q-weighted mean key count gives the sum over rows exactly. read_shard: the
        # keys read are 1/read_shard of each row's (vLLM's PCP x DCP indexer reads the rank's key shard)
        if not group:
            return []
        q = sum(n for _, n, *_ in group) / pcp
        qk = sum(n * (start + (n + 1) / 2) for start, n, *_ in group) / (pcp * shard)
        read = sum(start + n for start, n, *_ in group) / (shard * read_shard)
        q_sel = sum(n * min(k, (start + (n + 1) / 2) / shard) for start, n, *_ in group) / pcp
        scores = indexer_scores(cfg, hw, q, qk / q, keys_read=read, index_format=dep.index_format)
        topk = _kernel("indexer_topk", hw, flops=0.0, hbm_bytes=qk * FP32 + q_sel * INDEX_BYTES)
        return [scores, topk]

    # FlashMLA kernels (calibrated specs): which one prefill rows run on; in vLLM's mixed-batch mode decode
    # and prefill rows are one call of the fp8 decode kernel, one query token per request
    pre_kernel = "decode" if sharded_pre else sparse_prefill_kernel(dep.mla_format, heads, pcp=pcp, dcp=dcp,
                                                                     hisparse=dep.hisparse)
    mixed = hw.flashmla_kernels and dep.mla_format == "fp8_ds_mla" and pre_kernel == "decode"
    dec_s_q = 1 if mixed or not dec else max(1, round(sum(r[1] for r in dec) / len(dec)))

    def mla_work(group: list, shard: int) -> tuple[float, float]:
        q = sum(n for _, n, *_ in group) / pcp
        return q, sum(n * _mean_rows(k, start + 1, n) for start, n, *_ in group) / (pcp * shard)

    def mla(group: list, name: str, pad: bool, shard: int, h: int, kernel: str = "auto", s_q: int = 1) -> list[Cost]:
        if not group:
            return []
        q, pairs = mla_work(group, shard)
        return [sparse_mla(cfg, hw, q, pairs / q, h, mla_format=dep.mla_format, pad_heads=pad, kernel=kernel,
                           tokens_per_request=s_q, name=name)]

    def mla_parts() -> list[Cost]:
        pre_shard, pre_heads = (dcp, dcp_heads) if sharded_pre else (1, heads)
        if mixed and dec and pre and pre_heads == dcp_heads:
            # one kernel call: its time split between the two groups by their 64-row blocks
            (qd, pd), (qp, pp) = mla_work(dec, dcp), mla_work(pre, pre_shard)
            both = sparse_mla(cfg, hw, qd + qp, (pd + pp) / (qd + qp), dcp_heads, mla_format=dep.mla_format,
                              kernel="decode")
            ob = hw.sparse_decode_overhead_blocks
            frac = (pd / FLASHMLA_ROW_BLOCK + qd * ob) / ((pd + pp) / FLASHMLA_ROW_BLOCK + (qd + qp) * ob)
            out = []
            for own, f in ((mla(dec, "sparse_mla_decode", True, dcp, dcp_heads, "decode")[0], frac),
                           (mla(pre, "sparse_mla_prefill", False, pre_shard, pre_heads, "decode")[0], 1 - frac)):
                out.append(dataclasses.replace(both.scaled(f), name=own.name, kind="kernel", flops=own.flops,
                                               useful_flops=own.useful_flops, hbm_bytes=own.hbm_bytes))
            return out
        out = mla(dec, "sparse_mla_decode", True, dcp, dcp_heads, s_q=dec_s_q)
        if pre and hw.flashmla_kernels and pre_kernel == "prefill":
            rows = shard_rows if bf16_shard else sum(r[0] + r[1] for r in pre)
            out.append(sparse_mla_upconvert(cfg, hw, rows, mla_format=dep.mla_format))
        if bf16_shard and pre:
            # after the up-convert that fills it, before the kernel that reads it (one gather per layer)
            out.append(dcp_context_allgather(cfg, hw, shard_rows * dcp, dcp, -1, form="bf16_shard"))
        out += mla(pre, "sparse_mla_prefill", False, pre_shard, pre_heads, pre_kernel)
        return [c for c in out if c.time_s > 0 or c.name != "sparse_mla_upconvert"]

    def head_parts(layer: int) -> list[Cost]:
        parts = [mla_projections(cfg, hw, tokens, layer, tp=tp, weight_bytes=dep.weight_bytes)]
        if tp > 1:
            parts.append(all_reduce(hw, tokens * cfg.hidden_size * BF16, tp, name="tp_all_reduce"))
        return parts

    def mlp_parts(layer: int) -> list[Cost]:
        if cfg.layer_mlp_type(layer) == "dense":
            parts = [dense_mlp(cfg, hw, tokens, tp=tp, weight_bytes=dep.weight_bytes)]
            if tp > 1:
                parts.append(all_reduce(hw, tokens * cfg.hidden_size * BF16, tp, name="tp_all_reduce"))
            return parts
        parts = moe(cfg, hw, tokens, dep.ep, replicated_tokens=replicated, weight_bytes=dep.weight_bytes,
                    load_imbalance=dep.moe_load_imbalance)
        # DP x EP: the all-to-alls move every rank's padded rows, priced by the caller (StepLayout.dp)
        return [c for c in parts if dep.dp == 1 or c.name not in ("moe_dispatch", "moe_combine")]

    def layer_parts(layer: int) -> list[Cost]:
        full = cfg.layer_indexer_type(layer) == "full"
        parts = list(_token_parts(cfg, hw, dep, ("head", layer, tokens), lambda: head_parts(layer)))
        if pcp > 1 and pre_tokens:
            parts.append(pcp_kv_allgather(cfg, hw, pre_tokens, pcp, layer, *fmt))
        if dcp > 1 and pcp > 1 and not bf16_shard:
            parts += [dcp_context_allgather(cfg, hw, r[0], dcp, layer, *fmt) for r in pre if r[0] > 0]
        if full:
            parts += indexer(dec + (pre if sharded_pre else []), dcp)
            if not sharded_pre:
                parts += indexer(pre, 1, dcp if bf16_shard else 1)
                if bf16_shard and pre:
                    parts.extend(dcp_topk_merge(cfg, hw, pre_tokens / pcp, dcp, local_k=merge_k))
        merged = dec + (pre if sharded_pre else [])
        parts += mla_parts()
        if dcp > 1 and merged:
            q = sum(r[1] for r in merged)
            if full:
                parts.extend(dcp_topk_merge(cfg, hw, q, dcp))
            parts.extend(dcp_decode_merge(cfg, hw, q, dcp, dcp_heads, backend=dep.dcp_backend))
        parts.extend(_token_parts(cfg, hw, dep, ("mlp", layer, tokens), lambda: mlp_parts(layer)))
        return parts

    out: list[Cost] = []
    if h2d_bytes:
        out.append(host_copy(hw, h2d_bytes, transfers=max(1, host_transfers), name="kv_load"))
    if d2h_bytes:
        out.append(host_copy(hw, d2h_bytes, transfers=max(1, host_transfers), name="kv_store"))
    if rows and per_layer:
        by_kind: dict[tuple, list[Cost]] = {}
        for layer in _layers(cfg, dep.include_mtp):
            kind = (cfg.layer_indexer_type(layer), cfg.layer_mlp_type(layer), layer >= cfg.num_hidden_layers)
            if kind not in by_kind:
                by_kind[kind] = [c for c in layer_parts(layer) if c.time_s > 0]
            out += [c.at_layer(layer) for c in by_kind[kind]]
    elif rows:
        # each part once, scaled by the number of layers it runs in: the parts that depend on the step's
        # token count only, per layer kind (memoized); the rest depend on the rows but not on the layer,
        # except whether it is a full indexer layer (its keys travel with the KV gathers)
        kinds = [(kind, layer, n) for kind, layer, n in _layer_kinds(cfg, dep.include_mtp)
                 if not only_mtp or layer >= cfg.num_hidden_layers]
        out += _token_parts(cfg, hw, dep, ("layers", tokens, only_mtp), lambda: [
            c.scaled(n) for _, layer, n in kinds for c in (*head_parts(layer), *mlp_parts(layer)) if c.time_s > 0])
        n_all = sum(n for *_, n in kinds)
        n_full = sum(n for kind, _, n in kinds if kind[0] == "full")
        merged = dec + (pre if sharded_pre else [])
        if (pcp > 1 and pre_tokens) or (dcp > 1 and pcp > 1):
            for full in (True, False):  # a layer of each indexer type stands for all of that type
                layer = next((lay for kind, lay, _ in kinds if (kind[0] == "full") == full), None)
                if layer is None:
                    continue
                n = n_full if full else n_all - n_full
                if pcp > 1 and pre_tokens:
                    out.append(pcp_kv_allgather(cfg, hw, pre_tokens, pcp, layer, *fmt).scaled(n))
                if dcp > 1 and pcp > 1 and not bf16_shard:
                    out += [dcp_context_allgather(cfg, hw, r[0], dcp, layer, *fmt).scaled(n) for r in pre if r[0] > 0]
        parts = [(c, n_all) for c in mla_parts()]
        if n_full:
            parts += [(c, n_full) for c in indexer(merged, dcp)]
            if not sharded_pre:
                parts += [(c, n_full) for c in indexer(pre, 1, dcp if bf16_shard else 1)]
                if bf16_shard and pre:
                    parts += [(c, n_full) for c in dcp_topk_merge(cfg, hw, pre_tokens / pcp, dcp, local_k=merge_k)]
        if dcp > 1 and merged:
            q = sum(r[1] for r in merged)
            if n_full:
                parts += [(c, n_full) for c in dcp_topk_merge(cfg, hw, q, dcp)]
            parts += [(c, n_all) for c in dcp_decode_merge(cfg, hw, q, dcp, dcp_heads, backend=dep.dcp_backend)]
        out += [c.scaled(n) for c, n in parts if c.time_s > 0]
    if rows:
        if hw.forward_latency_s:
            out.append(Cost("forward_launch", latency_s=hw.forward_latency_s, time_s=hw.forward_latency_s))
        if hot_miss_rows:
            out.append(hisparse_row_copy(cfg, hw, hot_miss_rows, layers=len(_layers(cfg, dep.include_mtp)),
                                         mla_format=dep.mla_format))
        sampled = sum(1 + r[2] for r in rows if r[3])
        if sampled:
            out += _token_parts(cfg, hw, dep, ("lm_head", sampled), lambda: [lm_head(cfg, hw, sampled, shards=tp * pcp)])
    return StepCost(tuple(out), per_layer=per_layer)


def _sequential_verify(cfg: ModelConfig, hw: HardwareSpec, dep: StepLayout, plan, per_layer: bool, kw: dict) -> StepCost:
    """`step_cost` of a step with MTP verify rows under dep.verify == "sequential" (the runner's
    `verify="sequential"`): the target model's one-token passes over the verify rows' positions one after
    another (pass j: each verify row's position start + j; the step's other rows join pass 0), their
    logits at every position; the MTP layer over all the step's tokens at once, or under HiSparse per pass
    (its selections resolve one position at a time); one forward program (one hw.forward_latency_s), the
    transfers and HiSparse misses once."""
    main = _derived(dep, verify="batched", include_mtp=False)
    verify = [r for r in plan.rows if r.num_draft_tokens and r.num_tokens == 1 + r.num_draft_tokens]
    others = [r for r in plan.rows if not (r.num_draft_tokens and r.num_tokens == 1 + r.num_draft_tokens)]
    passes = [[_DraftRow(r.start + j, sample=bool(r.sample)) for r in verify if j <= r.num_draft_tokens]
              for j in range(1 + max(r.num_draft_tokens for r in verify))]
    parts: list[Cost] = []
    for j, rows in enumerate(passes):
        pass_rows = (*others, *rows) if j == 0 else tuple(rows)
        cost = step_cost(cfg, hw, main, _DraftPlan(pass_rows), per_layer=per_layer, **(kw if j == 0 else {}))
        parts += [c for c in cost.parts if j == 0 or c.name != "forward_launch"]
    if dep.include_mtp:
        mtp = _derived(dep, verify="batched")
        for rows in (passes if dep.hisparse else [plan.rows]):
            cost = step_cost(cfg, hw, mtp, _DraftPlan(tuple(rows)), per_layer=per_layer, only_mtp=True)
            parts += [c for c in cost.parts if c.name not in ("forward_launch", "lm_head")]
    return StepCost(tuple(parts), per_layer=per_layer)


class _DraftRow(typing.NamedTuple):  # what step_cost reads of a row: one token at `start`, sampled
    start: int
    num_tokens: int = 1
    num_draft_tokens: int = 0
    sample: bool = True


class _DraftPlan(typing.NamedTuple):  # (named tuples: a simulator builds one per drafting row per step)
    rows: tuple


def mtp_draft_cost(cfg: ModelConfig, hw: HardwareSpec, dep: StepLayout, contexts, passes: int) -> StepCost:
    """The MTP layer's one-token draft passes after a step (speculative decoding with k drafts runs
    k - 1 of them: the first draft comes from the MTP pass over the step's own tokens, which `step_cost`
    prices with include_mtp): `passes` passes over one token per drafting row, row i at context
    contexts[i], each pass the MTP layer (its indexer over the row's keys, sparse MLA, its MoE) and the
    lm_head for the drafts, one forward launch each. Part names carry the prefix "mtp_draft_"."""
    if not contexts or passes <= 0:
        return StepCost(())
    plan = _DraftPlan(tuple(_DraftRow(max(0, int(c))) for c in contexts))
    # the MTP layers' parts (scaled by their count), the launch and the lm_head of the drafting rows
    parts = step_cost(cfg, hw, _derived(dep, include_mtp=True), plan, only_mtp=True).parts
    return StepCost(tuple(c.scaled(passes, "mtp_draft_" + c.name, -1) for c in parts), per_layer=False)


_DERIVED: dict[tuple, StepLayout] = {}


def _derived(dep: StepLayout, **changes) -> StepLayout:
    """dataclasses.replace(dep, **changes), one object per (dep, changes): step_cost memoizes by the
    deployment's identity."""
    key = (dep, tuple(sorted(changes.items())))
    out = _DERIVED.get(key)
    if out is None:
        if len(_DERIVED) >= 64:
            _DERIVED.clear()
        out = _DERIVED[key] = dataclasses.replace(dep, **changes)
    return out
