"""KV cache events (kvcache.events) in vLLM's wire format, read the way a router reads them: a real ZMQ SUB
socket, msgspec decoding into vLLM's struct layout, gaps filled from the replay socket. The strongest check
replays the whole stream into per (medium, group) sets of hashes and compares them with what the pools
hold at the end of a run with evictions (device pool, host tiers, a filesystem tier); every stored page
must re-hash from its parent and tokens. Engines run the real scheduler and policies with
SyntheticRunner (no model), so each run takes a fraction of a second."""

import time
import types

import msgspec
import numpy as np
import pytest
import zmq

import glm53
from glm53 import DeployConfig, Engine, SamplingParams
from glm53.engine.synthetic import SyntheticRunner
from kvcache import events as ev
from kvcache.block_pool import KVCacheManager, hash_block
from kvcache.policies.hisparse import HiSparsePolicy
from kvcache.policies.offload import OffloadPolicy
from kvcache.tiers import Lookup, TierSet, chunk_key
from kvcache.tiers.fs import FileTier
from kvcache.transfer import TierStore
from parallel.launch import free_port

TINY = glm53.get_preset("tiny")
MODEL = types.SimpleNamespace(cfg=TINY, dtype="float32")  # the synthetic runner needs no weights
LOCAL = "tcp://127.0.0.1:*"  # a free port per socket: tests on one machine never collide
GROUP = {"mla": 0, "indexer": 1}


