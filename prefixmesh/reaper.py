"""What a process started that would outlive it, stopped once it is gone, however it went.

vLLM's engine processes and Ray Serve's HAProxy are children nobody stops when their parent
is killed: after a SIGKILL (a crash, the OOM killer, ``kill -9``) of a replica its engine
processes kept decoding on both cores for as long as we looked, and a killed ``prefixmesh
serve`` left HAProxy holding 127.0.0.1:8000, so every later ``serve`` died (issue 38). A
reaper is a small process of its own session that the owner feeds what to stop on its stdin;
the pipe closes when the owner ends, normally or not, and the reaper then stops the processes
(SIGTERM, then SIGKILL) and HAProxy, and removes the folders. ``python -m prefixmesh.reaper``
is the reaper's side; ``Reaper`` the owner's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import psutil

TMP = Path("/tmp")
SHARED_MEMORY = Path("/dev/shm")
GRACE_S = 5.0
"""How long a process gets to stop on SIGTERM before SIGKILL."""


@dataclass(frozen=True, slots=True)
class Watched:
    """One process to stop: its PID and its start time, so a PID reused by another process
    after it ended is never hit."""

    pid: int
    started: float

    def line(self) -> str:
        return f"pid {self.pid} {self.started!r}\n"


@dataclass
class Orders:
    """What the owner asked the reaper to stop and remove."""

    processes: list[Watched] = field(default_factory=list)
    haproxy_dirs: list[Path] = field(default_factory=list)
    folders: list[Path] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    autogroups: list[tuple[int, int]] = field(default_factory=list)
    """(session, niceness): the session groups to put back (``serve``'s, raised while it
    ran: killed, it cannot put it back itself)."""

    def read(self, line: str) -> None:
        """One line of the owner's: ``pid PID START``, ``haproxy DIR``, ``folder DIR`` or
        ``file PATH``; anything else is ignored."""
        kind, _, rest = line.strip().partition(" ")
        if kind == "pid":
            pid, _, started = rest.partition(" ")
            with contextlib.suppress(ValueError):
                self.processes.append(Watched(int(pid), float(started)))
        elif kind == "haproxy" and rest:
            self.haproxy_dirs.append(Path(rest))
        elif kind == "folder" and rest:
            self.folders.append(Path(rest))
        elif kind == "file" and rest:
            self.files.append(Path(rest))
        elif kind == "autogroup":
            session, _, niceness = rest.partition(" ")
            with contextlib.suppress(ValueError):
                self.autogroups.append((int(session), int(niceness)))


def watched(pids: Iterable[int]) -> list[Watched]:
    """``pids`` that are running, with their start times."""
    found = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            found.append(Watched(pid, psutil.Process(pid).create_time()))
    return found


SHARED_MEMORY_PREFIXES = ("psm_", "sem.mp-")
"""Python's multiprocessing names in /dev/shm (``shared_memory``, ``SemLock``): what vLLM's
message queues and locks are. Ray's object store maps /dev/shm too, and is never touched."""


