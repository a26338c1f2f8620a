"""P/D disaggregation with the PdConnector, as real processes on loopback, every server at the same
block_size (FLAGS'), so their pages span different tokens: two prefill servers (`kv_producer`, MTP3: PCP2 x
DCP2 with interleave 1 on two simulated devices, 16 tokens per page, and one device, 8) and two decode
servers (`kv_consumer`, MTP3: HiSparse on one device, 8 tokens per page, and DCP2 with interleave = block
size, 16) behind `python -m glm53.router` and by hand.

What must hold: greedy tokens equal one aggregated engine's; the decode server takes the prompt's KV
(MLA rows, indexer keys and the MTP layer's rows, re-laid out from the producer's DCP layout into its own
pages through the canonical chunk layout, and assembled from the producer's pages where they span other
tokens, its last partial page included: kvcache.tiers.remote.RelayoutTier, kvcache.tiers.tail_chunk)
instead of computing it, and counts it in `glm53:kv_transfer_received_tokens`: (len(prompt) - 1) // page x
page tokens, page = the consumer's tokens per MLA page, whatever the producer's; what cannot be had from
the producer (a producer that is not up, a prompt it never saw, a prompt that differs after some page)
is computed, never taken from another request; a producer whose chunks cannot be the consumer's (another model
or format) is counted in `glm53:kv_transfer_failed_lookups`; malformed kv_transfer_params (a remote_host that
is no host name or IP address among them) are a 400 and the consumer serves on."""

import json
import time

import numpy as np
import pytest

from glm53 import DeployConfig, Engine
from tests.glm53.test_router import servers_and_router
from parallel.launch import free_port
from tests.glm53.test_serve import FLAGS, _metric
from tests.glm53.test_serve import Server as Process

PAGE = FLAGS["block_size"]  # tokens per page of a one-device server; a DCP2 server's pages span 2 x PAGE
MTP = ("--num-speculative-tokens", "3")
SPAN = {"prefill_pcp": 2 * PAGE, "prefill_1": PAGE, "decode": PAGE, "decode_dcp2": 2 * PAGE}  # tokens per MLA page


def _expected(prompt, consumer: str) -> int:
    """Prompt tokens the consumer receives, whatever the producer's spans (the issue's count): its full
    pages of all but the last token, (len - 1) // page x page, page = its tokens per MLA page. Past the
    producer's full pages they come from its tail chunk (kvcache.tiers.tail_chunk)."""
    return (len(prompt) - 1) // SPAN[consumer] * SPAN[consumer]


def _ktc(role: str, **kw) -> str:
    return json.dumps({"kv_connector": "PdConnector", "kv_role": role, **kw})


# the producers' KV ports (kv_port), fixed so that the consumers can list them; DEAD: listed, never up
_PORTS = set()
while len(_PORTS) < 3:  # distinct: a port free when asked may be handed out again
    _PORTS.add(free_port())
KV_PORTS = dict(zip(("prefill_pcp", "prefill_1"), sorted(_PORTS)))
DEAD = max(_PORTS)
PRODUCERS = {"kv_connector_extra_config": {"producers": [f"127.0.0.1:{p}" for p in (*KV_PORTS.values(), DEAD)]}}


@pytest.fixture(scope="module")
def pd(tmp_path_factory, serving_dir):
    tmp = tmp_path_factory.mktemp("pd")
    dcp = ("--decode-context-parallel-size", "2")
    # PCP2 x DCP2 (the headline producer; PCP writes its KV in the DCP2 interleave-1 layout)
    flags = {"prefill_pcp": ("--prefill-context-parallel-size", "2", *dcp, "--cp-kv-cache-interleave-size", "1", *MTP,
                             "--kv-transfer-config", _ktc("kv_producer", kv_port=KV_PORTS["prefill_pcp"])),
             "prefill_1": (*MTP, "--kv-transfer-config", _ktc("kv_producer", kv_port=KV_PORTS["prefill_1"])),
             "decode": ("--kv-policy", "hisparse", *MTP, "--kv-transfer-config", _ktc("kv_consumer", **PRODUCERS)),
             "decode_dcp2": (*dcp, "--cp-kv-cache-interleave-size", str(PAGE), *MTP,
                             "--kv-transfer-config", _ktc("kv_consumer", **PRODUCERS))}
    with servers_and_router(tmp, serving_dir, flags, ["prefill_pcp"], ["decode"]) as pair:
        yield pair


