"""Leases are served while the exporter's Python is frozen (issue 28): the exporter's
process holds its GIL in one long C call (ctypes.PyDLL) while another process leases,
maps and loads a tp=2 group from it and verifies the bytes. The test asserts on the order
of events only (tests/support/gil_hostile.py says how the hold ends on the importer's
word), never on wall-clock time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

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


@pytest.mark.parametrize("blocks", [False, True], ids=["bank", "inventory-blocks"])
def test_an_exporter_holding_its_gil_still_serves_a_tp2_import(blocks: bool) -> None:
    """With ``blocks`` the leases name retained inventory blocks (as the vLLM connector's
    do): they are re-validated and pinned natively too, and unpinned when the leases end."""
    r, w = os.pipe()
    exporter = _child("exporter", r, "blocks" if blocks else "bank")
    importer = None
    try:
        holding = _line(exporter)
        assert holding["event"] == "holding"
        # From here the exporter's process is inside one C call with its GIL held, until
        # the importer writes its word.
        epoch = holding["epoch"]
        assert (epoch is not None) == blocks
        importer = _child("importer", w, "-" if epoch is None else str(epoch), *holding["descriptors"])
        os.close(w)
        w = -1
        assert importer.wait(timeout=300) == 0
        imported = _line(importer)
        returned = _line(exporter)
        # The importer finished (leased, mapped, loaded, verified) while the hold lasted:
        # the hold returned with its word already there, and no Python ran during it.
        assert imported["word"] == "done", imported
        assert returned["event"] == "hold returned" and returned["word"] == "done", returned
        # A GIL switch the ticker asked for before the hold may land just before the call or
        # just after it returns: at most one tick at each edge. A hold that let Python run
        # would count one tick per 0.5 ms of an import that spans a process start.
        assert returned["ticks_during_hold"] <= 2, returned
        if blocks:  # 11 and 13 were pinned by both ranks' leases, and the drain ended them
            assert _line(exporter) == {"event": "pins", "leased": [0, 0, 0]}
        released = _line(exporter)
        assert released["bank_states"] == ["released", "released"], released
        assert exporter.wait(timeout=60) == 0
    finally:
        for p in (exporter, importer):
            if p is not None:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                assert p.stdout is not None
                p.stdout.close()
        os.close(r)
        if w >= 0:
            os.close(w)


def test_an_exporter_holding_its_gil_still_serves_leases_over_tcp() -> None:
    """Issue 30: importers on other nodes lease over TCP. The exporter's Python is frozen
    from before the importer connects until it is done, so the handshake, the leases, the
    renewals and the releases of both ranks were all served natively."""
    pytest.importorskip("kvstate.transport.nixl")
    from kvstate.core.errors import BackendUnavailable
    from kvstate.transport.nixl import load_nixl

    try:
        load_nixl()
    except BackendUnavailable as exc:
        if os.environ.get("KVSTATE_REQUIRE_NIXL") == "1":
            pytest.fail(f"KVSTATE_REQUIRE_NIXL=1 but {exc}")
        pytest.skip(f"NIXL TESTS SKIPPED: {exc}")
    r, w = os.pipe()
    exporter = _child("exporter", r, "tcp")
    importer = None
    try:
        holding = _line(exporter)
        assert holding["event"] == "holding"
        importer = _child("tcp_importer", w, *holding["descriptors"])
        os.close(w)
        w = -1
        assert importer.wait(timeout=300) == 0
        imported = _line(importer)
        returned = _line(exporter)
        assert imported["word"] == "done", imported
        assert imported["steps"] == [f"{step} {rank}" for rank in (0, 1)
                                     for step in ("leased", "renewed", "renewed", "released")], imported
        assert returned["event"] == "hold returned" and returned["word"] == "done", returned
        assert returned["ticks_during_hold"] <= 2, returned
        # Every lease was returned while Python was frozen: nothing holds the banks.
        released = _line(exporter)
        assert released["bank_states"] == ["released", "released"], released
        assert exporter.wait(timeout=60) == 0
    finally:
        for p in (exporter, importer):
            if p is not None:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                assert p.stdout is not None
                p.stdout.close()
        os.close(r)
        if w >= 0:
            os.close(w)
