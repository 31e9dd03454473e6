"""The remote tier's shared secret, and the keys its control channel is
authenticated and encrypted with (docs/security.md). No store, no vLLM;
pyzmq only where keys are made.

Producers and consumers of a deployment share one secret: a file of at
least :data:`MIN_BYTES` random bytes, owned by the engine's user and
readable by it alone (``secret_file``, or the file
:data:`SECRET_FILE_ENV` names). From it, each side derives the same two
CURVE key pairs (ZeroMQ's CurveZMQ: X25519 and XSalsa20-Poly1305, from
libsodium inside libzmq): the server's and the client's. A client that
cannot prove it holds the client's secret key is refused by the server's
ZAP handler during the handshake, before any message is read; a server
that does not hold the server's secret key cannot complete the
handshake, so a consumer never takes an answer from it. The derivation is
HMAC-SHA256 (the standard library's) keyed with the secret, one label per
key: a PRF, so knowing one derived key reveals nothing of the others.
"""

from __future__ import annotations

import hmac
import os
import stat
from dataclasses import dataclass
from typing import Any, Optional

from .._config import SECRET_FILE_ENV

#: A secret shorter than this is refused (256 bits).
MIN_BYTES = 32
#: A "secret" longer than this is not one (a wrong path, a log file).
MAX_BYTES = 4096
HOW = "head -c 32 /dev/urandom > F; chmod 600 F"


class SecretError(ValueError):
    """A secret file that is missing, too short, or readable by others."""


@dataclass(frozen=True)
class Keys:
    """The CURVE keys of both ends, Z85-encoded as libzmq takes them. Not
    printed: its repr says only which secret they came from."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    source: str

    def __repr__(self) -> str:
        return f"Keys(from {self.source!r})"


def read_secret(path: str) -> bytes:
    """The secret in `path`, refused (SecretError, saying how to make a
    good one) unless it is a regular file owned by this process's user,
    readable by no one else, of MIN_BYTES to MAX_BYTES bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as e:
        raise SecretError(f"secret_file {path!r}: {e.strerror} (make one: {HOW})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"secret_file {path!r} is not a regular file (make one: {HOW})")
        if st.st_uid != os.geteuid():
            raise SecretError(
                f"secret_file {path!r} belongs to uid {st.st_uid}, not to this engine's user "
                f"(uid {os.geteuid()}): chown it, or make one: {HOW}"
            )
        if st.st_mode & 0o077:
            raise SecretError(
                f"secret_file {path!r} has mode {stat.S_IMODE(st.st_mode):04o}: group or others may read it. "
                f"It must be 0600 or 0400 (chmod 600 {path}), or make one: {HOW}"
            )
        if not MIN_BYTES <= st.st_size <= MAX_BYTES:
            raise SecretError(
                f"secret_file {path!r} holds {st.st_size} bytes, not {MIN_BYTES} to {MAX_BYTES} (make one: {HOW})"
            )
        data = b""
        while len(data) < st.st_size:
            chunk = os.read(fd, st.st_size - len(data))
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    if len(data) < MIN_BYTES:
        raise SecretError(f"secret_file {path!r} holds {len(data)} bytes, not at least {MIN_BYTES} ({HOW})")
    return data


def derive(secret: bytes, source: str = "") -> Keys:
    """Both ends' CURVE key pairs from the shared secret."""
    import zmq
    from zmq.utils import z85

    def pair(label: bytes) -> tuple[bytes, bytes]:
        scalar = hmac.new(secret, b"pinshm-ec/v1/curve/" + label, "sha256").digest()
        private: bytes = z85.encode(scalar)  # type: ignore[no-untyped-call]
        return zmq.curve_public(private), private

    if not zmq.has("curve"):
        raise SecretError("this pyzmq's libzmq has no CURVE support (pip install pyzmq: its wheels have it)")
    server_public, server_secret = pair(b"server")
    client_public, client_secret = pair(b"client")
    return Keys(server_public, server_secret, client_public, client_secret, source)


def keys_for(secret_file: Optional[str], insecure: bool) -> Optional[Keys]:
    """The keys of a deployment's secret file; None where `insecure` (the
    caller says so at WARNING) and there is no file."""
    if secret_file is None:
        if insecure:
            return None
        raise SecretError(
            "the remote tier ('serve' or 'peers') needs a shared secret: set ec_connector_extra_config "
            f"'secret_file' (or {SECRET_FILE_ENV}) to a file of {MIN_BYTES} random bytes ({HOW})"
        )
    return derive(read_secret(secret_file), secret_file)


def secure_server(sock: Any, public: bytes, secret: bytes) -> None:
    """Makes `sock` (before it binds) a CURVE server with the derived key
    pair (the serving process holds these two fields of `Keys` only)."""
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True


def secure_client(sock: Any, keys: Keys) -> None:
    """Makes `sock` (before it connects) a CURVE client of the derived server."""
    sock.curve_secretkey = keys.client_secret
    sock.curve_publickey = keys.client_public
    sock.curve_serverkey = keys.server_public
