"""experiments.pd_http's deployments are what the servers it starts build (the full benchmark starts 3-4
processes per point and runs for about an hour; results/paper/part2_laptop holds a committed run)."""

import pytest

import glm53
from experiments import pd_http


@pytest.mark.parametrize("layout", pd_http.DECODE_LAYOUTS)
def test_each_deployment_is_four_devices_of_producers_and_consumers_with_one_page_size(layout):
    cfg = glm53.get_preset("tiny")
    specs = pd_http.deployments(pd_http.DEPLOY, layout)
    assert set(specs) == {"pcp_dcp+hisparse", "dp+offload"}
    for name, spec in specs.items():
        devices, page_tokens, policies, kv, listed = 0, set(), set(), set(), set()
        made = pd_http.server_deploys(spec, "tiny")
        for role, want in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
            assert len(made[role]) == len(spec[role])
            for d in made[role]:
                d = d.resolved(cfg, "float32")
                assert d.kv_role == want and d.kv_transfer_config["kv_connector"] == "PdConnector"
                assert (d.max_model_len, d.max_num_seqs, d.max_num_batched_tokens) == (
                    pd_http.DEPLOY["max_model_len"], pd_http.DEPLOY["max_num_seqs"],
                    pd_http.DEPLOY["max_num_batched_tokens"])
                devices += d.devices_per_replica * d.data_parallel_size
                # a chunk (a page) must cover the same tokens on producer and consumer to be shared
                page_tokens.add(d.block_size * d.decode_context_parallel_size)
                if role == "decode":
                    # dp_ep: one server of two ranks that share the experts, else one-device servers
                    assert (d.experts_across_ranks, d.data_parallel_size) == ((True, 2) if layout == "dp_ep" else (False, 1))
                    policies.add(d.kv_policy)
                    listed.add(d.pd_producers)
                else:
                    kv.add(f"127.0.0.1:{d.kv_transfer_config['kv_port']}")
                    if name.startswith("pcp_dcp"):
                        assert (d.prefill_context_parallel_size, d.decode_context_parallel_size) == (2, 2)
                        assert d.enable_expert_parallel
        assert devices == pd_http.DEVICES, name
        assert page_tokens == {pd_http.DEPLOY["block_size"]}, name
        assert policies == {"hisparse" if name.endswith("hisparse") else "offload"}, name
        assert listed == {tuple(sorted(kv))} and len(kv) == len(spec["prefill"]), name  # every consumer lists them all


def test_redraw_tabulates_each_point_of_a_results_file(tmp_path):
    """`--redraw DIR` rewrites table.md and the figure from DIR/results.json alone: one column per point, each
    value in its unit, HiSparse's hot-buffer counts left blank where the decode policy has none."""
    import json

    run = dict(concurrency=1, throughput_tok_s_per_device=95.4, interactivity_p90_e2e_tok_s_user=70.2,
               ttft_median_s=0.1164, tpot_mean_s=0.01463, kv_transfer_received_tokens=9168,
               decode_prompt_tokens=34056, decode_prefix_hit_rate=0.9664, decode_h2d_bytes=260_017_600,
               preemptions=0, compilations_after_warmup=0, prefill_fallbacks=0, resends=2)
    result = {"preset": "tiny", "decode_layout": "dp_ep", "date": "2026-12-06", "git_revision": "0123456789abcdef",
              "machine": {"cpu": "cpu", "cores": 2}, "deployments": {"pcp_dcp+hisparse": {}, "dp+offload": {}},
              "complete": False,
              "runs": [dict(run, kv_policy="pcp_dcp+hisparse", hisparse_hot_hits=163470, hisparse_hot_misses=161246),
                       dict(run, kv_policy="dp+offload", hisparse_hot_hits=0, hisparse_hot_misses=0, tpot_mean_s=0.013)]}
    (tmp_path / "results.json").write_text(json.dumps(result))
    pd_http.main(["--redraw", str(tmp_path)])
    text = (tmp_path / "table.md").read_text()
    assert "decode layout dp_ep" in text and "0123456789ab," in text and "incomplete" in text
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
             if line.startswith("| ") and not line.startswith("| |")]
    rows = {label: values for label, *values in cells}
    assert rows["TTFT median, ms"] == ["116", "116"] and rows["TPOT mean, ms"] == ["14.6", "13.0"]
    assert rows["decode host->device MB"] == ["260", "260"] and rows["decode prefix-cache hit rate"] == ["96.6%"] * 2
    assert rows["hot-buffer hits / misses"] == ["163,470 / 161,246", ""]
    assert rows["router prefill fallbacks / resends"] == ["0 / 2", "0 / 2"]
    assert rows["greedy tokens equal across deployments"] == ["", ""]  # only concurrency 1 of a full run has it
    assert (tmp_path / "pd_http.png").stat().st_size > 0


