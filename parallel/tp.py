"""Tensor parallelism (TP): attention heads and MLP widths split over the TP ranks of a mesh, as vLLM's
TP serves GLM-5.3 (BRIEF §3, §5).

The TP group is the mesh axes `AXES = ("tp", "cp")`: T = tp x cp ranks, rank index tp_idx * cp + cp_idx
(`jax.lax.axis_index(AXES)`). DCP reuses the TP ranks (vLLM: tp % dcp == 0): the context axis "cp" is
the inner DCP sub-group of D ranks that hold different KV shards, "tp" the T / D groups that hold the same
shard. Without DCP, cp = 1 and the whole group is "tp". TP with PCP is not built.

What each rank holds (`state_specs`; weights are [in, out]):

| weight | split | why |
|---|---|---|
| q_b_proj [Q, H (N+P)], kv_b_proj [R, H (N+V)] | columns, by head | column-parallel: a rank's heads |
| o_proj [H V, D] | rows, by head; one all-reduce (psum) | row-parallel over the heads |
| dense MLP and shared expert gate/up [D, F] / down [F, D] | columns / rows; one all-reduce | SwiGLU is per column |
| routed experts, `expert_parallel` | whole experts (EP over the TP ranks) | vLLM's EP inside the TP group |
| routed experts otherwise | each expert's width F (columns of gate/up, rows of down) | vLLM's TP MoE |
| q_a_proj, kv_a_proj_with_mqa, their norms, the indexer | replicated | latent KV, top-k: the same on every rank |
| router, norms, embeddings, lm_head, MTP's eh_proj | replicated | (vLLM splits the vocabulary; not built) |

A MoE layer sums its routed experts' part and its shared-expert part locally and all-reduces once. So
a decoder layer costs two all-reduces of [tokens, D] (o_proj, then the MLP or MoE), as in vLLM.

Padding (exact): heads are zero-padded to a multiple of T (the tiny model's 4 heads on 8 ranks) and
widths to a multiple of T. A padded head has zero q_b columns, zero kv_b columns and zero o_proj rows:
its attention output is multiplied by zero kv_b value columns and zero o_proj rows, so it adds exact
zeros. A padded MLP column has zero gate/up/down weights (silu(0) * 0 = 0). Padded experts (EP with
E % T != 0) are never routed to. The routed experts' stacked [gate | up] columns are interleaved per
rank ([g_0 u_0 | g_1 u_1 | ...]) when their width is split, so a rank's slice is again [gate | up].

KV: MLA's latent rows are computed from replicated weights, so every rank of a "tp" group writes the
same rows: the cache is replicated over "tp" and (under DCP) split over "cp"
(`parallel.cp_cache.CpKVCache(gather_queries=True, heads_split=True)`): attention all-gathers the
DCP group's query heads over "cp", attends the rows the rank owns, and the LSE merge's reduce-scatter
(`parallel.dcp.combine`, ag_rs or a2a) hands each rank its own heads back for its o_proj rows.

The model runs unchanged inside one `jax.shard_map` (`parallel.model.forward(tensor_parallel=True)`):
`local_modules` swaps each layer's o_proj, MLP down projection and MoE for their all-reducing forms and
gives MLA the local head count. Why shard_map rather than a sharded jit: DCP's merge needs explicit
collectives over the inner axis (query all-gather, LSE reduce-scatter) that the model code cannot ask
the partitioner for; the all-reduces sit exactly where vLLM has them; and the indexer's top-k stays
replicated code, never split by a partitioner that could change its tie order.

fp8 (block-quantised) weights: a weight's `*_scale_inv` blocks split with it (same kind, same axis), so
their layout and per-device bytes are defined when every rank's slice is whole 128 x 128 blocks and
nothing is padded (GLM-5.3 at TP8: 8 heads x 256 / 448 columns, MLP 1,536, expert width 256 per rank),
which `prepare_state` checks. The runner still refuses them (`check_weights`): the fp8 forward under TP
is not tested.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from glm53.layers import MLP, MoE

AXES = ("tp", "cp")  # the TP group: "tp" (ranks sharing a KV shard) x "cp" (the DCP sub-group)


def mesh_sizes(tp: int, dcp: int = 1) -> dict:
    """make_mesh sizes of one TP replica: {"tp": T / D, "cp": D} (DCP reuses the TP ranks)."""
    if tp < 1 or dcp < 1 or tp % dcp:
        raise ValueError(f"decode_context_parallel_size ({dcp}) must divide tensor_parallel_size ({tp})")
    return {"tp": tp // dcp, "cp": dcp}


def padded(n: int, tp: int) -> int:
    """n rounded up to a multiple of tp."""
    return -(-n // tp) * tp


def _names(path) -> list:
    return [getattr(p, "key", getattr(p, "name", None)) for p in path]


def _kind(path) -> str:
    """How a parameter splits: "heads_out" (column-parallel by head), "heads_in" (o_proj rows),
    "cols" / "rows" (MLP / shared expert), "experts_gate_up" / "experts_down" (routed), or "" (replicated)."""
    # an fp8 weight's block scales (`weight_scale_inv`, `gate_up_proj_scale_inv`, ...) split as the weight
    names = [k.removesuffix("_scale_inv") for k in _names(path) if isinstance(k, str)]
    if "indexer" in names:
        return ""
    if "self_attn" in names:
        if "q_b_proj" in names or "kv_b_proj" in names:
            return "heads_out"
        if "o_proj" in names:
            return "heads_in"
        return ""
    if "mlp" not in names:
        return ""
    if "experts" in names:
        return "experts_gate_up" if "gate_up_proj" in names else "experts_down" if "down_proj" in names else ""
    if "gate_proj" in names or "up_proj" in names:
        return "cols"
    if "down_proj" in names:
        return "rows"
    return ""  # the router


def check_weights(state) -> None:
    """Refuse weights TP does not split yet (block-quantised fp8: its 128 x 128 scale blocks would need
    splitting with the heads)."""
    for path, x in jax.tree_util.tree_leaves_with_path(state):
        if "float8" in str(x.dtype) or any(isinstance(k, str) and k.endswith("_scale_inv") for k in _names(path)):
            raise NotImplementedError(f"tensor parallelism of fp8 weights ({jax.tree_util.keystr(path)}) is not "
                                      "built: load the model in float (glm53.from_pretrained(..., fp8=False)) or "
                                      "serve it with tensor_parallel_size=1")


def prepare_state(state, cfg, tp: int, expert_parallel: bool):
    """Global weights laid out for `tp` ranks (see the module docstring): heads and widths zero-padded to
    multiples of tp, routed experts padded (EP) or their [gate | up] columns interleaved per rank."""
    h, hp = cfg.num_attention_heads, padded(cfg.num_attention_heads, tp)

    def pad_axis(x, axis, size):
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, size - x.shape[axis])
        return jnp.pad(x, widths)

    def one(path, x):
        kind = _kind(path)
        if kind and _is_fp8(path, x):
            return _fp8_layout(path, x, kind, cfg, tp, expert_parallel)
        if kind == "heads_out":  # [in, H * per_head]
            return pad_axis(x.reshape(x.shape[0], h, -1), 1, hp).reshape(x.shape[0], -1)
        if kind == "heads_in":  # [H * V, D]
            return pad_axis(x.reshape(h, -1, x.shape[-1]), 0, hp).reshape(-1, x.shape[-1])
        if kind == "cols":
            return pad_axis(x, 1, padded(x.shape[1], tp))
        if kind == "rows":
            return pad_axis(x, 0, padded(x.shape[0], tp))
        if kind.startswith("experts") and expert_parallel:
            return pad_axis(x, 0, padded(x.shape[0], tp))
        if kind == "experts_gate_up":  # [E, D, 2F] -> [E, D, (rank, gate|up, F/tp)]
            e, d, f2 = x.shape
            fp = padded(f2 // 2, tp)
            x = pad_axis(x.reshape(e, d, 2, f2 // 2), 3, fp).reshape(e, d, 2, tp, fp // tp)
            return x.transpose(0, 1, 3, 2, 4).reshape(e, d, 2 * fp)
        if kind == "experts_down":  # [E, F, D]
            return pad_axis(x, 1, padded(x.shape[1], tp))
        return x

    return jax.tree_util.tree_map_with_path(one, state)


def _is_fp8(path, x) -> bool:
    return "float8" in str(x.dtype) or any(isinstance(k, str) and k.endswith("_scale_inv") for k in _names(path))


def _split_axis(kind: str, expert_parallel: bool) -> int:
    """The axis `state_specs` splits a weight of `kind` on."""
    if kind.startswith("experts"):
        return 0 if expert_parallel else (2 if kind == "experts_gate_up" else 1)
    return 1 if kind in ("heads_out", "cols") else 0


def _fp8_layout(path, x, kind: str, cfg, tp: int, expert_parallel: bool):
    """`prepare_state` of an fp8 block-quantised leaf (values or scales): nothing may need padding and each
    rank's slice must be whole 128 x 128 blocks (a rank reads only its own scales); the routed experts'
    [gate | up] blocks are interleaved per rank like their columns. Raises NotImplementedError otherwise."""
    scale = any(isinstance(k, str) and k.endswith("_scale_inv") for k in _names(path))
    axis = _split_axis(kind, expert_parallel)
    parts = 2 if kind == "experts_gate_up" and not expert_parallel else 1  # [gate | up] split part by part
    n = x.shape[axis] // parts
    whole = expert_parallel and kind.startswith("experts")  # whole experts: any count that divides
    unit = 1 if scale or whole else 128  # a rank's slice of values: a multiple of the block
    padding = cfg.num_attention_heads % tp or cfg.intermediate_size % tp or cfg.moe_intermediate_size % tp
    if padding or n % (unit * tp):
        raise NotImplementedError(f"tensor parallelism of fp8 weight {jax.tree_util.keystr(path)} {list(x.shape)} "
                                  f"over {tp} ranks: its slices are not whole 128 x 128 blocks, or the model "
                                  "needs padding (not built for fp8)")
    if parts == 2:  # [E, D', 2F'] -> [E, D', (rank, gate|up, F'/tp)], as the float columns
        e, d, f2 = x.shape
        return x.reshape(e, d, 2, tp, f2 // 2 // tp).transpose(0, 1, 3, 2, 4).reshape(e, d, f2)
    return x


def state_specs(state, expert_parallel: bool, axes=AXES):
    """PartitionSpecs of a `prepare_state` state over the TP axes `axes`."""
    ax = tuple(axes)

    def spec(path, _):
        kind = _kind(path)
        if kind in ("heads_out", "cols"):
            return P(None, ax)
        if kind in ("heads_in", "rows"):
            return P(ax, None)
        if kind.startswith("experts"):
            if expert_parallel:
                return P(ax)
            return P(None, None, ax) if kind == "experts_gate_up" else P(None, ax, None)
        return P()

    return jax.tree_util.tree_map_with_path(spec, state)


def place_state(state, cfg, mesh, expert_parallel: bool):
    """The model's weights laid out (`prepare_state`) and put on `mesh` split over the TP axes, once."""
    check_weights(state)
    tp = math.prod(mesh.shape[a] for a in AXES)
    state = prepare_state(state, cfg, tp, expert_parallel)
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), state,
                        state_specs(state, expert_parallel))