# ---------------------------------------------------------------------------------------- helpers
class Sub:
    """A router's end of one replica's stream: SUB on the publisher's address, DEALER on its replay."""

    def __init__(self, pub, topic: str = ""):
        ctx = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.connect(pub.endpoint)
        self.pub = pub
        self.replay_endpoint = pub.replay_endpoint
        self.frames: dict[int, tuple[bytes, bytes]] = {}  # seq -> (topic, payload), live
        time.sleep(0.3)  # PUB/SUB: a subscription takes a moment to reach the publisher (gaps are replayed)

    def drain(self, until_seq: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while until_seq >= 0 and until_seq not in self.frames and time.monotonic() < deadline:
            if self.sub.poll(50):
                topic, seq, payload = self.sub.recv_multipart()
                self.frames[int.from_bytes(seq, "big")] = (topic, payload)

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        """vLLM's replay protocol from a DEALER: [b"", start] -> [b"", seq, payload]... [b"", -1, b""]."""
        d = zmq.Context.instance().socket(zmq.DEALER)
        d.connect(self.replay_endpoint)
        try:
            d.send_multipart((b"", start.to_bytes(8, "big")))
            out = []
            while True:
                assert d.poll(5000), "no answer from the replay socket"
                empty, seq, payload = d.recv_multipart()
                assert empty == b""
                if seq == ev.END_SEQ:
                    assert payload == b""
                    return out
                out.append((int.from_bytes(seq, "big"), payload))
        finally:
            d.close(linger=0)

    def close(self):
        self.sub.close(linger=0)


def _wait_sent(pub, timeout=10.0) -> int:
    """Wait until the publisher's thread has sent every queued batch. -> batches queued so far."""
    deadline = time.monotonic() + timeout
    while pub.sent_batches < pub.queued_batches and time.monotonic() < deadline:
        time.sleep(0.005)
    assert pub.sent_batches == pub.queued_batches and pub.dropped_batches == 0
    return pub.queued_batches


def stream(sub: Sub) -> list[ev.KVEventBatch]:
    """The replica's whole stream, in sequence order: what came live, the gaps from the replay socket.
    Checks the sequence numbers are contiguous from 0 and that live and replayed payloads agree."""
    n = _wait_sent(sub.pub)
    sub.drain(n - 1)
    replayed = dict(sub.replay(0))
    assert sorted(replayed) == list(range(n))  # contiguous from 0, all of them buffered
    assert sub.frames, "the SUB socket received nothing"
    for seq, (topic, payload) in sub.frames.items():
        assert payload == replayed[seq]
    dec = ev.decoder()
    return [dec.decode(replayed[s]) for s in range(n)]


def reconstruct(batches, rank=None) -> dict:
    """Apply a stream to per (medium, group_idx) sets of hashes, as a router's index would. A store of a
    hash already held, or a removal of one not held, is an error: the stream must track state exactly."""
    state: dict[tuple[str, int], set] = {}
    for b in batches:
        if rank is not None:
            assert b.data_parallel_rank == rank
        for e in b.events:
            if isinstance(e, ev.AllBlocksCleared):
                state.clear()
            elif isinstance(e, ev.BlockStored):
                held = state.setdefault((e.medium, e.group_idx), set())
                for h in e.block_hashes:
                    assert h not in held, f"{e.medium} group {e.group_idx}: stored twice"
                    held.add(h)
            else:
                held = state.setdefault((e.medium, e.group_idx), set())
                for h in e.block_hashes:
                    assert h in held, f"{e.medium} group {e.group_idx}: removed a hash never stored"
                    held.remove(h)
    return {k: v for k, v in state.items() if v}


def check_payloads(batches, tokens_per_chunk: int) -> int:
    """Every BlockStored re-hashes: from its parent, each page's tokens in chunks of the MLA page size
    with its extra keys end at the page's hash; len(token_ids) = pages x block_size. -> pages checked."""
    n = 0
    for b in batches:
        for e in b.events:
            if not isinstance(e, ev.BlockStored):
                continue
            assert isinstance(e.block_size, int) and e.block_size % tokens_per_chunk == 0
            assert len(e.token_ids) == len(e.block_hashes) * e.block_size == len(e.extra_keys) * e.block_size
            assert e.kv_cache_spec_kind == "mla_attention" and e.lora_id is None and e.lora_name is None
            h = e.parent_block_hash
            for i, want in enumerate(e.block_hashes):
                page = e.token_ids[i * e.block_size:(i + 1) * e.block_size]
                for lo in range(0, e.block_size, tokens_per_chunk):
                    h = hash_block(h, page[lo: lo + tokens_per_chunk], e.extra_keys[i] or ())
                assert h == want, "a stored page does not re-hash from its parent and tokens"
                n += 1
    return n


def pool_state(sch) -> dict:
    """What the replica's pools hold, in reconstruct()'s shape."""
    out: dict[tuple[str, int], set] = {}
    pools = [("GPU", sch.kv.pool)]
    pol = sch.policy
    if isinstance(pol, OffloadPolicy):
        pools += [("CPU", p) for p in pol.host.values()]
    if isinstance(pol, HiSparsePolicy):
        pools += [("CPU", p) for p in (pol.host_mla, pol.host_index) if p is not None]
    for medium, p in pools:
        for g, h in p.cached:
            out.setdefault((medium, GROUP[g]), set()).add(h)
    return out


def _prompts(rng, n, lo=20, hi=70):
    return [rng.integers(0, 512, int(k)) for k in rng.integers(lo, hi, n)]


def _run_turns(eng, rng, sessions=6, turns=3, salted=True):
    """Multi-turn sessions (each turn extends the previous one's prompt and output), some salted."""
    ctx = {s: rng.integers(0, 512, int(rng.integers(10, 40))) for s in range(sessions)}
    for _ in range(turns):
        ids = {}
        for s in range(sessions):
            ids[s] = eng.add_request(ctx[s], SamplingParams(int(rng.integers(2, 9))),
                                     salt=f"user{s % 3}" if salted and s % 2 else "")
        while eng.has_unfinished():
            eng.step()
        for s, rid in ids.items():
            o = eng.output(rid)
            ctx[s] = np.concatenate([ctx[s], o.token_ids, rng.integers(0, 512, int(rng.integers(1, 20)))])


def _events(**kw):
    return {"enable_kv_cache_events": True, "endpoint": LOCAL, "replay_endpoint": LOCAL, **kw}


BASE = dict(max_model_len=160, max_num_batched_tokens=48, max_num_seqs=4, block_size=4, index_block_size=8)


def _engine(policy, dp=1, dcp=1, tier=False, **kw):
    """tier: a simulated secondary tier behind the host pools (SyntheticRunner.make_tiers; unbounded)."""
    fields = dict(BASE, data_parallel_size=dp, decode_context_parallel_size=dcp,
                  kv_events_config=_events(**kw.pop("events", {})), **kw)
    pages = DeployConfig(**fields).kv_sizes(TINY).page_bytes
    if policy == "offload":  # 24 MLA and 12 indexer pages: the host tier evicts too
        fields["cpu_offload_bytes"] = 24 * (pages["mla"] + pages["indexer"] // 2)
    if policy == "hisparse":  # one request of max_model_len (40 pages) and a little more: it evicts
        fields.update(hisparse_host_pool_bytes=48 * pages["mla"], cpu_offload_bytes=10 * pages["indexer"],
                      hisparse_device_buffer_size=16)
    fields["kv_policy"] = policy
    if tier:
        fields["kv_transfer_config"] = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {
            "cpu_bytes_to_use": fields["cpu_offload_bytes"], "secondary_tiers": [{"type": "fs", "root_dir": "unused"}]}}
    deploy = DeployConfig(**fields)
    sizes = deploy.kv_sizes(TINY)
    runners = [SyntheticRunner(lambda row: (row.start * 7 + row.num_tokens) % 509, page_bytes=sizes.page_bytes)
               for _ in range(dp)]
    return Engine(MODEL, deploy, runner=runners if dp > 1 else runners[0])


# ------------------------------------------------------------------------------------ the stream
@pytest.mark.parametrize("policy, dp, dcp", [("offload", 2, 1), ("offload", 1, 2), ("hisparse", 1, 1),
                                             ("preempt", 1, 1)])
def test_replayed_stream_equals_the_pools_at_the_end_of_a_run(policy, dp, dcp):
    """Sessions over small pools (device evictions, host-tier evictions), a reset, more sessions: per
    replica the stream rebuilds exactly the device pool's hashes (GPU) and the host pools' (CPU)."""
    eng = _engine(policy, dp=dp, dcp=dcp, num_gpu_blocks=40 if policy != "hisparse" else 70)
    subs = [Sub(p) for p in eng.kv_event_publishers]
    try:
        rng = np.random.default_rng(1)
        _run_turns(eng, rng)
        eng.reset_prefix_cache()
        _run_turns(eng, rng, sessions=4, turns=2)
        stats = [r.scheduler.kv.pool.stats for r in eng.replicas]
        assert sum(s.evicted for s in stats) > 0  # the device pool reused cached blocks
        salts = set()
        for rank, (rep, sub) in enumerate(zip(eng.replicas, subs)):
            batches = stream(sub)
            cleared = [i for i, b in enumerate(batches) if any(isinstance(e, ev.AllBlocksCleared) for e in b.events)]
            assert len(cleared) == 1 and batches[cleared[0]].events == [ev.AllBlocksCleared()]
            state = reconstruct(batches, rank)
            assert state == pool_state(rep.scheduler) and ("GPU", 0) in state and ("GPU", 1) in state
            if policy != "preempt":
                assert ("CPU", 0) in state
                assert any(isinstance(e, ev.BlockRemoved) and e.medium == "CPU" for b in batches for e in b.events)
            assert check_payloads(batches, eng.deploy.tokens_per_block) > 0
            sizes = {(e.medium, e.group_idx): e.block_size for b in batches for e in b.events
                     if isinstance(e, ev.BlockStored)}
            assert sizes[("GPU", 0)] == 4 * dcp and sizes[("GPU", 1)] == 8 * dcp  # tokens per page, truthfully
            salts |= {k for b in batches for e in b.events if isinstance(e, ev.BlockStored) for k in e.extra_keys}
        assert salts == {None, ("user0",), ("user1",), ("user2",)}  # the salt rides in extra_keys
    finally:
        eng.shutdown()
        for s in subs:
            s.close()


def test_hisparse_host_pools_and_their_tier_in_the_stream():
    """HiSparse on the one host-memory system (kvcache.host_tier) with a simulated secondary tier:
    sessions over small pools, a reset (device and host pools forget, the tier keeps its chunks, so the
    next turns load their prefixes from it into the host pools), more sessions. The stream rebuilds
    the device pool, both host pools (pages loaded from the tier included) and the tier's chunks."""
    eng = _engine("hisparse", tier=True, num_gpu_blocks=70)
    sub = Sub(eng.kv_event_publishers[0])
    try:
        rng = np.random.default_rng(1)
        _run_turns(eng, rng)
        eng.reset_prefix_cache()
        _run_turns(eng, rng, sessions=4, turns=2)
        batches = stream(sub)
        state = reconstruct(batches, 0)
        sch = eng.scheduler
        assert {k: v for k, v in state.items() if k[0] != "STORAGE"} == pool_state(sch)
        assert {("CPU", 0), ("CPU", 1), ("STORAGE", 0), ("STORAGE", 1)} <= set(state)  # MLA and indexer pages
        tier, fp = eng.tiers[0].tiers[0], eng.fingerprint
        announced = {chunk_key(fp, g, h) for g in GROUP for h in state.get(("STORAGE", GROUP[g]), ())}
        assert announced == set(tier.keys()) and len(announced) > 0  # every chunk written through, once
        assert sch.policy.host_tier.tier_counts["fs"].hits > 0  # the turns after the reset loaded from the tier
        # the reset sent removals, not AllBlocksCleared: the tier kept its chunks
        assert not any(isinstance(e, ev.AllBlocksCleared) for b in batches for e in b.events)
        assert check_payloads(batches, eng.deploy.tokens_per_block) > 0
    finally:
        eng.shutdown()
        sub.close()


def test_wire_layout_topic_and_replay_from_a_sequence_number():
    """The frames are [topic, 8-byte big-endian seq, payload]; the payload is vLLM's layout: a positional
    batch [ts, events, rank] of "type"-tagged maps; the replay socket answers from any number on."""
    topic = "kv@127.0.0.1:8000@tiny"
    eng = _engine("preempt", num_gpu_blocks=40, events={"topic": topic})
    pub = eng.kv_event_publishers[0]
    sub, other = Sub(pub, topic), Sub(pub, "kv@10.0.0.9")  # a subscriber of another topic
    try:
        _run_turns(eng, np.random.default_rng(2), sessions=3, turns=2)
        n = _wait_sent(pub)
        sub.drain(n - 1)
        assert n >= 3 and sub.frames and {t for t, _ in sub.frames.values()} == {topic.encode()}
        other.drain(0, timeout=0.3)
        assert not other.frames
        raw = msgspec.msgpack.decode(sub.replay(0)[0][1])  # untyped: the bytes' own shape
        ts, events, rank = raw
        assert abs(ts - time.time()) < 60 and rank == 0 and isinstance(events, list)
        first = events[0]
        assert isinstance(first, dict) and first["type"] == "BlockStored" and first["medium"] == "GPU"
        assert list(first)[:8] == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                   "medium", "lora_name"]
        assert first["parent_block_hash"] is None and isinstance(first["block_hashes"][0], bytes)
        assert "kv_cache_spec_sliding_window" not in first and "locality" not in first  # defaults omitted
        tail = sub.replay(n - 2)
        assert [s for s, _ in tail] == [n - 2, n - 1]
        assert sub.replay(n) == []  # nothing from there on: just the end marker
        assert sub.replay(n - 1)[0][1] == sub.frames[n - 1][1]
    finally:
        eng.shutdown()
        sub.close()
        other.close()
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish(ev.batch([ev.AllBlocksCleared()]))


