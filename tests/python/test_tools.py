"""`python -m pinshm inspect` and `python -m pinshm doctor`, run as a user
runs them: the installed package, in a fresh interpreter."""

import json
import os
import signal
import subprocess
import sys

import pytest

import pinshm

from _small_shm import run_in_small_dev_shm
from _workers import attach_hold_and_wait, create_and_wait

STORE_SHAPE = (1 << 20, 64 << 10, 2)


def _pinshm_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "pinshm", *args], capture_output=True, text=True, timeout=120
    )


def test_the_installed_package_is_not_the_source_tree():
    # The suite tests what pip installed (./test.sh, .ci/run): a module
    # missing from the wheel must fail here, not be found in python/.
    if os.environ.get("PINSHM_TEST_INSTALLED") != "1":
        import pytest

        pytest.skip("PINSHM_TEST_INSTALLED is not 1: this run may import a development build")
    source = os.path.realpath(os.path.join(os.path.dirname(__file__), "..", "..", "python"))
    assert not os.path.realpath(pinshm.__file__).startswith(source + os.sep), pinshm.__file__


def test_inspect_shows_a_held_object_and_a_dead_reader(store, reader, ctx):
    a = store.put("a", b"x" * 1000)
    b = store.put("b", b"y" * 2000)
    with reader.get(b):
        _inspect_held_and_dead(store, a, b, ctx)


def _inspect_held_and_dead(store, a, b, ctx):
    ready = ctx.Queue()
    child = ctx.Process(target=attach_hold_and_wait, args=(store.handle(), 1, a, ready))
    child.start()
    try:
        assert ready.get(timeout=120) == 1000
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(120)
    assert child.exitcode == -signal.SIGKILL

    out = _pinshm_cli("inspect", store.name, f"{a.address}:{a.monotonic_id}")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    lines = [line.split() for line in text.splitlines()]
    # Reader 0 (this process) alive, holding one guard; reader 1 killed.
    assert ["0", "attached", str(os.getpid()), "true"] == lines[_row(text, "0 ")][:4], text
    assert ["1", "attached", str(child.pid), "false"] == lines[_row(text, "1 ")][:4], text
    # b is held by the live reader: the oldest blocker. a is owed only by
    # the dead reader (and by reader 0, which has not read it).
    assert f"blocker   oldest in use: id {a.monotonic_id}" in text, text
    assert f"{a.address}:{a.monotonic_id}: live" in text, text
    # The killed reader's entry is free again: the kernel released its lock.
    assert "entries   1 of 2 reader entries held by live readers, 1 free" in text, text

    snap = json.loads(_pinshm_cli("inspect", store.name, "--json").stdout)
    assert (snap["entries_used"], snap["entries_free"]) == (1, 1)
    readers = {r["index"]: r for r in snap["readers"]}
    assert readers[0]["alive"] and readers[0]["holds"] == 1
    assert not readers[1]["alive"] and readers[1]["pid"] == child.pid
    slots = {s["monotonic_id"]: s for s in snap["slots"]}
    assert slots[b.monotonic_id]["holds"] == [1, 0]
    # The dead reader's hold on a still shows (its generation is current
    # until the writer reaps it), but it blocks nothing.
    assert slots[a.monotonic_id]["holds"] == [0, 1]
    assert snap["blocker"]["monotonic_id"] == a.monotonic_id
    assert "reader 0 owes 1 read" in snap["blocker"]["why"]
    assert "reader 1" not in snap["blocker"]["why"]  # dead: blocks nothing
    # The same, typed.
    typed = pinshm.inspect_segment(store.name, [(a.address, a.monotonic_id)])
    assert isinstance(typed, pinshm.segments.Snapshot) and typed.to_dict()["entries_used"] == 1
    assert isinstance(typed.readers[0], pinshm.segments.ReaderEntry) and typed.readers[0].holds == 1
    assert [s.kind for s in typed.slots] == ["raw", "raw"] and not typed.cache
    assert typed.blocker is not None and typed.blocker.monotonic_id == a.monotonic_id
    assert typed.explanations[0].startswith("live"), typed.explanations