def bytes_per_device(state, cfg, tp: int, expert_parallel: bool) -> int:
    """Bytes of weights one device of a TP replica holds (from shapes; no arrays are moved): the split
    weights' padded sizes / tp, plus every replicated weight."""
    shapes = jax.eval_shape(lambda s: prepare_state(s, cfg, tp, expert_parallel), state)
    specs = state_specs(shapes, expert_parallel)
    leaves = jax.tree.leaves(shapes)
    return int(sum(x.size * x.dtype.itemsize // (tp if any(s is not None for s in spec) else 1)
                   for x, spec in zip(leaves, jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P)))))


def bytes_on_each_device(state) -> dict:
    """{device: bytes of `state`'s arrays it holds} (placed arrays; each shard counted where it lives)."""
    out: dict = {}
    for x in jax.tree.leaves(state):
        for shard in x.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
    return out


# ------------------------------------------------------------------------------- inside the shard_map
class RowParallel:
    """A row-parallel projection: this rank's rows of the weight, then one all-reduce (psum) over the TP
    axes."""

    def __init__(self, linear, axes):
        self.linear, self.axes = linear, tuple(axes)

    def __call__(self, x):
        return jax.lax.psum(self.linear(x), self.axes)


class TensorParallelMoE:
    """A MoE layer under TP: the replicated router picks experts for every token (all ranks hold the same
    tokens); the rank applies its routed-expert part (its whole experts under EP, assignments to other
    ranks' experts weighing 0; else its slice of every expert's width) and its slice of the shared
    expert, and one all-reduce sums the ranks' parts."""

    def __init__(self, moe: MoE, axes, expert_parallel: bool):
        self.moe, self.axes, self.expert_parallel = moe, tuple(axes), expert_parallel

    def __call__(self, x_BTD):
        moe = self.moe
        x_ND = x_BTD.reshape(-1, x_BTD.shape[-1])
        idx_NK, w_NK = moe.gate(x_ND)
        if self.expert_parallel:
            e_local = moe.experts.gate_up_proj.shape[0]
            mine = idx_NK // e_local == jax.lax.axis_index(self.axes)
            idx_NK, w_NK = jnp.where(mine, idx_NK % e_local, 0), jnp.where(mine, w_NK, 0.0)
        y_ND = moe.experts(x_ND, idx_NK, w_NK)
        if moe.shared_experts is not None:
            y_ND = y_ND + moe.shared_experts(x_ND)
        return jax.lax.psum(y_ND, self.axes).reshape(x_BTD.shape)


def local_modules(model, *, expert_parallel: bool, axes=AXES):
    """Inside the shard_map, on a model merged from this rank's weights: give MLA the local head count
    and swap o_proj, the dense MLPs' down projections and the MoE layers for their all-reducing forms
    (main layers and MTP layers). Returns the model."""
    for layer in list(model.layers) + list(model.mtp):
        attn = layer.self_attn
        cfg = attn.cfg
        heads = attn.q_b_proj.weight.shape[-1] // cfg.qk_head_dim
        attn.cfg = dataclasses.replace(cfg, num_attention_heads=heads)
        attn.o_proj = RowParallel(attn.o_proj, axes)
        if isinstance(layer.mlp, MoE):
            layer.mlp = TensorParallelMoE(layer.mlp, axes, expert_parallel)
        elif isinstance(layer.mlp, MLP):
            layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, axes)
    return model

