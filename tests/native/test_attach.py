"""The importer's native attach (ffi/kvs_attach.c, kvstate/share/attach.py): one C call per
exporter batch runs the part table's `open` row, the fd checks, reserve, map and
set_access, and rolls every part of the batch back when one fails.

- differential: the native attach and the Python path (HostTransport.import_, reserve,
  map, set_access) give the same verdict (error type, reason, defect) on the same bad fd;
- all or nothing: a bad part anywhere in a batch leaves no allocation, reservation,
  region or fd behind, and the parts before it back in `leased`;
- the part rows decide: a guard that does not hold refuses the open as Python's table
  does, before anything is made;
- a real group import on the host backend goes through it, and the Python Part machine
  and its observers see each `open` (fed after the fact).

Failures of the later steps (reserve's and map's mmap, set_access's mprotect) are
injected at the syscall by the sweep of tests/syscalls (import_group cases).
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvstate.core.capabilities import Access
from kvstate.core.errors import ImportFailed, KvStateError, TransitionError
from kvstate.share import attach, native_import
from kvstate.transport.host import HostHandle, HostTransport, fd_identity_of

pytestmark = pytest.mark.native

BANK = 2 << 20
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
ADMITTED = frozenset({"group_admitted"})


@pytest.fixture
def t() -> HostTransport:
    return HostTransport()


def memfd(size: int = BANK, seals: int = SEALS, sealing: bool = True) -> int:
    fd = os.memfd_create("kvstate-test", os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if sealing else 0))
    os.ftruncate(fd, size)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


@pytest.fixture
def fds() -> Iterator[list[int]]:
    opened: list[int] = []
    yield opened
    for fd in opened:
        os.close(fd)


def _good(fds: list[int]) -> tuple[int, bytes, int]:
    fd = memfd()
    fds.append(fd)
    return fd, fd_identity_of(fd), BANK


def _wrong_size(fds: list[int]) -> tuple[int, bytes, int]:
    fd, ident, _ = _good(fds)
    return fd, ident, 2 * BANK


def _unsealed(fds: list[int]) -> tuple[int, bytes, int]:
    fd = memfd(seals=fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)  # the seals could still be lifted
    fds.append(fd)
    return fd, fd_identity_of(fd), BANK


def _no_sealing(fds: list[int]) -> tuple[int, bytes, int]:
    fd = memfd(seals=0, sealing=False)
    fds.append(fd)
    return fd, fd_identity_of(fd), BANK


def _foreign(fds: list[int]) -> tuple[int, bytes, int]:
    fd, _, size = _good(fds)
    other = memfd()
    fds.append(other)
    return fd, fd_identity_of(other), size  # the descriptor names another file


def _not_memfd(fds: list[int]) -> tuple[int, bytes, int]:
    f = tempfile.TemporaryFile()
    f.truncate(BANK)
    fd = os.dup(f.fileno())
    f.close()
    fds.append(fd)
    return fd, fd_identity_of(fd), BANK


def _pipe(fds: list[int]) -> tuple[int, bytes, int]:
    r, w = os.pipe()
    fds += [r, w]
    return r, fd_identity_of(r), BANK


BAD: dict[str, Callable[[list[int]], tuple[int, bytes, int]]] = {
    "wrong size": _wrong_size, "unsealed": _unsealed, "no sealing": _no_sealing, "foreign identity": _foreign,
    "not a memfd": _not_memfd, "a pipe": _pipe,
}


def held(t: HostTransport) -> tuple[int, int, int]:
    s = t.native.stats()
    return s.allocations, s.reservations, s.regions


def verdict(exc: BaseException) -> tuple[Any, ...]:
    assert isinstance(exc, KvStateError), f"untyped {exc!r}"
    return type(exc), getattr(exc, "reason", None), getattr(exc, "defect", None)


def python_path(t: HostTransport, fd: int, ident: bytes, size: int) -> tuple[Any, ...] | None:
    """Part._import's steps on the Python path; its verdict, or None when it opened (undone)."""
    made: list[Callable[[], None]] = []
    try:
        a = t.import_(HostHandle(fd, ident), size)
        made.append(lambda: t.release(a))
        r = t.reserve(size)
        made.append(lambda: t.free(r))
        m = t.map(r, 0, a)
        made.append(lambda: t.unmap(m))
        t.set_access(m, Access.READ)
        return None
    except Exception as exc:
        return verdict(exc)
    finally:
        for undo in reversed(made):
            undo()


def native_path(t: HostTransport, items: list[attach.Item]) -> tuple[Any, ...] | None:
    arr, rc, failed = attach.run(items, t)
    if rc == t.native.lib.KVS_OK:
        for i in range(len(items)):
            c = arr[i]
            assert t.native.lib.kvs_unmap(c.region) == 0
            assert t.native.lib.kvs_free_reservation(c.reservation) == 0
            assert t.native.lib.kvs_release(c.allocation) == 0
        return None
    assert 0 <= failed < len(items)
    return verdict(attach.error(items[failed], arr[failed], t))


