"""Helpers for tests that pause a real process (a peer, a server) to make it miss its deadlines."""

import os
import signal
import time


def _states(pid: int) -> list[str]:
    """The scheduler state letter of each thread of process `pid` (from /proc; Linux)."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                out.append(f.read().rsplit(")", 1)[1].split()[0])
        except FileNotFoundError:  # a thread that exited meanwhile
            pass
    return out


def pause(proc, timeout: float = 10.0) -> None:
    """SIGSTOP `proc` (a subprocess.Popen) and return once every one of its threads is stopped.

    kill(2) returns before the stop takes effect: one thread is woken to start the group stop, and the
    others run on until it does. On a loaded machine a peer paused by a bare SIGSTOP was seen to answer a
    request sent after the signal; a test of "nobody answers" must wait for the stop."""
    if proc.poll() is not None:
        raise AssertionError(f"process {proc.pid} exited ({proc.returncode}) before it could be paused")
    proc.send_signal(signal.SIGSTOP)
    end = time.monotonic() + timeout
    while not all(s in "TZX" for s in _states(proc.pid)):  # stopped, or a thread already exiting
        assert time.monotonic() < end, f"process {proc.pid} did not stop within {timeout} s"
        time.sleep(0.001)


def resume(proc) -> None:
    """SIGCONT `proc` (a paused process runs again; one already running is unaffected)."""
    proc.send_signal(signal.SIGCONT)
