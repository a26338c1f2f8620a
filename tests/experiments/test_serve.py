"""experiments/serve.py end to end on a 2-layer tiny model: a policy x concurrency sweep over a trace
file, results.json with the contract keys, the sweep plot, and the live Prometheus endpoint."""

import importlib.util
import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from experiments import serve
from experiments import workloads as wl
from parallel.launch import free_port

KEYS = ("throughput_tok_s_per_device", "interactivity_tok_s_user", "interactivity_p90_e2e_tok_s_user", "ttft_median_s",
        "tpot_mean_s", "running_requests_mean", "preemptions", "recomputed_tokens", "d2h_bytes", "h2d_bytes",
        "prefix_hit_rate")


@pytest.mark.slow
def test_serve_sweep_writes_results_plot_and_metrics(tmp_path):
    t = wl.Turn
    sessions = [wl.Session(f"s{i}", f"user{i}", (t(40, 4, 0.0, (10 * i,)), t(80, 4, 0.0, (10 * i, 10 * i + 1))),
                           "trace") for i in range(3)]
    wl.save_trace(sessions, tmp_path / "trace.json")
    port = free_port()
    args = ["--config", str(serve.REPO / "configs/smoke.py"), "--out", str(tmp_path / "out"), "--no-progress",
            "--metrics-port", str(port), "--compile-cache", "", "--config.model.layers=2",
            "--config.workload.kind=trace", f"--config.workload.trace_path={tmp_path / 'trace.json'}",
            # the deployment of tests/engine/test_recompilation.py: same programs, loaded from the session's
            # compilation cache instead of compiled again
            "--config.deploy.max_model_len=128", "--config.deploy.max_num_batched_tokens=16",
            "--config.deploy.block_size=8", "--config.deploy.num_gpu_blocks=36", "--config.deploy.max_num_seqs=4",
            "--config.deploy.cpu_offload_bytes=67108864", "--config.sweep.kv_policy=('preempt', 'offload')",
            "--config.sweep.concurrency=(1, 3)"]
    res = serve.main(args)
    on_disk = json.loads((tmp_path / "out" / "results.json").read_text())
    assert on_disk["runs"] == json.loads(json.dumps(res["runs"]))
    runs = res["runs"]
    assert [(r["kv_policy"], r["concurrency"]) for r in runs] == [("preempt", 1), ("preempt", 3), ("offload", 1),
                                                                   ("offload", 3)]
    for r in runs:
        assert all(k in r for k in KEYS), [k for k in KEYS if k not in r]
        assert r["requests"] == 6 and r["output_tokens"] == 24
        assert len(r["timeline"]["t_s"]) == len(r["timeline"]["running_requests"]) > 0
    # 3 users x 84 tokens need 3 x 2 x 11 = 66 blocks of the 36: at concurrency 3 the pool runs out
    assert runs[1]["preemptions"] >= 1 and runs[1]["recomputed_tokens"] > 0
    # the offload host tier stores every full page and gives preempted requests their pages back
    tier = runs[3]["kv_offload"]["cpu"]
    assert runs[3]["preemptions"] >= 1 and runs[3]["d2h_bytes"] == tier["store_bytes"] > 0
    assert runs[3]["h2d_bytes"] == tier["load_bytes"] > 0 and tier["hits"] > 0
    # a preempted request recomputes at most its last block (8 tokens): the rest comes back from a cache
    assert runs[3]["recomputed_tokens"] <= 8 * runs[3]["preemptions"] and runs[1]["d2h_bytes"] == 0
    # at concurrency 1 every step runs the one request; over wall-clock time the gaps between steps
    # (the client's turn-around) count as none running, so the time-weighted mean is at most 1
    assert runs[0]["preemptions"] == 0 and runs[0]["running_requests_mean_per_step"] == 1.0
    assert 0.5 < runs[0]["running_requests_mean"] <= 1.0
    # turn 2 re-sends turn 1's 40 prompt tokens (its generated tokens are not in the trace): the 5 full
    # 8-token blocks of them hit; users are salted apart, so nothing else does
    assert runs[0]["prefix_hit_rate"] == pytest.approx(3 * 40 / (3 * 120))
    assert (tmp_path / "out" / "throughput_vs_interactivity.png").stat().st_size > 10_000
    # the live endpoint shows the last point's engine (offload, concurrency 3) under vLLM's names
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {(s.name, s.labels.get("tier")): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("vllm:num_preemptions_total", None)] == runs[3]["preemptions"]
    assert samples[("vllm:generation_tokens_total", None)] == runs[3]["output_tokens"]
    assert samples[("vllm:kv_offload_store_bytes_total", "cpu")] == tier["store_bytes"]
    assert samples[("vllm:kv_offload_hits_total", "cpu")] == tier["hits"]
    assert samples[("vllm:time_to_first_token_seconds_count", None)] == runs[3]["requests"]