@pytest.mark.parametrize("case", sorted(BAD))
def test_native_and_python_attach_give_the_same_verdict_on_a_bad_fd(t: HostTransport, fds: list[int],
                                                                     case: str) -> None:
    fd, ident, size = BAD[case](fds)
    before = held(t)
    expected = python_path(t, fd, ident, size)
    assert expected is not None and expected[0] is ImportFailed, f"{case}: the Python path accepted it"
    assert held(t) == before
    got = native_path(t, [attach.Item(fd, ident, size, "leased", ADMITTED)])
    assert got == expected, f"{case}: native {got}, Python {expected}"
    assert held(t) == before


def test_a_good_fd_opens_on_both_paths_with_read_access(t: HostTransport, fds: list[int]) -> None:
    fd, ident, size = _good(fds)
    before = held(t)
    assert python_path(t, fd, ident, size) is None
    arr, rc, failed = attach.run([attach.Item(fd, ident, size, "leased", ADMITTED)], t)
    assert (rc, failed) == (0, -1)
    c = arr[0]
    assert held(t) == (before[0] + 1, before[1] + 1, before[2] + 1)
    assert attach.native_table("part").states[c.state] == "imported"
    stats = t.native.region_stats(c.region)
    assert (stats.addr, stats.size, stats.access) == (c.addr, size, t.native.lib.KVS_ACCESS_READ)
    assert c.addr % t.granularity() == 0
    os.pwrite(fd, b"attached", 0)  # the mapping is the exporter's file, readable
    assert bytes(memoryview(t.native.ffi.buffer(t.native.ffi.cast("char *", c.addr), 8))) == b"attached"
    lib = t.native.lib
    assert (lib.kvs_unmap(c.region), lib.kvs_free_reservation(c.reservation), lib.kvs_release(c.allocation)) == (0, 0, 0)
    assert held(t) == before


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("at", [0, 1, 3])
def test_a_bad_part_anywhere_in_a_batch_rolls_back_every_part(t: HostTransport, fds: list[int], case: str,
                                                              at: int) -> None:
    items = [attach.Item(*_good(fds), "leased", ADMITTED, f"part[{i}]") for i in range(4)]
    items[at] = attach.Item(*BAD[case](fds), "leased", ADMITTED, f"part[{at}]")
    before, nfds = held(t), len(os.listdir("/proc/self/fd"))
    arr, rc, failed = attach.run(items, t)
    assert rc != 0 and failed == at
    assert held(t) == before, "a part of the failed batch kept a native object"
    assert len(os.listdir("/proc/self/fd")) == nfds, "a duplicated fd was kept"
    states = attach.native_table("part").states
    for i in range(len(items)):
        c = arr[i]
        assert (c.allocation, c.reservation, c.region, c.left) == (0, 0, 0, 0)
        assert states[c.state] == "leased", f"part {i} is reported {states[c.state]}"
    assert verdict(attach.error(items[at], arr[at], t)) == python_path(t, items[at].fd, items[at].identity,
                                                                       items[at].size)


def test_the_part_rows_decide_a_refused_guard_opens_nothing(t: HostTransport, fds: list[int]) -> None:
    items = [attach.Item(*_good(fds), "leased", ADMITTED), attach.Item(*_good(fds), "leased", frozenset())]
    before = held(t)
    arr, rc, failed = attach.run(items, t)
    assert (rc, failed) == (t.native.lib.KVS_E_GUARD, 1)
    assert held(t) == before
    refusal = attach.error(items[1], arr[1], t)
    # What Python's own table says for the same part in the same state with no guard holding.
    python = TransitionError.guard("part", "leased", "open", ["group_admitted"])
    assert isinstance(refusal, TransitionError) and (refusal.reason, str(refusal)) == (python.reason, str(python))
    # An event the state does not declare: illegal, as Python's table says, nothing made.
    arr, rc, failed = attach.run([attach.Item(*_good(fds), "validated", ADMITTED)], t)
    assert (rc, failed) == (t.native.lib.KVS_E_ILLEGAL, 0)
    assert held(t) == before
    refusal = attach.error(attach.Item(0, b"", 0, "validated", ADMITTED), arr[0], t)
    python = TransitionError.illegal("part", "validated", "open")
    assert isinstance(refusal, TransitionError) and (refusal.reason, str(refusal)) == (python.reason, str(python))