def test_the_committed_run_is_complete_with_the_published_decode_layout():
    """results/paper/part2_laptop (what docs/engine.md and reproduce's part2_pd_laptop read): every point of
    both deployments, the decode side as DP2 x EP2, each point's KV received over the PdConnector with
    nothing compiled after warm-up, and equal greedy tokens across the deployments at concurrency 1."""
    import json

    from experiments.common import REPO

    res = json.loads((REPO / "results/paper/part2_laptop/results.json").read_text())
    assert res["complete"] is True and res["decode_layout"] == "dp_ep"
    dp_ep = ["--data-parallel-size", "2", "--enable-expert-parallel", "--kv-policy"]
    assert {n: [x[:4] for x in spec["decode"]] for n, spec in res["deployments"].items()} == {
        n: [dp_ep] for n in pd_http.deployments(pd_http.DEPLOY)}
    runs = res["runs"]
    assert sorted((r["kv_policy"], r["concurrency"]) for r in runs) == sorted(
        (n, c) for n in res["deployments"] for c in (1, 2, 4))
    assert all(r["kv_transfer_received_tokens"] > 0 and r["compilations_after_warmup"] == 0 and r["resends"] == 0
               for r in runs)
    assert [r["tokens_equal"] for r in runs if r["concurrency"] == 1] == [True, True]
    assert (REPO / "results/paper/part2_laptop/table.md").read_text() == pd_http.table(res)


def test_the_twin_at_concurrency_1_serves_what_the_committed_servers_served():
    """experiments.pd_http.twin (validate_sim's P/D-over-HTTP comparison): at concurrency 1 nothing depends on
    wall-clock routing, so the twin of each deployment serves the committed real run's requests and output
    tokens and its decode side receives exactly the prompt tokens the real decode servers received from a
    producer; pricing every device on a quarter of the host ("shared") instead of each engine's two on
    all of it ("alone") makes each decode step take about twice as long. The model between them
    ("contended") is "alone" at concurrency 1, where one turn's prefill waits for the last turn's decode
    (an engine with nothing left is idle, even in its last step's host tail), and strictly between the
    two at concurrency 4, where prefills and decodes overlap."""
    import json

    from experiments import validate_sim
    from experiments.common import REPO

    real = json.loads((REPO / validate_sim.PD_HTTP_REAL / "results.json").read_text())
    sessions = pd_http.sessions_of(real)
    specs = pd_http.deployments(real["deploy"], real["decode_layout"])
    fit = {(r["kv_policy"], r["concurrency"]): r["cpu_spec_fit"] for r in real["runs"]}  # pd_http --fit-each-point
    for r in (r for r in real["runs"] if r["concurrency"] == 1):
        got = {h: pd_http.twin(specs[r["kv_policy"]], sessions, 1, preset=real["preset"],
                               host_specs=validate_sim.host_specs(r["cpu_spec_fit"]), host=h, deploy=real["deploy"])
               for h in pd_http.HOST_SHARING}
        for m in got.values():
            assert (m["requests"], m["output_tokens"], m["kv_transfer_received_tokens"]) == (
                r["requests"], r["output_tokens"], r["kv_transfer_received_tokens"]), r["kv_policy"]
        assert 1.8 < got["shared"]["tpot_mean_s"] / got["alone"]["tpot_mean_s"] < 2.05
        assert {k: v for k, v in got["contended"].items() if k not in ("host", "sim_wall_s")} == {
            k: v for k, v in got["alone"].items() if k not in ("host", "sim_wall_s")}
    got = {h: pd_http.twin(specs["dp+offload"], sessions, 4, preset=real["preset"],
                           host_specs=validate_sim.host_specs(fit["dp+offload", 4]), host=h, deploy=real["deploy"])
           for h in pd_http.HOST_SHARING}
    for k in ("ttft_median_s", "tpot_mean_s"):
        assert got["alone"][k] < got["contended"][k] < got["shared"][k], k
    with pytest.raises(ValueError, match="host must be one of"):
        pd_http.twin(specs["dp+offload"], sessions, 1, preset=real["preset"],
                     host_specs=validate_sim.host_specs(fit["dp+offload", 1]), host="half")