def test_batches_are_one_per_step_and_coalesce_chains():
    """One batch per engine step that changed a pool; a request's newly full pages of one group form one
    BlockStored whose parent chain continues the previous one."""
    eng = _engine("preempt", num_gpu_blocks=200)
    sub = Sub(eng.kv_event_publishers[0])
    try:
        rid = eng.add_request(np.arange(40) % 509, SamplingParams(1))  # 40 tokens: prefill in one step
        while eng.has_unfinished():
            eng.step()
        batches = stream(sub)
        assert len(batches) == 1  # the step that computed the prompt registered its 10 + 5 full pages
        mla, idx = batches[0].events
        assert (mla.group_idx, len(mla.block_hashes), idx.group_idx, len(idx.block_hashes)) == (0, 10, 1, 5)
        assert mla.token_ids == idx.token_ids == (np.arange(40) % 509).tolist()
        assert eng.output(rid).token_ids.size == 1
    finally:
        eng.shutdown()
        sub.close()


# ----------------------------------------------------------------------------- secondary tiers
class _Req:
    extra_keys = ()

    def __init__(self, req_id, tokens):
        self.req_id, self.tokens, self.num_computed_tokens = req_id, np.asarray(tokens), 0

    @property
    def num_tokens(self):
        return self.tokens.size


