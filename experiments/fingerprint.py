"""A behaviour fingerprint of the engine, for restructurings that must not change what it does.

    python -m experiments.fingerprint --out FILE.json        # then compare two FILEs: --compare A B

Runs the tiny model through fixed workloads under every KV policy (preempt and offload with small
pools, HiSparse over two turns with the device prefix cache dropped between them, sampling) and records
per run: the greedy / sampled tokens, a SHA-256 of every block-pool decision (allocate, free, touch,
cache, on the device pool and the host pools, in order), the scheduler counters, bytes moved and the
HiSparse page counters. Runs without think time, so nothing depends on the machine's speed: two
checkouts that behave alike write equal files. It uses the public API and BlockPool only, so it runs
on older checkouts too (set PYTHONPATH to the checkout).
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
        "running_requests_mean", "residency_full_requests_mean", "residency_mixed_requests_mean",
        "residency_none_requests_mean")


class _History:
    """Every BlockPool allocate / free / touch / cache call, pools numbered by first use."""

    def __init__(self):
        from kvcache import block_pool

        self.events, self.pools = [], {}
        for op in ("allocate", "free", "touch", "cache"):
            orig = getattr(block_pool.BlockPool, op)

            def wrapped(pool, *args, _orig=orig, _op=op, **kwargs):
                out = _orig(pool, *args, **kwargs)
                blocks = out if _op == "allocate" else (args[1],) if _op == "cache" else args[0]
                self.events.append((self.pools.setdefault(id(pool), len(self.pools)), _op, tuple(int(b) for b in blocks)))
                return out

            setattr(block_pool.BlockPool, op, wrapped)

    def take(self) -> tuple[str, int]:
        out = (hashlib.sha256(repr(self.events).encode()).hexdigest(), len(self.events))
        self.events, self.pools = [], {}
        return out


def run() -> dict:
    import glm53
    from glm53 import DeployConfig, Engine

    hist = _History()
    model = glm53.init("tiny", seed=0, std=0.1)
    out = {}

    def record(name, eng, outs):
        m = eng.metrics()
        sha, n = hist.take()
        out[name] = {"tokens": [o.token_ids.tolist() for o in outs], "pool_history_sha256": sha, "pool_events": n,
                     **{k: m[k] for k in KEYS if k in m}, "steps": len(m["timeline"]["t_s"])}

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, n) for n in (37, 5, 70, 20)]
    base = dict(max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4, block_size=8)
    for name, kw in [("preempt_pool24_nocache", dict(num_gpu_blocks=24, enable_prefix_caching=False)),
                     ("preempt_pool24_cache", dict(num_gpu_blocks=24)),
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
    for blocks in (48, 40):
        hist.take()
        eng = Engine(model, DeployConfig(**base, **hisparse, num_gpu_blocks=blocks))
        outs = eng.generate(first, max_new_tokens=10)
        eng.scheduler.kv.pool.reset_prefix_cache()
        record(f"hisparse_two_turns_pool{blocks}", eng, outs + eng.generate(second, max_new_tokens=10))
    hist.take()
    eng = Engine(model, DeployConfig(**base, num_gpu_blocks=30))
    record("sampling_pool30", eng, eng.generate(prompts, 5, greedy=False, temperature=0.8, top_p=0.9, seed=3))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the fingerprint here (JSON)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two fingerprint files")
    args = ap.parse_args(argv)
    if args.compare:
        a, b = (json.load(open(p)) for p in args.compare)
        diff = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
        for k in sorted(a.keys() | b.keys()):
            print(("DIFF " if k in diff else "same ") + k)
        return 1 if diff else 0
    if not args.out:
        ap.error("give --out FILE or --compare A B")
    res = run()
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {args.out}: {len(res)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