def test_malformed_calls_are_refused_before_anything_is_made(t: HostTransport, fds: list[int]) -> None:
    ffi, lib = t.native.ffi, t.native.lib
    before = held(t)
    failed = ffi.new("int32_t *")
    arr = ffi.new("kvs_attach_part[]", 2)
    fd, ident, size = _good(fds)
    arr[0].fd, arr[0].size, arr[0].state = fd, size, 2
    arr[0].dev, arr[0].ino = int.from_bytes(ident[:8], "little"), int.from_bytes(ident[8:], "little")
    arr[1].fd, arr[1].state = -1, 2  # a bad second part: the first is not even tried
    assert lib.kvs_attach(arr, 2, t.granularity(), lib.KVS_ACCESS_READ, failed) == lib.KVS_E_INVAL
    assert failed[0] == 1 and held(t) == before
    assert lib.kvs_attach(arr, 0, t.granularity(), lib.KVS_ACCESS_READ, failed) == lib.KVS_E_INVAL
    assert lib.kvs_attach(ffi.NULL, 1, t.granularity(), lib.KVS_ACCESS_READ, failed) == lib.KVS_E_INVAL
    arr[1].fd, arr[1].state = fd, 99  # no such state
    assert lib.kvs_attach(arr, 2, t.granularity(), lib.KVS_ACCESS_READ, failed) == lib.KVS_E_INVAL
    assert held(t) == before


def test_a_host_group_import_attaches_natively_and_feeds_the_part_machines(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvstate import Deployment, ExportConfig, Exporter, ImportConfig, Importer, ReuseSettings
    from kvstate.core import layouts

    deployment = Deployment("attach", b"k" * 32)
    geometry = layouts.vllm_cpu(2, num_blocks=4, num_kv_heads=1, block_size=4, head_dim=8)
    granularity = 64 * 1024
    ex: Any = Exporter(ExportConfig(deployment, tmp_path / "e", b"s" * 16, tp=3),
                       HostTransport(granularity=granularity), name="decode")
    for rank in range(3):
        bank = ex.add_bank(rank, geometry)
        bank.register()
        bank.advertise()
    ex.start()
    calls: list[int] = []
    real = native_import._call
    monkeypatch.setattr(native_import, "_call",
                        lambda lib, link, payload, frame, ns, arr, n, *a: calls.append(n) or
                        real(lib, link, payload, frame, ns, arr, n, *a))
    monkeypatch.setattr(attach, "_call", lambda *a: pytest.fail("phase 2 belongs to the group's one native call"))
    changes: list[Any] = []
    t = HostTransport(granularity=granularity)
    im: Any = Importer(ImportConfig(deployment, reuse=ReuseSettings(enable_decode_to_prefill_reuse=True)), t,
                       observers=[changes.append])
    try:
        before = held(t)
        group = im.import_group([ex.descriptor(r) for r in range(3)])
        assert calls == [3], "one native call leases and opens the exporter's batch of three parts"
        assert group.state == "ready"
        steps = [(c.label, c.event, c.source, c.dest) for c in changes if c.machine == "part"
                 and c.event in ("lease", "open")]
        assert sorted(steps) == sorted((f"{group.label}/part[{r}]", e, s, d) for r in range(3)
                                       for e, s, d in (("lease", "validated", "leased"),
                                                       ("open", "leased", "imported")))
        for p in group.parts:
            assert p.state == "imported" and p.received is None and p.handle is None
            assert t.stats(p.mapping).access == t.native.lib.KVS_ACCESS_READ
        assert held(t) == (before[0] + 3, before[1] + 3, before[2] + 3)
        group.drain()
        assert held(t) == before
    finally:
        im.close()
        ex.stop()
        ex.drain(5.0)



def test_adopt_commits_only_a_declared_row_and_tells_the_observers() -> None:
    """Lifecycle.adopt, how the Part machine is fed what C committed: it decides nothing,
    and refuses a row its table does not declare (the executors diverged)."""
    from kvstate.core.errors import ArgumentInvalid
    from kvstate.core.machine import Lifecycle
    from kvstate.share.part import Part

    seen: list[Any] = []
    part: Any = Part.__new__(Part)  # the machine alone: no group, no transport (adopt runs no effect)
    Lifecycle.__init__(part, label="g/part[0]", observers=[seen.append])
    with pytest.raises(TransitionError):
        part.adopt("open", "imported")  # received: `open` is not declared there
    assert part.state == "received" and not seen
    part.adopt("validate", "validated")
    with pytest.raises(TransitionError):
        part.adopt("lease", "imported")  # declared, but to `leased`: another row
    part.adopt("lease", "leased")
    part.adopt("open", "imported", reason="native")
    assert part.state == "imported"
    assert [(c.event, c.source, c.dest) for c in seen] == [
        ("validate", "received", "validated"), ("lease", "validated", "leased"), ("open", "leased", "imported")]
    assert seen[-1].reason == "native"
    for bad in ([], None, 3):
        with pytest.raises(ArgumentInvalid):
            part.adopt(bad, "closed")
        with pytest.raises(ArgumentInvalid):
            part.adopt("close", bad)
    assert part.state == "imported"
