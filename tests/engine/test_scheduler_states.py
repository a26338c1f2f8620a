"""The scheduler under every KV policy as a hypothesis state machine, through a runner whose tokens
depend on the KV contents it is served (glm53.engine.synthetic.ContentRunner: a synthetic content per
cache slot, moved by the plans' transfers as the model runner moves bytes, and every token a hash of the
rows its position reads): random arrivals, prompt and output lengths, shared prefixes
and follow-up turns, and device pools down to a tenth of the offered load, with and without MTP
speculative decoding under every policy (a variable number of tokens per step: drafts that stand or
not, rejected positions rolled back; under HiSparse no page is pre-copied to the host before all its
positions are final). In the end every request's tokens are those it would get with all its KV
resident (ContentModel.expected over its own history), so a stale, swapped or wrong page served to any
row fails the machine (test_wrong_page_is_caught swaps two pages inside the runner to show it does).
After every step the block
pools' invariants hold (no leak, no double free: ref counts equal the tables and leases that hold
them); in the end every request finishes within a bound on steps (no starvation) and every block, lease
and host byte is returned. Under offload and HiSparse (one host-memory system, kvcache.host_tier) a
simulated secondary tier may sit behind the host pools (loads taking time, so admissions wait on them),
lose chunks at any moment, between a lookup that answered HIT and its load included, and be all that is
left after a prefix-cache reset; the host pools' pages are held exactly by the requests, loads and pins
that hold them. Requests may stop on a stop token or be aborted (waiting or running) at any point; an
aborted request holds nothing afterwards. Every admission retry the scheduler would skip is run anyway and checked to
change nothing (Scheduler.verify_skipped_admissions).

Rules have no preconditions: hypothesis' swarm testing turns rules off per example, and a draw whose
enabled rules all fail their preconditions is an invalid example; a rule with nothing to act on does
nothing instead."""

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

import glm53
from glm53 import DeployConfig, Engine, SamplingParams
from glm53.engine.scheduler import Scheduler
from glm53.engine.synthetic import ContentRunner
from kvcache.tiers.sim import TierCosts
from kvcache.policies.hisparse import HiSparsePolicy, device_blocks_per_request, hot_buffer_rows
from kvcache.block_pool import BlockPool
from kvcache.layout import page_bytes
from kvcache.policies.offload import OffloadPolicy
from kvcache.policies import SwapPolicy

CFG = glm53.get_preset("tiny")  # only its sizes matter: no weights, no arrays
MAX_LEN, BLOCK = 64, 4


@pytest.fixture(autouse=True)
def verify_skipped_admissions(monkeypatch):
    monkeypatch.setattr(Scheduler, "verify_skipped_admissions", True)


class _Model:
    cfg, dtype = CFG, "float32"


# a request: prompt length, new tokens, which of three shared prefixes (-1: none), a stop token, min_tokens
ARRIVAL = dict(prompt=st.integers(1, 48), new=st.integers(1, 40), prefix=st.integers(-1, 2),
               stop=st.one_of(st.none(), st.integers(0, 96)), min_tokens=st.integers(0, 4))
# the first requests arrive with the engine: swarm testing turns `arrive` off in about half the examples
FIRST = st.lists(st.fixed_dictionaries(ARRIVAL), min_size=1, max_size=6)
SIZES = dict(seqs=st.integers(1, 4), budget=st.sampled_from([8, 16, 64]), pool_scale=st.floats(1.0, 2.5),
             host_scale=st.floats(0.05, 2.0), index_ratio=st.sampled_from([1, 2]), hot_rows=st.sampled_from([None, 16]))


