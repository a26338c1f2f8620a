"""Trust at the server (issue 51 item 1), real processes on loopback: one PdConnector server (`kv_both`, the
role that takes KV from producers) with a shared secret from $GLM53_KV_SECRET_FILE and one listed
producer, which holds another secret.

The attack this guards against: a client's kv_transfer_params named an address of its choosing, the server
dialled it, took the "KV" it answered and kept it in the shared prefix cache under the prompt's hash, so a
later victim request without transfer params got the attacker's KV. Now a request may name only a listed
producer (anything else is a 400 naming kv_transfer_params, and nothing is dialled), and a listed one must
prove the secret on every message and chunk."""

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from tests.glm53.test_serve import _metric
from tests.glm53.test_serve import Server as Process
from tests.kvcache.test_tiers_trust import Producer

# A process that accepts connections on a port and reports how many it got: the "producer" an attacker
# names. It answers nothing; what matters is whether the server dials it at all.
_TRAP = """
import socket, sys, threading
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen(64)
got = []
def serve():
    while True:
        c, _ = s.accept()
        got.append(1)
threading.Thread(target=serve, daemon=True).start()
print(s.getsockname()[1], flush=True)
for line in sys.stdin:
    print(len(got), flush=True)
"""


class Trap:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", _TRAP], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.port = int(self.proc.stdout.readline())

    def dialled(self) -> int:
        self.proc.stdin.write("?\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline())

    def close(self):
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def trusted(tmp_path_factory, serving_dir):
    tmp = tmp_path_factory.mktemp("trust")
    (tmp / "kv.secret").write_bytes(os.urandom(32).hex().encode())
    (tmp / "other.secret").write_bytes(os.urandom(32).hex().encode())
    listed = Producer(secret_file=str(tmp / "other.secret"))
    ktc = {"kv_connector": "PdConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"producers": [listed.address]}}
    os.environ["GLM53_KV_SECRET_FILE"] = str(tmp / "kv.secret")  # the server process inherits it
    try:
        server = Process(serving_dir, tmp, "--kv-transfer-config", json.dumps(ktc))
    finally:
        del os.environ["GLM53_KV_SECRET_FILE"]
    trap = Trap()
    yield server, listed, trap
    server.stop()
    listed.close()
    trap.close()


def _tokens(server, prompt, **kw) -> list[int]:
    code, out = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0,
                                                "return_token_ids": True, **kw})
    assert code == 200, out
    return out["choices"][0]["token_ids"]


def test_a_client_cannot_make_the_server_dial_or_poison_the_prefix_cache(trusted):
    """The poisoning attack: a request naming an unlisted "producer" (a live process listening there) with
    the victim's prompt is a 400 naming kv_transfer_params; nothing dials it; the victim's later request
    (no salt, no transfer params) gives the greedy tokens the same prompt gives under a salt of its own
    (the reference: no cache entry of the attack's can reach it). 300 more requests, each naming another
    unlisted peer, change nothing, and the server serves on."""
    server, _, trap = trusted
    prompt = np.random.default_rng(51).integers(0, 512, 40).tolist()
    want = _tokens(server, prompt, cache_salt="reference")
    attack = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": trap.port}
    code, out = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 8, "kv_transfer_params": attack})
    assert code == 400 and out["error"]["param"] == "kv_transfer_params", out
    assert _tokens(server, prompt) == want
    def name(i):
        named = {"do_remote_prefill": True, "remote_host": f"127.0.{i // 250}.{1 + i % 250}", "remote_port": trap.port}
        return server.post("/v1/completions", {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": named})

    with ThreadPoolExecutor(8) as pool:
        for code, out in pool.map(name, range(300)):
            assert code == 400 and out["error"]["param"] == "kv_transfer_params", out
    time.sleep(0.5)  # a dial, had one been made, has reached the trap by now
    assert trap.dialled() == 0
    assert _tokens(server, prompt) == want


def test_a_listed_producer_without_the_secret_is_refused(trusted):
    """The listed producer holds another secret: the server's lookups fail its MAC check (it reads none
    and pins nothing), the server gets no answer it can verify, counts a failed lookup and computes the
    prompt with the right tokens."""
    server, listed, _ = trusted
    prompt = np.random.default_rng(52).integers(0, 512, 33).tolist()
    want = _tokens(server, prompt, cache_salt="reference")
    failed = _metric(server.metrics(), "glm53:kv_transfer_failed_lookups_total")
    host, port = listed.address.rsplit(":", 1)
    params = {"do_remote_prefill": True, "remote_host": host, "remote_port": int(port)}
    assert _tokens(server, prompt, kv_transfer_params=params) == want
    assert _metric(server.metrics(), "glm53:kv_transfer_failed_lookups_total") == failed + 1
    st = listed.cmd("stats")
    assert st["auth_failures"] >= 1 and st["pinned_chunks"] == 0 and st["served_chunks"] == 0
    assert "no shared secret" not in server.log.read_text()  # the server's tier runs authenticated
