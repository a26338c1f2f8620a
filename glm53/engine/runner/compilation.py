"""Compilation, out of the hot path: warm-up (every program a serving run can use, run once on padding
that writes nothing) and the workspace profile (the step programs lowered and compiled, never run:
`step_workspace_bytes`). Both read the runner's parts and change nothing a later step sees."""

from __future__ import annotations

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np

from attention.common import pow2_at_least
from glm53.api import window_bucket
from glm53.engine.runner.batch import group_rows_limit
from glm53.engine.runner.sampling import _last_logits, _sample, row_arrays, warm_prompt_logprobs, warm_sampling


def memory_maps() -> int:
    """Memory mappings this process holds (0 where /proc is missing: no such limit to watch)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def max_map_count() -> int | None:
    """The kernel's limit on one process's memory mappings (vm.max_map_count), None where unknown."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


# XLA:CPU maps about 3 regions per compiled kernel (a forward program holds hundreds) and aborts a compile
# past vm.max_map_count; warm-up stops short of it with an error that says so (docs/testing.md)
MAPS_HEADROOM = 0.9


def check_memory_maps(done: int, total: int) -> None:
    """Raise before XLA would abort: the process holds more than MAPS_HEADROOM of vm.max_map_count after
    `done` of `total` warm-up shapes."""
    limit, held = max_map_count(), memory_maps()
    if limit and held > MAPS_HEADROOM * limit:
        raise RuntimeError(
            f"warm-up holds {held} memory mappings after {done} of {total} bucket shapes, near the kernel's "
            f"vm.max_map_count ({limit}), past which XLA aborts a compile: raise it (sysctl -w "
            f"vm.max_map_count=262144) or serve fewer bucket shapes (smaller max_model_len, "
            f"max_num_batched_tokens or max_num_seqs)")