@pytest.fixture(scope="module")
def reference(serving_model):
    rng = np.random.default_rng(23)
    prompts = [rng.integers(0, 512, n).tolist() for n in (37, 26, 33)]
    eng = Engine(serving_model, DeployConfig(**FLAGS))
    return prompts, [eng.generate([np.asarray(p)], max_new_tokens=8)[0].token_ids.tolist() for p in prompts]


def _received(proc) -> float:
    return _metric(proc.metrics(), "glm53:kv_transfer_received_tokens_total")


def _failed(proc) -> float:
    return _metric(proc.metrics(), "glm53:kv_transfer_failed_lookups_total")


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
    """Through the router (the PCP2 x DCP2 interleave-1 producer, 16-token pages, and the one-device HiSparse
    consumer, 8: each of its pages is half of one of the producer's) and by hand (the same producer and
    the DCP2 consumer with interleave = block size: the same spans, other interleaves; the one-device
    producer and the DCP2 consumer: each page of the consumer's is two of the producer's): every full
    page of the consumer's below the prompt's last token comes from the producer (MLA rows, indexer keys,
    MTP rows), those past the producer's full pages from its tail chunk; MTP gives back the hit's last
    page, so that much and the rest are computed on the decode server."""
    router, procs = pd
    prompts, want = reference
    dec = procs["decode"]
    before = _received(dec)
    code, r = router.post({"prompt": prompts[0], "max_tokens": 8, "temperature": 0, "return_token_ids": True})
    assert code == 200 and r["choices"][0]["token_ids"] == want[0]
    full = _expected(prompts[0], "decode")
    assert _received(dec) - before == full
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == full - PAGE  # MTP: the hit's last page back
    for i, producer, consumer in ((1, "prefill_pcp", "decode_dcp2"), (2, "prefill_1", "decode_dcp2"),
                                  (1, "prefill_pcp", "decode")):
        before, dec = _received(procs[consumer]), procs[consumer]
        params = _prefill(procs[producer], prompts[i])
        out = _decode(dec, prompts[i], params)
        full = _expected(prompts[i], consumer)
        if SPAN[producer] > SPAN[consumer]:  # 26 tokens: 24 received, 8 of them from the producer's tail chunk
            assert full == 24 > (len(prompts[i]) - 1) // SPAN[producer] * SPAN[producer]
        assert full > 0 and params["remote_num_tokens"] == len(prompts[i]) - 1  # full pages and tails held
        assert params["remote_lease"] > 0 and params["remote_page_spans"]["page_tokens"]["mla"] == SPAN[producer]
        assert out["choices"][0]["token_ids"] == want[i], (producer, consumer)
        assert _received(dec) - before == full, (producer, consumer)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == full - SPAN[consumer]


def test_what_the_producer_cannot_give_is_computed(pd, serving_model):
    """A producer that is not up (its lookup times out), a prompt the named producer never prefilled, and
    a prompt that differs from a prefilled one after the producer's first two pages (only those come, as
    four of the consumer's: chunks are named by their chained token hash and salt, never by block ids
    that another request could reuse). The dead producer is a failed lookup (counted and logged); a
    producer that never saw the prompt, or the rest of it, is not."""
    _, procs = pd
    dec, pre = procs["decode"], procs["prefill_pcp"]
    rng = np.random.default_rng(5)
    seen, other = rng.integers(0, 512, 51).tolist(), rng.integers(0, 512, 27).tolist()
    fork = seen[:2 * SPAN["prefill_pcp"]] + rng.integers(0, 512, 20).tolist()
    params = _prefill(pre, seen)  # on the producer only
    dead = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": DEAD}  # listed, not up
    eng = Engine(serving_model, DeployConfig(**FLAGS))
    for prompt, ktp, got, failed in ((other, dead, 0, 1), (other[::-1], params, 0, 0),
                                     (fork, params, 2 * SPAN["prefill_pcp"], 0)):
        before = _received(dec), _failed(dec)
        out = _decode(dec, prompt, ktp)
        assert out["choices"][0]["token_ids"] == eng.generate([np.asarray(prompt)], 8)[0].token_ids.tolist()
        assert (_received(dec) - before[0], _failed(dec) - before[1]) == (got, failed)
    assert "named by request" in dec.log.read_text() and str(dead["remote_port"]) in dec.log.read_text()


