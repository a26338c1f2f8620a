"""Start a multi-process (multi-host style) JAX run on one machine, and always clean it up.

    python -m parallel.launch --processes 2 --local-devices 8 --timeout 300 -- python my_script.py ARGS

starts the command once per process with a free loopback coordinator port and the PARALLEL_* variables
that `parallel.mesh.init_distributed()` reads (coordinator, process count, process id, local CPU
devices). Each process runs in its own process group. The launcher waits for all of them under one
deadline; when any process fails or the deadline passes, it terminates every process group (SIGTERM, then
SIGKILL after a grace period), so a peer stuck in a collective cannot hang the caller. The exit status is 0
only when every process exited 0.

Output goes to per-process files, not pipes (a full pipe would block a child). `launch()` returns each
process's exit code, stdout and stderr, or raises `LaunchError` carrying them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from parallel.mesh import ENV_COORDINATOR, ENV_LOCAL_DEVICES, ENV_NUM_PROCESSES, ENV_PROCESS_ID


@dataclasses.dataclass(frozen=True)
class ProcessResult:
    process_id: int
    returncode: int | None  # None: killed by the launcher before it exited on its own
    stdout: str
    stderr: str


class LaunchError(RuntimeError):
    """A process failed or the run timed out; `results` holds every process's output."""

    def __init__(self, message: str, results: list[ProcessResult]):
        tails = "\n".join(f"--- process {r.process_id} (exit {r.returncode}) stderr tail:\n{r.stderr[-2000:]}"
                          for r in results)
        super().__init__(f"{message}\n{tails}")
        self.results = results


def _ephemeral_low() -> int | None:
    """The lowest port the kernel hands out on its own (Linux's ip_local_port_range), None where unknown."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago, for a process started next to bind.

    Taken below the kernel's ephemeral range where that range is known and leaves room (12,000 ports under
    it, at random): the kernel gives ephemeral ports to every outgoing connection and every bind to port 0
    (ZMQ's random ports, other servers), so a port taken from that range can be handed to someone else in the
    seconds before its process binds it; below the range only another caller of this function can take it.
    Elsewhere the OS picks one (bind to port 0)."""
    low = _ephemeral_low()
    if low is not None and low > 12000 + 1024:
        rng = random.SystemRandom()
        for _ in range(200):
            port = rng.randrange(low - 12000, low)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:  # in use (or lingering in TIME_WAIT): try another
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _kill_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the process group of `proc`, then SIGKILL it if it is still alive after `grace_s`."""
    if proc.poll() is not None:
        try:  # the leader exited; its children (same group) may still be alive
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def launch(argv: Sequence[str], *, num_processes: int, local_devices: int | None = None, timeout_s: float = 300,
           env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
           grace_s: float = 5.0, host: str = "127.0.0.1") -> list[ProcessResult]:
    """Run `argv` as `num_processes` cooperating processes; return their results when all exit 0.

    Raises LaunchError when a process exits non-zero (the others are killed at once) or when the whole run
    exceeds `timeout_s` seconds (all are killed). `local_devices`: CPU devices each process simulates
    (exported as PARALLEL_LOCAL_DEVICES; None leaves the platform's devices alone).
    """
    if not argv:
        raise ValueError("argv must name a command to run")
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be a positive int, got {num_processes!r}")
    if local_devices is not None and (not isinstance(local_devices, int) or local_devices < 1):
        raise ValueError(f"local_devices must be a positive int or None, got {local_devices!r}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    base_env = dict(os.environ if env is None else env)
    base_env[ENV_COORDINATOR] = f"{host}:{free_port(host)}"
    base_env[ENV_NUM_PROCESSES] = str(num_processes)
    if local_devices is not None:
        base_env[ENV_LOCAL_DEVICES] = str(local_devices)

    failure = None
    with tempfile.TemporaryDirectory(prefix="parallel_launch_") as tmp, contextlib.ExitStack() as files:
        procs: list[subprocess.Popen] = []
        logs = []
        killed: set[int] = set()
        try:
            for i in range(num_processes):
                out = files.enter_context(open(Path(tmp) / f"{i}.out", "w+"))
                err = files.enter_context(open(Path(tmp) / f"{i}.err", "w+"))
                logs.append((out, err))
                procs.append(subprocess.Popen(list(argv), env={**base_env, ENV_PROCESS_ID: str(i)}, cwd=cwd,
                                              stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                              start_new_session=True))
            deadline = time.monotonic() + timeout_s
            while True:
                codes = [p.poll() for p in procs]
                bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
                if bad:
                    failure = f"process {bad[0]} exited with status {codes[bad[0]]}; stopped the others"
                    break
                if all(c == 0 for c in codes):
                    break
                if time.monotonic() > deadline:
                    failure = f"timed out after {timeout_s:.0f} s; killed all {num_processes} processes"
                    break
                time.sleep(0.05)
        finally:  # also on exceptions and KeyboardInterrupt: no process outlives the launcher
            for i, p in enumerate(procs):
                if p.poll() is None:
                    killed.add(i)
                _kill_group(p, grace_s)
        results = []
        for i, (out, err) in enumerate(logs):
            out.seek(0)
            err.seek(0)
            results.append(ProcessResult(i, None if i in killed else procs[i].returncode, out.read(), err.read()))
    if failure:
        raise LaunchError(failure, results)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parallel.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2, help="number of processes (hosts) to start")
    parser.add_argument("--local-devices", type=int, default=None, help="CPU devices simulated per process")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before every process is killed")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- followed by the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        results = launch(command, num_processes=args.processes, local_devices=args.local_devices,
                         timeout_s=args.timeout)
    except LaunchError as e:
        for r in e.results:
            sys.stdout.write(r.stdout)
        print(e, file=sys.stderr)
        return 1
    for r in results:
        sys.stdout.write(r.stdout)
        sys.stderr.write(r.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
