"""The fit check (pinshm.vllm._fit): the plugin binds a drop-in only where
pinshm's class offers what vLLM's has, and doctor reports the same check.
Against stand-ins of vLLM always (a vLLM that gained a method, a
parameter, an abstract method), and against vLLM itself where installed."""

import abc
import subprocess
import sys

import pytest

from pinshm import doctor
from pinshm.vllm import _fit
from pinshm.vllm.cache import storage
from pinshm.vllm.queue import MessageQueue
from _vllm_stand_in import write_stand_in

# A stand-in vLLM as files on sys.path: its MessageQueue has every public
# name pinshm's has, plus `brand_new`, a method a newer vLLM's engine calls.
PLANTED = "    def brand_new(self, pending, deadline):\n        pass\n"


def stand_in_vllm(tmp_path, queue_body=PLANTED):
    names = _fit.public_names(MessageQueue)
    body = "".join(f"    def {n}(self, *a, **k):\n        pass\n" for n in names) + queue_body
    return write_stand_in(
        tmp_path,
        {
            "vllm/__init__.py": "__version__ = '0.99.0'\n",
            "vllm/distributed/device_communicators/shm_broadcast.py": (
                "class Handle: pass\nclass MessageQueue:\n" + body
            ),
        },
    )


PROBE = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(levelname)s %(message)s")
import vllm.distributed.device_communicators.shm_broadcast as sb
import vllm.multimodal.cache.shm as shm
from pinshm.vllm import plugin
plugin.register()
print("QUEUE", sb.MessageQueue.__module__)
print("CACHE", shm.SingleWriterShmObjectStorage.__module__)
"""


@pytest.mark.parametrize("mode", ["1", "auto"])
def test_a_vllm_queue_with_a_method_pinshms_lacks_stays_vllms_with_one_warning(tmp_path, mode):
    env = stand_in_vllm(tmp_path)
    env["PINSHM_VLLM_MESSAGE_QUEUE"] = mode
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "QUEUE vllm.distributed.device_communicators.shm_broadcast" in out.stdout, out.stdout
    assert "CACHE pinshm.vllm.cache.storage" in out.stdout, "the cache is a separate part: still rebound"
    warn = [x for x in out.stdout.splitlines() if x.startswith("LOG WARNING")]
    assert len(warn) == 1, out.stdout
    assert "MessageQueue does not fit vLLM 0.99.0: missing brand_new" in warn[0], warn
    assert "vLLM's MessageQueue stays in use" in warn[0] and "0.34.0" in warn[0], warn


def test_the_same_stand_in_without_the_planted_method_is_rebound(tmp_path):
    env = stand_in_vllm(tmp_path, queue_body="")
    env["PINSHM_VLLM_MESSAGE_QUEUE"] = "1"
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert "QUEUE pinshm.vllm.queue.message_queue" in out.stdout, out.stdout + out.stderr
    assert "LOG WARNING" not in out.stdout


def test_doctor_reports_the_misfit_as_a_problem_and_never_says_can_start(tmp_path):
    env = stand_in_vllm(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "pinshm", "doctor"], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    fail = [x for x in lines if x.startswith("[FAIL]") and "does not fit" in x]
    assert len(fail) == 1 and "MessageQueue" in fail[0] and "brand_new" in fail[0], out.stdout
    assert any("pinshm is tested with vLLM 0.32.0, 0.33.0, 0.34.0, not 0.99.0" in x for x in lines), out.stdout
    assert "can start" not in lines[-1], lines[-1]


def test_internal_names_are_ignored_and_any_other_name_is_missing():
    class Vllms:
        def acquire_read(self):  # vLLM's own, never called from outside
            pass

        def dequeue(self, timeout=None, indefinite=False):
            pass

        def readable(self):
            pass

    class Ours:
        def dequeue(self, timeout=None, indefinite=False, *, zero_copy=False):
            pass

    fit = _fit.compare("MessageQueue", Vllms, Ours)
    assert fit.missing == ["readable"] and not fit.mismatched
    Ours.readable = Vllms.readable
    assert _fit.compare("MessageQueue", Vllms, Ours).ok


@pytest.mark.parametrize(
    "theirs, ours, gap",
    [
        ("def f(self, timeout=None, new=False): pass", "def f(self, timeout=None): pass", "new"),
        ("def f(self, a): pass", "def f(self, a, b): pass", "requires b"),
        ("def f(self, a, *, new=1): pass", "def f(self, a, **kw): pass", None),
        ("def f(self, a, new=1): pass", "def f(self, *args, **kw): pass", None),
        ("def f(self, a, new=1): pass", "def f(self, a, **kw): pass", "new"),
    ],
)
def test_a_parameter_vllm_passes_that_pinshms_would_not_take_is_a_gap(theirs, ours, gap):
    t, o = {}, {}
    exec(theirs, t)
    exec(ours, o)
    assert _fit.signature_gaps(o["f"], t["f"]) == ([] if gap is None else [gap])


def test_a_connector_missing_an_abstract_method_of_vllms_base_does_not_fit():
    class Base(abc.ABC):
        @abc.abstractmethod
        def save_caches(self, encoder_cache, mm_hash, **kwargs): ...

        @abc.abstractmethod
        def new_hook(self, request): ...

    class Ours(Base):
        def save_caches(self, encoder_cache, mm_hash, **kwargs):
            pass

    fit = _fit.compare_connector(Base, Ours)
    assert fit.missing == ["new_hook"] and not fit.mismatched

    class Narrow(Ours):
        def new_hook(self):
            pass

    assert _fit.compare_connector(Base, Narrow).mismatched == ["new_hook(request)"]


def test_pinshms_classes_fit_the_installed_vllm():
    """Fails when a newer vLLM adds a name: then the plugin keeps vLLM's class."""
    pytest.importorskip("vllm", reason="vLLM is not installed (never in CI)")
    import importlib

    from vllm.distributed.device_communicators import shm_broadcast

    queue = getattr(shm_broadcast.MessageQueue, "vllm", shm_broadcast.MessageQueue)
    assert _fit.queue_fit(queue).ok, _fit.queue_fit(queue).describe()
    cache = importlib.import_module("vllm.distributed.device_communicators.shm_object_storage")
    assert all(f.ok for f in _fit.cache_fits(cache)), [f.describe() for f in _fit.cache_fits(cache)]
    connector = _fit.connector_fit(importlib.import_module)
    assert connector is None or connector.ok, connector.describe()
    checks = doctor.check_fit(_fit.vllm_version())
    assert not [c for c in checks if c.status == doctor.FAIL], checks


