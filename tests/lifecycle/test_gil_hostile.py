"""Leases are served while the exporter's Python is frozen (issue 28): the exporter's
process holds its GIL in one long C call (ctypes.PyDLL) while another process leases,
maps and loads a tp=2 group from it and verifies the bytes. The test asserts on the order
of events only (tests/support/gil_hostile.py says how the hold ends on the importer's
word), never on wall-clock time."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.need import need_nixl

pytestmark = [pytest.mark.native, pytest.mark.multiproc]

TESTS = Path(__file__).resolve().parents[1]
RUN = f"import sys; sys.path.insert(0, {str(TESTS)!r}); from support.gil_hostile import main; main()"


def _child(role: str, fd: int, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", RUN, role, str(fd), *args], pass_fds=(fd,),
                            stdout=subprocess.PIPE, text=True)


def _line(p: subprocess.Popen[str]) -> dict[str, Any]:
    assert p.stdout is not None
    line = p.stdout.readline()
    while line and not line.startswith("{"):  # NIXL's own log lines (the tcp case)
        line = p.stdout.readline()
    assert line, f"the child ended early (rc {p.poll()})"
    out: dict[str, Any] = json.loads(line)
    return out


class _Hold:
    """An exporter child that holds its GIL until a word arrives on its pipe, and the
    children that end it: the importer child is handed the pipe's write end."""

    def __init__(self, mode: str) -> None:
        self.r, self.w = os.pipe()
        self.children = [_child("exporter", self.r, mode)]

    @property
    def exporter(self) -> subprocess.Popen[str]:
        return self.children[0]

    def importer(self, role: str, *args: str) -> subprocess.Popen[str]:
        p = _child(role, self.w, *args)
        self.children.append(p)
        self._close_w()
        return p

    def word(self) -> None:
        """Ends the hold from this process."""
        if self.w >= 0:
            os.write(self.w, b"done")
            self._close_w()

    def _close_w(self) -> None:
        os.close(self.w)
        self.w = -1

    def close(self) -> None:
        for p in self.children:
            if p.poll() is None:
                p.kill()
            p.wait()
            assert p.stdout is not None
            p.stdout.close()
        os.close(self.r)
        if self.w >= 0:
            self._close_w()


@contextlib.contextmanager
def _holding(mode: str) -> Iterator[_Hold]:
    hold = _Hold(mode)
    try:
        yield hold
    finally:
        hold.close()


@pytest.mark.parametrize("blocks", [False, True], ids=["bank", "inventory-blocks"])
def test_an_exporter_holding_its_gil_still_serves_a_tp2_import(blocks: bool) -> None:
    """With ``blocks`` the leases name retained inventory blocks (as the vLLM connector's
    do): they are re-validated and pinned natively too, and unpinned when the leases end."""
    with _holding("blocks" if blocks else "bank") as hold:
        holding = _line(hold.exporter)
        assert holding["event"] == "holding"
        # From here the exporter's process is inside one C call with its GIL held, until
        # the importer writes its word.
        epoch = holding["epoch"]
        assert (epoch is not None) == blocks
        importer = hold.importer("importer", "-" if epoch is None else str(epoch), *holding["descriptors"])
        assert importer.wait(timeout=300) == 0
        imported = _line(importer)
        returned = _line(hold.exporter)
        # The importer finished (leased, mapped, loaded, verified) while the hold lasted:
        # the hold returned with its word already there, and no Python ran during it.
        assert imported["word"] == "done", imported
        assert returned["event"] == "hold returned" and returned["word"] == "done", returned
        # A GIL switch the ticker asked for before the hold may land just before the call or
        # just after it returns: at most one tick at each edge. A hold that let Python run
        # would count one tick per 0.5 ms of an import that spans a process start.
        assert returned["ticks_during_hold"] <= 2, returned
        if blocks:  # 11 and 13 were pinned by both ranks' leases, and the drain ended them
            assert _line(hold.exporter) == {"event": "pins", "leased": [0, 0, 0]}
        released = _line(hold.exporter)
        assert released["bank_states"] == ["released", "released"], released
        assert hold.exporter.wait(timeout=60) == 0


