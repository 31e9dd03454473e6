"""The segments a process made, removed after it dies: vLLM SIGKILLs its
engine core and workers, whose segments would otherwise stay in
/dev/shm. Used by the cache, the queue and the encoder cache alike.

Not multiprocessing's resource tracker: it unlinks by name, so a process
killed after another engine made a live segment of the same name removed
that engine's segment. Here a reaper of the process's own (a small
process, ``python -S .../pinshm/_node/reaper.py``, started at the first segment,
shared with forked children as the tracker is) is told each segment's
name and file (device, inode); when every process that could tell it
more is gone (its pipe's end), it removes each segment that is still
that file under that name and that no live writer holds
(``pinshm.remove_if_abandoned_file``). Nothing else.
"""

from __future__ import annotations

import os
import select
import stat
import subprocess
import sys
import threading
from typing import Optional

#: (pid that started it, its pid, the pipe's write end) of this process
#: tree's reaper; a forked child writes to its parent's.
_REAPER: Optional[tuple[int, int, int]] = None
#: (device, inode) of that pipe: a child that closed the descriptor and
#: reused its number for something else writes nothing there.
_PIPE_ID: Optional[tuple[int, int]] = None
#: One reaper per process, however many threads make their first segment at once.
_START = threading.Lock()
#: name -> (device, inode) of each segment told to the reaper, this process.
_TOLD: dict[str, tuple[int, int]] = {}


def reaper_pid() -> Optional[int]:
    """The pid of the reaper this process tells (None before its first segment)."""
    return None if _REAPER is None else _REAPER[1]


def _pipe() -> Optional[int]:
    with _START:
        return _start()


def _start() -> Optional[int]:
    global _REAPER, _PIPE_ID
    if _REAPER is not None:
        return _REAPER[2]
    read, write = os.pipe()
    import pinshm

    package = os.path.dirname(os.path.dirname(os.path.abspath(pinshm.__file__)))
    path = os.pathsep.join(p for p in (package, os.environ.get("PYTHONPATH", "")) if p)
    try:
        proc = subprocess.Popen(
            # By its path, without site (`-S`): it starts before the first
            # segment's put returns, on the engine's hosts' cores, so it
            # imports nothing but the standard library's os, signal, sys
            # and time until the tree is gone (about a quarter of the CPU
            # `-m pinshm._node.reaper` took: the package's imports, the
            # site's .pth files). PYTHONPATH (above) finds pinshm then.
            [sys.executable, "-S", os.path.join(os.path.dirname(os.path.abspath(__file__)), "reaper.py"), "--detach"],
            stdin=read,
            stdout=subprocess.PIPE,
            cwd="/",
            env=dict(os.environ, PYTHONPATH=path),
            # Its own session: a signal to the engine's process group (a
            # node killed whole) leaves it to clean up after them. Detached
            # too (it forks, and the first process exits): not this
            # process's child, so an engine that kills its process tree at
            # shutdown (SGLang's kill_process_tree) does not kill it.
            start_new_session=True,
        )
        assert proc.stdout is not None
        with proc.stdout:
            # The first process says the second's pid and exits at once; one
            # that does not within 30 s is not waited for.
            ready, _, _ = select.select([proc.stdout], [], [], 30.0)
            line = proc.stdout.readline() if ready else b""
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        pid = int(line)
    except BaseException:  # no reaper (OSError, a bad line) or an interrupt: the pipe goes
        os.close(write)
        raise
    finally:
        os.close(read)
    st = os.fstat(write)
    _REAPER, _PIPE_ID = (os.getpid(), pid, write), (st.st_dev, st.st_ino)
    return write


def _tell(line: str) -> None:
    try:
        fd = _pipe()
    except (OSError, ValueError):  # no reaper: `pinshm gc` removes what is left
        return
    if fd is None:
        return
    try:
        st = os.fstat(fd)
    except OSError:
        return
    if not stat.S_ISFIFO(st.st_mode) or (st.st_dev, st.st_ino) != _PIPE_ID:
        return  # the number names something else now (a child closed it)
    data = line.encode()
    try:
        os.write(fd, data)  # one write under PIPE_BUF: never interleaved
    except OSError:
        pass


def track(name: str) -> None:
    """Tells the reaper segment `name`, the file that is under it now (best
    effort: a segment it was not told of is left to ``pinshm gc``)."""
    try:
        st = os.stat(os.path.join("/dev/shm", name), follow_symlinks=False)
    except OSError:
        return
    if len(name) > 1000 or "\n" in name:
        return
    _TOLD[name] = (st.st_dev, st.st_ino)
    _tell(f"+ {st.st_dev} {st.st_ino} {name}\n")


def untrack(name: str) -> None:
    """Takes `name` back (it was removed, or will be by its owner)."""
    told = _TOLD.pop(name, None)
    if told is not None:
        _tell(f"- {told[0]} {told[1]} {name}\n")


class Tracked:
    """The names one object registered, taken back one by one or all at
    once (when it closes, or when it is collected: its segments go with
    it)."""

    def __init__(self) -> None:
        self._names: list[str] = []
        # A forked child shares its parent's reaper: its copy of this
        # object must not take back the parent's names (a child that closes
        # or drops it would leave a SIGKILLed parent's segments behind).
        self._pid = os.getpid()

    @property
    def names(self) -> list[str]:
        return list(self._names)

    def add(self, name: str) -> None:
        self._names.append(name)
        track(name)

    def discard(self, name: str) -> None:
        if name in self._names:
            self._names.remove(name)
            if os.getpid() == self._pid:
                untrack(name)

    def clear(self) -> None:
        for name in list(self._names):
            self.discard(name)