def test_a_method_planted_on_vllms_own_queue_keeps_vllms_queue(monkeypatch):
    pytest.importorskip("vllm", reason="vLLM is not installed (never in CI)")
    from vllm.distributed.device_communicators import shm_broadcast

    from pinshm.vllm import _status, plugin

    original = getattr(shm_broadcast.MessageQueue, "vllm", shm_broadcast.MessageQueue)
    monkeypatch.setattr(shm_broadcast, "MessageQueue", original)
    monkeypatch.setattr(original, "planted_by_the_test", lambda self: None, raising=False)
    monkeypatch.setattr(plugin, "_vllm_queue", None)
    monkeypatch.setattr(plugin, "rebound", {})
    monkeypatch.setenv("PINSHM_VLLM_MESSAGE_QUEUE", "1")
    warned = []
    monkeypatch.setattr(_status, "warn", lambda fmt, *a: warned.append(fmt % a))
    monkeypatch.setattr(storage, "SingleWriterShmObjectStorage", storage.SingleWriterShmObjectStorage)
    plugin.register()
    assert shm_broadcast.MessageQueue is original
    assert any("missing planted_by_the_test" in w for w in warned), warned
    fail = [c for c in doctor.check_fit(_fit.vllm_version()) if c.status == doctor.FAIL]
    assert len(fail) == 1 and "planted_by_the_test" in fail[0].text, fail
