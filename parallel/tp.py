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

fp8 (block-quantised) weights (`glm53.from_pretrained(dir, quantization="fp8")`): each rank holds its
slice of the fp8 values and the scales of exactly those values. A weight's `*_scale_inv` splits with it
(same kind, same axis). Where a rank's slice is whole 128 x 128 blocks (GLM-5.3 at TP8, 8 heads per rank:
q_b 2,048 and kv_b 3,584 columns, o_proj 2,048 rows, MLP 1,536, expert width 256) the rank's layer is an ordinary
`Fp8Linear` / `Fp8Experts`. Where a 128-block straddles a rank boundary (the tiny model's 192 q_b
columns, 96 per rank at TP2), the scales are re-blocked along the split axis at gcd(128, slice width)
(`fine_block`: each fine block carries its checkpoint block's scale; `_fp8_linear_layout`) and the layer
runs as an `Fp8Slice`: a column split dequantises exactly the one-device weight's columns; a row split's
128-value activation group may straddle ranks too, so its scale comes from the group's maxima
all-gathered over the TP axes. Both equal the one-device layer (the columns bit for bit, the all-reduced
rows to float32 summation order). Routed experts split by width must be whole blocks per rank (else
NotImplementedError naming the sizes: use EP, which splits whole experts).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from attention import fp8_matmul
from attention.formats import FP8, FP8_MAX, SCALE_FLOOR, dequantize_fp8, quantize_fp8
from glm53.layers import MLP, Fp8Linear, MoE

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


def check_weights(state, cfg, tp: int, expert_parallel: bool) -> None:
    """Raise NotImplementedError, naming the weight and its sizes, for weights TP cannot split (fp8 routed
    experts split by width where a rank's slice is not whole 128 x 128 blocks), from shapes alone: before
    the runner allocates anything."""
    jax.eval_shape(lambda s: prepare_state(s, cfg, tp, expert_parallel), state)


def _float_layout(x, kind: str, cfg, tp: int, expert_parallel: bool):
    """`prepare_state` of a float leaf (or of an fp8 leaf's values / per-row or per-column scales, which
    lay out like the float weight: see `_fp8_linear_layout`)."""
    h, hp = cfg.num_attention_heads, padded(cfg.num_attention_heads, tp)
    if kind == "heads_out":  # [in, H * per_head]
        return _pad_axis(x.reshape(x.shape[0], h, -1), 1, hp).reshape(x.shape[0], -1)
    if kind == "heads_in":  # [H * V, D]
        return _pad_axis(x.reshape(h, -1, x.shape[-1]), 0, hp).reshape(-1, x.shape[-1])
    if kind == "cols":
        return _pad_axis(x, 1, padded(x.shape[1], tp))
    if kind == "rows":
        return _pad_axis(x, 0, padded(x.shape[0], tp))
    if kind.startswith("experts") and expert_parallel:
        return _pad_axis(x, 0, padded(x.shape[0], tp))
    if kind == "experts_gate_up":  # [E, D, 2F] -> [E, D, (rank, gate|up, F/tp)]
        e, d, f2 = x.shape
        fp = padded(f2 // 2, tp)
        x = _pad_axis(x.reshape(e, d, 2, f2 // 2), 3, fp).reshape(e, d, 2, tp, fp // tp)
        return x.transpose(0, 1, 3, 2, 4).reshape(e, d, 2 * fp)
    if kind == "experts_down":  # [E, F, D]
        return _pad_axis(x, 1, padded(x.shape[1], tp))
    return x


def _pad_axis(x, axis, size):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return _xp(x).pad(x, widths)


def _xp(x):
    """numpy for host arrays (a host-loaded model is laid out on the host: nothing lands on a device
    before its shard), jax.numpy otherwise (device arrays, and tracers under jax.eval_shape)."""
    return np if isinstance(x, np.ndarray) else jnp


def prepare_state(state, cfg, tp: int, expert_parallel: bool):
    """Global weights laid out for `tp` ranks (see the module docstring): heads and widths zero-padded to
    multiples of tp, routed experts padded (EP) or their [gate | up] columns interleaved per rank; fp8
    linear layers' scales re-blocked so that every rank's slice is whole blocks (`_fp8_linear_layout`)."""
    leaves = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(state)}

    def one(path, x):
        kind = _kind(path)
        if kind and _is_fp8(path, x):
            if kind.startswith("experts"):
                return _fp8_experts_layout(path, x, kind, cfg, tp, expert_parallel)
            if _is_scale(path):  # its weight: the sibling without the suffix
                weight = leaves[jax.tree_util.keystr(path).replace("_scale_inv'", "'")]
                return _fp8_linear_layout(x, weight.shape, kind, cfg, tp)
        return _float_layout(x, kind, cfg, tp, expert_parallel)

    return jax.tree_util.tree_map_with_path(one, state)


def _is_scale(path) -> bool:
    return any(isinstance(k, str) and k.endswith("_scale_inv") for k in _names(path))


def _is_fp8(path, x) -> bool:
    return "float8" in str(x.dtype) or _is_scale(path)


def _split_axis(kind: str, expert_parallel: bool) -> int:
    """The axis `state_specs` splits a weight of `kind` on."""
    if kind.startswith("experts"):
        return 0 if expert_parallel else (2 if kind == "experts_gate_up" else 1)
    return 1 if kind in ("heads_out", "cols") else 0


def fine_block(n_local: int) -> int:
    """The scale block edge along a split axis whose per-rank slice is `n_local` wide: gcd(128, n_local).
    It divides 128, so each fine block lies inside one checkpoint block (whose scale it carries), and it
    divides n_local, so every rank's slice is whole fine blocks. 128 when n_local is a multiple of 128."""
    return math.gcd(fp8_matmul.BLOCK, n_local)


def _fp8_linear_layout(scale, weight_shape, kind: str, cfg, tp: int):
    """The TP layout of an fp8 linear layer's 128 x 128 block scales [ceil(K/128), ceil(N/128)], split
    like its weight [K, N] (whose fp8 values lay out exactly like a float weight: `_float_layout`).

    A 128-block may straddle a rank boundary (the tiny model's q_b: 192 columns, 96 per rank at TP2; GLM-5.3
    at TP8 has none). Exact answer: along the split axis the scales are re-blocked at `fine_block` of the
    rank's slice (each fine block repeats its checkpoint block's scale), the other axis keeps its 128-blocks.
    So rank r holds its values and the fine scales of exactly those values; the dequantised weight is the
    one-device weight's slice, bit for bit. Padding (heads, widths) adds zero values under zero scales."""
    b = fp8_matmul.BLOCK
    axis = _split_axis(kind, False)
    k, n = weight_shape
    per_value = _xp(scale).repeat(scale, b, axis=axis)  # scale of each value along the split axis
    per_value = per_value[:, :n] if axis == 1 else per_value[:k]
    per_value = _float_layout(per_value, kind, cfg, tp, False)  # padded and permuted like the values
    c = fine_block(per_value.shape[axis] // tp)
    return per_value[:, ::c] if axis == 1 else per_value[::c]


def _fp8_experts_layout(path, x, kind: str, cfg, tp: int, expert_parallel: bool):
    """`prepare_state` of fp8 routed experts (values or scales). Under EP whole experts split (padded
    experts: zero values, never routed to). Split by width, each rank's slice of every expert must be
    whole 128 x 128 blocks (its [gate | up] blocks interleaved per rank like the float columns): else
    NotImplementedError naming the sizes."""
    if expert_parallel:
        return _pad_axis(x, 0, padded(x.shape[0], tp))
    f = cfg.moe_intermediate_size
    b = fp8_matmul.BLOCK
    if f % (b * tp):
        raise NotImplementedError(
            f"tensor parallelism of fp8 routed experts {jax.tree_util.keystr(path)} split by width: "
            f"moe_intermediate_size {f} over {tp} ranks gives {f / tp:g} columns per rank, not whole "
            f"{b} x {b} blocks (a block would straddle ranks, and the down projection's activation groups "
            f"with it); use enable_expert_parallel=True (whole experts per rank), or a tensor_parallel_size "
            f"that divides {f} into multiples of {b}")
    if kind == "experts_gate_up":  # [E, D', 2F'] -> [E, D', (rank, gate|up, F'/tp)], as the float columns
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
    """The model's weights laid out (`prepare_state`) and put on `mesh` split over the TP axes, once.
    Host (numpy) weights are laid out on the host and each device receives only its shard; device
    weights are laid out on the device that holds them (the whole model there first)."""
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


class Fp8Slice:
    """This rank's slice of an fp8 linear layer whose checkpoint blocks straddle the rank boundaries: its
    scales are fine blocks along the split axis (`_fp8_linear_layout`). The product is the one-device
    layer's "dequant" form restricted to the rank's values, so it is exact:
    - split "cols" (q_b, kv_b, gate/up): the activations are whole on every rank and quantised as on one
      device; the weight dequantises to the one-device weight's columns;
    - split "rows" (o_proj, down): the rank holds x's slice [..., K/T], and a 128-value activation group
      may straddle ranks. Its scale is the group's max |x| over the ranks that hold it: each rank's maxima
      per fine group are all-gathered over the TP axes (T x K/T / fine_block floats per token), so every
      rank quantises its values with the one-device scale. The caller all-reduces the partial products.
    Only the "dequant" form is built here, and "auto" and "pallas" run it too (on a GPU too: the Pallas
    kernel multiplies whole 128 x 128 blocks); the "reference" block GEMM under straddling blocks raises
    NotImplementedError."""

    def __init__(self, linear: Fp8Linear, split: str, axes):
        if fp8_matmul.resolve_impl(linear.impl) == "reference":
            raise NotImplementedError(
                f"tensor parallelism of an fp8 layer whose 128 x 128 blocks straddle the ranks (weight "
                f"{list(linear.weight.shape)}) with fp8 impl {linear.impl!r}: only 'auto' / 'dequant' is built")
        self.linear, self.split, self.axes = linear, split, tuple(axes)

    def _weight(self):
        """The dequantised slice, float32 [K', N']: each value times its (fine) block's scale."""
        q, scale = self.linear.weight[...], self.linear.weight_scale_inv[...]
        k, n = q.shape
        bk = k // scale.shape[0] if self.split == "rows" else fp8_matmul.BLOCK
        bn = n // scale.shape[1] if self.split == "cols" else fp8_matmul.BLOCK
        per_value = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), bk, axis=0), bn, axis=1)[:k, :n]
        return q.astype(jnp.float32) * per_value

    def matrix(self):
        return self._weight().astype(self.linear.dtype)

    def _activations(self, x):
        """x [..., K'] -> its fp8 quantisation, dequantised to float32 (the one-device layer's numbers)."""
        if self.split == "cols":
            return dequantize_fp8(*quantize_fp8(x))
        x = x.astype(jnp.float32)
        kl = x.shape[-1]
        c = fine_block(kl)
        per = fp8_matmul.BLOCK // c  # fine groups per activation group
        amax = jnp.max(jnp.abs(x.reshape(x.shape[:-1] + (kl // c, c))), axis=-1)  # [..., K'/c]
        every = jax.lax.all_gather(amax, self.axes, axis=amax.ndim - 1, tiled=True)  # [..., T K'/c]
        groups = -(-every.shape[-1] // per)
        every = _pad_axis(every, every.ndim - 1, groups * per).reshape(every.shape[:-1] + (groups, per))
        scale = jnp.maximum(jnp.max(every, axis=-1), SCALE_FLOOR) / FP8_MAX  # [..., groups]
        mine = (jax.lax.axis_index(self.axes) * (kl // c) + jnp.arange(kl // c)) // per  # each fine group's group
        scale = jnp.repeat(jnp.take(scale, mine, axis=-1), c, axis=-1)  # [..., K']
        q = jnp.clip(x / scale, -FP8_MAX, FP8_MAX).astype(FP8)
        return q.astype(jnp.float32) * scale

    def __call__(self, x):
        w = self._weight()
        xd = self._activations(x)
        y = jnp.dot(xd.reshape(-1, x.shape[-1]), w, preferred_element_type=jnp.float32)
        return y.reshape(x.shape[:-1] + (w.shape[-1],)).astype(x.dtype)


def _columns(linear, axes):
    """A column-split layer as the rank runs it: an fp8 one whose slice is not whole 128-blocks as an
    `Fp8Slice`; anything else unchanged (its slice is an ordinary layer)."""
    if isinstance(linear, Fp8Linear) and linear.weight.shape[1] % fp8_matmul.BLOCK:
        return Fp8Slice(linear, "cols", axes)
    return linear


def _rows(linear, axes):
    """A row-split layer's partial product (the caller all-reduces): an fp8 one whose slice is not whole
    128-blocks as an `Fp8Slice` (activation groups straddling ranks); anything else unchanged."""
    if isinstance(linear, Fp8Linear) and linear.weight.shape[0] % fp8_matmul.BLOCK:
        return Fp8Slice(linear, "rows", axes)
    return linear


def local_modules(model, *, expert_parallel: bool, axes=AXES):
    """Inside the shard_map, on a model merged from this rank's weights: give MLA the local head count
    and swap o_proj, the dense MLPs' down projections and the MoE layers for their all-reducing forms
    (main layers and MTP layers). Returns the model."""
    for layer in list(model.layers) + list(model.mtp):
        attn = layer.self_attn
        cfg = attn.cfg
        heads = attn.q_b_proj.weight.shape[-1] // cfg.qk_head_dim
        attn.cfg = dataclasses.replace(cfg, num_attention_heads=heads)
        attn.q_b_proj, attn.kv_b_proj = _columns(attn.q_b_proj, axes), _columns(attn.kv_b_proj, axes)
        attn.o_proj = RowParallel(_rows(attn.o_proj, axes), axes)
        mlp = layer.mlp.shared_experts if isinstance(layer.mlp, MoE) else layer.mlp
        if mlp is not None:
            mlp.gate_proj, mlp.up_proj = _columns(mlp.gate_proj, axes), _columns(mlp.up_proj, axes)
            mlp.down_proj = _rows(mlp.down_proj, axes)  # the shared expert's: summed in the MoE's all-reduce
        if isinstance(layer.mlp, MoE):
            layer.mlp = TensorParallelMoE(layer.mlp, axes, expert_parallel)
        elif isinstance(layer.mlp, MLP):
            layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, axes)
    return model

