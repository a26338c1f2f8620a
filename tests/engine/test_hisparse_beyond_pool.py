"""HiSparse beyond the device pool (issue 21 item 1): a conversation whose KV is more than 4 times the
device pool runs, as one long prompt and through several turns, with the greedy tokens of a run whose
pool holds everything. The pool then holds a request's indexer keys, its chunk, its newest pages and a
hot buffer; prefill chunks over host-only pages stage only the rows their queries select, per tile of
queries, and every byte that crosses host -> device is accounted for. The offload policy refuses such
a request with a ValueError naming the pool and the blocks it needs. On the 2-layer model
(tests/engine/conftest.py: a full and a shared indexer layer, so shared layers stage what their full
layer selected; tests/engine/test_hisparse.py stages over the tiny model's four IndexShare groups)."""

import dataclasses

import numpy as np
import pytest

from glm53 import DeployConfig, Engine
from glm53.engine.request import SamplingParams
from glm53.engine.synthetic import SyntheticRunner

POOL = 16  # device blocks
# 16-token MLA pages, 256-token indexer pages (a running request's keys stay on the device: large pages
# keep them to a few blocks), 64-token chunks, staging tiles of 32 queries. Both engines force the sparse
# (absorbed) form, so a chunk computes the same way whether its prefix is on the device or staged.
BASE = dict(block_size=16, index_block_size=256, max_model_len=1280, max_num_batched_tokens=64, max_num_seqs=2,
            sparse_mla_force_mqa=True)
HISPARSE = dict(kv_policy="hisparse", hisparse_host_pool_bytes=64 << 20, cpu_offload_bytes=8 << 20,
                hisparse_prefill_tile_tokens=32)
NEW = 6


def _turns(vocab):
    rng = np.random.default_rng(3)
    return [rng.integers(0, vocab, n) for n in (420, 300, 280)]  # ~1,020 tokens of conversation


@pytest.fixture(scope="module")
def reference(small_model):
    """Full residency (a pool that holds everything): the turns, and the whole conversation as one prompt."""
    eng = Engine(small_model, DeployConfig(**BASE, **HISPARSE, num_gpu_blocks=160))
    history, outs = np.zeros(0, np.int64), []
    for turn in _turns(small_model.cfg.vocab_size):
        history = np.concatenate([history, turn])
        out = eng.generate([history], max_new_tokens=NEW)[0].token_ids
        outs.append(out.tolist())
        history = np.concatenate([history, out])
    long_prompt = history[:-NEW]
    long_out = eng.generate([long_prompt], max_new_tokens=NEW)[0].token_ids.tolist()
    assert eng.metrics()["released_pages"] == 0 and eng.scheduler.stats.preemptions == 0
    return outs, long_prompt, long_out


def _check_transfers(eng, before: dict, after: dict) -> None:
    """Every host->device byte of the interval is a restored indexer page, a staged row or a decode
    step's hot-buffer row (no MLA page is staged whole)."""
    row = eng.runner.host.row_bytes_mla
    pages = eng.sizes.page_bytes
    d = {k: after[k] - before[k] for k in after}
    assert d["staged_pages"] == 0
    assert d["h2d_bytes"] == (d["restored_index_pages"] * pages["indexer"]
                              + (d["staged_h2d_rows"] + d["hisparse_h2d_rows"]) * row)


def _snapshot(eng) -> dict:
    m = eng.metrics() if eng.finished else {}
    st, rs = eng.scheduler.policy.stats, eng.scheduler.policy.resolve
    return {"h2d_bytes": eng.scheduler.transfers.h2d_bytes, "staged_pages": st.staged_pages,
            "restored_index_pages": st.restored_index_pages, "staged_h2d_rows": rs.staged_h2d_rows,
            "hisparse_h2d_rows": rs.h2d_rows, "peak": m.get("device_blocks_peak", 0)}


