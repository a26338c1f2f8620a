"""What `jax.experimental.transfer` does between two CPU processes on loopback (issue 23 item 3 asked us to
check it as a transport for P/D; docs/engine.md "P/D" says what we found and why the peer tier keeps its
own ZMQ control and TCP bulk frames). Two real processes: a producer offers a canonical MLA page
(fp8 rows as uint8) and an indexer page (bfloat16) under one id, a consumer pulls them by shapes it
must know in advance. Pinned so that a JAX upgrade that changes any of it is noticed."""

import os
import subprocess
import sys
import time

SCRIPT = r'''
import datetime, sys, time
import jax, jax.numpy as jnp
import numpy as np
from jax.experimental import transfer

role, addr_file = sys.argv[1], sys.argv[2]
dev = jax.devices()[0]
# explicit IPv4 addresses: with the defaults ("[::]:0", no transport addresses) the pull fails with
# "Connection closed" and the producer aborts (a failed CHECK in the socket event loop)
srv = transfer.start_transfer_server(dev.client, "127.0.0.1:0", ["127.0.0.1:0"])
rng = np.random.default_rng(0)
mla = jnp.asarray(rng.integers(0, 256, (4, 656), dtype=np.uint8))
index = jnp.asarray(rng.standard_normal((4, 128)), jnp.bfloat16)
if role == "producer":
    srv.await_pull(7, [mla, index])
    with open(addr_file + ".tmp", "w") as f:
        f.write(srv.address())
    import os; os.replace(addr_file + ".tmp", addr_file)
    time.sleep(float(sys.argv[3]))
    sys.exit(0)
conn = srv.connect(open(addr_file).read())
sh = jax.sharding.SingleDeviceSharding(dev)
specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh) for x in (mla, index)]
got = conn.pull(7, specs)
same = bool(np.array_equal(np.asarray(got[0]), np.asarray(mla)) and np.array_equal(np.asarray(got[1]), np.asarray(index)))
print("PULLED", same, flush=True)
t = time.monotonic()
try:  # an id the producer never offered, with a 1 s timeout
    bad = conn.pull(8, specs, timeout=datetime.datetime.now() + datetime.timedelta(seconds=1))
    np.asarray(bad[0])
    print("UNKNOWN returned", flush=True)
except Exception as e:
    print("UNKNOWN raised", round(time.monotonic() - t, 1), type(e).__name__, flush=True)
'''


def test_pull_between_two_cpu_processes_and_an_unknown_id(tmp_path):
    script, addr = tmp_path / "xfer.py", tmp_path / "addr"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    linger = 8.0  # the producer exits this long after offering
    prod = subprocess.Popen([sys.executable, str(script), "producer", str(addr), str(linger)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not addr.exists():
            assert prod.poll() is None and time.monotonic() < deadline, prod.stdout.read() if prod.poll() is not None else "no address"
            time.sleep(0.1)
        cons = subprocess.run([sys.executable, str(script), "consumer", str(addr)], env=env, capture_output=True,
                              text=True, timeout=180)
        out = cons.stdout + cons.stderr
        # the offered arrays arrive bit for bit
        assert "PULLED True" in out, out[-3000:]
        # an id never offered returns nothing: the pull waits past its 1 s timeout and fails only when
        # the producer goes away (so a consumer must learn from its own control channel what is offered)
        line = next(ln for ln in out.splitlines() if ln.startswith("UNKNOWN"))
        assert line.startswith("UNKNOWN raised"), line
        assert float(line.split()[2]) > 2.0, line
        assert prod.wait(60) == 0, prod.stdout.read()[-3000:]  # the producer survives the failed pull
    finally:
        if prod.poll() is None:
            prod.kill()
