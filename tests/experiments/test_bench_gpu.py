"""experiments.bench_gpu under --dry-run: every row of the H200 bench (and the four-layer slice through the
ModelRunner) runs at tiny shapes on the CPU, so the script the device session runs cannot rot. Times mean
nothing here; what is checked is what the run records: every planned row in priority order, each kernel
row's price equal to the performance model's for its shape (computed here independently), its ratio and
rates from its own figures, tile candidates as rows with one default, steady-state timing (no compile in
a timed call), the deadline, resume and a failing row. One dry run is shared by the module (~1-2 minutes
on 2 cores, mostly interpret-mode Pallas and the slice's compiles)."""

import dataclasses
import json

import pytest

from attention import hisparse, indexer, sparse_mla
from experiments import bench_gpu
from glm53.config import get_preset
from glm53.perfmodel import FP8_WEIGHT_BYTES, HARDWARE
from glm53.perfmodel import measured as M
from glm53.perfmodel.step import StepLayout, step_cost
from glm53.perfmodel.studies import weight_bytes_per_gpu

TINY = get_preset("tiny")


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_gpu")
    res = bench_gpu.main(["--out", str(out), "--slice", "--dry-run"])
    return out, res, json.loads((out / "results.json").read_text())


def _records(res):
    return sorted(res["kernels"] + res["slice"]["rows"], key=lambda r: r["seq"])


def test_every_planned_row_ran_once_in_priority_order(dry):
    out, res, on_disk = dry
    assert on_disk == json.loads(json.dumps(res))  # the file is the run's last state
    plan = bench_gpu.plan_rows(TINY, dry_run=True, with_slice=True)
    recs = _records(res)
    assert res["complete"] is True and res["planned_rows"] == len(plan) == len(recs)
    assert [r["seq"] for r in recs] == list(range(len(plan)))
    assert not [r for r in recs if r.get("error") or r.get("skipped") or not r["measured_s"] > 0]
    # priority 1 (the slice's batch-64 decode step at 64K) first, then 2..6 in order
    assert recs[0]["priority"] == 1 and "kind" in recs[0] and recs[0]["batch"] == bench_gpu.DRY["batch"][64]
    prios = [r["priority"] for r in recs]
    assert prios == sorted(prios) and set(prios) == {1, 2, 3, 4, 5, 6}
    ops = [r.get("op", "slice") for r in recs]
    for op in M.OPS:  # every op of the contract, with its shape keys
        assert op in ops, op
        assert all(set(r["shape"]) == set(M.SHAPE_KEYS[op]) for r in res["kernels"] if r["op"] == op)
    assert [x["mlp"] for x in res["slice"]["layers"]] == ["dense", "dense", "dense", "moe"]
    assert [x["indexer"] for x in res["slice"]["layers"]] == ["full", "full", "full", "shared"]
    assert len(res["slice"]["rows"]) == 1 + 8 + 2  # the priority row, the other 8 decode rows, 2 prefill chunks
    # the README is generated from the results: one table line per row
    readme = (out / "README.md").read_text()
    assert readme.count("\n| ") - 2 == len(recs) and "Complete: **True**" in readme


def test_timed_calls_are_steady_state(dry):
    """The median is over calls that compile nothing (warm-up until a call compiles nothing), >= 1 warm-up."""
    recs = _records(dry[1])
    assert all(r["timed_compiles"] == 0 and r["warmups"] >= 1 and r["repeats"] == bench_gpu.DRY_REPEATS for r in recs)
    assert all(r["min_s"] <= r["measured_s"] <= r["max_s"] for r in recs)


def test_priced_s_is_the_perf_models_price_of_the_same_shape(dry):
    """Computed here independently: a decode row's sparse-MLA price as step_cost prices the decode rows of a
    one-layer plan (heads padded as there), the indexer's as its scores plus top-k parts, and each slice row's
    as step_cost of the same plan on the 4-layer cut; ratio = measured / priced on every row."""
    res = dry[1]
    hw = HARDWARE["h200"]
    one = TINY.replace(num_hidden_layers=1, indexer_types=("full",), mlp_layer_types=("dense",),
                       num_nextn_predict_layers=0)
    row = next(r for r in res["kernels"] if r["op"] == "sparse_mla_decode" and r["shape"]["batch"] == 4)
    s = row["shape"]
    parts = step_cost(one, hw, StepLayout(), M.slice_plan("decode", s["batch"], s["context"], 1)).by_name()
    assert row["priced_s"] == pytest.approx(parts["sparse_mla_decode"].time_s, rel=1e-12)
    idx = next(r for r in res["kernels"] if r["op"] == "indexer_decode" and r.get("default"))
    s = idx["shape"]
    parts = step_cost(one, hw, StepLayout(), M.slice_plan("decode", s["batch"], s["keys"] - 1, 1)).by_name()
    assert idx["priced_s"] == pytest.approx(parts["indexer_scores"].time_s + parts["indexer_topk"].time_s, rel=1e-12)
    sliced = M.slice_config(TINY)
    for r in res["slice"]["rows"]:
        plan = M.slice_plan(r["kind"], r["batch"], r["context"], r["chunk"])
        assert r["priced_s"] == pytest.approx(step_cost(sliced, hw, StepLayout(), plan).time_s(), rel=1e-12)
        assert r["ratio"] == pytest.approx(r["measured_s"] / r["priced_s"], rel=1e-12)
    for r in res["kernels"]:
        if r["op"] == "hisparse_resolve":
            assert r["priced_s"] is None and r["ratio"] is None  # the model has no resolver cost
        else:
            assert r["ratio"] == pytest.approx(r["measured_s"] / r["priced_s"], rel=1e-12)