class CompileCounter:
    """Context manager counting XLA compilations (JAX's backend-compile events) while active: `.count`."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __enter__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        return self

    def _on_event(self, event, duration_s, **kwargs):
        if event == self.EVENT:
            self.count += 1

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._on_event)


def _padding(runner, rows: int, width: int, window: int):
    """Token ids, positions (all -1: nothing is written) and block tables of a padding-only batch."""
    return (np.zeros((rows, width), np.int32), np.full((rows, width), -1, np.int32),
            runner._table("mla", rows, [], window), runner._table("indexer", rows, [], window))


def warmup(runner, shapes, *, prompt_logprobs: bool = False) -> int:
    """Compile the programs of `shapes` by running padding-only steps, which write nothing (every slot is
    -1), and every copy program of the KV policy (kvcache.host); a policy's device half adds its views'
    programs (each decode shape, and each prefill shape it stages, also runs with an empty view). ->
    number of shapes run. After this a serving run compiles nothing (tests/engine counts compilations
    under every policy). `prompt_logprobs`: also the programs of rows that ask for them
    (`ModelRunner._run_group`: a prefill width's keep_all forward, and each shape's position logits)."""
    half = runner.half
    if runner.k:
        _warmup_mtp(runner, shapes, prompt_logprobs)
    for done, (rows, width, window) in enumerate([] if runner.k else shapes):
        check_memory_maps(done, len(shapes))
        views = half.empty_views(rows, decode=width == 1)
        # a view is made for each forward: a forward donates the arrays its view carries (detach takes
        # the returned ones back), so a view must not serve twice
        for view_of in [lambda: None] + ([lambda: views(window)] if views else []):
            hidden = runner._forward(*_padding(runner, rows, width, window), window, view_of())
            warm_sampling(runner.c.logits, runner.state, hidden, rows, penalty_limit=_penalty_limit(runner))
            if prompt_logprobs:
                if width > 1:
                    _, hidden = runner._forward(*_padding(runner, rows, width, window), window, view_of(),
                                                keep_all=True)
                warm_prompt_logprobs(runner.c.logits, runner.state, hidden)
    half.end_warmup()  # the warm-up views counted nothing
    if shapes:
        runner.cache = runner.host.warmup(runner.cache, half.warmup_blocks())
        half.warmup()
    runner.cp_work_per_rank(reset=True)  # warm-up steps are not serving work
    runner.all2all_bytes(reset=True)
    return len(shapes)


def _penalty_limit(runner) -> int:
    """The most distinct tokens a row's penalties can see (`sampling.penalty_widths`); 0 under MTP, which
    refuses penalties (Engine.add_request)."""
    return 0 if runner.k else min(runner.model.cfg.vocab_size, runner.deploy.max_model_len)


def _warmup_mtp(runner, shapes, prompt_logprobs: bool = False) -> None:
    """`warmup` under MTP: per shape the programs `_run_group` runs (the verify or keep_all forward, the
    logits, the accept rule or sampling, the MTP pass over the group, the first draft), then the
    one-token draft passes for every (rows, window) the shapes name; with a device half's views also the
    verify shapes' forwards with a decode view, the prefill shapes' with a prefill view, and the draft
    passes with each. Padding only: nothing is written (and no lease: the views resolve nothing)."""
    half, vw = runner.half, runner.verify_width
    queries = vw if runner.verify_mode == "batched" else 1
    for done, (rows, width, window) in enumerate(shapes):
        check_memory_maps(done, len(shapes))
        views = half.empty_views(rows, decode=width == vw)
        if views is None:
            continue
        tok, pos, t_mla, t_idx = _padding(runner, rows, width, window)
        if width == vw:
            hidden = runner._verify(tok, pos, t_mla, t_idx, window, views(window, queries))
            view = views(window, queries)
        else:
            _, hidden = runner._forward(tok, pos, t_mla, t_idx, window, views(window), keep_all=True)
            view = views(window)
        runner._mtp_pass(hidden, tok, pos, t_mla, t_idx, window, np.zeros(rows, np.int32), view,
                         per_position=width == vw and runner.verify_mode != "batched")
    for rows, window in sorted({(r, w) for r, _, w in shapes}):
        for views in (half.empty_views(rows, decode=True), half.empty_views(rows, decode=False)):
            if views is not None:
                _warm_drafts(runner, rows, window, views(window))
    half.end_warmup()
    for done, (rows, width, window) in enumerate(shapes):
        check_memory_maps(done, len(shapes))
        tok, pos, t_mla, t_idx = _padding(runner, rows, width, window)
        if width == vw:
            hidden = runner._verify(tok, pos, t_mla, t_idx, window)
            warm_sampling(runner.c.logits, runner.state, hidden, rows, runner.k, runner.rates, verify=True)
        else:
            last, hidden = runner._forward(tok, pos, t_mla, t_idx, window, keep_all=True)
            warm_sampling(runner.c.logits, runner.state, last, rows, penalty_limit=_penalty_limit(runner))
        if prompt_logprobs:  # the group's hidden holds every position at either width
            warm_prompt_logprobs(runner.c.logits, runner.state, hidden)
        runner._mtp_pass(hidden, tok, pos, t_mla, t_idx, window, np.zeros(rows, np.int32))
    for rows, window in sorted({(r, w) for r, _, w in shapes}):
        _warm_drafts(runner, rows, window)


def _warm_drafts(runner, rows: int, window: int, view=None) -> None:
    h = jax.device_put(np.zeros((rows, 1, runner.model.cfg.hidden_size), runner.model.dtype), runner.devices[0])
    d = jax.device_put(np.zeros((rows, 1), np.int32), runner.devices[0])
    _, _, t_mla, t_idx = _padding(runner, rows, 1, window)
    runner._draft_chain(h, d, np.full((runner.k - 1, rows), -1, np.int32), t_mla, t_idx, window,
                        view).block_until_ready()


def workspace_shapes(runner) -> list[tuple[int, int, int]]:
    """The (rows, tokens per row, window) step programs whose workspace bounds every step's: decode
    (max_num_seqs rows, padded), a chunk of the whole token budget at a fresh prompt's window and at
    the max_model_len window, and the prefill groups with the most padded tokens that
    `forward_groups` can form: a group of width w holds rows of more than w / 2 tokens (2 in the
    narrowest bucket), so at most budget // (w / 2 + 1) of them, padded to a power of two, up to
    about twice the budget in all (the narrowest and the widest such width stand for their ties)."""
    cap, d = runner.capacity, runner.deploy
    full = window_bucket(cap, cap)
    widths = runner.width_buckets()
    groups = []
    for w in widths[1:]:
        rows = pow2_at_least(group_rows_limit(w, widths, d.max_num_batched_tokens, d.max_num_seqs))
        groups.append((rows * w, rows, w))
    most = max(t for t, _, _ in groups)
    ties = [(r, w) for t, r, w in groups if t == most]
    shapes = {(runner.max_rows, 1, full), (1, runner.max_tokens, window_bucket(runner.max_tokens, cap)),
              (1, runner.max_tokens, full), (*ties[0], full), (*ties[-1], full)}
    return sorted((r * runner.fwd.ranks, w, win) for r, w, win in shapes)  # DP x EP: every rank's rows


def step_workspace_bytes(runner, shapes=None) -> int:
    """Peak device bytes of `runner`'s step programs beyond their arguments (weights, pool, tables):
    XLA's temporaries plus the outputs that do not alias the donated cache, from the compiled
    programs' memory analysis, per device of the replica, the most over the forwards of `shapes`
    (default `workspace_shapes`) and the logits and sampling of max_num_seqs rows. What vLLM's
    profile run measures and leaves out of the KV budget (`DeployConfig.kv_budget_bytes`). Compiles
    them (nothing runs, nothing is allocated); the cache is donated, so the pool's size does not
    change the result (tests/engine/test_workspace.py). Not profiled: MTP's verify and draft
    programs, and HiSparse's resolver and staging state (the plain programs of the same shapes are).

    The step's own inputs count too (XLA's analysis leaves arguments out): those sent from the host
    (token ids, positions, block tables, sampling parameters) twice, since dispatch is asynchronous
    and the next step's are on the device while this step's temporaries are live; those an earlier
    program left on the device (the hidden rows the logits program reads, the logits sampling reads)
    once: without them a device's peak exceeds XLA's figure (the H200 run: docs/memory.md)."""
    def nbytes(xs) -> int:
        return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in xs)

    def peak(lowered, host=(), device=()) -> int:
        ma = lowered.compile().memory_analysis()
        return (int(ma.temp_size_in_bytes) + int(ma.output_size_in_bytes) - int(ma.alias_size_in_bytes)
                + 2 * nbytes(host) + nbytes(device))

    most = 0
    for rows, width, window in (workspace_shapes(runner) if shapes is None else shapes):
        inputs = (np.zeros((rows, width), np.int32), np.full((rows, width), -1, np.int32),
                  runner._table("mla", rows, [], window), runner._table("indexer", rows, [], window))
        most = max(most, peak(runner._forward(*inputs, window, lower=True), host=inputs))
    r, cfg = runner.max_rows * runner.fwd.ranks, runner.model.cfg
    hidden = jax.ShapeDtypeStruct((r, 1, cfg.hidden_size), jnp.dtype(runner.model.dtype))
    rows_i = jax.ShapeDtypeStruct((r,), jnp.int32)
    most = max(most, peak(_last_logits.trace(runner.c.logits, runner.state, hidden, rows_i).lower(), host=[rows_i],
                          device=[hidden]))
    logits = jax.ShapeDtypeStruct((r, cfg.vocab_size), jnp.float32)
    args = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in row_arrays([], [], r).items()}
    return max(most, peak(_sample.trace(logits, logits, **args).lower(), host=list(args.values()),
                          device=[logits]))
