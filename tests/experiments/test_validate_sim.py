"""experiments.validate_sim's CPU-spec fit recovers a known spec from step times it generated itself
(the real-engine comparison is a benchmark and asserts nothing)."""

import pytest

import glm53
from experiments import validate_sim as vs
from glm53.engine import sim
from glm53.engine.config import DeployConfig


def test_the_fit_recovers_the_spec_that_priced_the_steps():
    cfg = glm53.get_preset("tiny")
    deploy = DeployConfig(max_model_len=512, max_num_batched_tokens=64, max_num_seqs=4, num_gpu_blocks=64,
                          kv_cache_dtype="float32")
    eng = sim.build_engine(cfg, deploy)
    log = vs.StepLog(eng)
    rng = __import__("numpy").random.default_rng(0)
    eng.generate([rng.integers(0, cfg.vocab_size, n).tolist() for n in (40, 150, 90, 300)], max_new_tokens=12)
    assert len(log.steps) > 20
    true = vs.cpu_spec(1e10, 1e10)
    kern = vs._priced(cfg, eng.deploy, log.steps, true)
    steps = [(*s[:-1], float(k) + 2e-3) for s, k in zip(log.steps, kern)]  # a 2 ms step overhead
    f = vs.fit(cfg, eng.deploy, steps)
    assert (f["flops"], f["bandwidth"]) == pytest.approx((1e10, 1e10))
    assert f["step_overhead_s"] == pytest.approx(2e-3, rel=1e-6)
    assert f["step_abs_rel_error_mean"] < 1e-6
