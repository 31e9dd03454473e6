"""A stand-in for vLLM as files on sys.path (a helper module, not a test):
the plugin's and the fit check's tests run pinshm against it in a
subprocess."""

import os

# A stand-in for vLLM, as files on sys.path: the cache module, the queue's
# modules, and an executor module that raises NameError on import (vLLM
# 0.33's ray_executor_v2 without ray).
STAND_IN = {
    "vllm/__init__.py": "",
    "vllm/multimodal/__init__.py": "",
    "vllm/multimodal/cache/__init__.py": "",
    "vllm/multimodal/cache/shm.py": (
        "class SingleWriterShmRingBuffer: pass\n"
        "class SingleWriterShmObjectStorage: pass\n"
        "class MsgpackSerde: pass\n"
    ),
    "vllm/distributed/__init__.py": "",
    "vllm/distributed/device_communicators/__init__.py": "",
    "vllm/distributed/device_communicators/shm_broadcast.py": (
        "class Handle: pass\nclass MessageQueue: pass\n"
    ),
    "vllm/v1/__init__.py": "",
    "vllm/v1/executor/__init__.py": "",
    "vllm/v1/executor/multiproc_executor.py": (
        "from vllm.distributed.device_communicators.shm_broadcast import Handle, MessageQueue\n"
    ),
    "vllm/v1/executor/ray_executor_v2.py": "def f(x: ObjectRef): pass\n",
}


def write_stand_in(tmp_path, overrides=None):
    """Writes STAND_IN (with `overrides`: path -> text) under `tmp_path`;
    returns this environment with `tmp_path` first on PYTHONPATH."""
    for rel, text in {**STAND_IN, **(overrides or {})}.items():
        f = tmp_path / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    return env
