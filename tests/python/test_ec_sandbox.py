"""A takeover of the remote tier's NIXL process (producer) or fetch process
(consumer), simulated: once its sandbox is on, the child runs what an
attacker who reached its UCX port and took it over would try
(PINSHM_TEST_TAKEOVER: pinshm.vllm.ec.remote.sandbox.probe). It must not
open the secret file, read the engine's /proc/PID/environ or mem, ptrace or
process_vm_readv the engine, signal it, exec anything, make a UNIX socket
(vLLM's ipc:// ones), or open a store or make one. The same probe run outside a sandbox reaches them (the test can
fail). Where the kernel lacks Landlock or seccomp the test is skipped,
saying which, unless PINSHM_REQUIRE_SANDBOX=1 (.ci/run on this kernel)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from _ec_remote import make_secret, nixl_or_skip
from _ec_security import Served, ask
from _ec_remote import free_port

import pinshm
from pinshm.vllm.ec.remote import spawn
from pinshm.vllm.ec.remote.fetcher import Fetcher

REACHABLE = {
    "secret_file",
    "engine_environ",
    "engine_mem",
    "store_for_writing",
    "new_segment",
    "signal_engine",
    "unix_socket",
}


def _takeover(capfd, deadline_s=30):
    """The probe's result, from the child's stderr."""
    deadline = time.monotonic() + deadline_s
    seen = ""
    while time.monotonic() < deadline:
        out, err = capfd.readouterr()
        seen += err
        for line in seen.splitlines():
            if line.startswith("PINSHM-TAKEOVER "):
                return json.loads(line[len("PINSHM-TAKEOVER ") :])
        time.sleep(0.05)
    raise AssertionError(f"no probe result: {seen[-2000:]}")


def _require(status):
    """Skips (or fails, under PINSHM_REQUIRE_SANDBOX=1) where this kernel
    cannot sandbox fully."""
    missing = [what for what, ok in (("Landlock", status.get("landlock") == "full"), ("seccomp", status.get("seccomp"))) if not ok]
    if missing:
        why = f"this kernel lacks {' and '.join(missing)}: {status}"
        if os.environ.get("PINSHM_REQUIRE_SANDBOX") == "1":
            pytest.fail(f"PINSHM_REQUIRE_SANDBOX=1 but {why}")
        pytest.skip(why)


def _check(got, status):
    assert status["threads"] == 1, f"Landlock set with other threads running: {status}"
    assert status["no_new_privs"] is True, status
    for name in REACHABLE | {"exec"}:
        assert got[name].startswith("denied"), f"{name}: {got[name]}"
    assert got["ptrace_engine"] == "denied (EPERM)", got
    assert got["process_vm_readv_engine"] == "denied (EPERM)", got
    if os.geteuid() == 0:
        assert got["uid"] != "0" and status["uid"] != 0, f"still root: {got}, {status}"
    # Still dies with the engine (a change of uid clears the signal).
    assert got["pdeathsig"] == str(int(signal.SIGKILL)), got


@pytest.fixture
def targets(tmp_path, unique_name, monkeypatch):
    """The secret, a store, a token in the engine's environment; the probe
    asked of every child started from here on."""
    secret = make_secret(tmp_path)
    store = pinshm.ObjectStore(1 << 20, 1 << 18, 2, name=unique_name("sandbox"))
    monkeypatch.setenv("HF_TOKEN", "hf_not_for_a_takeover")
    want = {"secret": str(secret), "store": f"/dev/shm/{store.name}"}
    monkeypatch.setenv("PINSHM_TEST_TAKEOVER", json.dumps(want))
    yield secret, store, want
    store.close()


def test_unsandboxed_the_probe_reaches_what_the_sandbox_closes(targets):
    _, _, want = targets
    # A child of this process, as the NIXL process is of the engine's.
    code = "import json,sys; from pinshm.vllm.ec.remote.sandbox import probe; print(json.dumps(probe(json.loads(sys.argv[1]))))"
    done = subprocess.run([sys.executable, "-c", code, json.dumps(want)], capture_output=True, text=True, timeout=60)
    got = json.loads(done.stdout)
    assert all(got[name].startswith("REACHED") for name in REACHABLE), got


def test_a_takeover_of_the_producers_nixl_process_reaches_nothing(targets, capfd, unique_name, tmp_path):
    nixl_or_skip()
    secret, _, _ = targets
    s = Served(unique_name("served"), secret, free_port())
    try:
        status = spawn.SANDBOXES["nixl_process"]
        _require(status)
        got = _takeover(capfd)
        _check(got, status)
        # And it still serves: a hello registers the region (after the
        # sandbox, the descriptor passed in is mapped).
        hello = ask(s.client(), {"op": "hello"})
        assert hello is not None and "meta" in hello, hello
    finally:
        s.close()


def test_a_takeover_of_the_consumers_fetch_process_reaches_nothing(targets, capfd):
    nixl_or_skip()
    secret, _, _ = targets
    f = Fetcher(1 << 20, f"sandbox-{os.getpid()}", ("127.0.0.1",), (str(secret),))
    try:
        status = spawn.SANDBOXES["fetch_process"]
        _require(status)
        _check(_takeover(capfd), status)
        assert f.alive
    finally:
        f.close()


ENGINE = r"""
import os, sys, time
import pinshm
from pinshm.vllm.ec._config import ECSettings
from pinshm.vllm.ec.remote import producer
from pinshm.vllm.ec.remote.fetcher import Fetcher
store = pinshm.ObjectStore(1 << 20, 1 << 18, 2, name=sys.argv[1])
server = producer.Server(ECSettings.from_extra({"store": sys.argv[1], "serve": "127.0.0.1:" + sys.argv[2], "insecure": True}))
fetcher = Fetcher(1 << 20, "dies-" + str(os.getpid()))
print("PIDS", server.nixl_pid, fetcher.pid, flush=True)
time.sleep(600)
"""


def test_sandboxed_children_still_die_with_a_sigkilled_engine(unique_name):
    # A change of uid clears the parent-death signal: the children set it
    # again after dropping root (the probe checks the setting itself).
    nixl_or_skip()
    name = unique_name("dies")
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, name, str(free_port())], stdout=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith("PIDS"):  # NIXL logs to stdout too
            line = engine.stdout.readline()
            assert line, "the engine died at start"
        pids = [int(x) for x in line.split()[1:]]
        assert len(pids) == 2, pids
        uids = [os.stat(f"/proc/{pid}").st_uid for pid in pids]
        engine.send_signal(signal.SIGKILL)
        engine.wait(10)
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{pid}") and "Z" not in open(f"/proc/{pid}/stat").read().split()[2] for pid in pids):
            assert time.monotonic() < deadline, f"a child outlived its engine (uids {uids})"
            time.sleep(0.05)
    finally:
        if engine.poll() is None:
            engine.kill()
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")