def test_rates_and_peak_fraction_at_a_hand_computed_row(dry):
    """An fp8 linear layer: 2 x tokens x in x out FLOPs over the fp8 peak, its fp8 weight, block scales and
    bf16 activations over 4.8 TB/s."""
    row = next(r for r in dry[1]["kernels"] if r["op"] == "linear" and r["shape"]["name"] == "mlp.down_proj")
    s, t = row["shape"], row["measured_s"]
    flops = 2 * s["tokens"] * s["in"] * s["out"]
    nbytes = s["in"] * s["out"] * FP8_WEIGHT_BYTES + s["tokens"] * 2 * (s["in"] + s["out"])
    assert (s["in"], s["out"]) == (TINY.intermediate_size, TINY.hidden_size)
    assert row["tflops"] == pytest.approx(flops / t / 1e12, rel=1e-9)
    assert row["gbps"] == pytest.approx(nbytes / t / 1e9, rel=1e-9)
    assert row["peak_tflops"] == pytest.approx(1979.0)
    assert row["peak_fraction"] == pytest.approx(max(flops / t / 1979e12, nbytes / t / 4.8e12), rel=1e-9)
    sparse = next(r for r in dry[1]["kernels"] if r["op"] == "sparse_mla_decode")
    assert sparse["peak_tflops"] == pytest.approx(989.0)  # bf16 MMA


@pytest.mark.parametrize("op,mod", [("sparse_mla_decode", sparse_mla), ("indexer_decode", indexer),
                                    ("hisparse_resolve", hisparse)])
def test_tile_candidates_are_rows_of_one_shape_with_one_default(dry, op, mod):
    rows = [r for r in dry[1]["kernels"] if r["op"] == op and r["impl"] == "pallas"]
    shape = next(r["shape"] for r in rows if r["block_sizes"] != dataclasses.asdict(mod.BlockSizes()))
    cands = [r for r in rows if r["shape"] == shape]
    assert [r["block_sizes"] for r in cands] == [dataclasses.asdict(c) for c in mod.CANDIDATES]
    assert [r["default"] for r in cands] == [True] + [False] * (len(mod.CANDIDATES) - 1)


