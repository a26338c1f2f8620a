"""Device check for HiSparse's riskiest step: copying the selected rows from a pinned_host pool inside a
jitted step must move only those rows, never the pool (BRIEF §6, JAX note).

    python -m experiments.check_hisparse_copy --out results/check_hisparse_copy      # on the GPU machine
    python -m experiments.check_hisparse_copy --host-pool-mb 64 --out /tmp/check     # CPU: semantics only

What it does, per run:
1. builds a host pool of `--host-pool-mb` MB of 656-byte fp8_ds_mla rows (as 164 uint32 words) in the
   `pinned_host` memory kind and a device table;
2. times the jitted `take_host_rows` + scatter of `rows` random rows for several row counts, and the
   same step that instead moves the whole pool (`device_put(pool)[idx]`, the legal but wrong way);
3. checks that every copied row equals the host row (bit-exact);
4. runs the resolver's Pallas kernel against the reference on one shape (interpret mode off a GPU);
5. on a GPU only, times the resolver (reference vs kernel) at GLM-5.3's sizes (`resolver_glm53`): the
   kernel runs one program per request, and this says whether that is fast enough.

If only the selected rows cross the link, the copy's time is flat in the pool size and tiny next to the
whole-pool variant (a 1 GB pool at ~50 GB/s is ~20 ms); on CPU both memories are the same RAM, so the
times say nothing and the JSON says so. Saves results.json with the date and the machine.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from attention.common import on_gpu
from attention.hisparse import HotBuffer, resolve_pallas, resolve_reference
from kvcache.host import take_host_rows
from experiments.common import cpu_name, git_revision

WORDS = 164  # one fp8_ds_mla row: 656 bytes


@jax.jit
def _copy_selected(device_table, host_table, src, dst):
    return device_table.at[dst].set(take_host_rows(host_table, src))


@jax.jit
def _copy_whole_pool(device_table, pool_on_device, src, dst):
    return device_table.at[dst].set(pool_on_device[src])


def _median_s(fn, repeats: int = 5) -> float:
    fn()  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def check_copy(host_pool_mb: int, row_counts=(128, 2048, 16384), seed: int = 0) -> dict:
    """Copy `row_counts` random rows of a host pool of `host_pool_mb` MB into a device table, timed
    against moving the whole pool; each copy is checked bit-exact."""
    dev = jax.devices()[0]
    host_s = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    dev_s = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    n_host = host_pool_mb * (1 << 20) // (WORDS * 4)
    rng = np.random.default_rng(seed)
    host_np = rng.integers(0, 2**32, (n_host, WORDS), dtype=np.uint32)
    host = jax.device_put(host_np, host_s)
    row_counts = sorted({min(n, n_host) for n in row_counts})
    n_dev = max(row_counts)
    out = {"host_pool_bytes": int(host_np.nbytes), "rows": []}
    for n in row_counts:
        src = jnp.asarray(rng.choice(n_host, n, replace=False).astype(np.int32))
        dst = jnp.asarray(rng.permutation(n_dev)[:n].astype(np.int32))
        table = jnp.zeros((n_dev, WORDS), jnp.uint32)
        got = np.asarray(_copy_selected(table, host, src, dst))
        exact = bool(np.array_equal(got[np.asarray(dst)], host_np[np.asarray(src)]))
        t_sel = _median_s(lambda: _copy_selected(table, host, src, dst).block_until_ready())
        t_all = _median_s(lambda: _copy_whole_pool(table, jax.device_put(host, dev_s), src, dst).block_until_ready())
        out["rows"].append({"rows": n, "bytes_selected": n * WORDS * 4, "exact": exact, "selected_copy_s": t_sel,
                            "whole_pool_copy_s": t_all,
                            "selected_GB_s": n * WORDS * 4 / t_sel / 1e9})
    return out


def check_resolver(seed: int = 0, b: int = 4, k: int = 64, h: int = 128, m: int = 64, block: int = 16) -> dict:
    rng = np.random.default_rng(seed)
    hot = HotBuffer.create((np.arange(b * h) + 10_000).reshape(b, h))
    hot_p = hot
    mismatches = 0
    for step in range(5):
        dev = np.where(rng.random((b, m)) < 0.3, rng.integers(0, 500, (b, m)), -1).astype(np.int32)
        dev[:, -2:] = rng.integers(0, 500, (b, 2))
        host = rng.integers(0, 5000, (b, m)).astype(np.int32)
        sel = np.stack([rng.choice(m * block, k, replace=False) for _ in range(b)]).astype(np.int32)
        plan_r, hot = resolve_reference(sel, dev, host, block, hot, step)
        plan_p, hot_p = resolve_pallas(sel, dev, host, block, hot_p, step)
        for a, c in zip(jax.tree.leaves((plan_r, hot)), jax.tree.leaves((plan_p, hot_p))):
            mismatches += int(np.sum(np.asarray(a) != np.asarray(c)))
    return {"shape": {"b": b, "k": k, "h": h, "m": m, "block": block}, "steps": 5, "mismatched_ints": mismatches,
            "pallas_mode": "compiled" if on_gpu() else "interpret"}


def time_resolver(b: int = 4, k: int = 2048, h: int = 4096, m: int = 2048, block: int = 64, seed: int = 0) -> dict:
    """Seconds per call of the jitted resolver at GLM-5.3's sizes (top-k 2048, 2x hot slots, 128K context in
    64-token pages), reference vs Pallas kernel, on a half-resident context with a warm hot buffer. GPU
    only: in interpret mode on CPU the kernel at this size takes minutes and the time means nothing."""
    rng = np.random.default_rng(seed)
    dev = np.where(rng.random((b, m)) < 0.5, rng.integers(0, b * m, (b, m)), -1).astype(np.int32)
    host = rng.integers(0, b * m, (b, m)).astype(np.int32)
    sel = jnp.asarray(np.stack([rng.choice(m * block, k, replace=False) for _ in range(b)]).astype(np.int32))
    hot = HotBuffer(jnp.asarray(np.stack([rng.choice(m * block, h, replace=False) for _ in range(b)]).astype(np.int32)),
                    jnp.asarray(rng.integers(0, 100, (b, h)).astype(np.int32)),
                    jnp.asarray((np.arange(b * h) + 10_000).reshape(b, h).astype(np.int32)))
    out = {"shape": {"b": b, "k": k, "h": h, "m": m, "block": block}}
    for name, fn in (("reference", resolve_reference), ("pallas", resolve_pallas)):
        run = jax.jit(lambda s, d, hs, hb, fn=fn: fn(s, d, hs, block, hb, 100))
        args = (sel, jnp.asarray(dev), jnp.asarray(host), hot)
        out[f"{name}_s"] = _median_s(lambda: jax.block_until_ready(run(*args)), repeats=20)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m experiments.check_hisparse_copy", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host-pool-mb", type=int, default=1024)
    ap.add_argument("--out", default="out/check_hisparse_copy")
    args = ap.parse_args(argv)
    res = {"date": time.strftime("%Y-%m-%d"), "git_revision": git_revision(),
           "machine": {"cpu": cpu_name(), "device": str(jax.devices()[0]), "backend": jax.default_backend()},
           "times_meaningful": on_gpu(),
           "copy": check_copy(args.host_pool_mb), "resolver": check_resolver()}
    if on_gpu():
        res["resolver_glm53"] = time_resolver()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(res, indent=1))
    ok = all(r["exact"] for r in res["copy"]["rows"]) and res["resolver"]["mismatched_ints"] == 0
    for r in res["copy"]["rows"]:
        print(f"rows {r['rows']:6d}: selected {r['selected_copy_s'] * 1e3:8.3f} ms  whole pool "
              f"{r['whole_pool_copy_s'] * 1e3:8.3f} ms  exact {r['exact']}")
    if "resolver_glm53" in res:
        t = res["resolver_glm53"]
        print(f"resolver at GLM-5.3 sizes: reference {t['reference_s'] * 1e3:.3f} ms, pallas {t['pallas_s'] * 1e3:.3f} ms")
    print(f"resolver pallas vs reference: {res['resolver']['mismatched_ints']} mismatched ints "
          f"({res['resolver']['pallas_mode']}); {'OK' if ok else 'FAILED'}")
    if not ok:
        raise SystemExit(1)
    return res


if __name__ == "__main__":
    main()
