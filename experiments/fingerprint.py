"""A behaviour fingerprint of the engine, for restructurings that must not change what it does.

    python -m experiments.fingerprint --out FILE.json        # then compare two FILEs: --compare A B

Runs the tiny model through fixed workloads under every KV policy (preempt and offload with small
pools, HiSparse over two turns with the device prefix cache dropped between them, sampling) and records
per run: the greedy / sampled tokens, a SHA-256 of every block-pool decision (allocate, free, touch,
cache, on the device pool and the host pools, in order), a SHA-256 of every pool's state after each
engine step (ref counts, free-queue order, hash index, generations), the scheduler counters, bytes
moved and the HiSparse page counters. Runs without think time, so nothing depends on the machine's
speed: two checkouts that behave alike write equal files. It uses the public API and BlockPool only,
so it runs on older checkouts too (set PYTHONPATH to the checkout).

The event hash also counts operations that cancel out within a step: the scheduler skips re-admitting
a request that did not fit while nothing it reads has changed (glm53.engine.scheduler), which drops
such a retry's touch / free pairs, not a state. So a checkout with that skip writes different event
hashes than one without, and equal state hashes, tokens and counters: compare such files with
`--compare A B --states` (the event hash and count are left out). `--verify-skips` runs every skipped
retry anyway and checks it changes nothing; its events then equal those of a checkout without the
skip.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

import numpy as np

KEYS = ("preemptions", "offloads", "recomputed_tokens", "d2h_bytes", "h2d_bytes", "prefix_hit_rate", "hot_hits",
        "hot_misses", "hisparse_h2d_rows", "host_pool_bytes_peak", "precopied_pages", "released_pages", "lost_pages",
        "staged_pages", "parked_index_pages", "restored_index_pages", "host_prefix_pages", "leases",
        "running_requests_mean_per_step", "residency_full_requests_mean", "residency_mixed_requests_mean",
        "residency_none_requests_mean", "kv_offload")


EVENT_KEYS = ("pool_history_sha256", "pool_events")  # left out by --compare --states


def _pool_state(pool) -> tuple:
    return (tuple(pool.ref_count), tuple(pool.free_queue), tuple(pool.block_key), tuple(pool.generation))


class _History:
    """Every BlockPool allocate / free / touch / cache call, pools numbered by first use; and the state of
    every pool (numbered by creation) after each engine step."""

    def __init__(self):
        from glm53.engine import engine
        from kvcache import block_pool

        self.events, self.pools = [], {}
        self.created, self.states = [], hashlib.sha256()
        init = block_pool.BlockPool.__init__

        def register(pool, *args, **kwargs):
            init(pool, *args, **kwargs)
            self.created.append(pool)

        block_pool.BlockPool.__init__ = register
        step = engine.Engine.step

        def stepped(eng, *args, **kwargs):
            out = step(eng, *args, **kwargs)
            for i, pool in enumerate(self.created):
                self.states.update(repr((i, _pool_state(pool))).encode())
            return out

        engine.Engine.step = stepped
        for op in ("allocate", "free", "touch", "cache"):
            orig = getattr(block_pool.BlockPool, op)

            def wrapped(pool, *args, _orig=orig, _op=op, **kwargs):
                out = _orig(pool, *args, **kwargs)
                blocks = out if _op == "allocate" else (args[1],) if _op == "cache" else args[0]
                self.events.append((self.pools.setdefault(id(pool), len(self.pools)), _op, tuple(int(b) for b in blocks)))
                return out

            setattr(block_pool.BlockPool, op, wrapped)

    def take(self) -> tuple[str, int, str]:
        out = (hashlib.sha256(repr(self.events).encode()).hexdigest(), len(self.events), self.states.hexdigest())
        self.events, self.pools = [], {}
        self.created, self.states = [], hashlib.sha256()
        return out


def run() -> dict:
    import glm53
    from glm53 import DeployConfig, Engine

    hist = _History()
    model = glm53.init("tiny", seed=0, std=0.1)
    out = {}

    def record(name, eng, outs):
        m = eng.metrics()
        sha, n, states = hist.take()
        out[name] = {"tokens": [o.token_ids.tolist() for o in outs], "pool_history_sha256": sha, "pool_events": n,
                     "pool_states_sha256": states,
                     **{k: m[k] for k in KEYS if k in m}, "steps": len(m["timeline"]["t_s"])}

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, n) for n in (37, 5, 70, 20)]
    base = dict(max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4, block_size=8)
    for name, kw in [("preempt_pool24_nocache", dict(num_gpu_blocks=24, enable_prefix_caching=False)),
                     ("preempt_pool24_cache", dict(num_gpu_blocks=24)),
                     ("swap_pool24", dict(num_gpu_blocks=24, enable_prefix_caching=False, kv_policy="swap",
                                          cpu_offload_bytes=1 << 30)),
                     ("swap_pool20_small_host", dict(num_gpu_blocks=20, kv_policy="swap", cpu_offload_bytes=60_000)),
                     ("offload_pool24", dict(num_gpu_blocks=24, enable_prefix_caching=False, kv_policy="offload",
                                             cpu_offload_bytes=1 << 30)),
                     ("offload_pool20_small_host", dict(num_gpu_blocks=20, kv_policy="offload", cpu_offload_bytes=60_000)),
                     ("roomy_pool", dict(num_gpu_blocks=64))]:
        hist.take()
        eng = Engine(model, DeployConfig(**base, **kw))
        record(name, eng, eng.generate(prompts, max_new_tokens=6))
    rng = np.random.default_rng(1)
    first = [rng.integers(0, 512, n) for n in (71, 55, 79, 45)]
    full = Engine(model, DeployConfig(**base, num_gpu_blocks=64))
    ref = [o.token_ids for o in full.generate(first, max_new_tokens=10)]
    second = [np.concatenate([p, o] + ([] if i % 2 == 0 else [rng.integers(0, 512, 5)]))
              for i, (p, o) in enumerate(zip(first, ref))]
    hisparse = dict(kv_policy="hisparse", hisparse_host_pool_bytes=1 << 26, cpu_offload_bytes=1 << 24, index_block_size=16)
    offload = dict(kv_policy="offload", cpu_offload_bytes=1 << 24)
    for name, kw, blocks in [("hisparse", hisparse, 48), ("hisparse", hisparse, 40), ("offload", offload, 40)]:
        hist.take()
        eng = Engine(model, DeployConfig(**base, **kw, num_gpu_blocks=blocks))
        outs = eng.generate(first, max_new_tokens=10)
        eng.scheduler.kv.pool.reset_prefix_cache()
        record(f"{name}_two_turns_pool{blocks}", eng, outs + eng.generate(second, max_new_tokens=10))
    hist.take()
    eng = Engine(model, DeployConfig(**base, num_gpu_blocks=30))
    record("sampling_pool30", eng, eng.generate(prompts, 5, greedy=False, temperature=0.8, top_p=0.9, seed=3))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the fingerprint here (JSON)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two fingerprint files")
    ap.add_argument("--states", action="store_true",
                    help="with --compare: leave out the event hash and count (both files need state hashes)")
    ap.add_argument("--verify-skips", action="store_true",
                    help="with --out: run the admission retries the scheduler skips anyway and check they change nothing")
    args = ap.parse_args(argv)
    if args.compare:
        a, b = (json.load(open(p)) for p in args.compare)
        diff = []
        for k in sorted(a.keys() | b.keys()):
            ra, rb = dict(a.get(k) or {}), dict(b.get(k) or {})
            if args.states:
                if "pool_states_sha256" not in ra or "pool_states_sha256" not in rb:
                    ap.error(f"--states: run {k!r} has no state hash in both files")
                for key in EVENT_KEYS:
                    ra.pop(key, None), rb.pop(key, None)
            fields = sorted(f for f in ra.keys() | rb.keys() if ra.get(f) != rb.get(f))
            if fields or k not in a or k not in b:
                diff.append(k)
            print(("DIFF " if k in diff else "same ") + k + (f"  ({', '.join(fields)})" if fields else ""))
        return 1 if diff else 0
    if not args.out:
        ap.error("give --out FILE or --compare A B")
    if args.verify_skips:
        from glm53.engine.scheduler import Scheduler

        Scheduler.verify_skipped_admissions = True
    res = run()
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {args.out}: {len(res)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