def test_storage_events_follow_the_filesystem_tier(tmp_path):
    """The offload policy over a capacity-bound fs tier: chunks are announced ("STORAGE", "LOCAL") once
    written and removed when the tier evicts them; the stream equals the files on disk, the host pools
    and the device pool."""
    fp = "f" * 64
    page = {"mla": 64, "indexer": 16}
    tier = FileTier(fingerprint=fp, root_dir=tmp_path, max_bytes=12 * (64 + 56), write_threads=1)  # ~12 MLA chunks
    tiers = TierSet([tier])
    kv = KVCacheManager(48, 4, ("mla", "indexer"))
    pol = OffloadPolicy({"mla": 6, "indexer": 6}, page, tiers=tiers, fingerprint=fp)
    rec = ev.KVEventRecorder(("mla", "indexer"), {"mla": 4, "indexer": 4}, {"mla": "mla_attention",
                                                                            "indexer": "mla_attention"})
    kv.attach_events(rec)
    pol.attach_events(rec)
    tiers.attach_events(rec)
    rng = np.random.default_rng(3)
    batches = []
    try:
        for i in range(10):
            r = _Req(f"r{i}", rng.integers(0, 512, 17))  # 4 full pages per group
            r.num_computed_tokens = pol.admit(kv, r)
            kv.allocate(r.req_id, r.num_tokens)
            pol.prepare(kv, r, r.num_tokens - r.num_computed_tokens)
            r.num_computed_tokens = r.num_tokens
            kv.cache_full_blocks(r.req_id, r.tokens, r.num_tokens)
            pol.on_finish(kv, r)
            kv.free(r.req_id)
            for op in pol.take_transfers():
                if isinstance(op, TierStore):  # what the runner's host side does: the pages' bytes to the tiers
                    tiers.store(op.keys, [np.full(page[op.group], i, np.uint8)] * len(op.keys))
            tier._writers.submit(lambda: None).result()  # one writer thread: the stores above are done
            tiers.poll()  # so every chunk is announced before a later store can evict it
            batches.append(ev.batch(rec.take()))
        tiers.shutdown(wait=True)
        tiers.poll()
        batches.append(ev.batch(rec.take()))
    finally:
        tiers.shutdown(wait=True)
    batches = [ev.decoder().decode(msgspec.msgpack.encode(b)) for b in batches]  # through the wire format
    state = reconstruct(batches)
    assert tier.stats.evicted_chunks > 0 and tier.stats.stored_chunks > 12
    on_disk = {bytes.fromhex(p.name[:-3]) for p in tmp_path.rglob("*.kv")}
    announced = {chunk_key(fp, g, h) for (m, gi), hs in state.items() if m == "STORAGE"
                 for g in ("mla", "indexer") if GROUP[g] == gi for h in hs}
    assert announced == on_disk and all(tier.lookup(k) is Lookup.HIT for k in announced)
    stored = [e for b in batches for e in b.events if isinstance(e, ev.BlockStored) and e.medium == "STORAGE"]
    assert {(e.locality, e.ownership) for e in stored} == {("LOCAL", None)}
    assert any(isinstance(e, ev.BlockRemoved) and e.medium == "STORAGE" for b in batches for e in b.events)
    sch = types.SimpleNamespace(kv=kv, policy=pol)  # what pool_state reads of a scheduler
    assert {k: v for k, v in state.items() if k[0] != "STORAGE"} == pool_state(sch)
    assert check_payloads(batches, 4) > 0


