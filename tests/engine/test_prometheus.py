"""glm53.engine.prometheus: vLLM's metric names and types as a Prometheus parser reads them, and values
that agree with the engine's own per-request record (a priced runner on a virtual clock makes every time
exact)."""

import dataclasses
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import glm53
from glm53 import DeployConfig, Engine, SamplingParams
from glm53.engine.plan import VirtualClock
from glm53.engine.prometheus import (
    ITERATION_TOKENS_BUCKETS,
    ITL_BUCKETS,
    N_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    MetricsEndpoint,
    ServingMetrics,
)
from glm53.engine.synthetic import SyntheticRunner
from parallel.launch import free_port

TINY = glm53.get_preset("tiny")
STEP_S = 0.25


class PricedRunner(SyntheticRunner):
    """Every step takes STEP_S of virtual time."""

    def execute(self, plan):
        return dataclasses.replace(super().execute(plan), duration_s=STEP_S)


def _engine():
    deploy = DeployConfig(max_model_len=64, max_num_seqs=2, block_size=8, num_gpu_blocks=24, max_num_batched_tokens=32)
    return Engine(TINY, deploy, runner=PricedRunner(lambda row: 7), clock=VirtualClock())


def _parse(text: str) -> dict:
    """{family name: (type, {(sample name, frozenset of labels): value})}."""
    out = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = (fam.type, {(s.name, frozenset(s.labels.items())): s.value for s in fam.samples})
    return out


def _value(fams, family, sample=None, **labels):
    kind, samples = fams[family]
    want = {("model_name", "tiny-test"), ("engine", "0"), *((k, str(v)) for k, v in labels.items())}
    hits = [v for (name, lab), v in samples.items() if name == (sample or family) and lab == frozenset(want)]
    assert len(hits) == 1, (family, sample, labels, samples)
    return hits[0]


def _buckets_match(fams, family, values, bounds):
    """The histogram's cumulative bucket counts, count and sum equal those of `values`."""
    values = np.asarray(values, np.float64)
    for b in bounds:
        assert _value(fams, family, family + "_bucket", le=str(float(b))) == (values <= b + 1e-12).sum(), (family, b)
    assert _value(fams, family, family + "_count") == values.size
    assert _value(fams, family, family + "_sum") == pytest.approx(values.sum())


