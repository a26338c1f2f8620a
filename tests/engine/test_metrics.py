import numpy as np
import pytest

from glm53.engine.metrics import summarize
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
    m = summarize(outs, duration_s=4.0, num_devices=2, scheduler_stats=st, transfers=TransferStats(100, 60, 80.0),
                  running_per_step=[1, 2, 2, 1])
    assert m["ttft_median_s"] == pytest.approx(0.75)
    assert m["tpot_mean_s"] == pytest.approx(0.3)
    assert m["interactivity_tok_s_user"] == pytest.approx(1000 / 300)
    assert m["interactivity_p90_e2e_tok_s_user"] == pytest.approx(np.percentile([5 / 3, 11 / 1.5], 90))
    assert m["throughput_tok_s_per_device"] == pytest.approx((105 + 61) / 4.0 / 2)
    assert m["running_requests_mean"] == 1.5 and m["prefix_hit_rate"] == pytest.approx(40 / 150)
    assert (m["d2h_bytes"], m["h2d_bytes"], m["host_link_modelled_s"]) == (100, 60, 2.0)
    with pytest.raises(ValueError):
        summarize([], duration_s=1.0)


def test_window_counts_tokens_by_their_time_and_latencies_by_arrival():
    # a: prompt at t=1 (first token), tokens at 1, 1.5, 2, 2.5, 3; b arrives at 2.2, first token at 2.8
    outs = [_out("a", 100, 0.0, 1.0, 3.0, 5), _out("b", 50, 2.2, 2.8, 4.8, 3), _out("c", 70, 3.5, 4.0, 5.0, 2)]
    m = summarize(outs, num_devices=2, window=(0.0, 2.5), running_per_step=[2, 2])
    # in (0, 2.5]: a's prompt + its 4 tokens at 1..2.5; b's first token (2.8) and c are after it
    assert m["throughput_tok_s_per_device"] == pytest.approx((100 + 4) / 2.5 / 2)
    assert m["duration_s"] == 2.5 and m["requests"] == 2  # a and b arrived inside; c after
    assert m["ttft_median_s"] == pytest.approx(np.median([1.0, 0.6]))
    whole = summarize(outs, duration_s=5.0, num_devices=2)
    assert whole["requests"] == 3 and whole["throughput_tok_s_per_device"] == pytest.approx((220 + 10) / 5.0 / 2)
    with pytest.raises(ValueError, match="t1 > t0"):
        summarize(outs, window=(2.0, 2.0))