# --------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("cfg, says", [
    ({"enable_kv_cache_events": True, "endpiont": "tcp://*:5557"}, "unknown keys ['endpiont']"),
    ({"enable_kv_cache_events": True, "publisher": "kafka"}, "publisher must be one of ('zmq', 'null')"),
    ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events must be True or False"),
    ({"enable_kv_cache_events": True, "endpoint": "localhost:5557"}, "endpoint must be a ZMQ endpoint"),
    ({"enable_kv_cache_events": True, "endpoint": "udp://*:5557"}, "schemes ('tcp', 'ipc', 'inproc')"),
    ({"enable_kv_cache_events": True, "replay_endpoint": "tcp://*:port"}, "replay_endpoint must be tcp://HOST:PORT"),
    ({"enable_kv_cache_events": True, "buffer_steps": 0}, "buffer_steps must be an int >= 1"),
    ({"enable_kv_cache_events": True, "hwm": -1}, "hwm must be an int >= 0"),
    ({"enable_kv_cache_events": True, "topic": 7}, "topic must be a str"),
    ("on", "must be a dict"),
])
def test_bad_config_names_the_field(cfg, says):
    with pytest.raises(ValueError, match="DeployConfig.kv_events_config") as e:
        DeployConfig(kv_events_config=cfg)
    assert says in str(e.value)


