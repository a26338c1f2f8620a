"""Serving metrics from an engine run: latency, interactivity, throughput, memory traffic, cache reuse.

Definitions (times in seconds on the engine's clock), each as its source defines it:
- TTFT: first token time - arrival time, per request (latencies leave out requests aborted before
  their first token; every request's tokens count in throughput); `ttft_median_s`, `ttft_p90_s`.
- TPOT: (finish - first token) / (output tokens - 1), per request with >= 2 output tokens; vLLM's
  benchmark (vllm/benchmarks/serve.py, calculate_metrics) computes it so, once per request.
- interactivity_tok_s_user: 1000 / mean TPOT in ms, the tokens per second one user sees while decoding
  (BRIEF §8, Part 1: "per-user output tokens/s = 1000 / mean TPOT ms").
- interactivity_p90_e2e_tok_s_user: the end-to-end rate that 90% of requests reach: the 10th percentile
  over requests of output tokens / (finish - arrival). BRIEF §8, Part 2: "P90 end-to-end normalised
  per-user output tokens/s". A P90 in serving benchmarks is the slow tail: vLLM's benchmark reports the
  P-th percentile of each request's end-to-end latency (percentiles_e2el_ms, np.percentile over
  requests), the latency P% of requests stay under, and Kubernetes' inference-perf normalises that
  latency by the output tokens (docs/metrics.md, "normalized time per output token"). A rate is the
  reciprocal of a normalised latency, so the rate 90% of requests reach is the 10th percentile of the
  rates (the fastest tenth, np.percentile(rate, 90), is not a P90 of anything a user waits for).
  `interactivity_median_e2e_tok_s_user` is the median beside it.
- throughput_tok_s_per_device: every token the requests hold (prompt tokens, prefix-cached ones
  included, plus output tokens) / wall time of the run / devices (BRIEF §8: "logical tokens/s per GPU
  incl. cached tokens").
- prefix_hit_rate: prompt tokens served from the prefix cache / prompt tokens admitted (vLLM's
  vllm:prefix_cache_hits / vllm:prefix_cache_queries).
- running_requests_mean: the mean over time of the requests running (scheduled in the step under way;
  0 while the engine idles), over the run's span or the window: vLLM reports running requests as the
  gauge vllm:num_requests_running, which a published figure reads over time, and engine steps last
  from microseconds (one decode token) to seconds (a long prefill chunk), so a mean over steps weighs
  a short step as much as a long one. `running_requests_mean_per_step` keeps that per-step mean (of the
  requests running after each step's scheduling; in a window, the steps that start inside it).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from glm53.engine.request import RequestOutput


def summarize(outputs: Sequence[RequestOutput], *, duration_s: float | None = None, num_devices: int = 1,
              scheduler_stats=None, transfers=None, steps: Sequence[tuple[float, float, int]] = (),
              window: tuple[float, float] | None = None) -> dict:
    """Metrics of a finished run -> dict whose keys carry their units (the module docstring defines them).

    Whole run (window None): over every output, throughput = every token (prompt, cached ones too, and
    output) / duration_s, the run's span starting at the first arrival. Window (t0, t1) on the engine
    clock (a closed loop's steady state, before its drain): duration is t1 - t0; throughput counts a
    prompt when its first token came inside the window and each output token whose time is inside it;
    latencies are over the requests that arrived inside it (the caller passes them all finished:
    `ClosedLoopClient.run(stop_at_drain=True)` waits for them).
    steps: per engine step (start s, end s, requests running during it), the engine's timeline; the
    running-request means are nan without them."""
    if window is not None:
        t0, t1 = window
        if not t1 > t0:
            raise ValueError(f"window must have t1 > t0, got {window}")
        duration_s = t1 - t0
        tokens = sum((o.prompt_ids.size if o.first_token_s is not None and t0 <= o.first_token_s <= t1 else 0)
                     + sum(t0 <= t <= t1 for t in o.token_times_s) for o in outputs)
        outputs = [o for o in outputs if t0 <= o.arrival_s <= t1]
    if not outputs:
        raise ValueError("no finished requests to summarize")
    if duration_s is None or duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    if window is None:
        tokens = sum(o.prompt_ids.size + len(o.token_ids) for o in outputs)
        t0 = min(o.arrival_s for o in outputs)
        t1 = t0 + duration_s
    timed = [o for o in outputs if o.first_token_s is not None]  # an aborted request may have no token
    ttft = np.asarray([o.first_token_s - o.arrival_s for o in timed])
    tpot = np.asarray([(o.finish_s - o.first_token_s) / (len(o.token_ids) - 1) for o in timed if len(o.token_ids) > 1])
    e2e_rate = np.asarray([len(o.token_ids) / (o.finish_s - o.arrival_s) for o in timed if o.finish_s > o.arrival_s])
    nan = float("nan")
    out = {
        "requests": len(outputs),
        "output_tokens": int(sum(len(o.token_ids) for o in outputs)),
        "duration_s": float(duration_s),
        "ttft_median_s": float(np.median(ttft)) if ttft.size else nan,
        "ttft_p90_s": float(np.percentile(ttft, 90)) if ttft.size else nan,
        "tpot_mean_s": float(tpot.mean()) if tpot.size else nan,
        "interactivity_tok_s_user": float(1000.0 / (tpot.mean() * 1000.0)) if tpot.size and tpot.mean() > 0 else nan,
        "interactivity_p90_e2e_tok_s_user": float(np.percentile(e2e_rate, 10)) if e2e_rate.size else nan,
        "interactivity_median_e2e_tok_s_user": float(np.median(e2e_rate)) if e2e_rate.size else nan,
        "throughput_tok_s_per_device": float(tokens / duration_s / num_devices),
        **running_means(steps, t0, t1, windowed=window is not None),
    }
    if scheduler_stats is not None:
        st = scheduler_stats
        out.update(preemptions=st.preemptions, offloads=st.offloads, recomputed_tokens=st.recomputed_tokens,
                   prefix_hit_rate=st.prefix_hit_tokens / st.prompt_tokens if st.prompt_tokens else 0.0)
    if transfers is not None:
        out.update(d2h_bytes=transfers.d2h_bytes, h2d_bytes=transfers.h2d_bytes,
                   host_link_modelled_s=transfers.modelled_link_s)
    return out


def cp_work_metrics(per_rank: dict) -> dict:
    """Context parallelism's per-rank work counters ({name: int [N]}, the runner's `cp_work_per_rank`)
    -> {"cp_<name>_per_rank": [N ints], "cp_<name>_max_over_mean": float (1.0 = balanced; the slowest
    rank sets the step time)}; {} without context parallelism."""
    out = {}
    for name, v in per_rank.items():
        v = np.asarray(v, np.int64)
        out[f"cp_{name}_per_rank"] = v.tolist()
        out[f"cp_{name}_max_over_mean"] = float(v.max() / v.mean()) if v.mean() > 0 else 1.0
    return out


def running_means(steps: Sequence[tuple[float, float, int]], t0: float, t1: float, *, windowed: bool = True) -> dict:
    """{"running_requests_mean": the time-weighted mean over [t0, t1] of the requests running (each step's
    count over [start, end), 0 outside every step), "running_requests_mean_per_step": the mean over the
    steps (those starting in [t0, t1] when `windowed`)}; nan without steps."""
    if not len(steps):
        return {"running_requests_mean": float("nan"), "running_requests_mean_per_step": float("nan")}
    covered = sum(n * max(0.0, min(end, t1) - max(start, t0)) for start, end, n in steps)
    counted = [n for start, _, n in steps if not windowed or t0 <= start <= t1]
    return {"running_requests_mean": float(covered / (t1 - t0)) if t1 > t0 else float("nan"),
            "running_requests_mean_per_step": float(np.mean(counted)) if counted else float("nan")}
