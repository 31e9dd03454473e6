"""Fixtures of the encoder-cache connector's tests: vLLM's modules are a
stand-in's (_ec_vllm.py), a store name removed at the end, and engines
closed at the end (their workers killed if need be)."""

import multiprocessing as mp
import os
import sys

import pytest

from _ec_vllm import MODEL, ROWS, Engine, digest, encode, install

# 256 KiB hold about a dozen 16 KiB outputs.
SIZE = "256k"
HOLDS = 12


def _vllm_module(name):
    # vLLM, and the two modules of pinshm that import it.
    return name in ("vllm", "pinshm.vllm.ec._connector", "pinshm.vllm.ec_connector") or name.startswith("vllm.")


@pytest.fixture
def stand_in(tmp_path_factory, monkeypatch):
    """vLLM's modules are the stand-in's for this test (and its children);
    whatever was imported before (a real vLLM) is back afterwards."""
    root = tmp_path_factory.getbasetemp() / "vllm-stand-in"
    saved = {k: v for k, v in sys.modules.items() if _vllm_module(k)}
    for k in saved:
        del sys.modules[k]
    monkeypatch.setattr(sys, "path", list(sys.path))
    install(str(root))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    try:
        import vllm

        assert getattr(vllm, "STAND_IN", False)
        yield root
    finally:
        for k in [k for k in sys.modules if _vllm_module(k)]:
            del sys.modules[k]
        sys.modules.update(saved)


@pytest.fixture
def store(unique_name):
    """A store name; the segment is gone at the end, whatever happened."""
    name = unique_name("ec")
    yield name
    if os.path.exists("/dev/shm/" + name):
        os.unlink("/dev/shm/" + name)


@pytest.fixture
def extra(store):
    return {"store": store, "size": SIZE, "n_readers": 8}


@pytest.fixture
def engines(stand_in):
    """Makes engines; each is closed (its workers killed if need be) at the end."""
    made = []

    def make(method, role, extra, tp=1, model=MODEL):
        e = Engine(mp.get_context(method), role, extra, tp=tp, model=model)
        made.append(e)
        return e

    yield make
    for e in reversed(made):
        try:
            e.close()
        except Exception:  # noqa: BLE001 - the others are closed all the same
            e.kill()


def want(images, rows=ROWS):
    return {h: digest(encode(h, rows)) for h in images}


def run_with_installed_vllm(code, why_skipped):
    """Runs `code` in a fresh interpreter against the installed vLLM (it
    must print OK last); skipped with `why_skipped` where there is none."""
    import importlib.util
    import subprocess

    if importlib.util.find_spec("vllm") is None:
        pytest.skip(why_skipped)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]