def test_a_producer_of_chunks_the_consumer_cannot_read_is_counted_not_silent(pd, reference):
    """A producer whose fingerprint is not the one the consumer computes for its page spans (another
    model, weights, KV format, or MTP on one side only; here the fingerprint altered in its params): the
    consumer computes the prompt, with the right tokens, and counts a failed lookup (and logs it once)."""
    _, procs = pd
    prompts, want = reference
    dec = procs["decode"]
    params = _prefill(procs["prefill_1"], prompts[2])
    spans = params["remote_page_spans"]
    params["remote_page_spans"] = {**spans, "fingerprint": spans["fingerprint"][::-1]}
    before, failed = _received(dec), _failed(dec)
    out = _decode(dec, prompts[2], params)
    assert out["choices"][0]["token_ids"] == want[2]
    assert _received(dec) == before and _failed(dec) == failed + 1
    assert "holds chunks this engine cannot read" in dec.log.read_text()


@pytest.mark.parametrize("ktp", [
    {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": "x"},
    {"do_remote_prefill": True, "remote_port": 5000},
    {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 0},
    {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 5000, "remote_lease": "7"},
    # remote_host: an IP address or an ASCII host name, nothing the peer tier's socket could fail to dial
    *({"do_remote_prefill": True, "remote_host": h, "remote_port": 5000}
      for h in ("\ud800", "bad host", "tcp://127.0.0.1", "127.0.0.1:5000", "-x.example", "a" * 254, "", 7)),
    # remote_page_spans: what _produced announces, or nothing
    *({"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 5000, "remote_page_spans": sp}
      for sp in ([8], {"fingerprint": "ab" * 32, "hash_block_tokens": 8},
                 {"fingerprint": "xy" * 32, "hash_block_tokens": 8, "page_tokens": {"mla": 8, "indexer": 8}},
                 {"fingerprint": "ab" * 32, "hash_block_tokens": 8, "page_tokens": {"mla": 12, "indexer": 8}},
                 {"fingerprint": "ab" * 32, "hash_block_tokens": True, "page_tokens": {"mla": 8, "indexer": 8}})),
], ids=lambda ktp: ascii(ktp)[:60])
def test_malformed_kv_transfer_params_are_400(pd, ktp):
    dec = pd[1]["decode"]
    code, out = dec.post("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2, "kv_transfer_params": ktp})
    assert code == 400 and out["error"]["param"] == "kv_transfer_params", out
    assert dec.post("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})[0] == 200


def test_a_prefill_leg_takes_one_prompt_and_no_stream(pd):
    pre = pd[1]["prefill_pcp"]
    for body in ({"prompt": [[1, 2, 3], [4, 5, 6]]}, {"prompt": [1, 2, 3], "stream": True}):
        code, out = pre.post("/v1/completions", {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        assert code == 400 and out["error"]["param"] == "kv_transfer_params", out
    # prompt logprobs: a consumer computes no prompt it fetches, so neither leg takes them (named, before any fetch)
    dead = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": DEAD}
    for server, body, field in ((pre, {"prompt_logprobs": 1, "kv_transfer_params": {"do_remote_decode": True}},
                                 "prompt_logprobs"),
                                (pd[1]["decode"], {"echo": True, "logprobs": 1, "kv_transfer_params": dead}, "echo")):
        code, out = server.post("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1, **body})
        assert code == 400 and out["error"]["param"] == field, out


def test_a_prefill_server_restarted_loses_no_request(pd, reference, tmp_path, serving_model, serving_dir):
    """With the router's only prefill server down, a request is computed by the decode server (nothing
    received, the router counts a fallback); once the server is back on its port, the next request goes
    through it and its KV arrives again. Last in this file: it replaces the fixture's prefill server."""
    router, procs = pd
    prompts, want = reference
    dec, old = procs["decode"], procs["prefill_pcp"]
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
    procs["prefill_pcp"] = Process(serving_dir, tmp_path, *old.extra, port=old.port)
    deadline = time.monotonic() + 60
    while not router.health()["prefill"] and time.monotonic() < deadline:
        time.sleep(0.2)
    code, r = router.post({"prompt": fresh[1], "max_tokens": 8, "temperature": 0, "return_token_ids": True})
    assert code == 200 and r["choices"][0]["token_ids"] == eng.generate([np.asarray(fresh[1])], 8)[0].token_ids.tolist()
    assert _received(dec) - before == _expected(fresh[1], "decode")
