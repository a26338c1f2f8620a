"""HiSparse's spec: its sizes (hot buffer, device blocks per request, host pools), its config checks, its
construction, metrics and Prometheus series, and what the simulator prices it by. The planner
(planner.py's HiSparsePolicy) inherits it; glm53 reads it through kvcache.policies.REGISTRY."""

from __future__ import annotations

import dataclasses

from kvcache.policies.base import Policy

TAIL_PAGES = 2  # newest pages of a request that are never released


def hot_buffer_rows(device_buffer_size: int | None, num_speculative_tokens: int, topk: int) -> int:
    """Hot-buffer rows per request: `device_buffer_size` if given, else (num_speculative_tokens + 2) x
    top-k (a decode step selects top-k rows per token it verifies, and one more top-k of slack keeps the
    previous step's rows; with exactly top-k slots the LRU would thrash). At least top-k, or a step's
    misses would not fit."""
    rows = device_buffer_size or (num_speculative_tokens + 2) * topk
    if rows < topk:
        raise ValueError(f"DeployConfig.hisparse_device_buffer_size={rows} is below the model's top-k ({topk}): a "
                         "step's misses would not fit the hot buffer")
    return rows


def device_blocks_per_request(num_tokens: int, *, tokens_per_block: int, index_tokens_per_block: int,
                              chunk_tokens: int, lease_blocks: int, stage_rows: bool) -> int:
    """Most device blocks one HiSparse request of `num_tokens` tokens holds at once.

    Without row staging (`stage_rows` False: a prefill chunk reads its whole prefix from the pool) that is
    every MLA and indexer page plus a hot buffer. With it (the model runner stages the rows a chunk's
    queries select from the host, kvcache.views.StagingView), only what must be on the device: every
    indexer page (a running request's keys stay there), the MLA pages of the chunk being prefilled (a
    chunk of `chunk_tokens` may straddle one more page) and the TAIL_PAGES newest pages that are never
    released, and the hot buffer; the MLA pages behind them live in the host pool. Shared by
    `device_request_blocks` (the KV budget must hold one request of max_model_len) and the planner's
    `device_blocks` (Scheduler.add)."""
    mla = -(-num_tokens // tokens_per_block)
    index = -(-num_tokens // index_tokens_per_block)
    if stage_rows:
        mla = min(mla, -(-min(chunk_tokens, num_tokens) // tokens_per_block) + 1 + TAIL_PAGES)
    return mla + index + lease_blocks


# id(table) -> (the table, its share of host-only pages): HiSparse hands the same immutable table to every
# step while the row's residency stands still (`row_tables`' snapshot), so a long row's pages are counted
# once, not at every step (docs/simulator.md "Speed"). The entry keeps its table alive, so an id in it is
# that table's. Bounded by entries and by the table entries they hold (1 << 22: 32 MiB of references, about
# 250 rows of 1M-token contexts), cleared whole when either is reached.
_HOST_ONLY: dict[int, tuple[tuple, float]] = {}
_HOST_ONLY_HELD = [0]  # table entries the memo holds
HOST_ONLY_MAX_TABLES, HOST_ONLY_MAX_HELD = 2048, 1 << 22


def _host_only_share(table) -> float:
    """The share of -1 (a page with no device block, KVCacheManager.block_table) in an MLA table."""
    if type(table) is not tuple:
        return table.count(-1) / len(table)
    hit = _HOST_ONLY.get(id(table))
    if hit is not None and hit[0] is table:
        return hit[1]
    if len(_HOST_ONLY) >= HOST_ONLY_MAX_TABLES or _HOST_ONLY_HELD[0] + len(table) > HOST_ONLY_MAX_HELD:
        _HOST_ONLY.clear()
        _HOST_ONLY_HELD[0] = 0
    share = table.count(-1) / len(table)
    _HOST_ONLY[id(table)] = (table, share)
    _HOST_ONLY_HELD[0] += len(table)
    return share


@dataclasses.dataclass
class ResolveStats:
    """The sums of HiSparse's records (device.py's ResolveRecord and StageRecord), which the scheduler hands
    to the planner (`on_records`): the one source of its resolver figures. hot_hits / hot_misses:
    selected rows found in / copied into a hot buffer by decode steps, summed over IndexShare groups;
    h2d_rows: rows they copied host -> device, all layers; staged_rows / staged_h2d_rows: the same for
    prefill row staging (distinct rows per tile). log / stage_log: None, or every ResolveRecord /
    StageRecord (for tests)."""

    hot_hits: int = 0
    hot_misses: int = 0
    h2d_rows: int = 0
    staged_rows: int = 0
    staged_h2d_rows: int = 0
    log: list | None = None
    stage_log: list | None = None

    def add(self, rec) -> None:
        self.hot_hits += int(rec.hits.sum())
        self.hot_misses += int(rec.misses.sum())
        self.h2d_rows += int(rec.copied.sum())
        if self.log is not None:
            self.log.append(rec)

    def add_stage(self, rec) -> None:
        self.staged_rows += int(rec.staged.sum())
        self.staged_h2d_rows += int(rec.copied.sum())
        if self.stage_log is not None:
            self.stage_log.append(rec)


class HiSparseSpec(Policy):
    """The class-level hooks of kv_policy="hisparse" (kvcache.policies.base.Policy's), and its metrics
    (read from the planner's `resolve`, `stats`, `host_bytes_used` and `host_bytes_peak`)."""

    accepts_connector = True
    own_connector = True  # its idle indexer keys take the connector's budget; its pools, the tiers
    uses_tiers = True
    too_large_hint = ""

    @classmethod
    def check(cls, deploy) -> None:
        if deploy.context_parallel_size > 1:
            raise NotImplementedError("DeployConfig.kv_policy='hisparse' with context parallelism (PCP / DCP): "
                                      "HiSparse residency runs on one device or under tensor parallelism alone")
        if deploy.hisparse_host_pool_bytes <= 0:
            raise ValueError("DeployConfig.kv_policy='hisparse' needs hisparse_host_pool_bytes > 0 (the host pool "
                             "for MLA pages; cpu_offload_bytes sizes the separate pool for idle indexer keys)")

    @classmethod
    def check_connector(cls, deploy, opts: dict) -> None:
        # HiSparse's host pools store and load pages one at a time, LRU
        if opts["blocks_per_chunk"] != 1:
            raise ValueError(f"kv_connector_extra_config blocks_per_chunk must be 1 with kv_policy='hisparse', "
                             f"got {opts['blocks_per_chunk']!r}")
        if opts["eviction_policy"] != "lru":
            raise ValueError("kv_connector_extra_config eviction_policy must be 'lru' with kv_policy='hisparse', "
                             f"got {opts['eviction_policy']!r}")
        if opts["secondary_tiers"] and not deploy.enable_prefix_caching:
            raise ValueError("DeployConfig.kv_transfer_config secondary_tiers with kv_policy='hisparse' need "
                             "enable_prefix_caching=True (the tiers serve prefix hits by hash)")

    @classmethod
    def stages_rows(cls, deploy) -> bool:
        return True

    @classmethod
    def device_request_blocks(cls, deploy, cfg, request: int) -> tuple[int, int]:
        # a decoding request may also hold a hot buffer; with row staging only part of its pages at once
        lease = -(-hot_buffer_rows(deploy.hisparse_device_buffer_size, deploy.num_speculative_tokens,
                                   cfg.index_topk) // deploy.block_size)
        least = device_blocks_per_request(deploy.max_model_len, tokens_per_block=deploy.tokens_per_block,
                                          index_tokens_per_block=deploy.index_tokens_per_block,
                                          chunk_tokens=deploy.max_num_batched_tokens, lease_blocks=lease,
                                          stage_rows=cls.stages_rows(deploy))
        return request + lease, least

    @classmethod
    def host_sizes(cls, deploy, cfg, pages: dict[str, int]) -> dict:
        host = {"mla": deploy.hisparse_host_pool_bytes // pages["mla"],
                "indexer": deploy.cpu_offload_bytes // pages["indexer"]}
        if deploy.kv_transfer_config is not None and host["indexer"] < 1:
            raise ValueError(f"kv_transfer_config cpu_bytes_to_use={deploy.cpu_offload_bytes} holds no indexer-key page "
                             f"({pages['indexer']} bytes) under kv_policy='hisparse'")
        need = deploy.max_blocks_per_seq * pages["mla"]
        if host["mla"] < deploy.max_blocks_per_seq:
            raise ValueError(f"DeployConfig.hisparse_host_pool_bytes={deploy.hisparse_host_pool_bytes} must hold at least "
                             f"one request of max_model_len={deploy.max_model_len}: >= {need} bytes "
                             f"({deploy.max_blocks_per_seq} MLA pages of {pages['mla']} bytes)")
        hot = hot_buffer_rows(deploy.hisparse_device_buffer_size, deploy.num_speculative_tokens, cfg.index_topk)
        return {"host_blocks": host, "hot_rows": hot, "max_leases": deploy.max_num_seqs}

    @classmethod
    def verify_rows_limit(cls, sizes) -> int | None:
        # a batched verify step resolves one plan for the union of its positions' selections: the hot buffer
        return sizes.hot_rows

    @classmethod
    def make(cls, deploy, sizes, tiers=None, fingerprint: str = "") -> Policy:
        return cls(host_mla_blocks=sizes.host_blocks["mla"], host_index_blocks=sizes.host_blocks["indexer"],
                   block_size=deploy.block_size, hot_rows=sizes.hot_rows, max_leases=sizes.max_leases,
                   num_device_blocks=sizes.num_blocks, enable_prefix_caching=deploy.enable_prefix_caching,
                   page_bytes=sizes.page_bytes, tiers=tiers, fingerprint=fingerprint,
                   load_failure_policy=deploy.kv_load_failure_policy, stage_rows=cls.stages_rows(deploy),
                   chunk_tokens=deploy.max_num_batched_tokens, peer_waits=deploy.pd_wait_tier)

    @classmethod
    def device_half(cls, deploy, sizes, *, index_topk: int):
        from kvcache.policies.hisparse.device import HiSparseDevice

        return HiSparseDevice(max_leases=sizes.max_leases, hot_rows=sizes.hot_rows, index_topk=index_topk,
                              k=deploy.num_speculative_tokens, stage_rows=deploy.hisparse_stages_rows,
                              tile=deploy.hisparse_prefill_tile_tokens)

    @classmethod
    def sim_layout(cls, deploy) -> dict:
        return {"hisparse": True}

    @classmethod
    def sim_miss_rows(cls, plan, topk: int, miss_fraction: float) -> float:
        """Assumed misses of a decode step: per decode row with a lease, the share of its top-k that falls
        in host-only pages (-1 in its MLA table) times `miss_fraction`."""
        if plan.policy_rows is None or not miss_fraction:
            return 0.0
        total = 0.0
        for row, table, hs in zip(plan.rows, plan.block_tables["mla"], plan.policy_rows):
            if hs.lease < 0 or row.num_tokens != 1 + row.num_draft_tokens or not table:
                continue
            host_only = _host_only_share(table)
            total += miss_fraction * min(topk, row.start + 1) * host_only * row.num_tokens
        return total

    @classmethod
    def sim_stage_rows(cls, plan, deploy, topk: int, rows=None) -> float:
        """Each host-only row a prefill chunk could select, once (glm53.engine.sim's module docstring). An
        MTP verify row (its drafts) is a decode row: it reads through the hot buffer (`sim_miss_rows`). A
        row of one token over host-only pages without a hot-buffer lease stages too: the planner leases
        one to every such row it plans (HiSparsePlanner.prepare), so only the simulator's cut of a longer
        chunk has none (SimRunner.loaded_prompt: a P/D decode leg's last prompt token, whose selections
        would find a cold buffer)."""
        if plan.policy_rows is None or not cls.stages_rows(deploy):
            return 0.0
        tpb = deploy.tokens_per_block
        total = 0.0
        for i in range(len(plan.rows)) if rows is None else rows:
            row, table = plan.rows[i], plan.block_tables["mla"][i]
            if ((row.num_tokens > 1 or plan.policy_rows[i].lease < 0) and not row.num_draft_tokens
                    and -1 in table):
                total += min(row.num_tokens * topk, table.count(-1) * tpb)
        return total

    def on_records(self, resolves, stages) -> None:
        for rec in resolves:
            self.resolve.add(rec)
        for rec in stages:
            self.resolve.add_stage(rec)

    def metrics(self, sch) -> dict:
        """Hot-buffer hits and misses (summed over IndexShare groups; `resolve`), rows copied host ->
        device by decode steps (all layers) and staged, host pool bytes in use now and at peak, mean
        requests per step in each residency state, the page counters (HiSparseStats)."""
        rs, st = self.resolve, self.stats
        steps = max(1, sch.stats.steps)
        looked_up = rs.hot_hits + rs.hot_misses
        out = {"hot_hits": rs.hot_hits, "hot_misses": rs.hot_misses,
               "hot_hit_rate": rs.hot_hits / looked_up if looked_up else float("nan"), "hisparse_h2d_rows": rs.h2d_rows,
               "staged_rows": rs.staged_rows, "staged_h2d_rows": rs.staged_h2d_rows,
               "host_pool_bytes_used": self.host_bytes_used(), "host_pool_bytes_peak": self.host_bytes_peak}
        out.update({f"residency_{k}_requests_mean": v / steps for k, v in st.residency_steps.items()})
        out.update({k: v for k, v in dataclasses.asdict(st).items() if k != "residency_steps"})
        return out

    @classmethod
    def finish_metrics(cls, out: dict) -> None:
        looked_up = out["hot_hits"] + out["hot_misses"]
        out["hot_hit_rate"] = out["hot_hits"] / looked_up if looked_up else float("nan")

    def tier_metrics(self) -> dict:
        """Its secondary tiers' counters (HiSparse counts its host pools' pages itself: `metrics`)."""
        return self.host_tier.tier_metrics() if self.host_tier.tiers is not None else {}

    @classmethod
    def reports_tiers(cls, deploy) -> bool:
        return bool(deploy.offload_options["secondary_tiers"])

    prometheus_series = (
        ("hot_hits", "counter", "vllm:hisparse_cache_hits", "HiSparse hot-buffer hits."),
        ("hot_misses", "counter", "vllm:hisparse_cache_misses", "HiSparse hot-buffer misses."),
        ("h2d_bytes", "counter", "vllm:hisparse_host_to_device_bytes",
         "Bytes of KV rows HiSparse copied host -> device in decode steps."),
        ("host_usage", "gauge", "vllm:hisparse_host_cache_usage_perc", "HiSparse host pool usage."))

    def prometheus_values(self, sch, engine) -> dict[str, float]:
        capacity = sum(engine.sizes.host_blocks.get(g, 0) * b for g, b in engine.sizes.page_bytes.items())
        return {"hot_hits": self.resolve.hot_hits, "hot_misses": self.resolve.hot_misses,
                "h2d_bytes": self.resolve.h2d_rows * _mla_row_bytes(engine),
                "host_usage": self.host_bytes_used() / capacity if capacity else 0.0}


def _mla_row_bytes(engine) -> float:
    """Bytes of one layer's latent row for one token (what a HiSparse row copy moves)."""
    cfg, d = engine.cfg, engine.deploy
    layers = cfg.num_layers_with_mtp if d.num_speculative_tokens else cfg.num_hidden_layers  # MTP: its rows too
    return engine.sizes.page_bytes["mla"] / (d.block_size * d.decode_context_parallel_size) / layers
