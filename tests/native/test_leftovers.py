"""What a SIGKILLed server leaves in its socket directory is gone at the next start there,
and nothing of a live server, or of another tool, is ever touched (kvstate.channel.owner)."""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstate import channel
from kvstate.channel import owner

pytestmark = [pytest.mark.multiproc]

SERVE = """
import sys, time
from kvstate import channel
srv = channel.Server(sys.argv[1])
print("ready", flush=True)
time.sleep(120)
"""


@pytest.fixture
def d(tmp_path: Path) -> Path:
    return channel.make_socket_dir(tmp_path / "s")


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        p.kill()
        p.wait(10)
        assert p.stdout is not None
        p.stdout.close()


def serve(procs: list[subprocess.Popen[str]], path: Path) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", SERVE, str(path)], stdout=subprocess.PIPE, text=True)
    procs.append(p)
    assert p.stdout is not None and p.stdout.readline() == "ready\n"
    return p


def kill(p: subprocess.Popen[str]) -> None:
    p.send_signal(signal.SIGKILL)
    p.wait(10)


def names(d: Path) -> set[str]:
    return set(os.listdir(d))


def test_a_killed_servers_files_go_at_the_next_start(d: Path, procs: list[subprocess.Popen[str]]) -> None:
    dead = serve(procs, d / "decode-rank3.sock")
    live = serve(procs, d / "decode-rank0.sock")
    kill(dead)
    # SIGKILL runs no cleanup: the socket and its mark stay, and the mark is no longer held.
    assert {"decode-rank3.sock", "decode-rank3.sock.lock"} <= names(d)

    with channel.Server(d / "coordinator.sock"):
        left = names(d)
        assert "decode-rank3.sock" not in left and "decode-rank3.sock.lock" not in left
        assert {"decode-rank0.sock", "decode-rank0.sock.lock", "coordinator.sock", "coordinator.sock.lock"} == left
        with channel.connect(d / "decode-rank0.sock", timeout=5.0):
            pass  # the live server still serves
    assert names(d) == {"decode-rank0.sock", "decode-rank0.sock.lock"}  # a clean close leaves nothing
    assert live.poll() is None


def test_a_restart_under_the_same_name_takes_over(d: Path, procs: list[subprocess.Popen[str]]) -> None:
    kill(serve(procs, d / "decode-rank0.sock"))
    again = serve(procs, d / "decode-rank0.sock")
    assert names(d) == {"decode-rank0.sock", "decode-rank0.sock.lock"}
    with channel.connect(d / "decode-rank0.sock", timeout=5.0) as ch:
        assert ch.peer.pid == again.pid
    text = (d / "decode-rank0.sock.lock").read_text()
    assert f"pid {again.pid}\n" in text  # the mark says who, for operators


def test_a_live_server_is_never_swept_whatever_its_pid_says(d: Path, procs: list[subprocess.Popen[str]]) -> None:
    """Only the lock decides: a mark whose text names a dead pid, held by a live process, stays."""
    live = serve(procs, d / "a.sock")
    mark = d / "a.sock.lock"
    os.chmod(mark, 0o600)
    with open(mark, "w") as f:  # same inode: the live process still holds its flock
        f.write("pid 999999999\n")
    assert owner.sweep(d) == []
    assert {"a.sock", "a.sock.lock"} <= names(d) and live.poll() is None


def test_files_without_a_mark_and_odd_marks_are_left_alone(d: Path, tmp_path: Path) -> None:
    foreign = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    foreign.bind(str(d / "other-tool.sock"))
    foreign.close()
    (tmp_path / "target").write_text("x")
    os.symlink(tmp_path / "target", d / "link.sock.lock")  # a symlinked mark is not followed
    os.mkdir(d / "dir.sock.lock")
    (d / "plain.txt").write_text("y")
    with channel.Server(d / "me.sock"):
        assert {"other-tool.sock", "link.sock.lock", "dir.sock.lock", "plain.txt"} <= names(d)
    assert (tmp_path / "target").read_text() == "x"


def test_a_mark_left_half_made_is_swept_but_not_a_held_one(d: Path) -> None:
    """A server that died between locking its temporary mark and renaming it into place."""
    half = d / ".kvstate-lock-123-deadbeef"
    half.write_text("pid 123\n")
    held = d / ".kvstate-lock-456-cafef00d"
    with open(held, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        assert owner.sweep(d) == [".kvstate-lock-123-deadbeef"]
        assert held.exists() and not half.exists()


HOLD_SHM = """
import mmap, os, sys
base = f"/dev/shm/kvstate-test-{os.getpid()}"
mapped = os.open(base + "-mapped", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.ftruncate(mapped, 4096)
mem = mmap.mmap(mapped, 4096)
os.close(mapped)
held = os.open(base + "-open", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
gone = os.open(base + "-unlinked", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
os.unlink(base + "-unlinked")
print("ready", flush=True)
sys.stdin.read()
"""


def test_a_killed_process_files_in_dev_shm_are_attributed_by_its_pid() -> None:
    """leaks.shm_held (the kill matrix and the soak read each victim with it just before
    its SIGKILL): what the process has mapped or open in /dev/shm, not what others made;
    shm_left: which of those a SIGKILL left behind (an unlinked one is not left)."""
    from kvstate.harness import leaks

    p = subprocess.Popen([sys.executable, "-c", HOLD_SHM], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    base = f"/dev/shm/kvstate-test-{p.pid}"
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        held = leaks.shm_held(p.pid)
        assert {base + "-mapped", base + "-open", base + "-unlinked"} <= held
        assert all(path.startswith("/dev/shm/") for path in held)
        p.kill()
        p.wait(10)
        assert leaks.shm_left(held) == [base + "-mapped", base + "-open"]
        assert leaks.shm_held(p.pid) == frozenset()  # gone: nothing more to read
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        for path in (base + "-mapped", base + "-open"):
            if os.path.lexists(path):
                os.unlink(path)
        p.stdin.close()  # type: ignore[union-attr]
        p.stdout.close()  # type: ignore[union-attr]
    assert leaks.shm_left(held) == []