class SchedulerMachine(RuleBasedStateMachine):
    runner_class = ContentRunner

    @initialize(policy=st.sampled_from(["preempt", "offload", "swap", "hisparse", "hisparse"]), caching=st.booleans(),
                arc=st.booleans(), tier=st.sampled_from([None, None, 0, 2]),
                mtp=st.sampled_from([None, None, "standard", "synthetic"]), short_log=st.booleans(), first=FIRST,
                **SIZES)
    def setup(self, policy, seqs, budget, pool_scale, host_scale, caching, index_ratio, hot_rows, arc, tier, mtp,
              short_log, first):
        self._setup(policy, seqs, budget, pool_scale, host_scale, caching, index_ratio, hot_rows, arc, tier, mtp,
                    short_log)
        for r in first:
            self.arrive(**r)

    def _setup(self, policy, seqs, budget, pool_scale, host_scale, caching, index_ratio, hot_rows, arc, tier, mtp=None,
               short_log=False):
        fields = dict(max_model_len=MAX_LEN, max_num_batched_tokens=budget, max_num_seqs=seqs, block_size=BLOCK,
                      index_block_size=BLOCK * index_ratio, enable_prefix_caching=caching, kv_policy=policy)
        if mtp:
            # 3 drafts; the synthetic runner's drafter is wrong now and then (standard), or a synthetic
            # acceptance rule decides (wrong drafts stand too)
            fields["speculative_config"] = {"method": "mtp", "num_speculative_tokens": 3} if mtp == "standard" else {
                "method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
                "synthetic_acceptance_rates": [0.9, 0.6, 0.3]}
        probe = DeployConfig(**{**fields, "kv_policy": "preempt"})
        pages = page_bytes(CFG, "float32", BLOCK, BLOCK * index_ratio, include_mtp="speculative_config" in fields)
        # the smallest pool that admits a request of max_model_len (and its hot buffer), scaled up to 2.5x
        # (larger pools seldom fill with at most 4 running requests, and then no page moves): with up to 24
        # requests of up to 64 tokens the offered load is ~10x the smallest pool
        tpb = probe.group_tokens_per_block(("mla", "indexer"))
        request_blocks = sum(-(-MAX_LEN // n) for n in tpb.values())
        k = fields.get("speculative_config", {}).get("num_speculative_tokens", 0)
        lease = -(-hot_buffer_rows(hot_rows, k, CFG.index_topk) // BLOCK) if policy == "hisparse" else 0
        fields["num_gpu_blocks"] = int((request_blocks + lease) * pool_scale)
        if policy == "hisparse" and "speculative_config" not in fields:
            # chunks stage the rows they select: a request needs only its keys, chunk, tail and hot buffer
            # on the device, so pools from that up (requests up to several times the pool) are exercised
            least = device_blocks_per_request(MAX_LEN, tokens_per_block=tpb["mla"],
                                              index_tokens_per_block=tpb["indexer"], chunk_tokens=budget,
                                              lease_blocks=lease, stage_rows=True)
            fields["num_gpu_blocks"] = int(least * pool_scale)
        request_bytes = sum(pages[g] * -(-MAX_LEN // n) for g, n in tpb.items())
        host = max(1, int(request_bytes * host_scale * seqs))
        if policy == "swap":
            fields["cpu_offload_bytes"] = host
        # a simulated secondary tier whose loads take `tier` seconds of runner time
        tiers = [{"type": "fs", "root_dir": "unused", "max_bytes": 24 * sum(pages.values())}] if tier is not None else []
        if policy == "offload":  # at least a page of each group; LRU or ARC, in vLLM's config shape
            extra = {"cpu_bytes_to_use": max(host, 2 * sum(pages.values())), "eviction_policy": "arc" if arc else "lru",
                     "secondary_tiers": tiers}
            fields["kv_transfer_config"] = {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": extra}
        if policy == "hisparse":  # at least one request's MLA pages: smaller host pools are rejected
            fields["hisparse_host_pool_bytes"] = max(host, pages["mla"] * -(-MAX_LEN // BLOCK))  # >= one request
            fields["hisparse_device_buffer_size"] = hot_rows  # None: (MTP drafts + 2) x top-k; top-k leaves the
            # watermark slack
            if tier is not None and caching:  # the offload budget (indexer keys) in vLLM's shape, and the tier
                extra = {"cpu_bytes_to_use": max(host // 4, 2 * pages["indexer"]), "secondary_tiers": tiers}
                fields["kv_transfer_config"] = {"kv_connector": "OffloadingConnector",
                                                "kv_connector_extra_config": extra}
            else:
                fields["cpu_offload_bytes"] = host // 4
        self.deploy = DeployConfig(**fields)
        resolved = self.deploy.resolved(CFG, "float32")
        costs = {"fs": TierCosts(read_latency_s=float(tier or 0), write_latency_s=float(tier or 0))}
        # the standard rule's drafter is wrong now and then (rejections roll positions back); under the
        # synthetic rule wrong drafts would stand, and the outputs could not be checked against the model
        self.runner = self.runner_class(CFG, resolved, resolved.kv_sizes(CFG), tier_costs=costs,
                                        draft_error_rate=0.25 if mtp == "standard" else 0.0)
        self.engine = Engine(_Model(), self.deploy, runner=self.runner)
        if short_log:  # pools log 2 index changes: admission walk memos (PrefixWalk) older than that walk again
            sch = self.engine.scheduler
            for v in [sch.kv.pool, *vars(sch.policy).values()]:
                for pool in v.values() if isinstance(v, dict) else (v,):
                    if isinstance(pool, BlockPool):
                        pool.index_log_max = 2
        event(f"policy {policy}" + (f", MTP {mtp}" if mtp else "") + (", a tier" if tier is not None else ""))
        self.rng = np.random.default_rng(0)
        self.prefixes = [self.rng.integers(0, 512, 40) for _ in range(3)]
        self.sent: dict[str, int] = {}  # request id -> engine step at which it was added
        self.aborted: dict[str, bool] = {}  # request id -> whether it was running when aborted
        self.steps = 0

    @rule(**ARRIVAL)
    def arrive(self, prompt, new, prefix, stop, min_tokens):
        """A new request (at most 24 in all), sharing one of three prefixes or none, perhaps with a stop
        token (the runner's tokens are hashes mod 97, so a stop token ends about one output in 97)."""
        if len(self.sent) >= 24:
            return
        new = max(min(new, MAX_LEN - prompt), 1)
        ids = self.rng.integers(0, 512, prompt) if prefix < 0 else \
            np.concatenate([self.prefixes[prefix], self.rng.integers(0, 512, 48)])[:prompt]
        params = SamplingParams(new, stop_token_ids=() if stop is None else (stop,), min_tokens=min(min_tokens, new))
        self.sent[self.engine.add_request(ids, params)] = self.steps

    @rule(pick=st.integers(0, 10 ** 6))
    def abort(self, pick):
        """A client goes away: a waiting or running request is aborted between steps."""
        live = sorted(self.engine.requests)
        if not live:
            return
        rid = live[pick % len(live)]
        running = {r.req_id for r in self.engine.scheduler.running}
        out = self.engine.abort_request(rid)
        self.aborted[rid] = rid in running
        sch = self.engine.scheduler
        assert rid not in sch.requests and rid not in sch.kv.requests and rid not in sch.kv.leases
        assert rid not in sch.kv._kept_hashes and rid not in getattr(sch.policy, "state", {})
        assert rid not in getattr(sch.policy, "saved", {})
        tier = getattr(sch.policy, "host_tier", None)
        assert tier is None or (rid not in tier.tier_pins and rid not in tier.loading and rid not in tier._retry)
        assert self.engine.finished[rid].finish_reason == "abort" and len(out.token_ids) < out_max(self.engine, rid)

    @rule(pick=st.integers(0, 10 ** 6), extra=st.integers(0, 12), new=st.integers(1, 8))
    def follow_up(self, pick, extra, new):
        """The next turn of a finished request: its prompt, its output and `extra` new tokens."""
        done = list(self.engine.finished.values())
        if len(self.sent) >= 24 or not done:
            return
        r = done[pick % len(done)]
        ids = np.concatenate([r.prompt_ids, np.asarray(r.output_ids, np.int32),
                              self.rng.integers(0, 512, extra)]).astype(np.int32)
        if ids.size + new <= MAX_LEN:
            self.sent[self.engine.add_request(ids, SamplingParams(new), salt=r.salt)] = self.steps

    @rule(pick=st.integers(0, 10 ** 6))
    def tier_loses_a_chunk(self, pick):
        """A chunk disappears from the secondary tier (another process deleted it, say): between a lookup
        that answered HIT and its load, or at any other moment."""
        if self.engine.tiers[0] is None:
            return
        tier = self.engine.tiers[0].tiers[0]
        keys = tier.keys()
        if keys:
            assert tier.discard(keys[pick % len(keys)])

    @rule()
    def reset_prefix_cache(self):
        """Every device and host hash is forgotten (vLLM's reset_prefix_cache): the next turns find their
        prefixes only in the secondary tier, pinned pages stay pinned and loads in flight land."""
        if self.engine.tiers[0] is not None:
            self.engine.reset_prefix_cache()

    @rule(n=st.integers(1, 6))
    def step(self, n):
        for _ in range(n):
            if self.engine.has_unfinished():
                self.engine.step()
                self.steps += 1

    @invariant()
    def pools_are_consistent(self):
        if not hasattr(self, "engine"):
            return
        sch = self.engine.scheduler
        sch.kv.check()  # ref counts == holders (tables + leases): no leak, no double count
        pol = sch.policy
        if isinstance(pol, HiSparsePolicy):
            # between steps a host page is held by the running requests' MLA pages, a tier load in flight
            # and the pins of the waiting requests it loaded for, and nothing else
            held = {g: [0] * p.num_blocks for g, p in pol.host_tier.pools.items()}
            for st_ in pol.state.values():
                for b in st_.host:
                    if b >= 0:
                        held["mla"][b] += 1
                assert not st_.pending_index  # copied back in the step that admitted it
            for req in sch.running:  # a page goes to the host only once every position in it is final (under
                # MTP: below the computed count, which excludes rejected drafts and the lookahead positions)
                assert len(pol.state[req.req_id].host) * BLOCK <= req.num_computed_tokens
            self._tier_holders(pol.host_tier, held)
            for g, p in pol.host_tier.pools.items():
                p.check()
                assert p.ref_count == held[g], g
            assert set(pol.state) == set(sch.kv.requests)
            assert len(pol.free_leases) + sum(s.lease >= 0 for s in pol.state.values()) == self.deploy.max_num_seqs
        if isinstance(pol, SwapPolicy):
            assert pol.used_bytes == sum(b for _, b in pol.saved.values()) <= pol.capacity_bytes
        if isinstance(pol, OffloadPolicy):  # between steps the only host pages held are those of tier loads
            held = {g: [0] * p.num_blocks for g, p in pol.host.items()}  # in flight, and those pinned for the
            self._tier_holders(pol.host_tier, held)  # waiting requests that loaded them
            for g, p in pol.host.items():
                p.check()
                assert p.ref_count == held[g], g
            assert not pol.pending and set(pol.stored) == {r.req_id for r in sch.running}
        if tier := getattr(pol, "host_tier", None):
            waiting = {r.req_id for r in sch.waiting}
            assert set(tier.tier_pins) <= waiting and set(tier.loading) <= waiting
        for req in sch.running:
            held = min(len(t) * sch.kv.group_tokens_per_block[g] for g, t in sch.kv.requests[req.req_id].tables.items())
            assert held >= req.num_computed_tokens
            assert req.num_computed_tokens <= req.num_tokens - 1 or not req.output_ids  # rejected drafts rolled back
            assert len(req.spec_token_ids) <= self.deploy.num_speculative_tokens

    def _coverage(self) -> None:
        """Report (--hypothesis-show-statistics) which KV paths the example took."""
        c, eng = self.runner.counts, self.engine
        for what in ("PageCopy", "SaveKV", "LoadKV", "ResetLease", "TierStore", "TierLoad", "hot_hits", "hot_misses",
                     "staged_rows"):
            if c[what]:
                event(f"ran {what}")
        if any(self.aborted.values()):
            event("aborted a running request")
        if self.deploy.num_speculative_tokens and eng.scheduler.spec.num_drafts:
            event("verified drafts")

    @staticmethod
    def _tier_holders(tier, held) -> None:
        """Count into `held` (per group, per host page) the host tier's own references: loads in flight
        and the pages pinned for the requests waiting on them."""
        for _, _, g, hb, _ in tier.jobs.values():
            held[g][hb] += 1
        for pins in tier.tier_pins.values():
            for g, hb in pins:
                held[g][hb] += 1

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        eng = self.engine
        tokens = sum(r.num_tokens + r.params.max_new_tokens for r in eng.requests.values())
        bound = 200 + 20 * tokens  # generous; a starving request would exceed any bound
        start = self.steps
        while eng.has_unfinished():
            eng.step()
            self.steps += 1
            assert self.steps - start <= bound, f"requests starve: {sorted(eng.requests)}"
        assert set(eng.finished) == set(self.sent)  # every request finished
        model = self.runner.model
        for rid, r in eng.finished.items():
            # every token is the one its request gets with all its KV resident: no row was served a
            # wrong, stale or swapped page (aborted requests: the tokens they got)
            want = model.expected(r.prompt_ids, r.output_ids, r.params)
            assert tuple(r.output_ids) == want, (
                f"{rid}: tokens {list(r.output_ids)} differ from the all-resident reference {list(want)}: a row was "
                f"served KV that is not its own")
            out, p = r.output_ids, r.params
            stops = [j for j, t in enumerate(out) if t in p.stop_token_ids]  # none before min_tokens (masked)
            if rid in self.aborted:
                assert r.finish_reason == "abort"
            elif r.finish_reason == "stop":  # the first stop token, at or past min_tokens, ends the output
                assert stops == [len(out) - 1] and len(out) > p.min_tokens
            else:
                assert r.finish_reason == "length" and len(out) == p.max_new_tokens and not stops
        self._coverage()
        sch = eng.scheduler
        if self.deploy.num_speculative_tokens and any(len(r.output_ids) > 2 for r in eng.finished.values()):
            assert sch.spec.num_drafts > 0  # drafts were verified
        assert sch.kv.num_free_blocks == sch.kv.pool.num_blocks and not sch.kv.requests and not sch.kv.leases
        pol = sch.policy
        if isinstance(pol, HiSparsePolicy):
            assert not pol.state and len(pol.free_leases) == self.deploy.max_num_seqs
            assert all(p.num_free == p.num_blocks for p in pol.host_tier.pools.values())  # parked: cached, free
        if isinstance(pol, SwapPolicy):
            assert pol.used_bytes == 0 and not pol.saved
        if isinstance(pol, OffloadPolicy):
            assert not pol.stored and not pol.pending and all(p.num_free == p.num_blocks for p in pol.host.values())
        if tier := getattr(pol, "host_tier", None):
            assert not tier.jobs and not tier.tier_pins and not tier.loading and not tier.inflight


def out_max(engine, rid):
    return engine.finished[rid].params.max_new_tokens


class HiSparseTierMachine(SchedulerMachine):
    """The machine under HiSparse with the simulated tier behind its host pools (kvcache.host_tier), the
    tier holding the three shared prefixes to begin with (a first session served them, then the device
    and host pools forgot them): drawn from every policy above, a run with the tier comes up a few times
    in a hundred and rarely lives long enough for a page to come back from the tier."""

    @initialize(tier=st.sampled_from([0, 2]), first=FIRST, **SIZES)
    def setup(self, seqs, budget, pool_scale, host_scale, index_ratio, hot_rows, tier, first):
        self._setup("hisparse", seqs, budget, pool_scale, host_scale, True, index_ratio, hot_rows, False, tier)
        for p in self.prefixes:
            self.sent[self.engine.add_request(p, SamplingParams(1))] = self.steps
        while self.engine.has_unfinished():
            self.engine.step()
        self.engine.reset_prefix_cache()
        assert self.engine.tiers[0].tiers[0].keys()  # written through
        for r in first:
            self.arrive(**r)


SchedulerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
HiSparseTierMachine.TestCase.settings = SchedulerMachine.TestCase.settings
test_scheduler_state_machine = SchedulerMachine.TestCase
test_hisparse_behind_a_tier_state_machine = HiSparseTierMachine.TestCase


class _SwapsTwoPages(ContentRunner):
    """Fault injection: once, after a plan's transfers, the contents of two device pages of `group` that a
    row reads whole before its start change places, as if the pool served one page for the other."""

    group = "mla"
    swapped = False

    def _tokens(self, plan):
        n = self.tpb[self.group]
        for i, row in enumerate(plan.rows):
            pages = sorted({b for b in plan.block_tables[self.group][i][: row.start // n] if b >= 0})
            if not self.swapped and len(pages) >= 2:
                a, b = self._pages(self.group, pages[:2])
                self.dev[self.group][a], self.dev[self.group][b] = self.dev[self.group][b], self.dev[self.group][a]
                self.swapped = True
        return super()._tokens(plan)


@pytest.mark.parametrize("group", ["mla", "indexer"])
def test_wrong_page_is_caught(group):
    """The machine on a runner that swaps two pages' contents once fails on the token check (and nothing
    else), so the machine above would see a policy or a pool that serves a wrong page."""
    runner = type("Swaps", (_SwapsTwoPages,), {"group": group})
    machine = type("Faulty", (SchedulerMachine,), {"runner_class": runner})
    with pytest.raises(AssertionError, match="differ from the all-resident reference"):
        run_state_machine_as_test(machine, settings=settings(
            SchedulerMachine.TestCase.settings, max_examples=20, derandomize=True, database=None,
            phases=[Phase.generate]))