PART1_KEYS = ("deployment", "kv_policy", "concurrency", "max_model_len", "running_requests_mean",
              "throughput_tok_s_per_gpu", "interactivity_tok_s_user", "interactivity_p90_e2e_tok_s_user",
              "ttft_median_s", "num_speculative_tokens", "device_kv_budget_bytes_per_gpu")


def test_the_paper_config_runs_in_the_simulator_and_repeats_exactly(tmp_path):
    """configs/paper/part1.py at 1/64 scale: full GLM-5.3 shapes, no weights, a virtual clock; a
    simulated run does not depend on the machine, so two runs agree in everything but wall time."""
    from experiments.deployments import kv_budget, published

    args = ["--config", str(serve.REPO / "configs/paper/part1.py"), "--no-progress", "--compile-cache", "",
            "--config.workload.sessions=3", "--config.workload.scale=0.015625", "--config.workload.turns=3",
            "--config.sweep.concurrency=(1, 3)"]
    a = serve.main(args + ["--out", str(tmp_path / "a")])["runs"]
    b = serve.main(args + ["--out", str(tmp_path / "b")])["runs"]
    assert [(r["kv_policy"], r["concurrency"]) for r in a] == [("hisparse", 1), ("hisparse", 3), ("offload", 1),
                                                               ("offload", 3)]
    for r in a:
        assert all(k in r for k in PART1_KEYS), [k for k in PART1_KEYS if k not in r]
        assert r["runner"] == "sim" and r["deployment"] == "DP1 TP8 PCP1 DCP1" and r["max_model_len"] == 142_000
        assert r["simulated_s"] > 0 and r["requests"] == 9 and r["num_speculative_tokens"] == 0
        # the pool is the memory plan's budget for the policy's deployment, in whole blocks
        dep = published(f"tp8_{r['kv_policy']}", max_model_len=142_000, max_num_batched_tokens=32_768)
        assert 0 <= kv_budget(dep) - r["device_kv_budget_bytes_per_gpu"] < 64 * 54_728
    wall = ("wall_s", "sim_steps_per_wall_s")
    same = [json.dumps({k: v for k, v in r.items() if k not in wall}, sort_keys=True) for r in a]  # NaN == NaN
    assert same == [json.dumps({k: v for k, v in r.items() if k not in wall}, sort_keys=True) for r in b]
    # a fixed per-step cost lengthens each step by itself: the schedule is the same (it does not depend on
    # time), so the mean step (sim_step_mean_s) grows by exactly that much
    c = serve.main(args + ["--out", str(tmp_path / "c"), "--config.runner.step_overhead_s=0.01",
                           "--config.sweep.concurrency=(3,)", "--config.sweep.kv_policy=('offload',)"])["runs"]
    base = next(r for r in a if (r["kv_policy"], r["concurrency"]) == ("offload", 3))
    assert c[0]["engine_steps"] == base["engine_steps"] and base["sim_step_mean_s"] > 0
    assert c[0]["sim_step_mean_s"] - base["sim_step_mean_s"] == pytest.approx(0.01, rel=1e-6)
    # and so does each step of either kind (step_mix: the same steps, here over the whole run)
    mix, mix0 = c[0]["step_mix"], base["step_mix"]
    assert mix0["decode_only"]["steps"] > 0 and mix0["with_prefill"]["steps"] > 0
    assert mix0["decode_only"]["steps"] + mix0["with_prefill"]["steps"] == base["engine_steps"]
    assert mix0["span_s"] == pytest.approx(mix0["decode_only"]["time_s"] + mix0["with_prefill"]["time_s"])  # no gaps
    for kind in ("decode_only", "with_prefill"):
        assert mix[kind]["steps"] == mix0[kind]["steps"]
        assert mix[kind]["mean_s"] - mix0[kind]["mean_s"] == pytest.approx(0.01, rel=1e-6)
    assert mix["with_prefill"]["prefill_tokens_mean"] == mix0["with_prefill"]["prefill_tokens_mean"] > 1


