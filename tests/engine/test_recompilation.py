"""After the runner's warm-up has compiled every bucket shape, a serving run compiles nothing: counted
with JAX's own compilation events over a fixed 200-step run with arrivals, finishes, sampling and a
preemption."""

import jax
import jax.monitoring
import numpy as np
import pytest

import glm53
from glm53 import DeployConfig, Engine, SamplingParams
from glm53.engine.runner import CompileCounter


@pytest.fixture(scope="module")
def small_model():
    # The tiny preset cut to 2 layers (one full and one shared indexer layer, dense then MoE): the same
    # code paths with a quarter of the compile time, which this test pays once per bucket shape.
    cfg = glm53.get_preset("tiny").replace(num_hidden_layers=2, indexer_types=("full", "shared"),
                                           mlp_layer_types=("dense", "sparse"))
    return glm53.init(cfg, seed=0, std=0.1)


@pytest.mark.slow
def test_no_compilation_after_warmup(small_model):
    deploy = DeployConfig(max_model_len=128, max_num_batched_tokens=16, max_num_seqs=2, block_size=8,
                          num_gpu_blocks=28)
    eng = Engine(small_model, deploy)
    # rows 1, 2; tokens per row 1, 16; windows 64, 128
    assert eng.runner.warmup() == len(eng.runner.bucket_shapes()) == 2 * 2 * 2
    assert eng.runner.compiled_shapes == set(eng.runner.bucket_shapes())

    rng = np.random.default_rng(0)
    eng.runner.compiled_shapes.clear()  # from here on: the shapes the run itself uses
    with CompileCounter() as compiles:
        for step in range(200):
            if len(eng.scheduler.waiting) < 2 and rng.random() < 0.5:
                n, new = int(rng.integers(1, 90)), int(rng.integers(1, 12))
                greedy = bool(rng.random() < 0.5)
                eng.add_request(rng.integers(0, 512, n), SamplingParams(new, greedy, 0.9, 0.95, seed=step))
            assert eng.has_unfinished() or step == 0
            eng.step()
    st = eng.scheduler.stats
    assert len(eng.finished) >= 10 and st.preemptions >= 1, (len(eng.finished), st.preemptions)
    used = eng.runner.compiled_shapes
    assert used <= set(eng.runner.bucket_shapes())
    # the run moved between buckets: decode and prefill widths, several row counts, both windows
    assert {w for _, w, _ in used} == {1, 16} and len({r for r, _, _ in used}) >= 2 and len({w for *_, w in used}) == 2
    assert compiles.count == 0, f"{compiles.count} compilations during the run"
    with CompileCounter() as probe:  # the counter does see a compilation
        jax.jit(lambda x: x * 3 + 1)(np.arange(7)).block_until_ready()
    assert probe.count >= 1