def test_slice_memory_plan_fits_the_full_size_slice_and_skips_what_would_not_fit():
    """Byte counts at GLM-5.3's size, nothing allocated: the four layers' fp8 weights (about 15 GB, as the
    perf model's independent count says), a pool of 64 x (128K + 1) positions in 64-token pages at
    4 x 656 + 3 x 132 bytes per position (25 GB), every planned slice row within 90% of an H200, and a
    64 x 1M decode row (203 GB of KV) marked as not fitting."""
    cfg = M.slice_config(get_preset("glm-5.3"))
    rows = [r.shape for r in bench_gpu.plan_rows(get_preset("glm-5.3"), with_slice=True) if r.op == "slice"]
    assert len(rows) == 11
    mem = bench_gpu.slice_memory(cfg, rows + [dict(kind="decode", batch=64, context=1 << 20, chunk=1)], 64)
    assert mem["weights_bytes"] == pytest.approx(weight_bytes_per_gpu(cfg, include_mtp=False), rel=0.01)
    assert 14e9 < mem["weights_bytes"] < 16e9
    pages = 64 * -(-(128 * 1024 + 1) // 64)
    assert mem["pool_blocks"] == pages and mem["pool_bytes"] == pages * 64 * (4 * 656 + 3 * 132)
    assert mem["fits"] == [True] * 11 + [False]
    assert mem["limit_bytes"] == pytest.approx(0.9 * 141e9)


def _four_linear_rows(monkeypatch):
    """Runs of four tiny fp8 linear rows (the cheapest rows: "auto", no interpret-mode kernel), for the
    tests of the run's bookkeeping."""
    plan = bench_gpu.plan_rows

    def four(cfg, **kw):
        return [r for r in plan(cfg, **kw) if r.op == "linear" and r.impl == "auto"][:4]

    monkeypatch.setattr(bench_gpu, "plan_rows", four)


def test_deadline_stops_cleanly_and_resume_runs_only_the_rest(tmp_path, monkeypatch):
    """A row whose estimate would end past the deadline is not started: the file parses and says complete
    false; --resume keeps the rows done and runs the missing ones."""
    _four_linear_rows(monkeypatch)
    real = bench_gpu.estimate_s
    calls = []

    def estimate(row, cfg, repeats, hw=None):  # the third row would take a day
        calls.append(row.key())
        return 86400.0 if len(calls) == 3 else 0.0

    monkeypatch.setattr(bench_gpu, "estimate_s", estimate)
    res = bench_gpu.main(["--out", str(tmp_path), "--dry-run", "--deadline-s", "600"])
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk["complete"] is False and len(on_disk["kernels"]) == 2 == len(res["kernels"])
    assert on_disk["stopped"]["row"] == calls[2] and "Complete: **False**" in (tmp_path / "README.md").read_text()
    first = [r["measured_s"] for r in on_disk["kernels"]]
    monkeypatch.setattr(bench_gpu, "estimate_s", real)
    res = bench_gpu.main(["--out", str(tmp_path), "--dry-run", "--resume"])
    assert res["complete"] is True and len(res["kernels"]) == 4
    assert [r["measured_s"] for r in res["kernels"][:2]] == first and len(res["runs"]) == 2
    assert [r["seq"] for r in res["kernels"]] == list(range(len(res["kernels"])))


def test_a_failing_row_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    _four_linear_rows(monkeypatch)
    real = bench_gpu.Bench._inputs_linear

    def broken(self, s):
        if s["name"] == "o_proj":
            raise RuntimeError("out of memory (simulated)")
        return real(self, s)

    monkeypatch.setattr(bench_gpu.Bench, "_inputs_linear", broken)
    res = bench_gpu.main(["--out", str(tmp_path), "--dry-run"])
    bad = [r for r in res["kernels"] if r.get("error")]
    assert [r["shape"]["name"] for r in bad] == ["o_proj"] and bench_gpu.LINEARS[3] == "o_proj"
    assert "RuntimeError: out of memory (simulated)" in bad[0]["error"] and bad[0]["measured_s"] is None
    assert sum(1 for r in res["kernels"] if r["measured_s"]) == 3 and len(res["kernels"]) == 4
    assert "RuntimeError" in (tmp_path / "README.md").read_text()
    monkeypatch.setattr(bench_gpu.Bench, "_inputs_linear", real)  # --resume runs the failed row again
    res = bench_gpu.main(["--out", str(tmp_path), "--dry-run", "--resume"])
    assert len(res["kernels"]) == 4 and all(r["measured_s"] and not r.get("error") for r in res["kernels"])
    assert sorted(r["seq"] for r in res["kernels"]) == [0, 1, 2, 3] and res["kernels"][-1]["shape"]["name"] == "o_proj"


def test_full_size_plan_and_its_device_time_estimate():
    """The device run's rows at GLM-5.3's sizes and what the deadline weighs them by: every issue row is
    planned once (candidates as their own rows), and the estimates grow with the work."""
    cfg = get_preset("glm-5.3")
    rows = bench_gpu.plan_rows(cfg, with_slice=True)
    keys = [r.key() for r in rows]
    assert len(keys) == len(set(keys))
    by_op = {}
    for r in rows:
        by_op.setdefault(r.op, []).append(r)
    assert len(by_op["sparse_mla_decode"]) == 4 + len(sparse_mla.CANDIDATES) - 1 + 4
    assert {(r.shape["batch"], r.shape["heads"]) for r in by_op["sparse_mla_decode"] if r.priority == 2} == {
        (32, 64), (64, 64), (32, 8), (64, 8)}
    # the fp8 rows in both forms: the Pallas kernels and what "auto" runs
    assert [(r.shape["experts_local"], r.impl) for r in by_op["moe"]] == [
        (32, "pallas"), (32, "auto"), (32, "pallas"), (32, "auto"), (256, "pallas"), (256, "auto")]
    assert len(by_op["linear"]) == 36 and len(by_op["slice"]) == 11
    est = {r.key(): bench_gpu.estimate_s(r, cfg, bench_gpu.REPEATS) for r in rows}
    pre = sorted(by_op["sparse_mla_prefill"], key=lambda r: r.shape["chunk"])
    assert est[pre[0].key()] < est[pre[1].key()]  # a 8K chunk costs more than a 2K one
    assert all(v > 0 for v in est.values())