def test_the_tiered_h200_config_puts_each_boundary_inside_the_range(tmp_path):
    """configs/paper/tiered_scaling_h200.py: the device pool holds between 48 and 64 conversations, the host
    tier between 96 and 128; at 128 conversations the host tier alone keeps nothing while the simulated
    filesystem tier behind it keeps the hits (and the throughput) of a working set that fits."""
    import glm53
    from experiments.common import load_config
    from kvcache.block_pool import KVCacheManager
    from kvcache.policies.offload import host_tier_blocks

    path = str(serve.REPO / "configs/paper/tiered_scaling_h200.py")
    cfg = load_config(path)
    spec = importlib.util.spec_from_file_location("tiered_h200", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    model = glm53.get_preset(cfg.model.preset)
    d = serve._deploy(cfg, "host").resolved(model, "bfloat16")
    sizes = d.kv_sizes(model, "bfloat16")
    kv = KVCacheManager(d.num_gpu_blocks, d.tokens_per_block, ("mla", "indexer"),
                        group_tokens_per_block=d.group_tokens_per_block(("mla", "indexer")))
    assert 48 < d.num_gpu_blocks / kv.blocks_needed_all(mod.CONVERSATION_TOKENS) < 64
    host = host_tier_blocks(d.cpu_offload_bytes, sizes.page_bytes, d.group_tokens_per_block(("mla", "indexer")))
    assert 96 < host["mla"] * 64 / mod.CONVERSATION_TOKENS < 128
    runs = serve.main(["--config", path, "--no-progress", "--compile-cache", "", "--out", str(tmp_path),
                       "--config.sweep.concurrency=(128,)", "--config.sweep.kv_policy=('host', 'host_fs')"])["runs"]
    host_only, with_fs = runs
    assert host_only["prefix_hit_rate"] == 0 and with_fs["prefix_hit_rate"] > 0.6
    assert with_fs["kv_offload"]["fs"]["hits"] > 0 and with_fs["sim_tier_busy_frac"]["fs"]["read"] > 0
    assert with_fs["throughput_tok_s_per_gpu"] > 2 * host_only["throughput_tok_s_per_gpu"]


def test_steady_measure_stops_at_the_drain_and_reports_its_window(tmp_path):
    """sweep.measure="steady" (configs/paper/part2.py's P/D pair at 1/64 scale): the run is the full run
    up to the end of its steady window (a simulated run is deterministic, so the window is the same), it
    stops there instead of draining, and its figures are the window's."""
    args = ["--config", str(serve.REPO / "configs/paper/part2.py"), "--no-progress", "--compile-cache", "",
            "--config.workload.sessions=6", "--config.workload.scale=0.015625", "--config.workload.median_turns=4.0",
            "--config.sweep.concurrency=(2,)", "--config.sweep.kv_policy=('pcp_dcp+hisparse',)",
            "--config.sweep.sessions_per_user=3", "--config.sweep.window_warmup_s=0.0", "--config.sweep.window_s=0.0"]
    full = serve.main(args + ["--out", str(tmp_path / "full"), "--config.sweep.measure=full"])
    steady = serve.main(args + ["--out", str(tmp_path / "steady"), "--config.sweep.measure=steady"])
    assert full["measure"] == "full" and steady["measure"] == "steady"
    t0, t1 = full["steady_window_s"]
    assert steady["steady_window_s"] == [t0, t1] and 0 == t0 < t1 < full["simulated_s"]
    assert t1 <= steady["simulated_s"] < full["simulated_s"] and steady["duration_s"] == t1 - t0
    assert 0 < steady["requests"] < full["requests"]
    # the window keeps the pool full: more requests run on average than over the drained whole run
    assert steady["running_requests_mean"] > full["running_requests_mean"]
    with pytest.raises(ValueError, match="measure"):
        serve.main(args + ["--out", str(tmp_path / "bad"), "--config.sweep.measure=steadyish"])
    # a window after a warm-up, both inside the pool's full part: the figures are that window's, recorded with
    # the point, and the run stops once the requests in flight at its end have finished
    w0, w = round(t1 / 4, 3), round(t1 / 2, 3)
    win = serve.main(args + ["--out", str(tmp_path / "win"), "--config.sweep.measure=steady",
                             f"--config.sweep.window_warmup_s={w0}", f"--config.sweep.window_s={w}"])
    assert win["steady_window_s"] == [w0, w0 + w] and win["duration_s"] == pytest.approx(w)
    assert (win["window_warmup_s"], win["window_s"]) == (w0, w)
    assert (steady["window_warmup_s"], steady["window_s"]) == (0, 0)
    assert w0 + w <= win["simulated_s"] < steady["simulated_s"] and 0 < win["requests"] < steady["requests"]
    assert 0 < win["sessions_started"] <= steady["sessions_started"] <= 6
    with pytest.raises(ValueError, match="need sweep.measure='steady'"):
        serve.main(args + ["--out", str(tmp_path / "bad"), "--config.sweep.measure=full",
                           f"--config.sweep.window_s={w}"])
    with pytest.raises(ValueError, match="ran short of sessions"):  # the pool runs short at t1, inside this window
        serve.main(args + ["--out", str(tmp_path / "short"), "--config.sweep.measure=steady",
                           f"--config.sweep.window_s={t1 * 2}"])


def test_resume_takes_a_file_from_before_a_knob_added_at_its_default(tmp_path):
    """--resume keeps the points of a results.json measured before a config key existed, when the current
    config leaves that key at the built-in default; any other difference, or the new key set otherwise,
    refuses. A key whose default changed later stands, in a file without it, for its default before."""
    from experiments import serve

    cfg = serve.default_config()
    old = json.loads(json.dumps(cfg.to_dict(), default=serve._jsonable))
    del old["runner"]["host_copy_overlap"]  # a file from before the knob
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"config": old, "runs": [{"kv_policy": "preempt", "concurrency": 1}]}))
    assert [r["kv_policy"] for r in serve._resumed(path, cfg)] == ["preempt"]
    cfg.runner.host_copy_overlap = 0.5
    with pytest.raises(SystemExit, match="another config"):
        serve._resumed(path, cfg)
    cfg = serve.default_config()
    cfg.runner.step_overhead_s = 1e-3
    with pytest.raises(SystemExit, match="another config"):
        serve._resumed(path, cfg)
    # a key whose default changed: a file from before it ran the old behaviour, which only that value keeps
    del old["pd"]["consumer_waits"]
    path.write_text(json.dumps({"config": old, "runs": [{"kv_policy": "preempt", "concurrency": 1}]}))
    with pytest.raises(SystemExit, match="another config"):
        serve._resumed(path, serve.default_config())
    cfg = serve.default_config()
    cfg.pd.consumer_waits = False
    assert [r["kv_policy"] for r in serve._resumed(path, cfg)] == ["preempt"]


