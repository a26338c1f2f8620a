"""Trust at the server (issue 51 item 1), real processes on loopback: one PdConnector server (`kv_both`, the
default role, which takes KV from producers) with a shared secret from $GLM53_KV_SECRET_FILE and no
producers listed, and an attacker's fake producer.

The attack: a client's kv_transfer_params named an address of its choosing; the server dialled it, took
the "KV" it answered (the CRC is the sender's, so it proves nothing) and kept it in the shared prefix
cache under the prompt's hash, so a later victim request without transfer params or salt attended to the
attacker's KV. The fake producer here is a real peer tier holding junk under exactly the chunk keys the
victim's prompt has on this server (the fingerprint read from the server's own prefill-leg answer, the
chained hashes recomputed, the sizes from the deployment), as an attacker would build it. Now a request
may name only a listed producer: anything else is a 400 naming kv_transfer_params, nothing is dialled,
and the victim keeps its greedy tokens. What a listed producer without the secret gets (its messages
and chunks refused): tests/kvcache/test_tiers_trust.py."""

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from glm53 import DeployConfig
from kvcache.block_pool import block_hashes
from kvcache.tiers import chunk_key
from tests.glm53.test_serve import FLAGS
from tests.glm53.test_serve import Server as Process

REPO = Path(__file__).resolve().parents[2]

# The attacker's producer: a peer tier on loopback holding a chunk of random bytes (small normal floats)
# under each key it is given; it reports what it was asked (pinned) and served.
_FAKE = """
import json, sys, time
import numpy as np
from kvcache.tiers import StoreJob
from kvcache.tiers.p2p import PeerTier
chunks = json.loads(sys.stdin.readline())
tier = PeerTier(fingerprint="00" * 32, host="127.0.0.1", port=0, max_bytes=None)
rng = np.random.default_rng(0)
keys = tuple(bytes.fromhex(k) for k, _ in chunks)
junk = tuple(rng.standard_normal(n // 4).astype(np.float32).view(np.uint8) for _, n in chunks)
tier.submit_store(StoreJob(1, keys, junk))
while not tier.get_finished_jobs():
    time.sleep(0.001)
print(tier.port, flush=True)
for line in sys.stdin:
    with tier._lock:
        print(json.dumps({"pinned": tier.stats.pinned_chunks, "served": tier.stats.served_chunks}), flush=True)
"""

# A plain listener that counts the connections it accepts: the address 300 more requests name.
_TRAP = """
import socket, sys, threading
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen(64)
got = []
def serve():
    while True:
        got.append(s.accept())
threading.Thread(target=serve, daemon=True).start()
print(s.getsockname()[1], flush=True)
for line in sys.stdin:
    print(len(got), flush=True)
"""


class _Proc:
    def __init__(self, script: str, first_line: str = ""):
        self.proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        if first_line:
            self.proc.stdin.write(first_line + "\n")
            self.proc.stdin.flush()
        self.port = int(self.proc.stdout.readline())

    def ask(self) -> str:
        self.proc.stdin.write("?\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline()

    def close(self):
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def server(tmp_path_factory, serving_dir):
    tmp = tmp_path_factory.mktemp("trust")
    (tmp / "kv.secret").write_bytes(os.urandom(32).hex().encode())
    ktc = {"kv_connector": "PdConnector", "kv_role": "kv_both"}
    os.environ["GLM53_KV_SECRET_FILE"] = str(tmp / "kv.secret")  # the server process inherits it
    try:
        proc = Process(serving_dir, tmp, "--kv-transfer-config", json.dumps(ktc))
    finally:
        del os.environ["GLM53_KV_SECRET_FILE"]
    yield proc
    proc.stop()


def _tokens(server, prompt, **kw) -> list[int]:
    code, out = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                "return_token_ids": True, **kw})
    assert code == 200, out
    return out["choices"][0]["token_ids"]


def _victim_chunks(server, serving_model, prompt) -> list[tuple[str, int]]:
    """(key hex, bytes) of every chunk the server would look up for `prompt` without a salt, as an
    attacker derives them: the fingerprint and page spans from the server's answer to a prefill leg of
    another salt, the chained hashes of the prompt, the page sizes of the deployment."""
    code, out = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 1, "cache_salt": "probe",
                                                "kv_transfer_params": {"do_remote_decode": True}})
    assert code == 200, out
    spans = out["kv_transfer_params"]["remote_page_spans"]
    sizes = DeployConfig(**FLAGS).kv_sizes(serving_model.cfg, np.dtype(serving_model.dtype).name).page_bytes
    hb = spans["hash_block_tokens"]
    out = []
    for c, h in enumerate(block_hashes(prompt, hb, (), upto=len(prompt) - 1)):
        for g, tokens in spans["page_tokens"].items():
            if not (c + 1) % (tokens // hb):
                out.append((chunk_key(spans["fingerprint"], g, h).hex(), sizes[g]))
    return out


def test_a_client_cannot_make_the_server_dial_or_poison_the_prefix_cache(server, serving_model):
    """The poisoning attack: a request with the victim's prompt naming the fake producer, which holds junk
    under every one of the prompt's chunk keys, is a 400 naming kv_transfer_params; the producer is never
    asked; the victim's later request (no salt, no transfer params) gives the greedy tokens the prompt
    gives under a salt of its own (no cache entry of the attack can reach that). 300 more requests, each
    naming another unlisted address (a live listener's port), are 400s, nothing dials it, and the server
    serves on with the same tokens."""
    prompt = np.random.default_rng(51).integers(0, 512, 41).tolist()
    want = _tokens(server, prompt, cache_salt="reference")
    fake = _Proc(_FAKE, json.dumps(_victim_chunks(server, serving_model, prompt)))
    trap = _Proc(_TRAP)
    try:
        attack = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": fake.port}
        code, out = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 8, "kv_transfer_params": attack})
        assert code == 400 and out["error"]["param"] == "kv_transfer_params", out
        assert _tokens(server, prompt) == want
        assert json.loads(fake.ask()) == {"pinned": 0, "served": 0}  # never asked for anything

        def name(i):
            named = {"do_remote_prefill": True, "remote_host": f"127.0.{i // 250}.{1 + i % 250}",
                     "remote_port": trap.port}
            return server.post("/v1/completions", {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": named})

        with ThreadPoolExecutor(8) as pool:
            for code, out in pool.map(name, range(300)):
                assert code == 400 and out["error"]["param"] == "kv_transfer_params", out
        time.sleep(0.5)  # a dial, had one been made, has reached the listener by now
        assert int(trap.ask()) == 0
        assert _tokens(server, prompt) == want
    finally:
        fake.close()
        trap.close()
    assert "no shared secret" not in server.log.read_text()  # its peer tier runs with the file's secret
