"""What the NIXL process and the fetch process give up (docs/security.md):
UCX over TCP lets whoever reaches their ports READ and WRITE their memory,
so whoever takes one over must find nothing worth taking. A leaf.

Before its agent is made (the process has one thread: Landlock binds the
threads started after it, and UCX's come later), a child calls
:func:`confine`: no new privileges; a filesystem of libraries (read and
map), ``/sys``, a few files of its own ``/proc/PID`` and of ``/etc``
(read),
``/dev/null`` (write), and nothing else: not the deployment's secret, not
``/dev/shm`` (no store opened, none made), not ``/proc`` of the engine;
no signal to a process outside; and a seccomp filter refusing ``ptrace``,
``process_vm_readv``/``writev``, ``pidfd_getfd``, ``execve``, UNIX
sockets, namespaces, mounts, ``bpf``, ``io_uring`` and the like
(python/src/sandbox.rs). Once
its agent is up, a child running as root becomes a uid of its own
(:func:`drop_uid`). What held is sent to the scheduler with the child's
ready, which says so in a WARNING where something did not (a kernel
without Landlock or seccomp): :func:`report`.

``PINSHM_TEST_TAKEOVER`` (tests only: a JSON object of targets) has a
child try, once its sandbox is on, what a takeover would
(:func:`probe`), and print what it reached to stderr.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import sys
from typing import Any, Callable, Optional

from .child import PR_SET_DUMPABLE, PR_SET_PDEATHSIG

logger = logging.getLogger("vllm.pinshm.ec")

#: Where a child running as root goes (``PINSHM_SANDBOX_UID``: "UID" or
#: "UID:GID"): a uid no one else runs as, by default this base plus the
#: engine's pid (mod 65536).
SANDBOX_UID_ENV = "PINSHM_SANDBOX_UID"
UID_BASE = 0x5EED0000
TAKEOVER_ENV = "PINSHM_TEST_TAKEOVER"

#: Read beside the libraries: what UCX and the C library look at as an
#: agent starts or a peer is added.
READ = (
    "/sys",
    "/proc/cpuinfo",
    "/proc/meminfo",
    "/proc/stat",
    "/proc/sys",
    "/proc/filesystems",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/hosts",
    "/etc/host.conf",
    "/etc/nsswitch.conf",
    "/etc/resolv.conf",
    "/etc/gai.conf",
    "/etc/passwd",
    "/etc/group",
    "/etc/ucx",
    "/dev/urandom",
    "/dev/random",
)
#: Libraries UCX may still load (its transports' plugins, their deps).
LIBRARIES = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib")
WRITE = ("/dev/null", "/dev/infiniband")


#: Of its own /proc/PID: what UCX and Python read of themselves.
#: `net/` is the routes and interfaces UCX's TCP transport reads (procfs
#: makes its files anew at each lookup, so Landlock can only name the
#: directory: it lists the node's UNIX socket paths too, which no socket
#: of this process can reach, seccomp refusing AF_UNIX).
OWN_PROC = ("maps", "smaps", "status", "stat", "statm", "task", "fd", "fdinfo", "cmdline", "limits", "mountinfo", "net")


def paths(deny: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(read, write) paths of the sandbox, and those left out for holding a
    path of `deny` (the secret file). Read: the directories of the files
    this process has mapped (its libraries), the system library
    directories, and of ``sys.path`` only the entries it has imported from
    (a ``PYTHONPATH`` of ``$HOME`` is not the home directory's to read)."""
    libraries = set(LIBRARIES)
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/") and not parts[5].startswith(("/dev/", "/memfd:")):
                libraries.add(os.path.dirname(parts[5].rstrip("\n").removesuffix(" (deleted)")))
    loaded = {os.path.realpath(str(getattr(m, "__file__", None) or "")) for m in list(sys.modules.values())}
    for entry in sys.path:
        real = os.path.realpath(entry) if entry else ""
        if real and os.path.isdir(real) and any(f.startswith(real + "/") for f in loaded):
            libraries.add(real)
    libraries.add(os.path.dirname(os.__file__))  # the standard library, for a later import
    read = set(READ) | libraries | {f"/proc/{os.getpid()}/{name}" for name in OWN_PROC}
    denied = [os.path.realpath(p) for p in deny if p]
    dropped: list[str] = []
    out = []
    for group in (read, set(WRITE)):
        kept = []
        for p in sorted(group):
            real = os.path.realpath(p)
            if real == "/":
                continue  # never the whole tree
            if any(d == real or d.startswith(real + "/") for d in denied):
                dropped.append(p)
            else:
                kept.append(real)
        out.append(kept)
    return out[0], out[1], dropped


def confine(deny: list[str]) -> dict[str, Any]:
    """Puts this process in its sandbox (the module doc); what held."""
    from ...._pinshm import _sandbox

    read, write, dropped = paths(deny)
    try:
        status: dict[str, Any] = dict(_sandbox(read, write))
    except OSError as e:
        status = {"error": str(e)}
    status["dropped"] = dropped
    return status