def _check_stage_log(eng, small_model, spec=None) -> None:
    """Per staging record: each layer copied its group's staged rows (shared layers stage what their
    full layer selected), except the last layer, which runs only each row's last query (GLM53 last_only)
    and so copies at most that; and no tile staged more than its queries can select. Under MTP a chunk
    leaves three records (the target's forward, the MTP layer's pass, the drafts): the MTP layer is an
    IndexShare group of its own, one layer, which the target's forward does not touch; that forward keeps
    every position's hidden state, so its last layer runs for every query and again for the last one
    (GLM53 keep_all), which may stage up to top-k more rows per request."""
    cfg = small_model.cfg
    full = [i for i in cfg.full_indexer_layers if i < cfg.num_hidden_layers]
    per_group = np.diff(full + [cfg.num_hidden_layers])
    tile = eng.deploy.hisparse_prefill_tile_tokens
    log = eng.scheduler.policy.resolve.stage_log
    assert log
    if spec:
        mtp = [rec for rec in log if rec.staged[:, :-1].sum() == 0]  # the MTP layer's passes
        target = [rec for rec in log if rec.staged[:, -1].sum() == 0 and rec.staged.sum() > 0]
        assert mtp and target and all((rec.copied == rec.staged[:, -1]).all() for rec in mtp)
        log = [dataclasses.replace(rec, staged=rec.staged[:, :-1]) for rec in target]
    for rec in log:
        last = per_group.copy()
        if spec:
            assert (rec.staged @ last <= rec.copied).all()
            assert (rec.copied <= rec.staged @ per_group + cfg.index_topk).all()
        else:
            last[-1] -= 1
            assert (rec.staged @ last <= rec.copied).all() and (rec.copied <= rec.staged @ per_group).all()
        tiles = -(-eng.deploy.max_num_batched_tokens // tile)
        assert (rec.staged <= tiles * tile * cfg.index_topk).all()


MTP3 = {"method": "mtp", "num_speculative_tokens": 3}


@pytest.mark.slow
@pytest.mark.parametrize("spec", [None, MTP3], ids=["plain", "mtp3"])
def test_a_conversation_four_times_the_pool_matches_full_residency(small_model, reference, spec):
    """With MTP3 the pool is the same 16 blocks (its hot buffer is (3 + 2) x top-k rows: 5 blocks, not 2);
    prefill chunks, the MTP layer's pass over them and the drafts after a prompt's last chunk stage
    their host rows, and greedy speculative decoding gives the non-speculative reference's tokens."""
    outs, long_prompt, long_out = reference
    deploy = DeployConfig(**BASE, **HISPARSE, num_gpu_blocks=POOL, speculative_config=spec)
    eng = Engine(small_model, deploy)
    kv = eng.scheduler.kv
    total = long_prompt.size + NEW
    assert kv.blocks_needed_all(total) >= 4 * POOL  # the conversation's KV over the pool
    eng.scheduler.policy.resolve.stage_log = []
    history = np.zeros(0, np.int64)
    for i, turn in enumerate(_turns(small_model.cfg.vocab_size)):
        history = np.concatenate([history, turn])
        before = _snapshot(eng)
        out = eng.generate([history], max_new_tokens=NEW)[0].token_ids
        assert out.tolist() == outs[i], f"turn {i}"
        _check_transfers(eng, before, _snapshot(eng))
        history = np.concatenate([history, out])
        # other sessions reuse the device pool between turns: the next turn finds its prefix only in the
        # host pools, and its first chunks run with no residency
        kv.pool.reset_prefix_cache()
    m = eng.metrics()
    assert m["device_blocks_peak"] <= POOL == m["num_gpu_blocks"]
    assert m["preemptions"] == 0 and m["released_pages"] > 0 and m["staged_rows"] > 0
    assert m["hot_misses"] > 0  # decode steps read host-only pages through the hot buffer
    st = eng.scheduler.policy.stats
    assert st.residency_steps["none"] > 0 and st.host_prefix_pages > 0
    _check_stage_log(eng, small_model, spec)
    if spec:
        assert m["spec_num_drafts"] > 0

    # the whole conversation as one prompt: its prefill releases its own sealed pages as it goes
    eng = Engine(small_model, deploy)
    eng.scheduler.policy.resolve.stage_log = []
    before = _snapshot(eng)
    assert eng.generate([long_prompt], max_new_tokens=NEW)[0].token_ids.tolist() == long_out
    _check_transfers(eng, before, _snapshot(eng))
    m = eng.metrics()
    assert m["device_blocks_peak"] <= POOL and m["preemptions"] == 0 and m["released_pages"] > 0
    _check_stage_log(eng, small_model, spec)


def test_a_request_beyond_the_pool_is_refused_where_it_cannot_run(small_model):
    prompt = np.zeros(1000, np.int32)
    offload = Engine(small_model.cfg, DeployConfig(**BASE, kv_policy="offload", cpu_offload_bytes=64 << 20,
                                                  num_gpu_blocks=POOL), runner=SyntheticRunner())
    with pytest.raises(ValueError, match=r"needs 67 device blocks at once under kv_policy='offload' but the pool "
                                         r"has 16 \(num_gpu_blocks\)"):  # 63 MLA + 4 indexer pages
        offload.add_request(prompt, SamplingParams(max_new_tokens=8))
    assert not offload.has_unfinished()
    hisparse = Engine(small_model.cfg, DeployConfig(**BASE, **HISPARSE, num_gpu_blocks=POOL), runner=SyntheticRunner())
    hisparse.add_request(prompt, SamplingParams(max_new_tokens=8))  # 4 indexer + (4 chunk + 1 + 2 tail) MLA + 2 hot-buffer blocks = 13
    with pytest.raises(ValueError, match=r"needs 13 device blocks .* pool has 12"):
        Engine(small_model.cfg, DeployConfig(**BASE, **HISPARSE, num_gpu_blocks=12),
               runner=SyntheticRunner()).add_request(prompt, SamplingParams(max_new_tokens=8))
    # a KV budget that cannot hold even that for one request of max_model_len is refused at construction
    with pytest.raises(ValueError, match="fewer than one request of max_model_len"):
        DeployConfig(**BASE, **HISPARSE, kv_cache_memory_bytes=1 << 16).resolved(small_model.cfg)