def test_a_sweep_that_drops_jaxs_caches_warms_its_buckets_up_again(tmp_path, monkeypatch):
    """warmup="buckets" compiles every program before the first point; a point before which the sweep drops
    JAX's caches (past its memory-map budget) finds none of them, so the sweep warms up again first, and
    the time counts as warm-up. A budget of a third of a raised vm.max_map_count keeps them longer."""
    from experiments import common, serve

    calls = []
    monkeypatch.setattr(serve, "warm_up", lambda model, cfg: calls.append("warm_up") or 2.0)
    dropped = iter([False, True, False])  # the caches go before the second point only
    monkeypatch.setattr(serve, "bound_memory_maps", lambda limit: calls.append(("bound", limit)) or next(dropped))

    def run_one(model, cfg, policy, conc, **kw):
        calls.append((policy, conc))
        return dict(kv_policy=policy, concurrency=conc, throughput_tok_s_per_device=1.0, interactivity_tok_s_user=1.0,
                    ttft_median_s=0.0, running_requests_mean=1.0, preemptions=0, prefix_hit_rate=0.0)

    monkeypatch.setattr(serve, "run_one", run_one)
    monkeypatch.setattr(serve, "_model", lambda model_cfg, weights=True: (None, "no model: run_one is replaced"))
    res = serve.main(["--out", str(tmp_path), "--no-progress", "--compile-cache", "", "--config.model.layers=1",
                      "--config.warmup=buckets", "--config.sweep.kv_policy=('preempt', 'swap', 'offload')",
                      "--config.sweep.concurrency=(1,)"])
    budget = common.sweep_map_budget()
    assert calls == ["warm_up", ("bound", budget), ("preempt", 1), ("bound", budget), "warm_up", ("swap", 1),
                     ("bound", budget), ("offload", 1)]
    assert res["warmup_s"] == 4.0
    monkeypatch.setattr("glm53.engine.runner.compilation.max_map_count", lambda: 262_144)
    assert common.sweep_map_budget() == 78_643
    monkeypatch.setattr("glm53.engine.runner.compilation.max_map_count", lambda: 65_530)
    assert common.sweep_map_budget() == common.MAX_MAPS == 20_000