def drop_uid(status: dict[str, Any]) -> None:
    """Where this process runs as root: becomes the sandbox's uid (every
    capability goes); `status` says which (or why not)."""
    if os.geteuid() != 0:
        status["uid"] = os.geteuid()
        return
    from ...._pinshm import _drop_uid

    parent = os.getppid()
    want = os.environ.get(SANDBOX_UID_ENV) or str(UID_BASE + (parent & 0xFFFF))
    uid, _, gid = want.partition(":")
    try:
        if int(uid) == 0 or int(gid or uid) == 0:
            raise ValueError(f"{SANDBOX_UID_ENV}={want} names root")
        status["uid"] = _drop_uid(int(uid), int(gid or uid))
    except (OSError, ValueError) as e:  # a user namespace that maps no such uid
        status["uid"] = os.geteuid()
        status["uid_error"] = str(e)
        return
    # A change of uid clears the parent-death signal (and dumpable): set
    # again, or this process would outlive an engine that vLLM SIGKILLs.
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        os._exit(1)  # cannot die with the engine: not started at all
    if os.getppid() != parent:
        os._exit(0)  # the engine died meanwhile


def report(what: str, status: Optional[dict[str, Any]]) -> None:
    """The scheduler's side: a WARNING where `what`'s sandbox is weaker
    than the docs say (docs/security.md: what is then left)."""
    if status is None:
        return
    weak = []
    if "error" in status:
        weak.append(status["error"])
    else:
        if status.get("landlock") == "none":
            weak.append("no Landlock on this kernel: its files and the engine's /proc are open to it")
        elif status.get("landlock") != "full":
            weak.append("Landlock partial (this kernel's ABI < 6): signals and abstract sockets outside are open")
        if int(status.get("threads", 1)) > 1:
            weak.append(f"{status['threads']} threads when Landlock was set: the others are not confined")
        if not status.get("no_new_privs"):
            weak.append("no_new_privs is off")
    if status.get("uid_error"):
        weak.append(f"it still runs as root ({status['uid_error']})")
    if status.get("dropped"):
        weak.append(f"{status['dropped']} closed to it, for they hold secret_file (a later import from them fails)")
    if weak:
        logger.warning(
            "pinshm encoder cache: %s: its sandbox is weaker than docs/security.md says: %s", what, "; ".join(weak)
        )


def probe_if_asked() -> None:
    """Under ``PINSHM_TEST_TAKEOVER``: :func:`probe` its targets, and print
    the result to stderr (tests)."""
    raw = os.environ.get(TAKEOVER_ENV)
    if raw:
        print("PINSHM-TAKEOVER " + json.dumps(probe(json.loads(raw))), file=sys.stderr, flush=True)


def probe(targets: dict[str, Any]) -> dict[str, str]:
    """What code run in this process reaches: each attempt "denied (ERRNO)"
    or "REACHED ...". `targets`: ``secret`` (a path), ``store`` (a
    segment's path); the engine is this process's parent."""
    import errno

    engine = os.getppid()
    out: dict[str, str] = {"uid": str(os.geteuid())}
    libc = ctypes.CDLL(None, use_errno=True)
    death = ctypes.c_int(0)
    libc.prctl(2, ctypes.byref(death), 0, 0, 0)  # PR_GET_PDEATHSIG
    out["pdeathsig"] = str(death.value)
    numbers = {"x86_64": {"ptrace": 101, "process_vm_readv": 310}, "aarch64": {"ptrace": 117, "process_vm_readv": 270}}

    def syscall(name: str, *args: int) -> int:
        r = int(libc.syscall(numbers[os.uname().machine][name], *[ctypes.c_long(a) for a in args]))
        if r < 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
        return r

    def read(path: str) -> int:
        with open(path, "rb") as f:
            return len(f.read(64))

    def create(path: str) -> None:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
        os.unlink(path)

    buf = ctypes.create_string_buffer(8)
    iov = (ctypes.c_void_p * 2)(ctypes.cast(buf, ctypes.c_void_p), 8)
    attempts: dict[str, Callable[[], Any]] = {
        "secret_file": lambda: read(targets["secret"]),
        "engine_environ": lambda: read(f"/proc/{engine}/environ"),
        "engine_mem": lambda: os.close(os.open(f"/proc/{engine}/mem", os.O_RDONLY)),
        "store_for_writing": lambda: os.close(os.open(targets["store"], os.O_RDWR)),
        "new_segment": lambda: create(f"/dev/shm/pinshm-takeover-{os.getpid()}"),
        "signal_engine": lambda: os.kill(engine, 0),
        "unix_socket": lambda: socket.socket(socket.AF_UNIX).close(),
        "exec": lambda: os.posix_spawn("/bin/true", ["/bin/true"], {}),
        # PTRACE_SEIZE: never stops the engine, even where it is allowed.
        "ptrace_engine": lambda: syscall("ptrace", 0x4206, engine, 0, 0),
        "process_vm_readv_engine": lambda: syscall(
            "process_vm_readv", engine, ctypes.addressof(iov), 1, ctypes.addressof(iov), 1, 0
        ),
    }
    for name, fn in attempts.items():
        try:
            out[name] = f"REACHED {fn()!r}"[:80]
        except OSError as e:
            out[name] = f"denied ({errno.errorcode.get(e.errno or 0, e.errno)})"
    return out
