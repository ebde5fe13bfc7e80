"""A worker's exit with a KV pair open, over a real gloo pair in two processes (tests/_disagg_exit_child.py,
no model): no `terminate called without an active exception`, no SIGABRT.

That line came from every PD shutdown: the workers returned from serving while their pair threads were
still inside torch.distributed waits (the sender sending its Close, the receiver waiting for it), and
CPython's teardown ended those threads with pthread_exit when they woke, whose forced unwind through
torch's C++ frames calls std::terminate. Now the pairs end before the teardown, or it is skipped.
"""

from __future__ import annotations

import os
import subprocess
import sys

from _router_util import ROOT

CHILD = str(ROOT / "tests" / "_disagg_exit_child.py")


def spawn(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, CHILD, *args], cwd=ROOT, env=env, text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def linked_pair() -> tuple[subprocess.Popen[str], subprocess.Popen[str]]:
    decode = spawn("decode")
    assert decode.stdout is not None
    store = decode.stdout.readline().strip()
    prefill = spawn("prefill", store)
    assert decode.stdout.readline().strip() == "linked", decode.communicate(timeout=30)
    return prefill, decode


def tell(p: subprocess.Popen[str], line: str) -> None:
    assert p.stdin is not None
    p.stdin.write(line + "\n")
    p.stdin.flush()


def test_a_cluster_shutdown_ends_both_ends_of_a_pair_before_the_teardown() -> None:
    prefill, decode = linked_pair()
    try:
        tell(prefill, "stop")  # both at once, as the router's ShutdownReq reaches every worker
        tell(decode, "stop")
        for p in (prefill, decode):
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0 and "terminate called" not in err, err
            assert "finished" in out, err  # a normal exit: the pair ended in time, the teardown ran
            assert "without interpreter teardown" not in err
    finally:
        for p in (prefill, decode):
            p.kill()


def test_a_peer_that_stays_up_neither_holds_nor_aborts_the_exit() -> None:
    prefill, decode = linked_pair()
    try:
        tell(prefill, "linger")  # up and silent: the decode end's receive cannot be woken
        tell(decode, "stop")
        out, err = decode.communicate(timeout=30)
        assert decode.returncode == 0 and "terminate called" not in err, err
        assert "still waiting on their peers" in err and "finished" not in out, err  # teardown skipped
    finally:
        for p in (prefill, decode):
            p.kill()
            p.communicate(timeout=30)