def test_an_exporter_holding_its_gil_still_serves_leases_over_tcp() -> None:
    """Issue 30: importers on other nodes lease over TCP. The exporter's Python is frozen
    from before the importer connects until it is done, so the handshake, the leases, the
    renewals and the releases of both ranks were all served natively."""
    need_nixl()
    with _holding("tcp") as hold:
        holding = _line(hold.exporter)
        assert holding["event"] == "holding"
        importer = hold.importer("tcp_importer", *holding["descriptors"])
        assert importer.wait(timeout=300) == 0
        imported = _line(importer)
        returned = _line(hold.exporter)
        assert imported["word"] == "done", imported
        assert imported["steps"] == [f"{step} {rank}" for rank in (0, 1)
                                     for step in ("leased", "renewed", "renewed", "released")], imported
        assert returned["event"] == "hold returned" and returned["word"] == "done", returned
        assert returned["ticks_during_hold"] <= 2, returned
        # Every lease was returned while Python was frozen: nothing holds the banks.
        released = _line(hold.exporter)
        assert released["bank_states"] == ["released", "released"], released
        assert hold.exporter.wait(timeout=60) == 0


def test_an_importer_holding_its_gil_keeps_its_tcp_lease_renewed() -> None:
    """Issue 30, the prefill side: a remote part's lease over TCP is renewed by the
    importer's native renewal thread on a stream link (kvstate.share.remote_part), so an
    importer whose engine holds its GIL for several lease terms still holds the lease
    afterwards. (Renewed from Python, as before, it expired at the exporter.) This process
    holds its GIL in one C call for four terms of a one-second lease; the exporter's
    Python is frozen too, so both ends are native."""
    import ctypes

    from kvstate import channel as chan
    from kvstate.channel.tcp import connect_tcp
    from kvstate.core.descriptor import decode
    from kvstate.share.link import NativeLink
    from kvstate.share.part import lease_request
    from kvstate.share.renewal import Renewal
    from support.gil_hostile import DEPLOYMENT

    need_nixl()
    renewal: Renewal[object] | None = None
    with _holding("tcp-short") as hold:
        try:
            holding = _line(hold.exporter)
            desc = decode(bytes.fromhex(holding["descriptors"][0]), DEPLOYMENT)
            ch = connect_tcp(desc.socket_path, DEPLOYMENT, timeout=5.0)
            ch.send(lease_request(desc, None), timeout=5.0)
            with ch.recv(timeout=5.0) as msg:
                grant = chan.decode(msg.payload)
            assert grant["ok"] is True and 0 < grant["expires_in_s"] <= 1.0, grant
            link = NativeLink(ch, chan.Limits(), stream=True)
            renewal = Renewal(interval_s=0.25, timeout_s=5.0)
            key = renewal.add(object(), link, desc.rank, grant["lease"], grant["expires_in_s"], time.monotonic())
            assert key is not None
            libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held for the whole call
            libc.usleep.argtypes = [ctypes.c_uint]
            libc.usleep(4_000_000)  # four terms: unrenewed, the lease would have expired three times over
            state = renewal.state(key)
            assert state is not None and not state.failed and state.renewals >= 2, state
            assert renewal.take() == []
            renewal.remove(key)
            # The exporter still holds the lease live: it grants one more renewal by hand.
            with link.request(chan.encode({"op": "renew", "rank": desc.rank, "lease": grant["lease"]}), 5.0) as msg:
                renewed = chan.decode(msg.payload)
            assert renewed["ok"] is True, renewed
            ch.close()
            assert link.closed  # closing the channel closed its link
        finally:
            if renewal is not None:
                renewal.close()
            hold.word()
