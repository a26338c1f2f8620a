"""The communication formulas (parallel.comm) equal the bytes the implementation's collectives move.

The programs are only traced (jax.make_jaxpr over an AbstractMesh): no devices, no compilation.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType

from parallel import comm, dcp, layers, pcp
from parallel.mesh import AXES

H, R, P, HI, DI = 4, 16, 8, 2, 8
F32 = 4


def _mesh(n):
    return AbstractMesh((1, 1, n), AXES, axis_types=(AxisType.Auto,) * 3)


def _zeros(*shape, dtype=jnp.float32):
    return jnp.zeros(shape, dtype)


@pytest.mark.parametrize("n", [2, 8, 16])
@pytest.mark.parametrize("backend", dcp.BACKENDS)
def test_decode_bytes_match_the_formula(n, backend):
    b, t, blocks, bs, topk = 3, 2, 3, 4, 16
    mesh, layout = _mesh(n), dcp.DcpLayout(n, bs)
    local = (b * blocks + 1) * bs
    args = (_zeros(b, t, H, R), _zeros(b, t, H, P), _zeros(b, t, dtype=jnp.int32),
            _zeros(b, blocks, dtype=jnp.int32), _zeros(n * local, R + P))
    measured = comm.collective_bytes(lambda *a: layers.decode(mesh, *a, layout=layout, scale=1.0, backend=backend),
                                     *args, axis_sizes=mesh.shape)
    want = comm.dcp_decode_bytes(backend, n=n, tokens=b * t, heads=H, kv_lora=R, rope=P, q_bytes=F32, out_bytes=F32,
                                 lse_bytes=F32)
    assert measured["total"] == pytest.approx(want["total"]) and measured["count"] == want["collectives"]

    index_args = (_zeros(b, t, HI, DI), _zeros(b, t, HI), _zeros(n * local, DI))
    sparse = comm.collective_bytes(
        lambda *a: layers.decode(mesh, *a[:5], layout=layout, scale=1.0, backend=backend, index=(*a[5:], topk)),
        *args, *index_args, axis_sizes=mesh.shape)
    local_k = min(topk, blocks * bs)
    extra = comm.dcp_topk_merge_bytes(n=n, tokens=b * t, local_k=local_k)
    assert sparse["total"] == pytest.approx(want["total"] + extra)


@pytest.mark.parametrize("n", [2, 8])
def test_prefill_bytes_match_the_formula(n):
    length = 5 * n + 3
    split = pcp.PcpSplit(length, n)
    mesh = _mesh(n)
    s = split.padded_length + 10
    args = (_zeros(length, H, R), _zeros(length, H, P), _zeros(length, HI, DI), _zeros(length, HI),
            _zeros(length, R + P), _zeros(length, DI), _zeros(s, R + P), _zeros(s, DI))
    measured = comm.collective_bytes(lambda *a: layers.prefill_layer(mesh, split, *a, topk=4, scale=1.0, block=4),
                                     *args, axis_sizes=mesh.shape)
    want = comm.pcp_prefill_bytes(n=n, new_tokens=split.padded_length, row_bytes=(R + P) * F32, key_bytes=DI * F32)
    assert measured["total"] == pytest.approx(want) and measured["count"] == 4  # rows, keys and their positions

    # PCP x DCP: the same new-token gather, plus the temporary full copy gathered from the shards
    layout = dcp.DcpLayout(n, 4)
    blocks = -(-(10 + split.padded_length) // layout.virtual_block)
    local = (blocks + 1) * 4
    dargs = args[:6] + (np.arange(blocks, dtype=np.int32), _zeros(n * local, R + P), _zeros(n * local, DI))
    measured = comm.collective_bytes(
        lambda *a: layers.pcp_dcp_prefill(mesh, split, *a, layout=layout, start=10, topk=4, scale=1.0, block=4),
        *dargs, axis_sizes=mesh.shape)
    # the copy gathers the request's own blocks (blocks x 4 local slots), not the whole table of `local`
    want += comm.dcp_full_copy_bytes(n=n, local_slots=blocks * 4, row_bytes=(R + P) * F32, key_bytes=DI * F32)
    assert measured["total"] == pytest.approx(want) and measured["count"] == 6


def test_glm53_decode_volumes():
    """GLM-5.3 under DCP8 (64 heads, latent 512, rope 64; 8 heads per rank), one decode token per layer.

    Two independent references for `comm.dcp_decode_bytes`: the collectives of the real `layers.decode`
    traced at GLM-5.3's widths (bf16 queries; this implementation merges float32 outputs and LSEs), part
    by part, and the published bf16-output volumes of docs/parallel.md, derived by hand below."""
    n, h, r, p = 8, 64, 512, 64
    mesh, layout = _mesh(n), dcp.DcpLayout(n, 64)
    args = (_zeros(1, 1, h, r, dtype=jnp.bfloat16), _zeros(1, 1, h, p, dtype=jnp.bfloat16),
            _zeros(1, 1, dtype=jnp.int32), _zeros(1, 1, dtype=jnp.int32), _zeros(n * 64, r + p))
    for backend, parts in (("ag_rs", {"query_all_gather": "all_gather", "lse_all_gather": "all_gather",
                                      "output_reduce_scatter": "reduce_scatter"}),
                           ("a2a", {"query_all_gather": "all_gather", "output_all_to_all": "all_to_all"})):
        measured = comm.collective_bytes(
            lambda *a, backend=backend: layers.decode(mesh, *a, layout=layout, scale=1.0, backend=backend),
            *args, axis_sizes=mesh.shape)
        want = comm.dcp_decode_bytes(backend, n=n, tokens=1, heads=h, kv_lora=r, rope=p, q_bytes=2, out_bytes=4,
                                     lse_bytes=4)
        by_kind = {}
        for part, kind in parts.items():
            by_kind[kind] = by_kind.get(kind, 0) + want[part]
        assert {k: measured[k] for k in by_kind} == pytest.approx(by_kind), backend
        assert measured["total"] == pytest.approx(want["total"]) and measured["count"] == want["collectives"]

    # Published (docs/parallel.md, bf16 queries and outputs, fp32 LSE). Each rank sends:
    # ag_rs: its 8 heads x (512 + 64) bf16 query values to 7 ranks: 7 * 8 * 576 * 2 = 64,512 B; its 64 fp32
    #        LSEs to 7 ranks: 1,792 B; all but its own 1/8 of the 64 x 512 bf16 outputs: 57,344 B -> 123,648 B.
    # a2a:   the same query all-gather, then 7/8 of 64 x (512 bf16 + one fp32 LSE) = 7/8 * 64 * 1,028 =
    #        57,568 B -> 122,080 B.
    ag = comm.dcp_decode_bytes("ag_rs", n=8, tokens=1, heads=64, kv_lora=512, rope=64)
    a2a = comm.dcp_decode_bytes("a2a", n=8, tokens=1, heads=64, kv_lora=512, rope=64)
    assert (ag["total"], a2a["total"]) == (123_648, 122_080)
    assert (ag["collectives"], a2a["collectives"]) == (3, 2)
    with pytest.raises(ValueError, match="backend"):
        comm.dcp_decode_bytes("ring", n=8, tokens=1, heads=64, kv_lora=512, rope=64)
