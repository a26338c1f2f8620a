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