def _row(text, prefix):
    """The index of the reader-table line of `text` starting with `prefix`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("index"))
    return next(i for i in range(start + 1, len(lines)) if lines[i].strip().startswith(prefix))


def test_inspect_of_a_missing_segment_says_so_and_exits_1(unique_name):
    out = _pinshm_cli("inspect", unique_name())
    assert out.returncode == 1
    assert out.stderr.startswith("pinshm inspect: "), out.stderr


def test_inspect_without_a_name_says_only_the_name_is_required():
    out = _pinshm_cli("inspect")
    assert out.returncode == 2
    assert "NAME is required" in out.stderr and "ADDRESS:ID is optional" in out.stderr, out.stderr


def test_doctor_json_into_a_pipe_closed_early_exits_quietly():
    # `true` exits at once, long before doctor writes: every write fails.
    done = subprocess.run(f"{sys.executable} -m pinshm doctor --json | true", shell=True, capture_output=True, text=True)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr


def test_doctor_reports_no_driver_cleanly_and_no_vllm():
    out = _pinshm_cli("doctor", "--json")
    checks = json.loads(out.stdout)
    assert out.returncode == 0, out.stdout + out.stderr
    cuda = [c for c in checks if c["topic"] == "cuda"]
    assert cuda, checks
    status = pinshm._pinshm.cuda_status()
    if not status["driver"]:
        assert len(cuda) == 1 and cuda[0]["status"] in ("info", "warn"), cuda
        assert ("no driver" in cuda[0]["text"]) or ("no cuda feature" in cuda[0]["text"]), cuda
    topics = {c["topic"] for c in checks}
    assert {"pinshm", "/dev/shm", "cache", "start"} <= topics, checks
    assert not [c for c in checks if c["topic"] == "doctor"], checks  # no check crashed


def test_doctor_in_a_small_dev_shm_says_the_planned_cache_does_not_fit():
    code = """
        import json, subprocess, sys
        out = subprocess.run([sys.executable, "-m", "pinshm", "doctor", "--tp", "2"],
                             capture_output=True, text=True)
        print(out.stdout)
        sys.exit(out.returncode)
    """
    out = run_in_small_dev_shm(code, size="64m")
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "/dev/shm: 64 MiB" in text, text
    assert "the planned 4 GiB cache does not fit" in text, text
    # vLLM's executor queue (16 MiB x 10) would be refused there: pinshm's
    # takes its place, and no line says vLLM's fits.
    assert "executor broadcast: pinshm's queue (vLLM's would need 160 MiB" in text, text
    assert "executor broadcast: vLLM's own queue" not in text, text


def test_doctor_plans_for_shm_mib_in_every_line_it_prints():
    # A roomy /dev/shm here, a container's 64 MiB planned: no line may
    # judge by this machine's space (the cache and the executor queue fit
    # here, not there).
    out = _pinshm_cli("doctor", "--tp", "2", "--shm-mib", "64", "--json")
    checks = json.loads(out.stdout)
    text = "\n".join(f"{c['topic']} {c['text']}" for c in checks)
    assert "planning for an empty 64 MiB /dev/shm" in text, text
    assert "the planned 4 GiB cache does not fit" in text, text
    assert "executor broadcast: vLLM's own queue" not in text, text
    assert "vLLM's would need 160 MiB, 64 MiB free" in text, text


@pytest.mark.parametrize(
    "args, what",
    [(["--tp", "0"], "--tp"), (["--cache-gib", "-1"], "--cache-gib"), (["--shm-mib", "0"], "--shm-mib"),
     (["--tp", "two"], "not a int")],
)
def test_doctor_refuses_inputs_no_engine_can_have(args, what):
    out = _pinshm_cli("doctor", *args)
    assert out.returncode == 2 and what in out.stderr, out.stderr


def test_doctor_claims_only_what_it_checked():
    from pinshm import doctor

    checks = [doctor.Check("vllm", doctor.SKIP, "vLLM is not installed"), doctor.Check("shm", doctor.OK, "fine")]
    last = doctor.format_report(checks).splitlines()[-1]
    assert "not checked: vllm" in last and "vLLM can start" not in last, last
    last = doctor.format_report(checks[1:]).splitlines()[-1]
    assert last.endswith("vLLM can start with pinshm"), last
    # Unset, the start method is said to be vLLM's default, not "=fork".
    os.environ.pop("VLLM_WORKER_MULTIPROC_METHOD", None)
    (start,) = doctor.check_start_method()
    assert "is unset" in start.text and "=fork" not in start.text, start


def test_the_cli_has_a_version_and_names_itself_as_it_was_run():
    out = _pinshm_cli("--version")
    assert out.returncode == 0 and out.stdout.startswith(f"pinshm {pinshm.__version__} ("), out.stdout
    assert _pinshm_cli("--help").stdout.startswith("usage: python -m pinshm"), "run as a module"
    script = os.path.join(os.path.dirname(sys.executable), "pinshm")
    if not os.path.exists(script):
        pytest.skip("no pinshm console script beside this Python (not a wheel install)")
    out = subprocess.run([script, "gc", "--help"], capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("usage: pinshm gc"), out.stdout
    assert "liveness lock" in out.stdout, "the subcommand has a description"


def test_doctor_names_the_rebinding_targets_a_vllm_lacks(tmp_path):
    # A stand-in vLLM on PYTHONPATH: its cache module lacks two of the
    # names the plugin rebinds; the required queue module has MessageQueue;
    # the optional executors are absent.
    files = {
        "vllm/__init__.py": '__version__ = "0.0-standin"\n',
        "vllm/multimodal/__init__.py": "",
        "vllm/multimodal/cache/__init__.py": "",
        "vllm/multimodal/cache/shm.py": "SingleWriterShmRingBuffer = object\n",
        "vllm/distributed/__init__.py": "",
        "vllm/distributed/device_communicators/__init__.py": "",
        "vllm/distributed/device_communicators/shm_broadcast.py": "class MessageQueue: pass\n",
    }
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    out = subprocess.run(
        [sys.executable, "-m", "pinshm", "doctor", "--json"],
        capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=str(tmp_path)),
    )
    checks = json.loads(out.stdout)
    assert out.returncode == 1, checks  # a FAIL line
    by_text = {c["text"].split(" ", 1)[0]: c for c in checks if c["topic"] in ("cache", "queue", "vllm")}
    assert by_text["vLLM"]["text"] == "vLLM 0.0-standin"
    cache = by_text["vllm.multimodal.cache.shm"]
    assert cache["status"] == "FAIL" and "SingleWriterShmObjectStorage, MsgpackSerde" in cache["text"], cache
    assert by_text["vllm.distributed.device_communicators.shm_broadcast"]["status"] == "ok"
    assert by_text["vllm.v1.executor.multiproc_executor"]["status"] == "info"  # optional, absent


def test_gc_lists_then_removes_a_killed_writers_store_and_leaves_a_live_one(ctx, unique_name, closing):
    prefix = unique_name("gc")
    dead, live = prefix + "-dead", prefix + "-live"
    ready = ctx.Queue()
    child = ctx.Process(target=create_and_wait, args=(dead, ready))
    child.start()
    try:
        assert ready.get(timeout=120) == "created"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.join(120)
    try:
        closing(pinshm.ObjectStore(1 << 20, 4096, 1, name=live))
        out = _pinshm_cli("gc", "--prefix", prefix, "--dry-run")
        assert out.returncode == 0, out.stderr
        (line,) = out.stdout.splitlines()
        assert line.startswith(f"would remove /dev/shm/{dead} (store, "), line
        assert line.endswith(f"writer pid {child.pid} gone)"), line
        assert os.path.exists(f"/dev/shm/{dead}"), "a dry run removes nothing"
        typed = pinshm.gc_segments(prefix)
        assert [(x.name, x.kind, x.writer_pid, x.removed) for x in typed] == [(dead, "store", child.pid, False)]
        found = json.loads(_pinshm_cli("gc", "--prefix", prefix, "--json").stdout)
        assert [(a["name"], a["kind"], a["writer_pid"], a["removed"]) for a in found] == [
            (dead, "store", child.pid, True)
        ]
        assert not os.path.exists(f"/dev/shm/{dead}") and os.path.exists(f"/dev/shm/{live}")
        assert "no segment of a dead writer" in _pinshm_cli("gc", "--prefix", prefix).stdout
    finally:
        if os.path.exists(f"/dev/shm/{dead}"):
            os.unlink(f"/dev/shm/{dead}")


def test_doctor_gpu_says_what_it_checks_or_why_it_cannot():
    out = _pinshm_cli("doctor", "--gpu")
    assert out.returncode in (0, 1), out.stderr
    gpu = [line for line in out.stdout.splitlines() if "] gpu " in line]
    assert gpu, out.stdout
    try:
        import torch
    except ImportError:
        assert "torch is not installed" in gpu[0], gpu
        return
    if not torch.cuda.is_available():
        assert "no CUDA device" in gpu[0], gpu
        return
    assert any("[ ok ] h2d" in line for line in out.stdout.splitlines()), out.stdout


def test_everything_public_in_the_native_module_is_re_exported_by_pinshm():
    import pinshm._pinshm as native

    public = {n for n in dir(native) if not n.startswith("_")} | {"__version__"}
    kept_native = {"signature_bytes"}  # the vLLM drop-in's, documented in __init__
    typed = {"inspect_segment", "gc_segments"}  # pinshm.segments: the natives' typed forms
    assert public - kept_native | typed == set(pinshm.__all__), public ^ set(pinshm.__all__)
    assert all(getattr(pinshm, n) is getattr(native, n) for n in set(pinshm.__all__) - typed)
    assert pinshm.inspect_segment is pinshm.segments.inspect_segment


def test_doctor_prints_the_node_budgets_plan_for_a_container():
    from pinshm import doctor

    checks = doctor.budget_plan(doctor.Plan(cache_gib=4, tp=2), 64 << 20)
    text = "\n".join(c.text for c in checks)
    assert "vLLM's own segments (its CPU communicator): 8 MiB left free" in text
    # vLLM's own queues would not fit: pinshm's, their slots backed at start.
    assert text.count("10 slots of 0.38 MiB backed at start (4 MiB)") == 3
    assert "in pieces" in text  # what happens at the overflow's limit
    assert "multimodal cache: sparse, grows while 24 MiB stay free" in text
    assert not [c for c in checks if c.status == doctor.FAIL]