def test_step_mix_splits_the_steps_of_a_window_by_what_they_carry():
    """step_mix on a hand-built timeline (start, running, waiting, free blocks, end, prefill tokens): the
    steps starting inside the window, decode-only (0 prefill tokens) apart from prefill-carrying ones."""
    timeline = [(0.0, 2, 0, 9, 0.5, 0), (0.5, 2, 1, 9, 1.5, 100), (1.5, 2, 0, 9, 2.0, 0), (2.0, 3, 0, 8, 4.0, 50),
                (4.0, 3, 0, 8, 4.25, 0)]
    assert serve.step_mix(timeline, (0.4, 2.5)) == {
        "span_s": 3.5, "decode_only": {"steps": 1, "mean_s": 0.5, "time_s": 0.5},
        "with_prefill": {"steps": 2, "mean_s": 1.5, "time_s": 3.0, "prefill_tokens_mean": 75.0}}
    whole = serve.step_mix(timeline)
    assert whole["decode_only"] == {"steps": 3, "mean_s": 1.25 / 3, "time_s": 1.25}
    assert serve.step_mix(timeline, (5.0, 6.0))["with_prefill"] == {"steps": 0, "mean_s": None, "time_s": 0,
                                                                   "prefill_tokens_mean": None}


def test_the_tiers_media_scale_their_bandwidth_and_fixed_time_per_chunk():
    """runner.tier_bandwidth_scale multiplies every simulated tier medium's bandwidths, tier_latency_scale its
    fixed times per chunk (0: none): the P/D connector's assumed 20 us a chunk is swept this way."""
    from experiments import serve
    from glm53.perfmodel import STORAGE

    cfg = serve.default_config()
    cfg.runner.tier_bandwidth_scale, cfg.runner.tier_latency_scale = 0.5, 10.0
    media = serve._tier_storage(cfg)
    assert set(media) == set(STORAGE)
    for kind, m in media.items():
        assert m.read_bandwidth == STORAGE[kind].read_bandwidth * 0.5
        assert m.read_latency_s == pytest.approx(STORAGE[kind].read_latency_s * 10)
        assert m.write_latency_s == pytest.approx(STORAGE[kind].write_latency_s * 10)
    assert media["p2p"].read_latency_s == pytest.approx(200e-6)
    cfg.runner.tier_latency_scale = 0.0
    assert serve._tier_storage(cfg)["p2p"].read_latency_s == 0.0
    cfg.runner.tier_latency_scale = -1.0
    with pytest.raises(ValueError, match="tier_latency_scale must be >= 0"):
        serve._tier_storage(cfg)
