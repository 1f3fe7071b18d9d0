"""The reaper stops what its owner asked once the owner is gone: at a normal close, and after
the owner was killed with SIGKILL (the case it exists for); a PID reused by another process is
never hit; folders are removed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from prefixmesh.reaper import (
    Orders,
    Reaper,
    Watched,
    left_behind,
    removable,
    restore_autogroup,
    stop_processes,
    watched,
)


def gone(pid: int, within_s: float = 20.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def sleeper(ignore_term: bool = False) -> subprocess.Popen[bytes]:
    code = "import signal, time\n"
    if ignore_term:
        code += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    code += "print('up', flush=True)\ntime.sleep(120)\n"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert child.stdout is not None and child.stdout.readline() == b"up\n"
    return child


def test_orders_are_read_line_by_line(tmp_path: Path) -> None:
    orders = Orders()
    for line in ["pid 12 3.5\n", f"haproxy {tmp_path}\n", "folder /tmp/x\n", "junk\n", "pid x\n"]:
        orders.read(line)
    assert orders.processes == [Watched(12, 3.5)]
    assert orders.haproxy_dirs == [tmp_path] and orders.folders == [Path("/tmp/x")]


def test_a_process_that_ignores_sigterm_is_killed_and_a_reused_pid_spared() -> None:
    stubborn = sleeper(ignore_term=True)
    other = sleeper()
    try:
        stale = Watched(other.pid, psutil.Process(other.pid).create_time() - 100.0)
        assert stop_processes([*watched([stubborn.pid]), stale], grace_s=0.5) == [stubborn.pid]
        assert gone(stubborn.pid)  # psutil reaped it here, its parent: no exit status to read
        assert other.poll() is None  # its PID was named, but with another start time
    finally:
        other.kill()
        other.wait()


def test_a_normal_close_carries_the_orders_out(tmp_path: Path) -> None:
    child = sleeper()
    folder = tmp_path / "run"
    folder.mkdir()
    reaper = Reaper.start()
    reaper.watch([child.pid])
    reaper.remove(folder)
    reaper.close()
    assert child.wait(10) == -signal.SIGTERM
    assert not folder.exists()


OWNER = """
import subprocess, sys, time
from prefixmesh.reaper import Reaper
reaper = Reaper.start()
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
reaper.watch([child.pid])
print(child.pid, reaper.pid, flush=True)
time.sleep(120)
"""


def test_a_killed_owner_leaves_nothing_running() -> None:
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    child_pid, reaper_pid = map(int, owner.stdout.readline().split())
    os.kill(owner.pid, signal.SIGKILL)
    owner.wait(10)
    assert gone(child_pid), "the owner's child outlived it"
    assert gone(reaper_pid), "the reaper did not end after its work"


HOLDER = """
import mmap, os, socket, sys, time
# A segment no resource tracker knows of (as vLLM's worker side maps its queue's).
name = f"psm_pmt{os.getpid()}"
fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_RDWR, 0o600)
os.ftruncate(fd, 4096)
mapped = mmap.mmap(fd, 4096)
os.close(fd)
server = socket.socket(socket.AF_UNIX)
server.bind(sys.argv[1])
server.listen()
print(name, flush=True)
time.sleep(120)
"""


def test_what_a_killed_process_would_leave_is_found_and_removed(tmp_path: Path) -> None:
    """vLLM's engine leaves its message queues in /dev/shm and ZMQ sockets in /tmp."""
    address = Path(f"/tmp/pmt-{os.urandom(6).hex()}")  # as ZMQ's ipc:// names: in /tmp
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(address)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None
    segment = Path("/dev/shm") / holder.stdout.readline().strip()
    try:
        found = left_behind(holder.pid)
        assert segment in found and address in found
        reaper = Reaper.start()
        reaper.watch([holder.pid], with_files=True, owner_files=False)  # pytest's are not
        reaper.close()  # SIGTERM: the holder dies without unlinking either
        assert gone(holder.pid)
        assert not segment.exists() and not address.exists()
    finally:
        holder.kill()
        holder.wait()
        segment.unlink(missing_ok=True)
        address.unlink(missing_ok=True)
    assert left_behind(holder.pid) == []  # gone: nothing to read


def test_only_what_left_behind_names_is_ever_removed(tmp_path: Path) -> None:
    plain = Path(f"/tmp/pmt-{os.urandom(6).hex()}")
    plain.write_text("a user's file")
    try:
        assert not removable(plain)  # a plain file in /tmp, never
        assert not removable(Path("/dev/shm/plasma-store"))  # not multiprocessing's name
        assert removable(Path("/dev/shm/psm_0a1b2c")) and removable(Path("/dev/shm/sem.mp-x"))
        assert not removable(tmp_path / "psm_0a1b2c")
    finally:
        plain.unlink()


def test_a_session_group_is_put_back_through_a_process_still_in_it() -> None:
    """serve raised its terminal session's group; killed, its reaper puts it back through
    whatever is left in that session (the terminal's shell)."""
    member = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    group = Path(f"/proc/{member.pid}/autogroup")
    try:
        if not group.exists():
            pytest.skip("this kernel has no autogroups")
        try:
            group.write_text("6")
        except OSError:
            pytest.skip("this machine does not let a session change its group's niceness")
        orders = Orders()
        orders.read(f"autogroup {member.pid} 0\n")
        assert orders.autogroups == [(member.pid, 0)]
        assert restore_autogroup(member.pid, 0)
        assert group.read_text().split()[-1] == "0"
    finally:
        member.kill()
        member.wait()
    assert not restore_autogroup(member.pid, 0)  # nobody left in that session
