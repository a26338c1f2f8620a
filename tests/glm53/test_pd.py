"""P/D disaggregation with the PdConnector, as real processes on loopback: two prefill servers
(`kv_producer`, DCP2 with interleave 1 and with interleave = block size, MTP3) and one decode server
(`kv_consumer`, HiSparse, MTP3) behind `python -m glm53.router`.

What must hold: greedy tokens equal one aggregated engine's; the decode server takes the prompt's KV
(MLA rows, indexer keys and the MTP layer's rows, re-laid out from the producer's DCP layout into its own
pages through the canonical chunk layout) instead of computing it, and counts it in
`glm53:kv_transfer_received_tokens`; what cannot be had from the producer (a producer that is not up, a
prompt it never saw, a prompt that differs after some page) is computed, never taken from another
request; malformed kv_transfer_params (a remote_host that is no host name or IP address among them) are a
400 and the consumer serves on."""

import json
import time

import numpy as np
import pytest

from glm53 import DeployConfig, Engine
from tests.glm53.test_router import servers_and_router
from tests.glm53.test_serve import FLAGS, _free_port, _metric
from tests.glm53.test_serve import Server as Process

PAGE = FLAGS["block_size"]  # tokens per page on both sides (the producers: 4 rows per rank x DCP2)
MTP = ("--num-speculative-tokens", "3")


def _ktc(role: str) -> str:
    return json.dumps({"kv_connector": "PdConnector", "kv_role": role})


