"""`python -m glm53.serve CHECKPOINT --data-parallel-size 4 --enable-expert-parallel --kv-policy hisparse`
on four simulated devices (XLA_FLAGS in the server's environment): the published decode node's layout
served as a real process on loopback, each rank with its own HiSparse hot buffers and host pool (and the
server's warm-up of their view programs). Concurrent requests through the official openai client spread
over the ranks, which step together with the routed experts split over them, and each completion's greedy
tokens equal one device's with every page resident (`Engine.generate` on the same weights and shapes). One server for the module: tests/glm53/test_serve.py's
`Server`, its flags and the session's compilation cache."""

import os
import threading

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from glm53 import DeployConfig, Engine
from tests.glm53.openai_cases import TIMEOUT_S
from tests.glm53.test_serve import FLAGS, NAME, Server

RANKS = 4


@pytest.fixture(scope="module")
def dp_ep_server(tmp_path_factory, serving_dir):
    # the server's environment: four host devices (this process keeps its own)
    before = os.environ.get("XLA_FLAGS")
    os.environ["XLA_FLAGS"] = f"{before or ''} --xla_force_host_platform_device_count={RANKS}".strip()
    try:
        s = Server(serving_dir, tmp_path_factory.mktemp("dp_ep_serve"), "--data-parallel-size", str(RANKS),
                   "--enable-expert-parallel", "--kv-policy", "hisparse")
    finally:
        if before is None:
            del os.environ["XLA_FLAGS"]
        else:
            os.environ["XLA_FLAGS"] = before
    yield s
    s.stop()


def test_concurrent_requests_over_four_dp_ep_ranks_equal_one_device(dp_ep_server, serving_model):
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 512, n).tolist() for n in (9, 30, 3, 50, 17, 24)]
    want = [o.token_ids.tolist() for o in Engine(serving_model, DeployConfig(**FLAGS)).generate(
        [np.asarray(p) for p in prompts], max_new_tokens=6)]
    client = openai.OpenAI(base_url=dp_ep_server.url("/v1"), api_key="unused", max_retries=0, timeout=TIMEOUT_S)
    got: dict[int, list[int]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(prompts))

    def ask(i: int) -> None:
        try:
            start.wait()
            r = client.completions.create(model=NAME, prompt=prompts[i], max_tokens=6, temperature=0,
                                          extra_body={"return_token_ids": True})
            got[i] = r.choices[0].token_ids
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert [got[i] for i in range(len(prompts))] == want
    # the requests went to several ranks (queued together: routed by load), each rank its own engine label
    text = httpx.get(dp_ep_server.url("/metrics"), timeout=60).text
    per_rank = {s.labels["engine"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                if s.name == "vllm:generation_tokens_total"}
    assert sum(per_rank.values()) == 6 * len(prompts) and sum(v > 0 for v in per_rank.values()) >= 2, per_rank
    # and they stepped together with the routed experts split over them: tokens went through the all-to-alls
    # (independent replicas would dispatch nothing and report no such series)
    a2a = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples
           if s.name == "glm53:ep_all2all_bytes_total"]
    assert len(a2a) == 1 and a2a[0] > 0, a2a
