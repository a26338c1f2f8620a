"""Helpers of the engine tests that check a warm engine compiles nothing during a serving run: the warm-up,
the compilations counted inside the runner, random arrivals that keep the pool under pressure, and the
buckets the run went through (tests/engine/test_recompilation.py, test_mtp.py, test_hisparse.py)."""

import numpy as np

from glm53 import SamplingParams
from glm53.engine.runner import CompileCounter


def warm_up(eng, prompt_logprobs: bool = False) -> None:
    """Compile every bucket shape and copy program of the runner (with `prompt_logprobs` also the programs
    of rows that ask for them, as `glm53.serve` warms up); from here on `compiled_shapes` holds only what
    the run itself uses."""
    runner = eng.runner
    assert runner.warmup(prompt_logprobs=prompt_logprobs) == len(runner.bucket_shapes())
    assert runner.compiled_shapes == set(runner.bucket_shapes())
    runner.compiled_shapes.clear()


def count_compiles(eng) -> list[int]:
    """Wrap the runner's `execute`: each step appends the XLA compilations made inside it to the returned
    list. A test's own eager array operations (tests/engine/test_mtp.py's poisoning of rejected
    positions) compile outside it and are not counted. Wrap before any other wrapper of `execute`."""
    execute, counts = eng.runner.execute, []

    def counted(plan):
        with CompileCounter() as c:
            res = execute(plan)
        counts.append(c.count)
        return res

    eng.runner.execute = counted
    return counts


def random_arrivals(eng, steps: int, lens: tuple[int, int], new) -> None:
    """Run `steps` engine steps during which, while fewer than two requests wait, a request of
    rng.integers(*lens) prompt tokens arrives with probability 1/2, asking for `new(n, rng)` tokens,
    greedy or sampled (temperature 0.9, top-p 0.95) with even odds (rng = default_rng(0))."""
    rng = np.random.default_rng(0)
    for step in range(steps):
        if len(eng.scheduler.waiting) < 2 and rng.random() < 0.5:
            n = int(rng.integers(*lens))
            tokens = int(new(n, rng))
            greedy = bool(rng.random() < 0.5)
            eng.add_request(rng.integers(0, 512, n), SamplingParams(tokens, greedy, 0.9, 0.95, seed=step))
        eng.step()


def check_buckets_used(eng, prefill_widths: set[int]) -> None:
    """The run moved between buckets: the decode (or verify) width and `prefill_widths`, several row
    counts, every window the engine has, all of them warmed up; under MTP drafts stood in every number and
    the draft passes ran."""
    runner, k = eng.runner, eng.deploy.num_speculative_tokens
    used = runner.compiled_shapes
    assert used <= set(runner.bucket_shapes())
    assert {w for _, w, _ in used} == {1 + k, *prefill_widths}
    assert len({r for r, _, _ in used}) >= 2 and {w for *_, w in used} == {w for *_, w in runner.bucket_shapes()}
    if k:
        st = eng.scheduler.spec
        assert st.num_drafts > 0 and 0 < st.accepted_per_pos[k - 1] < st.accepted_per_pos[0] < st.num_drafts
        assert runner.compiled_draft_shapes