def test_vllm_defaults_and_data_parallel_ports():
    on = DeployConfig(kv_events_config={"enable_kv_cache_events": True}).kv_events
    assert (on.publisher, on.endpoint, on.replay_endpoint, on.buffer_steps, on.hwm, on.max_queue_size, on.topic) == (
        "zmq", "tcp://127.0.0.1:5557", None, 10_000, 100_000, 100_000, "")
    assert DeployConfig().kv_events.publisher == "null" and not DeployConfig().kv_events.publishing
    assert ev.offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert ev.offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert ev.offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1" and ev.offset_endpoint(LOCAL, 3) == LOCAL


def test_the_default_endpoint_binds_loopback_only():
    """A departure from vLLM (whose default, tcp://*:5557, publishes on every interface): the default binds
    127.0.0.1, and a loopback host is bound, not connected to; a wildcard, ipc:// and inproc:// are bound
    as in vLLM, any other host connected to (a collector)."""
    assert ev.binds(ev.KVEventsConfig().endpoint)
    for endpoint in ("tcp://127.0.0.1:5557", "tcp://localhost:1", "tcp://[::1]:2", "tcp://*:5557", "tcp://[::]:3",
                     "ipc:///tmp/kv", "inproc://kv"):
        assert ev.binds(endpoint), endpoint
    for endpoint in ("tcp://10.0.0.7:5557", "tcp://collector.example:5557"):
        assert not ev.binds(endpoint), endpoint
    port = free_port()
    pub = ev.ZmqEventPublisher(ev.KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{port}"))
    try:
        assert [addr for _, addr in pub._bound] == [f"tcp://127.0.0.1:{port}"]  # bound, not connected to
    finally:
        pub.close()


def test_a_busy_address_fails_the_engine_and_leaves_no_socket_open():
    """A PUB or replay address already bound: the engine fails naming the field, and closes the sockets
    it had opened (inproc names, in the one process-wide context, are taken exactly like ports)."""
    first = _engine("preempt", num_gpu_blocks=40, events={"endpoint": "inproc://ev-busy",
                                                          "replay_endpoint": "inproc://ev-replay_dp1"})
    try:
        with pytest.raises(ValueError, match=r"kv_events_config endpoint 'inproc://ev-busy': cannot bind"):
            _engine("preempt", num_gpu_blocks=40, events={"endpoint": "inproc://ev-busy", "replay_endpoint": None})
        # replica 0 binds both its sockets, replica 1 its PUB, then its replay address is taken
        with pytest.raises(ValueError, match=r"kv_events_config replay_endpoint 'inproc://ev-replay_dp1'"):
            _engine("preempt", dp=2, num_gpu_blocks=40, events={"endpoint": "inproc://ev-free",
                                                               "replay_endpoint": "inproc://ev-replay"})
        for name in ("inproc://ev-free", "inproc://ev-free_dp1", "inproc://ev-replay"):
            probe = zmq.Context.instance().socket(zmq.PUB)
            _bind_soon(probe, name)  # the failed engine closed what it had bound
            probe.close(linger=0)
    finally:
        first.shutdown()
    second = _engine("preempt", num_gpu_blocks=40, events={"endpoint": "inproc://ev-busy"})
    second.shutdown()  # shutdown released the first engine's address


def _bind_soon(sock, name, timeout=2.0):
    """Bind, allowing ZMQ's background reaper a moment to release a name a closed socket held."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return sock.bind(name)
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


@pytest.mark.parametrize("cfg", [None, {"enable_kv_cache_events": False, "publisher": "zmq"},
                                 {"enable_kv_cache_events": True, "publisher": "null"}])
def test_no_socket_without_publishing(monkeypatch, cfg):
    """Events off (or the null publisher): no socket is made; off, the pools have no sink either."""
    def no_socket(*a, **k):
        raise AssertionError("a ZMQ socket was opened")

    monkeypatch.setattr(zmq.Context, "socket", no_socket)
    eng = Engine(MODEL, DeployConfig(**BASE, num_gpu_blocks=40, kv_policy="offload", cpu_offload_bytes=60_000,
                                     kv_events_config=cfg),
                 runner=SyntheticRunner(page_bytes=DeployConfig(**BASE, num_gpu_blocks=40, kv_policy="offload",
                                                                cpu_offload_bytes=60_000).kv_sizes(TINY).page_bytes))
    _run_turns(eng, np.random.default_rng(4), sessions=2, turns=2)
    eng.reset_prefix_cache()
    assert all(isinstance(p, ev.NullEventPublisher) for p in eng.kv_event_publishers)
    pools = [eng.scheduler.kv.pool, *eng.scheduler.policy.host.values()]
    assert all((p.events is None) == (cfg is None or not cfg["enable_kv_cache_events"]) for p in pools)
    eng.shutdown()


def test_a_full_queue_drops_a_batch_and_leaves_a_gap():
    """publish never waits: past max_queue_size a batch is dropped and its sequence number skipped, so a
    subscriber sees the gap (vLLM would block the engine step instead)."""
    cfg = ev.KVEventsConfig(enable_kv_cache_events=True, endpoint=LOCAL, max_queue_size=1)
    pub = ev.ZmqEventPublisher(cfg)
    try:
        seqs = [pub.publish(ev.batch([ev.AllBlocksCleared()])) for _ in range(200)]
        assert seqs[0] == 0 and None in seqs and pub.dropped_batches == seqs.count(None)
        kept = [s for s in seqs if s is not None]
        assert kept == sorted(kept) and kept[-1] <= 199
    finally:
        pub.close()


@pytest.mark.slow
def test_model_engine_with_a_filesystem_tier_publishes_its_last_stores_at_shutdown(small_model, tmp_path):
    """The one model run: the runner's host side writes the chunks and polls the tier, the engine's
    shutdown waits for the last writes and publishes them before closing the socket. The stream then
    equals the device pool, the host tier and the chunk files (test_tiers' deployment: same programs)."""
    tier = {"type": "fs", "root_dir": str(tmp_path)}
    deploy = DeployConfig(max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4, block_size=8,
                          kv_events_config=_events(), kv_transfer_config={
                              "kv_connector": "OffloadingConnector",
                              "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 20, "secondary_tiers": [tier]}})
    eng = Engine(small_model, deploy)
    sub = Sub(eng.kv_event_publishers[0])
    try:
        rng = np.random.default_rng(5)
        prompts = [rng.integers(0, 512, n) for n in (37, 20)]
        eng.generate(prompts, max_new_tokens=5)
        batches = stream(sub)  # everything up to now, gaps replayed
        n = len(batches)
        eng.shutdown()
        sub.drain(n, timeout=5.0)  # the shutdown's batch, if stores finished after the last step
        dec = ev.decoder()
        batches += [dec.decode(sub.frames[s][1]) for s in sorted(sub.frames) if s >= n]
        state = reconstruct(batches, 0)
        on_disk = {bytes.fromhex(p.name[:-3]) for p in tmp_path.rglob("*.kv")}
        fp = eng.fingerprint
        assert {chunk_key(fp, g, h) for g in GROUP for h in state.get(("STORAGE", GROUP[g]), ())} == on_disk
        assert len(on_disk) == 2 * (41 // 8 + 24 // 8)  # every full page (prompt + 4 computed outputs), both groups
        assert {k: v for k, v in state.items() if k[0] != "STORAGE"} == pool_state(eng.scheduler)
        assert check_payloads(batches, 8) > 0
    finally:
        eng.shutdown()
        sub.close()