def test_names_types_and_values_follow_the_engine():
    eng = _engine()
    metrics = ServingMetrics(eng, model_name="tiny-test")
    rng = np.random.default_rng(0)
    lens, new = (20, 10, 30), (3, 4, 2)
    ids = [eng.add_request(rng.integers(0, 256, n), SamplingParams(k)) for n, k in zip(lens[:2], new[:2])]
    eng.step()
    ids.append(eng.add_request(rng.integers(0, 256, lens[2]), SamplingParams(new[2])))  # arrives at STEP_S
    eng.step()  # two requests run (max_num_seqs), the third waits
    fams = _parse(metrics.text())
    assert _value(fams, "vllm:num_requests_running") == 2 and _value(fams, "vllm:num_requests_waiting") == 1
    used = 24 - eng.scheduler.kv.num_free_blocks
    assert used > 0 and _value(fams, "vllm:kv_cache_usage_perc") == pytest.approx(used / 24)
    while eng.has_unfinished():
        eng.step()
    fams = _parse(metrics.text())
    types = {name: kind for name, (kind, _) in fams.items()}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:cache_config_info"):
        assert types[name] == "gauge", name
    for name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions", "vllm:prompt_tokens",
                 "vllm:generation_tokens", "vllm:request_success", "glm53:recomputed_tokens"):
        assert types[name] == "counter", name
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                 "vllm:request_time_per_output_token_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                 "vllm:request_params_max_tokens", "vllm:request_params_n", "vllm:iteration_tokens_total"):
        assert types[name] == "histogram", name
    assert "vllm:hisparse_cache_hits" not in types and "vllm:kv_offload_hits" not in types  # policy-specific
    assert _value(fams, "vllm:cache_config_info", block_size=8, num_gpu_blocks=24, cache_dtype="bfloat16",
                  enable_prefix_caching=True, kv_policy="preempt") == 1
    # counters: a scraper sees them with the _total suffix
    assert _value(fams, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == sum(lens)
    assert _value(fams, "vllm:generation_tokens", "vllm:generation_tokens_total") == sum(new)
    assert _value(fams, "vllm:request_success", "vllm:request_success_total", finished_reason="length") == 3
    assert _value(fams, "vllm:num_preemptions", "vllm:num_preemptions_total") == 0
    assert _value(fams, "vllm:num_requests_running") == 0 and _value(fams, "vllm:kv_cache_usage_perc") == 0
    # histograms: exactly the engine's own per-request times
    outs = [eng.output(r) for r in ids]
    reqs = [eng.finished[r] for r in ids]
    assert reqs[2].scheduled_s > reqs[2].arrival_s == STEP_S  # it queued behind the first two
    _buckets_match(fams, "vllm:time_to_first_token_seconds", [o.ttft_s for o in outs], TTFT_BUCKETS)
    _buckets_match(fams, "vllm:inter_token_latency_seconds", np.concatenate([np.diff(o.token_times_s) for o in outs]),
                   ITL_BUCKETS)
    _buckets_match(fams, "vllm:e2e_request_latency_seconds", [o.finish_s - o.arrival_s for o in outs], ())
    _buckets_match(fams, "vllm:request_queue_time_seconds", [r.scheduled_s - r.arrival_s for r in reqs], ())
    _buckets_match(fams, "vllm:request_prompt_tokens", lens, (1, 2, 5, 10, 20, 50))
    # the phases of each request (vLLM's definitions), its max_tokens and n, and the tokens of each step
    first, last = [r.token_times_s[0] for r in reqs], [r.token_times_s[-1] for r in reqs]
    _buckets_match(fams, "vllm:request_prefill_time_seconds", [f - r.scheduled_s for f, r in zip(first, reqs)],
                   REQUEST_LATENCY_BUCKETS)
    _buckets_match(fams, "vllm:request_decode_time_seconds", np.subtract(last, first), REQUEST_LATENCY_BUCKETS)
    _buckets_match(fams, "vllm:request_inference_time_seconds", [x - r.scheduled_s for x, r in zip(last, reqs)],
                   REQUEST_LATENCY_BUCKETS)
    tpot = [(x - f) / (k - 1) for x, f, k in zip(last, first, new)]
    assert min(tpot) >= STEP_S  # every request's tokens are a step or more apart
    _buckets_match(fams, "vllm:request_time_per_output_token_seconds", tpot, ITL_BUCKETS)
    _buckets_match(fams, "vllm:request_params_max_tokens", new, (1, 2, 5, 10, 20, 50))
    _buckets_match(fams, "vllm:request_params_n", [1, 1, 1], N_BUCKETS)
    steps = sorted({t for r in reqs for t in r.token_times_s})  # a priced step per distinct time
    per_step = [sum(r.token_times_s.count(t) + (r.prompt_ids.size if r.token_times_s[0] == t else 0) for r in reqs)
                for t in steps]
    assert max(per_step) > sum(new)  # some step carried a prompt
    _buckets_match(fams, "vllm:iteration_tokens_total", per_step, ITERATION_TOKENS_BUCKETS)
    for reason in ("stop", "abort", "error", "repetition"):  # vLLM's label set from the start
        assert _value(fams, "vllm:request_success", "vllm:request_success_total", finished_reason=reason) == 0
    # a second request with the first one's prompt hits its cached blocks: 2 full 8-token blocks
    again = eng.add_request(eng.finished[ids[0]].prompt_ids, SamplingParams(1))
    while eng.has_unfinished():
        eng.step()
    fams = _parse(metrics.text())
    assert _value(fams, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == sum(lens) + 20
    assert _value(fams, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 16
    assert eng.output(again).token_ids.tolist() == [7]
    # XLA compilations in this process since the metrics began: a new program counts once
    before = metrics.compilations
    import jax

    jax.jit(lambda x: x * 3 + 1)(np.arange(5, dtype=np.int32)).block_until_ready()
    fams = _parse(metrics.text())
    assert metrics.compilations == before + 1
    assert fams["glm53:xla_compilations"][1][("glm53:xla_compilations_total",
                                              frozenset({("model_name", "tiny-test")}))] == before + 1


def test_endpoint_serves_the_attached_engine_over_http():
    endpoint = MetricsEndpoint()
    port = free_port()
    server, thread = endpoint.serve(port)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        assert "vllm:" not in urllib.request.urlopen(url, timeout=10).read().decode()  # nothing attached yet
        for k in (1, 2):  # a sweep attaches each point's fresh engine in turn
            eng = _engine()
            endpoint.attach(ServingMetrics(eng, model_name="tiny-test"))
            eng.generate([np.arange(12)] * k, max_new_tokens=3)
            fams = _parse(urllib.request.urlopen(url, timeout=10).read().decode())
            assert _value(fams, "vllm:generation_tokens", "vllm:generation_tokens_total") == 3 * k
    finally:
        server.shutdown()
        thread.join(5)
