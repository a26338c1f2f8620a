"""The engine benchmark runs end to end on tiny settings (the tiny preset's first 4 layers; structure and
sanity, not speed). It runs in a
subprocess so XLA can compile with cheap optimisation flags (set before JAX starts)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from experiments.common import FAST_COMPILE_XLA_FLAGS

REPO = Path(__file__).resolve().parents[2]


def test_bench_engine_tiny(tmp_path):
    # the default run's pool in 1 GiB of vLLM's CPU KV space, not 4: first touching the memory is what costs
    env = dict(os.environ, PYTHONPATH=str(REPO), TF_CPP_MIN_LOG_LEVEL="2", XLA_FLAGS=FAST_COMPILE_XLA_FLAGS,
               VLLM_CPU_KVCACHE_SPACE="1")
    cmd = [sys.executable, "-m", "experiments.bench_engine", "--out", str(tmp_path), "--sched-requests", "8",
           "--sched-prompt-len", "100", "--sched-decode-steps", "40", "--sched-batched-tokens", "256", "--config",
           "tiny", "--layers", "4", "--requests", "2", "--prompt-len", "40", "--new-tokens", "5", "--batched-tokens", "128",
           "--skip-hf"]
    proc = subprocess.run(cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["date"] and res["git_commit"] and res["machine"]["cores"] >= 1

    # A: 8 requests all running, no preemption, every step timed
    sched = res["scheduler"]
    assert res["running_requests"] == 8 and sched["preemptions"] == 0
    assert 0 < res["scheduler_host_us_per_step_median"] <= res["scheduler_host_us_per_step_p90"]
    assert res["scheduler_host_us_per_step_median"] == sched["all_running"]["scheduler"]["median_us"]
    assert sched["prefill_phase"]["scheduler"]["steps"] >= 4  # 800 prompt tokens, at most 256 a step
    assert sched["decode_phase"]["scheduler"]["steps"] >= 30  # 40 tokens each, the first sampled after prefill
    assert sched["decode_phase"]["tokens_per_step_mean"] == 8
    assert sched["steps"] == sched["prefill_phase"]["scheduler"]["steps"] + 40 - 1  # the last request's decode

    # B: the engine ran three times (compile, 2 timed: the fastest reported) to the same greedy tokens; HF skipped
    eng = res["engine_vs_hf"]
    assert res["engine_s"] > 0 and res["engine_incl_compile_s"] > 0
    assert len(eng["engine_runs_s"]) == 2 and res["engine_s"] == min(eng["engine_runs_s"])
    assert res["hf_generate_s"] is None and res["speedup_vs_hf"] is None and res["target_met"] is None
    assert res["target_speedup"] == 5
    assert len(eng["engine_tokens"]) == 2 and all(len(t) == 5 for t in eng["engine_tokens"])
    prof = eng["profile"]
    assert prof["prefill_steps"]["real_tokens"] == 80 and prof["decode_steps"]["real_tokens"] == 2 * 4
    assert prof["prefill_steps"]["padded_token_slots"] == 2 * 64  # 2 rows of 40 tokens in the 64-wide bucket
    assert len(prof["step_s"]) == prof["prefill_steps"]["steps"] + prof["decode_steps"]["steps"] == 5
    assert len(prof["per_forward"]) == prof["prefill_steps"]["forwards"] + prof["decode_steps"]["forwards"] == 5
    assert eng["deploy"]["max_model_len"] == 45 and eng["deploy"]["max_num_batched_tokens"] == 128
    assert eng["model_config"]["num_hidden_layers"] == 4  # --layers 4: the tiny preset's first four

    # the same run with the defaults (DeployConfig()): the model's length, the CPU limits, the same tokens
    default = eng["default"]
    assert default["deploy"]["max_model_len"] == 65_536 and default["deploy"]["max_num_batched_tokens"] == 8192
    assert default["deploy"]["max_num_seqs"] == 256 and default["tokens_equal_tuned"]
    assert res["engine_default_s"] == min(default["engine_runs_s"]) > 0 and res["speedup_default_vs_hf"] is None
    assert default["profile"]["prefill_steps"]["real_tokens"] == 80
