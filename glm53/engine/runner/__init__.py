"""The model runner: executes a `glm53.engine.plan.StepPlan` on the paged KV pool of one device or a
mesh, and samples. `ModelRunner` composes small parts, each chosen once at start-up:

- batch building (`batch`): width buckets, the step's forward groups, padded rows and block tables;
- a forward strategy (`forward`): one device, a context mesh (PCP / DCP) or tensor parallelism;
- the KV policy's device half (kvcache.policies.device): the views a forward carries, and their counts;
- sampling (`sampling`): the logit rules, greedy or a draw, logprobs; and MTP's accept rule;
- compilation (`compilation`): warm-up of every bucket program and the workspace profile.

Per step it runs the plan's KV transfers (kvcache.host.HostMemory), then groups the rows by width
bucket (1 token for decoding requests, 1 + k under MTP; powers of two from 16 up to
max_num_batched_tokens for prefill chunks) and runs one padded forward per group (rows: powers of two up
to max_num_seqs; attention window: powers of two up to the cache capacity), then samples. So a serving
run compiles a bounded set of programs (`bucket_shapes`; `warmup` compiles them all), and padding stays
under 2x per row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from attention.common import pow2_at_least
from glm53.api import window_bucket
from glm53.engine.config import DeployConfig, KVSizes
from glm53.engine.plan import PlanRow, StepPlan, StepResult
from glm53.engine.runner import compilation, ranks
from glm53.engine.runner.batch import (MIN_PREFILL_WIDTH, block_table, bucket_shapes, forward_groups, padded_rows,
                                       step_limits, width_buckets)
from glm53.engine.runner.compilation import CompileCounter
from glm53.engine.runner.forward import strategy_for
from glm53.engine.runner.sampling import (_concat_drafts, _draft_argmax, _last_logits, _mtp_head, _position_logits,
                                          _sample, accept, last_logits, pick, prompt_logprobs)
from glm53.engine.spec_decode import rates_array
from glm53.model import GLM53, compiled
from kvcache.host import HostMemory
from kvcache.paged import PagedKVCache
from parallel import tp as parallel_tp
from parallel.mesh import make_mesh

__all__ = ["MIN_PREFILL_WIDTH", "CompileCounter", "ModelRunner", "_last_logits", "_position_logits", "_sample",
           "forward_groups", "step_limits", "width_buckets"]


class ModelRunner:
    """Executes step plans on `devices` (default: the first `deploy.devices_per_replica` of
    `jax.devices()`; a data-parallel replica passes its own group). One device: weights and KV pool live
    there. Several: a context mesh over them (parallel.model), or under tensor parallelism a mesh
    tp x cp (DCP reusing the TP ranks) with the weights split over it (parallel.tp). `sizes`: the
    replica's pool, page and host-pool sizes (glm53.engine.config.KVSizes), the same numbers its policy
    plans with. Plain decoding is MTP with k = 0: one execute path, whose verify form
    (`speculative_config["verify"]`) is an argument of the forward."""

    # it computes logits, so the logprobs a request asks for (Engine.add_request refuses them elsewhere)
    gives_logprobs = True

    @property
    def gives_prompt_logprobs(self) -> bool:
        """Whether it computes prompt logprobs (Engine.add_request refuses them elsewhere): not yet under DP x
        EP, whose steps (`ranks.execute_ranks`) carry no prompt logprobs."""
        return self.fwd.ranks == 1

    def __init__(self, model: GLM53, deploy: DeployConfig, sizes: KVSizes, devices=None, *, tiers=None):
        self.model, self.deploy, self.sizes = model, deploy, sizes
        self.c = compiled(model)
        n = deploy.devices_per_runner
        if devices is None:  # this process's devices, in the order make_mesh uses
            devices = sorted(jax.local_devices(), key=lambda d: d.id)[:n]
            if len(devices) < n:
                make_mesh(cp=n)  # raises with how to simulate more devices on CPU
        devices = list(devices)
        if len(devices) != n:
            raise ValueError(f"a runner with devices_per_runner={n} needs {n} devices, got {len(devices)}")
        experts = model.cfg.n_routed_experts
        self.tp = deploy.tensor_parallel_size  # TP pads the experts to its ranks (parallel.tp)
        if self.tp > 1:
            # before any array is allocated: what TP cannot split (fp8 experts by width, blocks straddling)
            parallel_tp.check_weights(self.c.state, model.cfg, self.tp, deploy.enable_expert_parallel)
        if deploy.enable_expert_parallel and self.tp == 1 and n > 1 and experts % n:
            raise ValueError(f"enable_expert_parallel: the model's {experts} routed experts do not split over the "
                             f"{n} devices of the context axis")
        self.devices = devices
        self.tiers = tiers  # the offload host tier's secondary tiers (kvcache.tiers.TierSet), or None
        self.half = deploy.policy.device_half(deploy, sizes, index_topk=model.cfg.index_topk)
        # MTP speculative decoding: drafts per step (0: off), the decode bucket's width, the verify form
        self.spec = deploy.speculative
        self.k = deploy.num_speculative_tokens
        if self.k and model.cfg.num_nextn_predict_layers < 1:
            raise ValueError("DeployConfig.speculative_config: the model has no MTP layer to draft with")
        self.verify_width = 1 + self.k if self.k else 0
        self.verify_mode = self.half.verify_form(self.spec, devices[0].platform) if self.k else None
        self.rates = rates_array(self.spec, self.k)
        self._logprobs, self._prompt_logprobs = {}, {}  # the step's, by request (`execute`)
        self.compiled_shapes: set[tuple] = set()  # (rows, tokens, window): one program each
        self.staging_shapes: set[tuple] = set()  # ... run with a prefill group's view
        self.compiled_draft_shapes: set[tuple] = set()  # (rows, window) of the MTP layer's one-token passes
        # "auto": the model picks the dense form for short windows and, on CPU, for prefill chunks over a
        # few times top-k (attention.dense_mla.use_dense_mha); force_mqa sends everything sparse
        self.form = "mqa" if deploy.sparse_mla_force_mqa else "auto"
        self.max_rows = pow2_at_least(deploy.max_num_seqs)
        self.max_tokens = step_limits(deploy)[0]
        self.num_blocks = sizes.num_blocks
        with jax.default_device(devices[0]):  # every array this runner creates starts on its devices
            self._place()

    def _place(self):
        """The strategy, the pool (kv_ranks x num_blocks pages under DCP, split over the context axis),
        the weights, and the host memory (laid out like the pool)."""
        d, sz = self.deploy, self.sizes
        self.fwd = strategy_for(self, self.devices)
        self.mesh, self.kv_ranks = self.fwd.mesh, self.fwd.kv_ranks
        cache = PagedKVCache.create(self.model.cfg, self.num_blocks * self.kv_ranks, d.block_size,
                                    self._table("mla", self.max_rows, []), index_block_size=d.index_block_size,
                                    index_block_table=self._table("indexer", self.max_rows, []),
                                    kv_cache_dtype=sz.kv_cache_dtype, include_mtp=self.k > 0)
        self.cache, self.state = self.fwd.place(cache, self.c.state)
        # bytes of weights on the fullest device (engine.metrics()["weights_bytes_per_device"])
        self.weights_bytes_per_device = max(parallel_tp.bytes_on_each_device(self.state).values())
        host, device = self.fwd.memory()
        self.host = HostMemory(self.cache, page_rows={"mla": d.block_size, "indexer": d.index_block_size or d.block_size},
                               kv_ranks=self.kv_ranks, interleave=d.cp_kv_cache_interleave_size,
                               num_blocks=self.num_blocks * self.fwd.ranks, host=host, device=device,
                               host_blocks={g: b * self.fwd.ranks for g, b in sz.host_blocks.items()} or None,
                               tiers=self.tiers, shared=self.fwd.host_share())
        self.half.bind(self.host, self._table, index_groups=len(self.cache.index), ranks=self.fwd.ranks)
        if self.host.page_bytes != sz.page_bytes:  # the policy plans in kvcache.layout's page sizes
            raise RuntimeError(f"page bytes of the device arrays {self.host.page_bytes} differ from "
                               f"kvcache.layout's {sz.page_bytes}")

    @property
    def capacity(self) -> int:
        """Positions per request a block table can address (max_model_len rounded up to whole pages)."""
        return step_limits(self.deploy)[1]

    def _table(self, group: str, rows: int, tables, window: int | None = None) -> np.ndarray:
        return block_table(self.deploy, group, rows, tables, window)

    def width_buckets(self) -> list[int]:
        """Tokens per row: 1 (decode; 1 + k under MTP) and powers of two from MIN_PREFILL_WIDTH up to the
        budget."""
        return width_buckets(self.max_tokens, self.verify_width)

    def bucket_shapes(self) -> list[tuple[int, int, int]]:
        """Every (rows, tokens per row, window) program a serving run can use (`batch.bucket_shapes`; DP x
        EP: N ranks' rows)."""
        return bucket_shapes(self.deploy, self.verify_width, self.fwd.ranks)

    def warmup(self, shapes=None, *, prompt_logprobs: bool = False) -> int:
        """Compile the programs of `shapes` (default: every bucket) and every copy program of the KV policy
        (`compilation.warmup`); with `prompt_logprobs` also each shape's programs for requests that ask for
        them (per prefill shape a second forward, the one that keeps every position; per (rows, width) the
        position logits and logprobs), which only a runner that will serve them need pay for. -> number of
        shapes run.
        After this a serving run compiles nothing."""
        return compilation.warmup(self, self.bucket_shapes() if shapes is None else shapes,
                                  prompt_logprobs=prompt_logprobs)

    def workspace_shapes(self) -> list[tuple[int, int, int]]:
        return compilation.workspace_shapes(self)

    def step_workspace_bytes(self, shapes=None) -> int:
        """Peak device bytes of the step programs beyond their arguments (`compilation.step_workspace_bytes`)."""
        return compilation.step_workspace_bytes(self, shapes)

    def execute_ranks(self, plans) -> list:
        """DP x EP: one plan per rank (None: none) run as one step -> their results (`ranks.execute_ranks`)."""
        return ranks.execute_ranks(self, plans)

    def all2all_bytes(self, reset: bool = False) -> int:
        """Bytes one device sent by the MoE's all-to-alls since the start (or the last reset); 0 without them."""
        return self.fwd.all2all_bytes(reset)

    def cp_work_per_rank(self, reset: bool = False) -> dict[str, np.ndarray]:
        """Context parallelism: each rank's work since the start (or the last reset) -> {name: int64 [N]}
        (parallel.cp_cache.COUNTERS: indexer pairs scored, causal and computed, and MLA rows read);
        {} without a mesh."""
        return self.fwd.cp_work_per_rank(reset)

    # ---------------------------------------------------------------------------------------- the step
    def execute(self, plan: StepPlan) -> StepResult:
        """The plan's transfers in order, then one forward per width bucket (decode rows never pad to a
        prefill chunk's width, and a chunk pads to less than twice its length; the groups are independent
        requests, so running them one after the other on the same cache computes exactly what one batch
        would), then sampling, and under MTP the draft passes. A group whose rows the policy's device half
        serves runs every forward with its view and leaves one record per forward."""
        if self.fwd.ranks > 1:  # its programs carry every rank's rows
            raise RuntimeError("a DP x EP runner runs every rank's plan together: execute_ranks")
        if not self.k and any(row.num_draft_tokens for row in plan.rows):
            raise ValueError("a plan with draft tokens for a runner without MTP (DeployConfig.speculative_config)")
        self.cache, d2h, h2d = self.host.apply(plan.transfers, self.cache, others=self.half.transfer)
        tokens, drafts, resolves, stages = {}, {}, [], []
        self._logprobs, self._prompt_logprobs = {}, {}
        data = plan.policy_rows
        for width, idx, padded, window in forward_groups(plan.rows, self.max_tokens, self.capacity, self.verify_width):
            rows = [plan.rows[i] for i in idx]
            t_mla, t_idx = [plan.block_tables["mla"][i] for i in idx], [plan.block_tables["indexer"][i] for i in idx]
            views = self.half.group_views(None if data is None else [data[i] for i in idx],
                                          decode=width == (self.verify_width or 1), tables_mla=t_mla, padded=padded)
            out, new = self._run_group(rows, t_mla, t_idx, width, padded, window, views)
            tokens.update(out)
            drafts.update(new)
            res, st, nbytes = self.half.take_records(tuple(row.req_id for row in rows))
            resolves += res
            stages += st
            h2d += nbytes
        # tier loads finished by now; a step with nothing to compute waits a little for one (an engine
        # whose only waiting requests wait on tiers would otherwise spin)
        loads = self.host.poll_tiers(wait_s=0.0 if plan.rows else 0.02)
        return StepResult(tokens, frozenset(range(len(plan.transfers))), d2h, h2d, tuple(resolves), loads,
                          drafts=drafts, stages=tuple(stages), logprobs=self._logprobs,
                          prompt_logprobs=self._prompt_logprobs)

    def _run_group(self, rows: list[PlanRow], tables_mla, tables_index, width: int, r: int, window: int,
                   views=None) -> tuple[dict, dict]:
        """One width group, r padded rows over `window` positions -> (tokens, drafts) of its rows that
        sample. The decode bucket verifies (k = 0: a one-token forward), a prefill width runs the chunk;
        both sample; under MTP the MTP layer then passes over the group and drafts. `views`: the policy's
        views (`DeviceHalf.group_views`), one per forward; a batched verify's view serves 1 + k queries."""
        tok, pos = padded_rows(rows, r, width)
        t_mla, t_idx = self._table("mla", r, tables_mla, window), self._table("indexer", r, tables_index, window)
        need = [i for i, row in enumerate(rows) if row.sample]
        decode = width == (self.verify_width or 1)
        batched = self.verify_mode == "batched"
        queries = width if decode and batched else 1

        def view(win, q=1):
            return None if views is None else views(win, q)

        prompt = any(row.prompt_len for row in rows)  # rows asking for prompt logprobs
        if not self.k:
            if prompt and width > 1:  # every position's hidden state too; `last` is the last_only form's
                last, hidden = self._forward(tok, pos, t_mla, t_idx, window, view(window), keep_all=True)
                self._prompt_logprobs.update(prompt_logprobs(self.c.logits, self.state, hidden, rows))
                at = np.zeros(r, np.int32)
            else:
                last = hidden = self._forward(tok, pos, t_mla, t_idx, window, view(window))
                if prompt:  # a one-token chunk: its hidden state is every position's
                    self._prompt_logprobs.update(prompt_logprobs(self.c.logits, self.state, hidden, rows))
                at = np.array([row.num_tokens - 1 for row in rows] + [0] * (r - len(rows)), np.int32)
            if not need:
                return {}, {}
            return self._pick(self._last_logits(self.state, last, at), [rows[i] for i in need], need), {}
        out = {}
        stand = [row.num_tokens for row in rows]  # per row: positions whose KV stands (from the row's start)
        final = [row.next_token for row in rows]  # ... and the token after the last of them
        if decode:
            hidden = self._verify(tok, pos, t_mla, t_idx, window, view(window, queries))
            if prompt:  # a short prompt chunk in the verify group: hidden holds every position
                self._prompt_logprobs.update(prompt_logprobs(self.c.logits, self.state, hidden, rows))
            if need:
                toks, accepted, logprobs = accept(self.c.logits, self.state, hidden, rows, need, r, self.k, self.rates)
                self._logprobs.update(logprobs)
                for i in need:
                    a = int(accepted[i])
                    out[rows[i].req_id] = tuple(int(t) for t in toks[i, : a + 1])
                    stand[i] = rows[i].num_tokens - rows[i].num_draft_tokens + a
                    final[i] = int(toks[i, a])
        else:
            last, hidden = self._forward(tok, pos, t_mla, t_idx, window, view(window), keep_all=True)
            if prompt:
                self._prompt_logprobs.update(prompt_logprobs(self.c.logits, self.state, hidden, rows))
            if need:
                picked = self._pick(self._last_logits(self.state, last, np.zeros(r, np.int32)),
                                    [rows[i] for i in need], need)
                out.update(picked)
                for i in need:
                    final[i] = picked[rows[i].req_id][0]
        # the MTP layer over the group: position p pairs hidden[p] with token p+1
        nxt = np.zeros((r, width), np.int32)
        mpos = np.full((r, width), -1, np.int32)
        sel = np.zeros(r, np.int32)
        for i, row in enumerate(rows):
            n = stand[i]
            if not n:  # a padding row (DP x EP: a rank with fewer rows of this width)
                continue
            nxt[i, : n - 1] = tok[i, 1:n]
            nxt[i, n - 1] = max(final[i], 0)
            mpos[i, :n] = pos[i, :n]
            if final[i] < 0:  # no known next token (cannot happen for a plan from the scheduler): skip it
                mpos[i, n - 1] = -1
            sel[i] = n - 1
        h, d = self._mtp_pass(hidden, nxt, mpos, t_mla, t_idx, window, sel, view(window, queries),
                              per_position=decode and views is not None and not batched)
        if not need:
            return out, {}
        # drafts 2..k at the positions after each sampling row's last standing one, within max_model_len
        limit = self.deploy.max_model_len
        dpos = np.full((self.k - 1, r), -1, np.int32)
        for i in need:
            base = rows[i].start + stand[i] - 1
            for s in range(1, self.k):
                dpos[s - 1, i] = base + s if base + s < limit else -1
        dwin = window_bucket(int(dpos.max(initial=0)) + 1, self.capacity)
        drafts = np.asarray(self._draft_chain(h, d, dpos, self._table("mla", r, tables_mla, dwin),
                                              self._table("indexer", r, tables_index, dwin), dwin, view(dwin)))
        return out, {rows[i].req_id: tuple(int(t) for t in drafts[i]) for i in need}

    # ------------------------------------------------------------------------------------- forwards
    def _forward(self, tok, pos, table_mla, table_index, window, view=None, *, keep_all: bool = False,
                 lower: bool = False):
        """One padded batch [rows, width] -> hidden (`forward.OneDevice.forward`: a mesh returns every
        position in token order, one device the last real token's of a prefill row), or with `keep_all`
        (MTP's prefill) (hidden of each row's last token [rows, 1, D], hidden of every position). `view`:
        the policy's view of the group (its reads go through the sparse "mqa" form). lower=True: run
        nothing, return the step's `jax.stages.Lowered` program (`step_workspace_bytes`)."""
        self.fwd.check_ids(table_mla, table_index)
        if not lower:
            self.compiled_shapes.add((tok.shape[0], tok.shape[1], window))
            if view is not None and tok.shape[1] > (self.verify_width or 1):  # a program of its own per shape
                self.staging_shapes.add((tok.shape[0], tok.shape[1], window))
        cache = self.half.attach(self.cache.with_block_table(table_mla, table_index), view)
        form = self.form if view is None else "mqa"
        if lower:
            return self.fwd.forward(tok, pos, cache, window, form, lower=True)
        hidden, cache = self.fwd.forward(tok, pos, cache, window, form, keep_all=keep_all)
        self.cache = self.half.detach(cache)
        return hidden

    def _verify(self, tok, pos, table_mla, table_index, window, view=None):
        """A verify group's forward -> hidden [rows, 1 + k, D] of every position (cache updated), in the
        runner's verify form: sequential (each position as a one-token step, so a view resolves each
        position's selection at its own step) or batched (one forward; a view resolves one plan for the
        union of the 1 + k positions' selections)."""
        self.fwd.check_ids(table_mla, table_index)
        self.compiled_shapes.add((tok.shape[0], tok.shape[1], window))
        cache = self.half.attach(self.cache.with_block_table(table_mla, table_index), view)
        hidden, cache = self.fwd.verify(tok, pos, cache, window, "mqa" if view is not None else self.form,
                                        self.verify_mode == "batched")
        self.cache = self.half.detach(cache)
        return hidden

    def _mtp_pass(self, hidden, nxt, mpos, table_mla, table_index, window, sel, view=None, *, per_position=False):
        """The MTP layer over a whole group: position mpos[r, j] (-1: skip) pairs hidden[r, j] with token
        nxt[r, j] (the token after it) and writes the MTP layer's KV there -> (its state at each row's
        position sel[r], [rows, 1, D]; the draft taken from it, [rows, 1] int32). `per_position`: one
        position at a time (a decode view under sequential verify resolves per position)."""
        cache = self.half.attach(self.cache.with_block_table(table_mla, table_index), view)
        h, cache = self.fwd.mtp(hidden, nxt, mpos, cache, window, "mqa" if view is not None else self.form,
                                per_position)
        self.cache = self.half.detach(cache)
        return _mtp_head(self.c.logits, self.state, h, jnp.asarray(sel))

    def _draft_chain(self, h, d, dpos, table_mla, table_index, window, view=None):
        """Drafts 2..k: k - 1 one-token MTP passes, pass s at positions dpos[s] (-1: skip) with the previous
        draft as its token and the previous pass's normed output as its state (not the raw residual: vLLM
        PR #46075) -> drafts [rows, k] int32 (device)."""
        self.compiled_draft_shapes.add((d.shape[0], window))
        cache = self.half.attach(self.cache.with_block_table(table_mla, table_index), view)
        form = "mqa" if view is not None else self.form
        out = [d]
        for p in dpos:
            h, cache = self.fwd.draft(h, d, p, cache, window, form)
            d = _draft_argmax(self.c.logits, self.state, h)
            out.append(d)
        self.cache = self.half.detach(cache)
        return _concat_drafts(tuple(out))

    def _last_logits(self, state, hidden_RTD, last_R):
        return last_logits(self.c.logits, state, hidden_RTD, last_R)

    def _pick(self, logits_RV, rows: list[PlanRow], idx: list[int]) -> dict[str, tuple[int]]:
        """`sampling.pick`'s tokens; the logprobs of rows that ask for them go to this step's result."""
        tokens, logprobs = pick(logits_RV, rows, idx)
        self._logprobs.update(logprobs)
        return tokens
