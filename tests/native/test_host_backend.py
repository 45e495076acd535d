"""The host backend keeps CUDA-VMM semantics, and refuses bad fds before mapping them."""

from __future__ import annotations

import fcntl
import os
import signal
import sys
import tempfile
from collections.abc import Iterator

import pytest

from support.errors import raises

from kvstate.core import errors, handles
from kvstate.core.reasons import ArgumentReason, ImportReason, ImportDefect, BusyReason
from kvstate.core.errors import ArgumentInvalid, ImportFailed, Busy
from kvstate.core.handles import HandleKind
from kvstate.transport import MappedTransport
from kvstate.core.capabilities import Access, MemoryKind, Scope
from kvstate.transport.host import (
    HostHandle,
    HostTransport,
    fd_identity_of,
    host_device_uuid,
)
from native.helpers import PEERS, peer

BANK = 2 << 20


@pytest.fixture
def t() -> HostTransport:
    return HostTransport()


@pytest.mark.native
@pytest.mark.multiproc
def test_native_module_loads_only_when_asked() -> None:
    """Importing kvstate and its transports loads no native code (fresh interpreter)."""
    code = ("import sys, kvstate, kvstate.transport, kvstate.channel, kvstate.transport.native, kvstate.derive.header\n"
            "assert 'kvstate._native' not in sys.modules, 'loaded at import'\n"
            "from kvstate.transport.host import HostTransport\n"
            "assert 'kvstate._native' not in sys.modules, 'loaded by importing the backend'\n"
            "HostTransport()\n"
            "assert 'kvstate._native' in sys.modules\n")
    import subprocess

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_transport_interface_and_identity(t: HostTransport) -> None:
    assert isinstance(t, MappedTransport)
    assert t.name == "host" and t.granularity() == 2 << 20
    assert t.capabilities.handle_kinds == {HandleKind.MEMFD}
    assert t.capabilities.memory_kinds == {MemoryKind.HOST}
    assert t.capabilities.scopes == {Scope.SAME_NODE}
    uuid = t.device_uuid()
    assert len(uuid) == 16 and uuid == host_device_uuid()
    assert HostTransport(granularity=4 << 20).granularity() == 4 << 20
    with raises(ArgumentInvalid, ArgumentReason.NATIVE):
        HostTransport(granularity=3 << 20)


def test_create_map_access_pattern_roundtrip(t: HostTransport) -> None:
    a = t.create(2 * BANK)
    r = t.reserve(4 * BANK)
    assert r.addr % t.granularity() == 0
    m = t.map(r, BANK, a)
    assert m.addr == r.addr + BANK and m.size == 2 * BANK
    assert t.stats(m).access == 0
    t.set_access(m, Access.READ_WRITE)
    view = t.view(m)
    view[: 1 << 16] = bytes(range(256)) * 256
    assert bytes(view[:256]) == bytes(range(256))
    del view
    t.unmap(m)
    t.release(a)
    t.free(r)


def test_sizes_and_offsets_follow_the_granularity(t: HostTransport) -> None:
    with raises(ArgumentInvalid, ArgumentReason.NATIVE):
        t.create(BANK + 4096)
    with pytest.raises(errors.ArgumentInvalid):  # refused before the native call
        t.reserve(0)
    a = t.create(BANK)
    r = t.reserve(2 * BANK)
    try:
        with raises(ArgumentInvalid, ArgumentReason.NATIVE):
            t.map(r, 4096, a)
        with raises(ArgumentInvalid, ArgumentReason.OUT_OF_RANGE):
            t.map(r, 2 * BANK, a)
        m = t.map(r, 0, a)
        with raises(ArgumentInvalid, ArgumentReason.OVERLAP):
            t.map(r, 0, a)
        with raises(Busy, BusyReason.MAPPED):
            t.release(a)
        with raises(Busy, BusyReason.MAPPED):
            t.free(r)
        t.unmap(m)
        with raises(ArgumentInvalid, ArgumentReason.UNKNOWN_OBJECT):
            t.unmap(m)
    finally:
        t.release(a)
        t.free(r)


