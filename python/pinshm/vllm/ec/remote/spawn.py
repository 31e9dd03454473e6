"""Starting the remote tier's processes (:mod:`.serving_process` and
:mod:`.nixl_process` for the producer, :mod:`.fetch_process` for the
consumer): what of the engine's environment they get, and the start
itself. A leaf but for :mod:`.protocol` and :mod:`.child`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from typing import Any, Optional

from .child import LOCAL_MESSAGE, LOCAL_TIMEOUT_S
from .protocol import PeerError, pack, unpack
from .sandbox import SANDBOX_UID_ENV, TAKEOVER_ENV, report

#: How long a process may take to start (NIXL's import).
START_S = 120.0


class ServeError(RuntimeError):
    """A process of the remote tier could not start (the port taken, say)."""


#: The keys the serving process needs: its own pair, and the one client
#: key it admits (never a client's secret key).
KEY_FIELDS = ("server_public", "server_secret", "client_public")
#: What the serving process keeps of the engine's environment.
ENV_KEEP = frozenset(
    {"PATH", "HOME", "LANG", "TMPDIR", "LD_LIBRARY_PATH", "PYTHONHOME", "VIRTUAL_ENV", "SSL_CERT_FILE"}
    | {SANDBOX_UID_ENV, TAKEOVER_ENV}
)
ENV_PREFIXES = ("UCX_", "NIXL_", "LC_")
#: What each kind of child said of its sandbox, the last time one started.
SANDBOXES: dict[str, Optional[dict[str, Any]]] = {}


def spawn(
    module: str,
    args: list[str],
    cfg: dict[str, Any],
    what: str,
    pass_fds: tuple[int, ...] = (),
    env: Optional[dict[str, str]] = None,
) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """A process of `module` (``pinshm.vllm.ec.remote.<module>``, with `args`, then `pass_fds` kept open, `env`
    added to the allowlisted environment), given `cfg` over a socket pair,
    ready; ServeError saying `what` (ImportError for a
    missing extra) if it is not."""
    import pinshm

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    package = os.path.dirname(os.path.dirname(os.path.abspath(pinshm.__file__)))
    path = os.pathsep.join(p for p in (package, os.environ.get("PYTHONPATH", "")) if p)
    # Of the engine's environment, what Python, UCX and NIXL read, and
    # nothing else (a token in it is not these processes' to hold).
    keep = {k: v for k, v in os.environ.items() if k in ENV_KEEP or k.startswith(ENV_PREFIXES)}
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", f"{__package__}.{module}", str(theirs.fileno()), *args],
            pass_fds=[theirs.fileno(), *pass_fds],
            stdin=subprocess.DEVNULL,
            cwd="/",
            # One thread until the sandbox is on (numpy's BLAS would start
            # a pool at import; these processes never multiply matrices).
            env=dict(keep, **(env or {}), PYTHONPATH=path, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1"),
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    try:
        ours.settimeout(START_S)
        ours.sendall(pack(dict(cfg, parent=os.getpid())))
        said = unpack(ours.recv(LOCAL_MESSAGE))
        ours.settimeout(LOCAL_TIMEOUT_S)
    except (OSError, PeerError) as e:  # socket.timeout is an OSError
        said = {"error": f"it died at start, or said nothing in {START_S:g} s ({e!r})"}
    if "ready" not in said:
        stop(proc, ours)
        why = str(said.get("error"))[:2000]
        if why.startswith("ImportError: "):
            raise ImportError(why[len("ImportError: ") :])
        raise ServeError(f"pinshm encoder cache: {what}: {why}")
    SANDBOXES[module] = said.get("sandbox")
    report(f"the {module.replace('_', ' ')} {proc.pid}", said.get("sandbox"))
    return proc, ours


def stop(proc: subprocess.Popen[bytes], sock: socket.socket, wait_s: float = 5) -> None:
    """Ends the serving process: its socket closed (it exits), then killed
    if it has not within `wait_s`."""
    sock.close()
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
