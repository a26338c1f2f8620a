"""Prometheus metrics of an `Engine` under vLLM's names and types (../shared/ANCHORS.md §1), so dashboards,
routers and benchmark clients written for vLLM read them unchanged.

`ServingMetrics(engine, model_name)` registers one collector in its own `CollectorRegistry` and observes
the engine's steps (`Engine.add_observer`). Every metric carries the labels `model_name` and `engine`
(the data-parallel replica, as vLLM labels its DP ranks).

- Gauges, read from the engine at scrape time: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
  `vllm:kv_cache_usage_perc` (device blocks in use / pool blocks, 0-1), `vllm:cache_config_info` (value 1;
  labels block_size, num_gpu_blocks, cache_dtype, enable_prefix_caching, kv_policy: routers read the
  block size from it), HiSparse's `vllm:hisparse_host_cache_usage_perc` and the offload host tier's
  `vllm:kv_offload_host_cache_usage_perc`.
- Counters, the scheduler's and policies' cumulative counts at scrape time (prometheus appends
  `_total`): `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits` (prompt tokens looked up at first
  admission / found cached), `vllm:num_preemptions`, `vllm:prompt_tokens`, `vllm:generation_tokens`,
  `vllm:request_success{finished_reason}`; HiSparse's `vllm:hisparse_cache_hits`,
  `vllm:hisparse_cache_misses` (hot-buffer lookups, summed over IndexShare groups),
  `vllm:hisparse_host_to_device_bytes`; the offload tiers' `vllm:kv_offload_{hits,misses,corrupt}`
  (hash blocks for the host tier "cpu", chunks for secondary tiers) and `vllm:kv_offload_{store,load}_bytes`
  with a `tier` label ("cpu", "fs", "obj", "p2p", or a custom tier's name); under HiSparse with
  secondary tiers, the tiers' alone (its host pools have the hisparse_ figures).
  `vllm:request_success` has a sample for each of vLLM's finish reasons (stop, length, abort, error,
  repetition) from the start, 0 until one happens.
- Histograms, observed as tokens arrive (seconds on the engine's clock: virtual time in the simulator):
  `vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`,
  `vllm:iteration_tokens_total` (per replica step that produced tokens: the tokens it generated plus the
  prompts of the requests whose first token it produced, vLLM's count); and per finished request
  `vllm:e2e_request_latency_seconds`, `vllm:request_queue_time_seconds` (arrival to first scheduled),
  `vllm:request_prefill_time_seconds` (first scheduled to first token), `vllm:request_decode_time_seconds`
  (first to last token), `vllm:request_inference_time_seconds` (first scheduled to last token),
  `vllm:request_time_per_output_token_seconds` (decode time / (tokens - 1), 0 for one token),
  `vllm:request_prompt_tokens`, `vllm:request_generation_tokens`, `vllm:request_params_max_tokens`
  (max_new_tokens as the server filled it in) and `vllm:request_params_n` (1: one sequence per request);
  the four phase figures only for requests that were scheduled and produced a token. Buckets are vLLM's. Secondary tiers' `vllm:kv_offload_{load,store}_time_seconds{tier}` (one observation
  per job, the tier's own I/O time, from `kvcache.tiers.TierStats`).
- MTP speculative decoding (only with DeployConfig.speculative_config, as vLLM registers them only then):
  counters `vllm:spec_decode_num_drafts` (steps of a request that verified drafts),
  `vllm:spec_decode_num_draft_tokens`, `vllm:spec_decode_num_accepted_tokens` and
  `vllm:spec_decode_num_accepted_tokens_per_pos{position}` (glm53.engine.spec_decode.SpecDecodeStats);
  the mean acceptance length is 1 + accepted / drafts.
- This project's own figures under `glm53:` (recomputed tokens, host link bytes, engine steps, XLA
  compilations in this process; with the PdConnector, `glm53:kv_transfer_received_tokens`: prompt tokens
  whose KV a consumer loaded from a producer, and `glm53:kv_transfer_failed_lookups`: requests whose
  producer's KV it could not take for a reason other than "never prefilled", each logged once per producer;
  with data-parallel ranks that share the routed experts, `glm53:ep_all2all_bytes`: the bytes one device
  sent through the MoE all-to-alls).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import jax
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

_KINDS = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}  # a policy's series kinds

# vLLM's histogram buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")  # vLLM's; this engine never repeats-stops


def _token_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5 x powers of ten up to max_model_len (vLLM's build_1_2_5_buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(float(m * scale))
        scale *= 10


class ServingMetrics:
    """vLLM-named Prometheus metrics of `engine` (see the module docstring). `text()` renders them;
    `serve(port)` starts an HTTP endpoint on 127.0.0.1 (or `addr`). Thread-safe to scrape while the
    engine steps in another thread: the collector reads counters and lengths, and histograms lock."""

    def __init__(self, engine, model_name: str = "glm53", registry: CollectorRegistry | None = None):
        self.engine = engine
        self.model_name = model_name
        self.registry = registry or CollectorRegistry()
        self._labels = ["model_name", "engine"]
        self._lock = threading.Lock()
        self._generation_tokens = [0] * len(engine.replicas)
        self._success: dict[tuple[int, str], int] = {}
        h = lambda name, doc, buckets: Histogram(name, doc, self._labels, buckets=buckets, registry=self.registry)
        self.ttft = h("vllm:time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS)
        self.itl = h("vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = h("vllm:e2e_request_latency_seconds", "End to end request latency in seconds.",
                     REQUEST_LATENCY_BUCKETS)
        self.queue = h("vllm:request_queue_time_seconds", "Time a request spent waiting before it was first "
                       "scheduled, in seconds.", REQUEST_LATENCY_BUCKETS)
        self.tpot = h("vllm:request_time_per_output_token_seconds", "Per finished request, its mean seconds per "
                      "output token after the first.", ITL_BUCKETS)
        self.prefill = h("vllm:request_prefill_time_seconds", "Seconds from a request's first scheduling to its "
                         "first token.", REQUEST_LATENCY_BUCKETS)
        self.decode = h("vllm:request_decode_time_seconds", "Seconds from a request's first token to its last.",
                        REQUEST_LATENCY_BUCKETS)
        self.inference = h("vllm:request_inference_time_seconds", "Seconds from a request's first scheduling to its "
                           "last token.", REQUEST_LATENCY_BUCKETS)
        self.iteration = h("vllm:iteration_tokens_total", "Tokens per engine step: generated, plus the prompts of "
                           "requests that got their first token.", ITERATION_TOKENS_BUCKETS)
        tokens = _token_buckets(engine.deploy.max_model_len)
        self.req_prompt = h("vllm:request_prompt_tokens", "Prompt tokens per finished request.", tokens)
        self.req_generation = h("vllm:request_generation_tokens", "Generated tokens per finished request.", tokens)
        self.max_tokens = h("vllm:request_params_max_tokens", "The max_tokens each finished request ran with.", tokens)
        self.n = h("vllm:request_params_n", "The n (sequences) of each finished request.", N_BUCKETS)
        self.compilations = 0  # XLA programs compiled in this process since (JAX's monitoring events)
        jax.monitoring.register_event_duration_secs_listener(self._on_compile)
        self.registry.register(_Collector(self))
        engine.add_observer(self)

    def _on_compile(self, event, duration_s, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            self.compilations += 1

    # ------------------------------------------------------------------------------ engine observer
    def on_step(self, engine, tokens: Iterable[tuple[str, int, bool]], finished) -> None:
        """After every engine step: the tokens it produced and the requests it finished."""
        seen: dict[str, int] = {}
        for rid, _, _ in tokens:
            seen[rid] = seen.get(rid, 0) + 1
        with self._lock:
            step_tokens: dict[int, int] = {}  # per replica
            for rid, n in seen.items():
                req = engine.requests.get(rid) or engine.finished[rid]
                i = engine.replica_of(rid)
                labels = (self.model_name, str(i))
                self._generation_tokens[i] += n
                times = req.token_times_s
                first = len(times) - n  # index of this step's first token
                step_tokens[i] = step_tokens.get(i, 0) + n + (req.prompt_ids.size if first == 0 else 0)
                for k in range(first, len(times)):
                    if k == 0:
                        self.ttft.labels(*labels).observe(times[0] - req.arrival_s)
                    else:
                        self.itl.labels(*labels).observe(times[k] - times[k - 1])
            for i, n in step_tokens.items():
                self.iteration.labels(self.model_name, str(i)).observe(n)
            for req in finished:
                i = engine.replica_of(req.req_id)
                labels = (self.model_name, str(i))
                key = (i, req.finish_reason or "length")
                self._success[key] = self._success.get(key, 0) + 1
                self.e2e.labels(*labels).observe(req.finish_s - req.arrival_s)
                if req.scheduled_s is not None:
                    self.queue.labels(*labels).observe(req.scheduled_s - req.arrival_s)
                    if req.token_times_s:
                        first, last = req.token_times_s[0], req.token_times_s[-1]
                        n = len(req.token_times_s)
                        self.prefill.labels(*labels).observe(first - req.scheduled_s)
                        self.decode.labels(*labels).observe(last - first)
                        self.inference.labels(*labels).observe(last - req.scheduled_s)
                        self.tpot.labels(*labels).observe((last - first) / (n - 1) if n > 1 else 0.0)
                self.req_prompt.labels(*labels).observe(req.prompt_ids.size)
                self.req_generation.labels(*labels).observe(len(req.output_ids))
                self.max_tokens.labels(*labels).observe(req.params.max_new_tokens)
                self.n.labels(*labels).observe(1)

    # ---------------------------------------------------------------------------------- exposition
    def text(self) -> str:
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()

    def serve(self, port: int, addr: str = "127.0.0.1"):
        """Start the /metrics HTTP endpoint in a thread -> (server, thread) (prometheus_client)."""
        from prometheus_client import start_http_server

        return start_http_server(port, addr=addr, registry=self.registry)


class _Collector:
    """Reads the engine's gauges and cumulative counters at scrape time."""

    def __init__(self, metrics: ServingMetrics):
        self.m = metrics

    def collect(self):
        m, eng = self.m, self.m.engine
        labels = m._labels

        def family(kind, name, doc, extra=()):
            return kind(name, doc, labels=labels + list(extra))

        running = family(GaugeMetricFamily, "vllm:num_requests_running", "Requests in model execution batches.")
        waiting = family(GaugeMetricFamily, "vllm:num_requests_waiting", "Requests waiting to be processed.")
        usage = family(GaugeMetricFamily, "vllm:kv_cache_usage_perc", "Device KV-cache usage (1 = full).")
        d = eng.deploy
        info = family(GaugeMetricFamily, "vllm:cache_config_info", "Information of the KV cache configuration.",
                      ("block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching", "kv_policy"))
        queries = family(CounterMetricFamily, "vllm:prefix_cache_queries",
                         "Prompt tokens looked up in the prefix cache at admission.")
        hits = family(CounterMetricFamily, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        preempt = family(CounterMetricFamily, "vllm:num_preemptions", "Cumulative number of preemptions.")
        prompt = family(CounterMetricFamily, "vllm:prompt_tokens", "Prompt tokens admitted.")
        gen = family(CounterMetricFamily, "vllm:generation_tokens", "Generated tokens.")
        success = family(CounterMetricFamily, "vllm:request_success", "Finished requests.", ("finished_reason",))
        recomputed = family(CounterMetricFamily, "glm53:recomputed_tokens",
                            "Tokens computed again after a preemption.")
        d2h = family(CounterMetricFamily, "glm53:device_to_host_bytes", "KV bytes copied device -> host.")
        h2d = family(CounterMetricFamily, "glm53:host_to_device_bytes", "KV bytes copied host -> device.")
        steps = family(CounterMetricFamily, "glm53:scheduler_steps", "Scheduler steps that ran requests.")
        received = family(CounterMetricFamily, "glm53:kv_transfer_received_tokens",
                          "Prompt tokens whose KV came from a P/D producer (the PdConnector) instead of being computed.")
        failed = family(CounterMetricFamily, "glm53:kv_transfer_failed_lookups",
                        "P/D requests whose producer's KV this consumer could not take for a reason other than "
                        "the producer never having prefilled it (its chunks are another model's, weights' or KV "
                        "format's, or it did not answer); their prompts are computed.")
        compiles = CounterMetricFamily("glm53:xla_compilations", "XLA programs compiled by this process (a warm "
                                       "server compiles none while serving).", labels=["model_name"])
        compiles.add_metric([m.model_name], m.compilations)
        a2a = None
        if d.experts_across_ranks:  # the ranks share one runner and its devices: one figure, no engine label
            a2a = CounterMetricFamily("glm53:ep_all2all_bytes", "Bytes one device sent through the MoE "
                                      "all-to-alls of data-parallel ranks that share the routed experts.",
                                      labels=["model_name"])
            a2a.add_metric([m.model_name], eng.ep_all2all_bytes())
        # the policy's own series (kvcache.policies: its prometheus_series / prometheus_values)
        spec = d.policy
        own = {key: family(_KINDS[kind], name, doc) for key, kind, name, doc in spec.prometheus_series}
        tier = ("tier",)
        off = {k: family(CounterMetricFamily, f"vllm:kv_offload_{k}", doc, tier) for k, doc in (
            ("hits", "Blocks (host tier) or chunks (secondary tiers) served by the tier."),
            ("misses", "Lookups the tier could not serve."),
            ("corrupt", "Chunks that failed verification (dropped and recomputed)."),
            ("store_bytes", "Bytes stored to the tier."), ("load_bytes", "Bytes loaded from the tier."))}
        lat = {k: family(HistogramMetricFamily, f"vllm:kv_offload_{k}_time_seconds",
                         f"Secondary-tier {k} job time in seconds.", tier) for k in ("load", "store")}
        drafts = {k: family(CounterMetricFamily, f"vllm:spec_decode_{k}", doc) for k, doc in (
            ("num_drafts", "Steps of a request that verified draft tokens."),
            ("num_draft_tokens", "Draft tokens verified."),
            ("num_accepted_tokens", "Draft tokens accepted."))}
        per_pos = family(CounterMetricFamily, "vllm:spec_decode_num_accepted_tokens_per_pos",
                         "Draft tokens accepted, per draft position.", ("position",))
        for i, rep in enumerate(eng.replicas):
            sch, lv = rep.scheduler, [m.model_name, str(i)]
            running.add_metric(lv, len(sch.running))
            waiting.add_metric(lv, len(sch.waiting))
            total = sch.kv.pool.num_blocks
            usage.add_metric(lv, (total - sch.kv.num_free_blocks) / total if total else 0.0)
            info.add_metric(lv + [str(d.block_size), str(total), eng.sizes.kv_cache_dtype,
                                  str(d.enable_prefix_caching), d.kv_policy], 1.0)
            st = sch.stats
            queries.add_metric(lv, st.prompt_tokens)
            hits.add_metric(lv, st.prefix_hit_tokens)
            preempt.add_metric(lv, st.preemptions)
            prompt.add_metric(lv, st.prompt_tokens)
            gen.add_metric(lv, m._generation_tokens[i])
            recomputed.add_metric(lv, st.recomputed_tokens)
            d2h.add_metric(lv, sch.transfers.d2h_bytes)
            h2d.add_metric(lv, sch.transfers.h2d_bytes)
            steps.add_metric(lv, st.steps)
            if d.kv_role is not None:
                received.add_metric(lv, eng.kv_transfer_received_tokens(i))
                failed.add_metric(lv, eng.kv_transfer_failed(i))
            with m._lock:
                for reason in FINISH_REASONS:
                    success.add_metric(lv + [reason], m._success.get((i, reason), 0))
            if d.num_speculative_tokens:
                st = sch.spec
                for k, fam in drafts.items():
                    fam.add_metric(lv, getattr(st, k))
                for pos in range(d.num_speculative_tokens):
                    n = st.accepted_per_pos[pos] if pos < len(st.accepted_per_pos) else 0
                    per_pos.add_metric(lv + [str(pos)], n)
            pol = sch.policy
            if own:
                for key, value in pol.prometheus_values(sch, eng).items():
                    own[key].add_metric(lv, value)
            tiered = pol.tier_metrics()  # the offload tier's and its secondary tiers', or HiSparse's tiers'
            for name, counts in tiered.items():
                for k, fam in off.items():
                    fam.add_metric(lv + [name], counts.get(k, 0))
            if tiered and pol.host_tier.tiers is not None:
                for t in pol.host_tier.tiers.tiers:
                    for k, fam in lat.items():
                        h = getattr(t.stats, f"{k}_latency", None)
                        if h is not None and h.count:
                            fam.add_metric(lv + [t.name], h.prometheus_buckets(), h.sum)
        yield from (running, waiting, usage, info, queries, hits, preempt, prompt, gen, success, recomputed, d2h,
                    h2d, steps, compiles)
        if a2a is not None:
            yield a2a
        if d.kv_role is not None:
            yield received
            yield failed
        if d.num_speculative_tokens:
            yield from (*drafts.values(), per_pos)
        yield from own.values()
        if spec.reports_tiers(d):
            yield from off.values()
            yield from lat.values()


class MetricsEndpoint:
    """One /metrics HTTP endpoint that shows whichever engine's `ServingMetrics` is attached now (a sweep
    runs one fresh engine per point: `attach` each in turn; nothing attached serves an empty page)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.current: ServingMetrics | None = None
        self.registry.register(self)

    def attach(self, metrics: ServingMetrics) -> None:
        self.current = metrics

    def collect(self):
        cur = self.current
        if cur is not None:
            yield from cur.registry.collect()

    def serve(self, port: int, addr: str = "127.0.0.1"):
        from prometheus_client import start_http_server

        return start_http_server(port, addr=addr, registry=self.registry)
