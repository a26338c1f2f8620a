"""One process of a multi-process DCP / PCP run (started by `parallel.launch`; see test_mesh.py).

    python -m parallel.launch --processes 2 --local-devices 4 -- python tests/parallel/multihost_worker.py OUT

Every process joins the run (`parallel.mesh.init_distributed`), builds one mesh over all processes'
devices (cp = total device count), builds the same global inputs from a fixed seed, runs sparse DCP
decode with both comm backends and a PCP prefill layer, and gathers the results to every process.
Process 0 writes OUT/results.npz; every process prints one line "process I of P on MESH: done" and, with
--check-reference, its max error against the single-device reference (parallel.reference).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, when run as a script

from parallel.mesh import init_distributed


def main(out_dir: str, check_reference: bool = False) -> None:
    init_distributed()
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from parallel import dcp, layers, pcp, reference
    from parallel.mesh import describe, make_mesh

    jax.config.update("jax_default_matmul_precision", "highest")
    n = jax.device_count()
    mesh = make_mesh(cp=n)
    rng = np.random.default_rng(0)
    b, t, h, r, p, hi, di, bs, blocks, topk, scale = 2, 1, 4, 16, 8, 2, 8, 4, 2, 6, 0.25

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    layout = dcp.DcpLayout(n, bs)
    cap = blocks * layout.virtual_block
    seq = np.array([cap, 5])
    q_pos = (seq - 1)[:, None].astype(np.int32)
    table = np.arange(b * blocks, dtype=np.int32).reshape(b, blocks)
    rows, keys = normal(b, cap, r + p), normal(b, cap, di)
    q_lat, q_pe, qi, w = normal(b, t, h, r), normal(b, t, h, p), normal(b, t, hi, di), normal(b, t, hi)

    def global_rows(x_BSX):  # per-rank DCP tables as one global array sharded over cp
        tables = dcp.shard_cache(x_BSX, seq, table, layout, b * blocks).reshape(-1, x_BSX.shape[-1])
        return jax.make_array_from_callback(tables.shape, NamedSharding(mesh, P("cp")), lambda idx: tables[idx])

    def fetch(x):
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))

    results, errors = {}, []
    for backend in dcp.BACKENDS:
        res = layers.decode(mesh, q_lat, q_pe, q_pos, table, global_rows(rows), layout=layout, scale=scale,
                            backend=backend, index=(qi, w, global_rows(keys), topk))
        results[f"decode_{backend}_out"], results[f"decode_{backend}_topk"] = fetch(res.out), fetch(res.topk)
    if check_reference:
        want = reference.decode(q_lat, q_pe, q_pos, rows, scale=scale, index=(qi, w, keys, topk))
        for backend in dcp.BACKENDS:
            errors.append(np.abs(results[f"decode_{backend}_out"] - want[0]).max())
            errors.append(float(not np.array_equal(results[f"decode_{backend}_topk"], want[2])))

    length = 3 * n + 1  # not a multiple of 2N
    split = pcp.PcpSplit(length, n)
    s = split.padded_length
    d = {"q_lat": normal(length, h, r), "q_pe": normal(length, h, p), "qi": normal(length, hi, di),
         "w": normal(length, hi), "rows": normal(s, r + p), "keys": normal(s, di)}
    res = layers.prefill_layer(mesh, split, d["q_lat"], d["q_pe"], d["qi"], d["w"], d["rows"][:length],
                               d["keys"][:length], jnp.zeros((s, r + p)), jnp.zeros((s, di)), topk=topk, scale=scale,
                               block=4)
    results["prefill_out"], results["prefill_topk"] = fetch(res.out), fetch(res.topk)
    if check_reference:
        full_rows, full_keys = d["rows"].copy(), d["keys"].copy()
        full_rows[length:], full_keys[length:] = 0, 0
        want = reference.prefill(d["q_lat"], d["q_pe"], d["qi"], d["w"], full_rows, full_keys, np.arange(length),
                                 topk=topk, scale=scale)
        errors.append(np.abs(results["prefill_out"] - want[0]).max())
        errors.append(float(not np.array_equal(results["prefill_topk"], want[2])))

    if jax.process_index() == 0:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        np.savez(Path(out_dir) / "results.npz", **results)
    check = f"; max error vs one device {max(errors):.3g}" if check_reference else ""
    print(f"process {jax.process_index()} of {jax.process_count()} on {describe(mesh)}: done{check}", flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], check_reference="--check-reference" in sys.argv[2:])