@pytest.fixture(scope="module")
def pd(tmp_path_factory, serving_dir):
    tmp = tmp_path_factory.mktemp("pd")
    dcp = ("--decode-context-parallel-size", "2", "--block-size", str(PAGE // 2))
    flags = {"prefill_i1": (*dcp, "--cp-kv-cache-interleave-size", "1", *MTP, "--kv-transfer-config", _ktc("kv_producer")),
             "prefill_ib": (*dcp, "--cp-kv-cache-interleave-size", str(PAGE // 2), *MTP,
                            "--kv-transfer-config", _ktc("kv_producer")),
             "decode": ("--kv-policy", "hisparse", *MTP, "--kv-transfer-config", _ktc("kv_consumer"))}
    with servers_and_router(tmp, serving_dir, flags, ["prefill_i1"], ["decode"]) as pair:
        yield pair


@pytest.fixture(scope="module")
def reference(serving_model):
    rng = np.random.default_rng(23)
    prompts = [rng.integers(0, 512, n).tolist() for n in (41, 26, 33)]
    eng = Engine(serving_model, DeployConfig(**FLAGS))
    return prompts, [eng.generate([np.asarray(p)], max_new_tokens=8)[0].token_ids.tolist() for p in prompts]


def _received(proc) -> float:
    return _metric(proc.metrics(), "glm53:kv_transfer_received_tokens_total")


def _prefill(producer, prompt) -> dict:
    """The prefill leg by hand -> the producer's kv_transfer_params."""
    code, a = producer.post("/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                                                "kv_transfer_params": {"do_remote_decode": True}})
    assert code == 200, a
    return a["kv_transfer_params"]


def _decode(consumer, prompt, params) -> dict:
    code, b = consumer.post("/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                "return_token_ids": True, "kv_transfer_params": params})
    assert code == 200, b
    return b


def test_router_prefill_decode_equals_one_engine_and_the_kv_arrives(pd, reference):
    """Through the router (producer with interleave 1) and by hand (interleave = block size): every
    full page of the prompt but the last token's comes from the producer (MLA rows, indexer keys, MTP
    rows) and lands on the HiSparse host pool; MTP gives back the hit's last page, so that much and the
    tail are computed on the decode server."""
    router, procs = pd
    prompts, want = reference
    dec = procs["decode"]
    before = _received(dec)
    code, r = router.post({"prompt": prompts[0], "max_tokens": 8, "temperature": 0, "return_token_ids": True})
    assert code == 200 and r["choices"][0]["token_ids"] == want[0]
    full = (len(prompts[0]) - 1) // PAGE * PAGE
    assert _received(dec) - before == full
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == full - PAGE  # MTP: the hit's last page back
    for i in (1, 2):
        before = _received(dec)
        params = _prefill(procs["prefill_ib"], prompts[i])
        out = _decode(dec, prompts[i], params)
        full = (len(prompts[i]) - 1) // PAGE * PAGE
        assert params["remote_num_tokens"] == full and params["remote_lease"] > 0
        assert out["choices"][0]["token_ids"] == want[i]
        assert _received(dec) - before == full
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == full - PAGE


def test_what_the_producer_cannot_give_is_computed(pd, serving_model):
    """A producer that is not up (its lookup times out), a prompt the named producer never prefilled, and
    a prompt that differs from a prefilled one after its first two pages (only those two come: chunks are
    named by their chained token hash and salt, never by block ids that another request could reuse)."""
    _, procs = pd
    dec, pre = procs["decode"], procs["prefill_ib"]
    rng = np.random.default_rng(5)
    seen, other = rng.integers(0, 512, 35).tolist(), rng.integers(0, 512, 27).tolist()
    fork = seen[:2 * PAGE] + rng.integers(0, 512, 20).tolist()
    params = _prefill(pre, seen)  # on the producer only
    dead = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": _free_port()}
    eng = Engine(serving_model, DeployConfig(**FLAGS))
    for prompt, ktp, got in ((other, dead, 0), (other[::-1], params, 0), (fork, params, 2 * PAGE)):
        before = _received(dec)
        out = _decode(dec, prompt, ktp)
        assert out["choices"][0]["token_ids"] == eng.generate([np.asarray(prompt)], 8)[0].token_ids.tolist()
        assert _received(dec) - before == got


@pytest.mark.parametrize("ktp", [
    {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": "x"},
    {"do_remote_prefill": True, "remote_port": 5000},
    {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 0},
    {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 5000, "remote_lease": "7"},
    # remote_host: an IP address or an ASCII host name, nothing the peer tier's socket could fail to dial
    *({"do_remote_prefill": True, "remote_host": h, "remote_port": 5000}
      for h in ("\ud800", "bad host", "tcp://127.0.0.1", "127.0.0.1:5000", "-x.example", "a" * 254, "", 7)),
], ids=lambda ktp: ascii(ktp)[:60])
def test_malformed_kv_transfer_params_are_400(pd, ktp):
    dec = pd[1]["decode"]
    code, out = dec.post("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2, "kv_transfer_params": ktp})
    assert code == 400 and out["error"]["param"] == "kv_transfer_params", out
    assert dec.post("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})[0] == 200


def test_a_prefill_leg_takes_one_prompt_and_no_stream(pd):
    pre = pd[1]["prefill_i1"]
    for body in ({"prompt": [[1, 2, 3], [4, 5, 6]]}, {"prompt": [1, 2, 3], "stream": True}):
        code, out = pre.post("/v1/completions", {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        assert code == 400 and out["error"]["param"] == "kv_transfer_params", out


def test_a_prefill_server_restarted_loses_no_request(pd, reference, tmp_path, serving_model, serving_dir):
    """With the router's only prefill server down, a request is computed by the decode server (nothing
    received, the router counts a fallback); once the server is back on its port, the next request goes
    through it and its KV arrives again. Last in this file: it replaces the fixture's prefill server."""
    router, procs = pd
    prompts, want = reference
    dec, old = procs["decode"], procs["prefill_i1"]
    assert old.stop()
    deadline = time.monotonic() + 60
    while router.health()["prefill"] and time.monotonic() < deadline:  # the router's poll notices
        time.sleep(0.2)
    before = _received(dec)
    rng = np.random.default_rng(9)
    eng = Engine(serving_model, DeployConfig(**FLAGS))
    fresh = [rng.integers(0, 512, 30).tolist() for _ in range(2)]
    code, r = router.post({"prompt": fresh[0], "max_tokens": 8, "temperature": 0, "return_token_ids": True})
    assert code == 200 and r["choices"][0]["token_ids"] == eng.generate([np.asarray(fresh[0])], 8)[0].token_ids.tolist()
    assert _received(dec) == before and router.health()["prefill_fallbacks"] == 1
    procs["prefill_i1"] = Process(serving_dir, tmp_path, *old.extra, port=old.port)
    deadline = time.monotonic() + 60
    while not router.health()["prefill"] and time.monotonic() < deadline:
        time.sleep(0.2)
    code, r = router.post({"prompt": fresh[1], "max_tokens": 8, "temperature": 0, "return_token_ids": True})
    assert code == 200 and r["choices"][0]["token_ids"] == eng.generate([np.asarray(fresh[1])], 8)[0].token_ids.tolist()
    assert _received(dec) - before == (len(fresh[1]) - 1) // PAGE * PAGE