@pytest.mark.native
@pytest.mark.multiproc
@pytest.mark.parametrize("mode", ["write", "read", "read-only-write"])
def test_touch_before_set_access_faults(mode: str) -> None:
    """As on CUDA, a mapping is unusable until set_access: the touch dies with SIGSEGV."""
    proc = peer("touch", mode)
    out_b, err_b = proc.communicate(timeout=60)
    out, err = out_b.decode(), err_b.decode()
    assert "touching" in out and "survived" not in out, (out, err)
    assert proc.returncode == -signal.SIGSEGV, (proc.returncode, err)
    assert PEERS.is_file()


def test_export_import_in_process(t: HostTransport) -> None:
    a = t.create(BANK)
    h = t.export(a, HandleKind.MEMFD)
    assert h.identity == fd_identity_of(h.fd) and len(h.identity) == handles.FD_IDENTITY_BYTES
    b = t.import_(h, BANK)
    assert b.imported and b.id != a.id
    with raises(ArgumentInvalid, ArgumentReason.RANGE):  # fix the call: the host backend exports memfds only
        t.export(a, HandleKind.FABRIC)
    t.release(b)
    t.release(a)


@pytest.fixture
def sealed_memfd() -> Iterator[int]:
    fd = os.memfd_create("kvstate-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, BANK)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    yield fd
    os.close(fd)


def test_import_refuses_wrong_size(t: HostTransport, sealed_memfd: int) -> None:
    before = t.native.stats().allocations
    with raises(ImportFailed, ImportReason.HANDLE, defect=ImportDefect.FD_SIZE):
        t.import_(HostHandle(sealed_memfd, fd_identity_of(sealed_memfd)), 2 * BANK)
    assert t.native.stats().allocations == before


def test_import_refuses_unsealed_memfd(t: HostTransport) -> None:
    fd = os.memfd_create("kvstate-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, BANK)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)  # can still be unsealed
        with raises(ImportFailed, ImportReason.HANDLE, defect=ImportDefect.FD_UNSEALED):
            t.import_(HostHandle(fd, fd_identity_of(fd)), BANK)
    finally:
        os.close(fd)
    fd = os.memfd_create("kvstate-test", os.MFD_CLOEXEC)  # no sealing at all
    try:
        os.ftruncate(fd, BANK)
        with raises(ImportFailed, ImportReason.HANDLE, defect=ImportDefect.FD_UNSEALED):
            t.import_(HostHandle(fd, fd_identity_of(fd)), BANK)
    finally:
        os.close(fd)


def test_import_refuses_what_is_not_a_memfd(t: HostTransport) -> None:
    # A file on disk, and a tmpfs file: shared memory too, but not on the memfds' mount.
    for where in (None, "/dev/shm"):
        if where is not None and not os.path.isdir(where):
            continue
        with tempfile.TemporaryFile(dir=where) as f:
            f.truncate(BANK)
            with raises(ImportFailed, ImportReason.HANDLE, defect=ImportDefect.FD_NOT_MEMFD):
                t.import_(HostHandle(f.fileno(), fd_identity_of(f.fileno())), BANK)
    r, w = os.pipe()
    try:
        with raises(ImportFailed, ImportReason.HANDLE, defect=ImportDefect.FD_NOT_MEMFD):
            t.import_(HostHandle(r, fd_identity_of(r)), BANK)
    finally:
        os.close(r)
        os.close(w)


def test_import_refuses_an_fd_its_descriptor_does_not_name(t: HostTransport, sealed_memfd: int) -> None:
    other = t.create(BANK)
    try:
        wrong = fd_identity_of(t.export(other, HandleKind.MEMFD).fd)
        with raises(ImportFailed, ImportReason.HANDLE, defect=ImportDefect.FD_IDENTITY):
            t.import_(HostHandle(sealed_memfd, wrong), BANK)
        with raises(ImportFailed, ImportReason.HANDLE, defect=ImportDefect.FD_IDENTITY):
            t.import_(HostHandle(sealed_memfd, b"short"), BANK)
    finally:
        t.release(other)


def test_explicit_pins_block_unmap_release_and_access_revocation(t: HostTransport) -> None:
    """INV-NO-UNMAP-PINNED: a lease's explicit pin holds the region like an op's."""
    a = t.create(BANK)
    r = t.reserve(BANK)
    m = t.map(r, 0, a)
    t.set_access(m, Access.READ_WRITE)
    t.pin(m)
    assert t.stats(m).pins == 1 and t.stats(m).explicit_pins == 1 and not t.stats(m).quiescent
    with raises(Busy, BusyReason.PINNED):
        t.unmap(m)
    with raises(Busy, BusyReason.PINNED):
        t.release(a)
    with raises(Busy, BusyReason.PINNED):
        t.set_access(m, Access.READ)
    t.unpin(m)
    with raises(ArgumentInvalid, ArgumentReason.NATIVE):
        t.unpin(m)
    t.set_access(m, Access.NONE)
    t.unmap(m)
    t.release(a)
    t.free(r)


def test_an_owned_mapping_is_unmapped_and_its_access_changed_only_by_its_owner(t: HostTransport) -> None:
    """A part's or a bank's mapping (kvstate.share.owned): nobody without the owner's
    token ends it or changes its access, and what it maps cannot go while it is mapped."""
    a = t.create(BANK)
    r = t.reserve(BANK)
    m = t.map(r, 0, a)
    t.set_access(m, Access.READ_WRITE)
    t.own(m, 7)
    with raises(Busy, BusyReason.OWNED):
        t.unmap(m)
    with raises(Busy, BusyReason.OWNED):
        t.set_access(m, Access.NONE)
    with raises(Busy, BusyReason.MAPPED):
        t.release(a)
    with raises(Busy, BusyReason.MAPPED):
        t.free(r)
    with raises(Busy, BusyReason.OWNED):
        t.own(m, 8)        # another owner
    with raises(Busy, BusyReason.OWNED):
        t.disown(m, 8)     # only the owner gives it up
    for bad in (0, -1, 1 << 64):
        with raises(ArgumentInvalid, ArgumentReason.RANGE):
            t.own(m, bad)
    t.view(m)[0] = 1       # nothing of it changed
    t.own(m, 7)            # its owner again: no change
    t.disown(m, 7)
    t.disown(m, 7)         # owned by nobody: nothing to give up
    t.set_access(m, Access.NONE)
    t.unmap(m)
    t.release(a)
    t.free(r)


def test_bad_arguments_are_typed_errors(t: HostTransport) -> None:
    before = t.native.stats().allocations
    # The C layer's own argument checks, beneath the transport's (which never passes these).
    nat, lib = t.native, t.native.lib
    for align in (0, 3 * 4096):
        rc = lib.kvs_reserve(BANK, align, nat.ffi.new("uint64_t *"), nat.ffi.new("uint64_t *"))
        err = nat.error(rc, "kvs_reserve", f"align {align}")
        assert isinstance(err, ArgumentInvalid) and err.reason is ArgumentReason.NATIVE
    rc = lib.kvs_create(100, nat.ffi.new("uint64_t *"))
    err = nat.error(rc, "kvs_create", "size 100")
    assert isinstance(err, ArgumentInvalid) and err.reason is ArgumentReason.NATIVE
    with raises(ArgumentInvalid, ArgumentReason.NATIVE):
        t.create(100)
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    with raises(ImportFailed, ImportReason.HANDLE):
        t.import_(HostHandle(r, bytes(16)), BANK)
    with raises(ArgumentInvalid, ArgumentReason.UNKNOWN_OBJECT):
        t.native.region_stats(0)
    assert t.native.stats().allocations == before
