"""Building an engine's parts: each replica's KV policy (through kvcache.policies.REGISTRY), the
secondary tiers' KV fingerprint of the weights, and the numbers a pool sized from device memory needs
(the weights one device holds and the step workspace, from a compile-only profile run).
glm53.engine.engine calls these once, at construction."""

from __future__ import annotations

import dataclasses
import gc
import hashlib

import jax
import numpy as np
from flax import nnx

from glm53.config import ModelConfig
from glm53.engine.config import GROUPS, DeployConfig, KVSizes, device_memory_bytes
from glm53.engine.runner import ModelRunner
from kvcache.layout import DEFAULT_INDEX_FORMAT, cache_groups
from kvcache.policies import KVPolicy
from kvcache.tiers import TierSet, layout_fingerprint
from parallel import mesh as parallel_mesh
from parallel import model as parallel_model
from parallel import tp as parallel_tp


def make_policy(deploy: DeployConfig, sizes: KVSizes, tiers: TierSet | None = None, fingerprint: str = "") -> KVPolicy:
    """One replica's planner of the policy `deploy.kv_policy` names (its registered class's `make`), sized by
    `sizes` (a policy with `uses_tiers`: with the secondary `tiers` behind its host pools)."""
    return deploy.policy.make(deploy, sizes, tiers, fingerprint)


def kv_fingerprint(model, deploy: DeployConfig, sizes: KVSizes, *, page_tokens: dict | None = None,
                   page_bytes: dict | None = None, weights: bytes | None = None) -> str:
    """The secondary tiers' fingerprint of this deployment's KV bytes (kvcache.tiers.layout_fingerprint)
    and of the weights that computed them: SHA-256 over 256 values spread evenly over every weight array
    (every expert of a stacked expert array included), so two random initialisations of one preset, or
    two checkpoints of one architecture, do not share KV. A sample, not a proof: two checkpoints equal
    at every sampled value would collide (fine-tunes change every weight; name a separate root_dir for
    checkpoints that differ only in a few). page_tokens / page_bytes: another page span's (a P/D
    producer's, Engine.page_spans); weights: `weights_sample(model)`, computed once."""
    cfg = model if isinstance(model, ModelConfig) else model.cfg
    fp = layout_fingerprint(dataclasses.asdict(cfg), group_tokens=page_tokens or deploy.group_tokens_per_block(GROUPS),
                            page_bytes=page_bytes or sizes.page_bytes, kv_cache_dtype=sizes.kv_cache_dtype)
    return hashlib.sha256(fp.encode() + (weights_sample(model) if weights is None else weights)).hexdigest()


def weights_sample(model) -> bytes:
    """What the KV fingerprint hashes of the weights: each leaf's path, shape, dtype and `_head` (b"" for a
    config: a simulated engine)."""
    if not isinstance(model, nnx.Module):
        return b""
    leaves = jax.tree_util.tree_leaves_with_path(nnx.state(model))
    on_device = iter(_leaf_heads([x for _, x in leaves if not isinstance(x, np.ndarray)]))
    # a host-loaded model's leaves are read on the host (a jit would copy every whole leaf to a device)
    heads = [_head(x) if isinstance(x, np.ndarray) else next(on_device) for _, x in leaves]
    return b"".join(f"{jax.tree_util.keystr(path)}:{x.shape}:{x.dtype}".encode() + np.asarray(head).tobytes()
                    for (path, x), head in zip(leaves, heads))


def kv_row_bytes(cfg: ModelConfig, deploy: DeployConfig, sizes: KVSizes) -> dict[str, tuple[int, ...]]:
    """Per cache group, the bytes per token of each array of a canonical chunk (kvcache.host.HostMemory:
    one per layer, the MTP layer's with MTP on), checked against the pages' bytes."""
    mla, index = cache_groups(cfg, sizes.kv_cache_dtype, DEFAULT_INDEX_FORMAT[sizes.kv_cache_dtype],
                              include_mtp=deploy.num_speculative_tokens > 0)
    out = {g.name: (g.bytes_per_token,) * len(g.layers) for g in (mla, index)}
    tokens = deploy.group_tokens_per_block(GROUPS)
    for g in GROUPS:
        if sum(out[g]) * tokens[g] != sizes.page_bytes[g]:
            raise ValueError(f"kv_row_bytes: {g} rows of {out[g]} bytes do not make its {sizes.page_bytes[g]}-byte "
                             f"pages of {tokens[g]} tokens")
    return out


def _head(x):
    """Up to 256 evenly spaced values of a weight (what the KV fingerprint hashes of it)."""
    return x.reshape(-1)[:: max(1, x.size // 256)][:256]


@jax.jit
def _leaf_heads(leaves):
    return [_head(x) for x in leaves]


def weights_bytes(model, device, deploy: DeployConfig) -> int:
    """Bytes of the model's weights one device of a replica holds (all of them without tensor or expert
    parallelism; parallel.tp.bytes_per_device under TP; under expert parallelism on a context mesh, or
    over N DP x EP ranks, the replicated weights and 1/N of the routed experts, parallel.model.state_specs); 0 where the KV budget
    does not depend on them (a device that reports no memory: CPU)."""
    if not device_memory_bytes(device) or not isinstance(model, nnx.Module):
        return 0
    return weights_bytes_per_device(nnx.state(model), model.cfg, deploy)


def profile_workspace(model, deploy: DeployConfig, model_dtype: str, device, devices=None) -> int:
    """The step workspace a replica of `deploy` needs per device (`ModelRunner.step_workspace_bytes`),
    from a throwaway runner of the same deployment on a one-block pool without host pools or tiers (the
    step programs' shapes do not depend on them). It places the weights once more, briefly: vLLM's
    profile run costs a forward too."""
    probe = dataclasses.replace(deploy, num_gpu_blocks=1, kv_policy="preempt", cpu_offload_bytes=0,
                                hisparse_host_pool_bytes=0, hisparse_device_buffer_size=None,
                                kv_transfer_config=None).resolved(model.cfg, model_dtype, device=device)
    runner = ModelRunner(model, probe, probe.kv_sizes(model.cfg, model_dtype), devices)
    try:
        return runner.step_workspace_bytes()
    finally:
        del runner
        gc.collect()  # its weights and pool leave the device before the serving runner places its own


def weights_bytes_per_device(state, cfg: ModelConfig, deploy: DeployConfig) -> int:
    """Bytes of `state` (arrays or jax.ShapeDtypeStructs: sized from shapes, nothing moves) one device of
    a `deploy` replica holds, as the model runner places it (see `weights_bytes`)."""
    if deploy.tensor_parallel_size > 1:
        return parallel_tp.bytes_per_device(state, cfg, deploy.tensor_parallel_size, deploy.enable_expert_parallel)
    if deploy.experts_across_ranks:  # DP x EP: a rank's share of the routed experts, every other weight
        dp = deploy.data_parallel_size
        return parallel_mesh.bytes_per_device(state, parallel_model.state_specs(state, "dp", True), {"dp": dp})
    n = deploy.context_parallel_size
    if n > 1 and deploy.enable_expert_parallel:
        return parallel_mesh.bytes_per_device(state, parallel_model.state_specs(state, "cp", True), {"cp": n})
    return sum(int(x.size) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state) if hasattr(x, "dtype"))