def left_behind(
    pid: int, proc: Path = Path("/proc"), prefixes: tuple[str, ...] = SHARED_MEMORY_PREFIXES
) -> list[Path]:
    """What a process would leave behind if killed: the shared-memory files of ``prefixes``
    it maps (``/dev/shm``: vLLM's message queues between its engine and worker processes, and
    multiprocessing's semaphores) and the Unix sockets it bound directly in /tmp (ZMQ's
    ``ipc://`` endpoints; Ray's are in its session folder). Empty where /proc is not
    readable."""
    found: set[Path] = set()
    try:
        for line in (proc / str(pid) / "maps").read_text().splitlines():
            parts = line.split(maxsplit=5)  # address perms offset dev inode [path]
            path = parts[5] if len(parts) == 6 else ""
            name = path.removeprefix("/dev/shm/")
            if name != path and name.startswith(prefixes) and not name.endswith("(deleted)"):
                found.add(Path(path))
        inodes = set()
        for fd in (proc / str(pid) / "fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        for line in (proc / "net" / "unix").read_text().splitlines()[1:]:
            fields = line.split(maxsplit=7)  # the path last, as it is (spaces included)
            if len(fields) >= 8 and fields[6] in inodes and Path(fields[7]).parent == TMP:
                found.add(Path(fields[7]))
    except OSError:
        return []
    return sorted(found)


def alive(processes: Sequence[Watched]) -> list[psutil.Process]:
    """The processes of ``processes`` still running (the same ones: same start time)."""
    running = []
    for item in processes:
        with contextlib.suppress(psutil.Error):
            process = psutil.Process(item.pid)
            if abs(process.create_time() - item.started) < 0.01:
                running.append(process)
    return running


def stop_processes(processes: Sequence[Watched], grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM each process still running, SIGKILL what is left after ``grace_s``; the PIDs
    that were running."""
    running = alive(processes)
    for process in running:
        with contextlib.suppress(psutil.Error):
            process.send_signal(signal.SIGTERM)
    survivors = _wait_gone(running, grace_s)
    for process in survivors:
        with contextlib.suppress(psutil.Error):
            process.kill()
    _wait_gone(survivors, grace_s)
    return [process.pid for process in running]


def _ended(process: psutil.Process) -> bool:
    """Gone, or a zombie (ended; only its parent's wait is missing)."""
    try:
        status: str = process.status()
    except psutil.NoSuchProcess:
        return True
    return bool(status == psutil.STATUS_ZOMBIE)


def _wait_gone(processes: Sequence[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait up to ``timeout_s`` for ``processes`` to end; those still running."""
    deadline = time.monotonic() + timeout_s
    left = [process for process in processes if not _ended(process)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [process for process in left if not _ended(process)]
    return left


def removable(path: Path) -> bool:
    """Whether ``path`` is what ``left_behind`` names: a shared-memory file of Python's
    multiprocessing names, or a socket directly in /tmp (a plain file there never is)."""
    if path.parent == SHARED_MEMORY:
        return path.name.startswith(SHARED_MEMORY_PREFIXES)
    try:
        return path.parent == TMP and stat.S_ISSOCK(path.lstat().st_mode)
    except OSError:
        return False


def restore_autogroup(session: int, niceness: int, proc: Path = Path("/proc")) -> bool:
    """Set the scheduling group of ``session`` back to ``niceness``, through any process
    still in it (the group is the session's, whichever member writes it); False when none
    is left (the group went with it)."""
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getsid(process.pid) == session:
                (proc / str(process.pid) / "autogroup").write_text(str(niceness))
                return True
    return False


def carry_out(orders: Orders) -> None:
    """Stop and remove everything ``orders`` names."""
    from prefixmesh.local_ray import stop_haproxy

    stop_processes(orders.processes)
    for path in orders.files:  # only once their processes are gone
        if removable(path):
            with contextlib.suppress(OSError):
                path.unlink()
    for run_dir in orders.haproxy_dirs:
        stop_haproxy(run_dir)
    for folder in [*orders.haproxy_dirs, *orders.folders]:
        shutil.rmtree(folder, ignore_errors=True)
    for session, niceness in orders.autogroups:
        restore_autogroup(session, niceness)


def reap(stream: IO[str]) -> Orders:
    """The reaper's life: read orders until the owner's end closes ``stream``, then carry
    them out."""
    orders = Orders()
    for line in stream:
        orders.read(line)
    carry_out(orders)
    return orders


class Reaper:
    """The owner's side: start one, tell it what to stop, ``close`` it at a normal end (which
    carries the orders out then and waits for it)."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self._process = process

    @classmethod
    def start(cls) -> Reaper:
        # A session of its own: a signal to the owner's process group never reaches it.
        process = subprocess.Popen(
            [sys.executable, "-m", "prefixmesh.reaper"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
            text=True,
        )
        return cls(process)

    @property
    def pid(self) -> int:
        return self._process.pid

    def _send(self, lines: Iterable[str]) -> None:
        stdin = self._process.stdin
        if stdin is None or stdin.closed:
            return
        with contextlib.suppress(OSError):
            stdin.writelines(lines)
            stdin.flush()

    def watch(
        self, pids: Iterable[int], with_files: bool = False, owner_files: bool = True
    ) -> None:
        """Stop these processes when the owner ends; ``with_files``: and remove what they
        would leave behind (``left_behind``, as they are now), and the owner too unless
        ``owner_files`` is False."""
        items = watched(pids)
        lines = [item.line() for item in items]
        if with_files:
            owners = [*([os.getpid()] if owner_files else []), *(item.pid for item in items)]
            paths = {path for pid in owners for path in left_behind(pid)}
            lines += [f"file {path}\n" for path in sorted(paths)]
        self._send(lines)

    def watch_haproxy(self, run_dir: Path) -> None:
        """Stop the HAProxy whose files are under ``run_dir``, and remove it, at the end."""
        self._send([f"haproxy {run_dir}\n"])

    def restore_session(self, niceness: int) -> None:
        """Put the owner's session group back to ``niceness`` at the end (``local_ray.
        yield_to_other_sessions`` raised it)."""
        self._send([f"autogroup {os.getsid(0)} {niceness}\n"])

    def remove(self, folder: Path) -> None:
        self._send([f"folder {folder}\n"])

    def close(self, timeout_s: float = 3 * GRACE_S) -> None:
        """Carry the orders out now and wait for that (at most ``timeout_s``)."""
        if self._process.stdin is not None and not self._process.stdin.closed:
            with contextlib.suppress(OSError):
                self._process.stdin.close()
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(max(0.0, deadline - time.monotonic()))


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the owner's terminal
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # the owner's terminal closing
    reap(sys.stdin)
