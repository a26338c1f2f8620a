"""Serving metrics from an engine run: latency, interactivity, throughput, memory traffic, cache reuse.

Definitions (times in seconds on the engine's clock):
- TTFT: first token time - arrival time, per request (latencies leave out requests aborted before
  their first token; every request's tokens count in throughput).
- TPOT: (finish - first token) / (output tokens - 1), per request with >= 2 output tokens.
- interactivity_tok_s_user: 1000 / mean TPOT in ms (tokens per second one user sees while decoding).
- interactivity_p90_e2e_tok_s_user: the 90th percentile over requests of output tokens / (finish -
  arrival), the end-to-end definition.
- throughput_tok_s_per_device: every token the requests hold (prompt tokens, prefix-cached ones
  included, plus output tokens) / wall time of the run / devices.
- prefix_hit_rate: prompt tokens served from the prefix cache / prompt tokens admitted.
- running_requests_mean: mean over engine steps (not time-weighted) of the requests running after
  each step's scheduling; the engine's `timeline` has the time axis.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from glm53.engine.request import RequestOutput


def summarize(outputs: Sequence[RequestOutput], *, duration_s: float | None = None, num_devices: int = 1,
              scheduler_stats=None, transfers=None, running_per_step: Sequence[int] = (),
              window: tuple[float, float] | None = None) -> dict:
    """Metrics of a finished run -> dict whose keys carry their units.

    Whole run (window None): over every output, throughput = every token (prompt, cached ones too, and
    output) / duration_s. Window (t0, t1) on the engine clock (a closed loop's steady state, before its
    drain): duration is t1 - t0; throughput counts a prompt when its first token came inside the window
    and each output token whose time is inside it; latencies are over the requests that arrived inside it
    (the caller passes them all finished: `ClosedLoopClient.run(stop_at_drain=True)` waits for them);
    running_per_step is the caller's, already cut to the window."""
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
    timed = [o for o in outputs if o.first_token_s is not None]  # an aborted request may have no token
    ttft = np.asarray([o.first_token_s - o.arrival_s for o in timed])
    tpot = np.asarray([(o.finish_s - o.first_token_s) / (len(o.token_ids) - 1) for o in timed if len(o.token_ids) > 1])
    e2e_rate = np.asarray([len(o.token_ids) / (o.finish_s - o.arrival_s) for o in timed if o.finish_s > o.arrival_s])
    out = {
        "requests": len(outputs),
        "output_tokens": int(sum(len(o.token_ids) for o in outputs)),
        "duration_s": float(duration_s),
        "ttft_median_s": float(np.median(ttft)) if ttft.size else float("nan"),
        "ttft_p90_s": float(np.percentile(ttft, 90)) if ttft.size else float("nan"),
        "tpot_mean_s": float(tpot.mean()) if tpot.size else float("nan"),
        "interactivity_tok_s_user": float(1000.0 / (tpot.mean() * 1000.0)) if tpot.size and tpot.mean() > 0
        else float("nan"),
        "interactivity_p90_e2e_tok_s_user": float(np.percentile(e2e_rate, 90)) if e2e_rate.size else float("nan"),
        "throughput_tok_s_per_device": float(tokens / duration_s / num_devices),
        "running_requests_mean": float(np.mean(running_per_step)) if len(running_per_step) else float("nan"),
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
