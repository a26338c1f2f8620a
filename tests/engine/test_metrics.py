import numpy as np
import pytest

from glm53.engine.metrics import running_means, summarize
from glm53.engine.request import RequestOutput
from kvcache.transfer import TransferStats
from glm53.engine.scheduler import SchedulerStats


def _out(rid, prompt, arrival, first, finish, n):
    return RequestOutput(rid, np.zeros(prompt, np.int32), np.zeros(n, np.int32), arrival, first, finish,
                         tuple(np.linspace(first, finish, n)), 0)


def test_summary_follows_the_definitions():
    outs = [_out("a", 100, 0.0, 1.0, 3.0, 5),   # TPOT 0.5 s, e2e 5 tok / 3 s
            _out("b", 50, 1.0, 1.5, 2.5, 11)]   # TPOT 0.1 s, e2e 11 tok / 1.5 s
    st = SchedulerStats(preemptions=2, offloads=1, recomputed_tokens=30, prefix_hit_tokens=40, prompt_tokens=150)
    # four steps over the run's span [0, 4): one running for 3 s, two for 0.5 s, then two, one
    steps = [(0.0, 3.0, 1), (3.0, 3.5, 2), (3.5, 3.75, 2), (3.75, 4.0, 1)]
    m = summarize(outs, duration_s=4.0, num_devices=2, scheduler_stats=st, transfers=TransferStats(100, 60, 80.0),
                  steps=steps)
    assert m["ttft_median_s"] == pytest.approx(0.75)
    assert m["tpot_mean_s"] == pytest.approx(0.3)
    assert m["interactivity_tok_s_user"] == pytest.approx(1000 / 300)
    assert m["throughput_tok_s_per_device"] == pytest.approx((105 + 61) / 4.0 / 2)
    # time-weighted: (1 x 3 + 2 x 0.75 + 1 x 0.25) / 4 s; per step: (1 + 2 + 2 + 1) / 4
    assert m["running_requests_mean"] == pytest.approx(4.75 / 4)
    assert m["running_requests_mean_per_step"] == 1.5
    assert m["prefix_hit_rate"] == pytest.approx(40 / 150)
    assert (m["d2h_bytes"], m["h2d_bytes"], m["host_link_modelled_s"]) == (100, 60, 2.0)
    with pytest.raises(ValueError):
        summarize([], duration_s=1.0)


def test_p90_interactivity_is_the_rate_nine_in_ten_requests_reach():
    """Ten requests of 10 tokens whose end-to-end rates are 1, 2, ..., 10 tok/s: 90% of them reach at least
    the 10th percentile, np.percentile's linear interpolation between the slowest two (1 + 0.9 x (2 - 1));
    the fastest tenth (the 90th percentile, 9.1) is not it. The median is 5.5."""
    outs = [_out(f"r{k}", 10, 0.0, 0.5 / k, 10 / k, 10) for k in range(1, 11)]
    m = summarize(outs, duration_s=10.0)
    assert m["interactivity_p90_e2e_tok_s_user"] == pytest.approx(1.9)
    assert m["interactivity_median_e2e_tok_s_user"] == pytest.approx(5.5)
    # the reciprocal of the normalised end-to-end latency's 90th percentile (0.5 + 0.1 x (1 - 0.5) s per token)
    # falls between the same two slowest requests: both readings put the P90 in the slow tail
    latency = np.percentile([1 / k for k in range(1, 11)], 90)
    assert 1 / latency == pytest.approx(1 / 0.55) and 1.0 < 1 / latency < 2.0
    assert np.percentile([float(k) for k in range(1, 11)], 90) == pytest.approx(9.1)  # the old figure: the fast tail


def test_running_requests_are_weighted_by_time_not_steps():
    """A long prefill step with one request, then many short decode steps with eight: per step the mean is
    near eight, over time near one."""
    steps = [(0.0, 9.0, 1)] + [(9.0 + 0.01 * i, 9.01 + 0.01 * i, 8) for i in range(100)]
    got = running_means(steps, 0.0, 10.0, windowed=False)
    assert got["running_requests_mean"] == pytest.approx((9.0 + 8 * 1.0) / 10.0)
    assert got["running_requests_mean_per_step"] == pytest.approx((1 + 800) / 101)
    # a window cuts the steps at its edges; an idle gap counts as zero running
    cut = running_means([(0.0, 2.0, 4), (3.0, 5.0, 2)], 1.0, 4.0)
    assert cut["running_requests_mean"] == pytest.approx((4 * 1.0 + 2 * 1.0) / 3.0)
    assert cut["running_requests_mean_per_step"] == 2.0  # only the step that starts inside [1, 4]
    assert np.isnan(running_means([], 0.0, 1.0)["running_requests_mean"])


def test_window_counts_tokens_by_their_time_and_latencies_by_arrival():
    # a: prompt at t=1 (first token), tokens at 1, 1.5, 2, 2.5, 3; b arrives at 2.2, first token at 2.8
    outs = [_out("a", 100, 0.0, 1.0, 3.0, 5), _out("b", 50, 2.2, 2.8, 4.8, 3), _out("c", 70, 3.5, 4.0, 5.0, 2)]
    m = summarize(outs, num_devices=2, window=(0.0, 2.5), steps=[(0.0, 2.0, 2), (2.0, 3.0, 2)])
    # in (0, 2.5]: a's prompt + its 4 tokens at 1..2.5; b's first token (2.8) and c are after it
    assert m["throughput_tok_s_per_device"] == pytest.approx((100 + 4) / 2.5 / 2)
    assert m["duration_s"] == 2.5 and m["requests"] == 2  # a and b arrived inside; c after
    assert m["ttft_median_s"] == pytest.approx(np.median([1.0, 0.6]))
    assert m["running_requests_mean"] == pytest.approx(2.0)  # two running over the whole window
    whole = summarize(outs, duration_s=5.0, num_devices=2)
    assert whole["requests"] == 3 and whole["throughput_tok_s_per_device"] == pytest.approx((220 + 10) / 5.0 / 2)
    assert np.isnan(whole["running_requests_mean"])  # no steps given
    with pytest.raises(ValueError, match="t1 > t0"):
        summarize(outs, window=(2.0, 2.0))
