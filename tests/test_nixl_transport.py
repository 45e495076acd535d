"""The NIXL transport on the real library, across real processes, UCX over loopback TCP.

Where the nixl extra is not installed these tests skip, loudly, with the install
command; with KVSTATE_REQUIRE_NIXL=1 (set by `make test`, which installs it) a missing
NIXL fails instead, so CI cannot pass by skipping.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from support.need import need_nixl
from support.peers import PeerError, peers
from support.waiting import stop_process

ROOT = Path(__file__).resolve().parents[1]
CMDS = "support.nixl_commands"
BLOCK = 4096
BLOCKS = 64
SIZE = BLOCK * BLOCKS


needs_nixl = pytest.mark.usefixtures("_nixl")


@pytest.fixture
def _nixl() -> None:
    need_nixl()


@needs_nixl
def test_load_reads_exporter_bytes() -> None:
    """INV-LOAD-BYTES: a NIXL READ of random blocks returns exactly what the exporter wrote."""
    with peers(CMDS, 2) as (exporter, importer):
        name = exporter.call("start")
        importer.call("start")
        handle = exporter.call("export_bank", blocks=BLOCKS, block_bytes=BLOCK, seed=1, generation=1)
        info = importer.call("import_bank", handle=handle, size=SIZE, generation=1)
        assert info == {"agent": name, "generation": 1, "size": SIZE}
        blocks = [63, 0, 17, 17, 5, 42, 1, 62]
        assert importer.call("load", blocks=blocks, block_bytes=BLOCK, seed=1, generation=1)["matches"] is True
        exporter.call("fill_bank", seed=2, blocks=BLOCKS, block_bytes=BLOCK)  # the bank changes: loads see it
        assert importer.call("load", blocks=blocks, block_bytes=BLOCK, seed=2, generation=1)["matches"] is True
        with pytest.raises(PeerError, match="ValueError.*out of range"):
            importer.call("load", blocks=[BLOCKS], block_bytes=BLOCK, seed=None, generation=1)
        importer.call("close")
        exporter.call("close")
        assert importer.stop() == 0 and exporter.stop() == 0


@needs_nixl
def test_deregistration_does_not_revoke_access_but_the_lease_gate_does() -> None:
    """INV-RELEASE-QUIESCENT: why kvstate leases govern NIXL memory.

    On the real library, the owner deregisters its bank and reuses the memory; the peer,
    still holding the metadata, READs it and gets the owner's *new* bytes. NIXL does not
    stop it. kvstate's gate does: once the lease ends, the load is refused before
    anything is posted, and the destination is untouched.
    """
    with peers(CMDS, 2) as (exporter, importer):
        exporter.call("start")
        importer.call("start")
        handle = exporter.call("export_bank", blocks=BLOCKS, block_bytes=BLOCK, seed=1, generation=1,
                               owned_by_test=True)
        importer.call("import_bank", handle=handle, size=SIZE, generation=1)
        blocks = list(range(0, BLOCKS, 3))
        assert importer.call("load", blocks=blocks, block_bytes=BLOCK, seed=1, generation=1)["matches"] is True

        exporter.call("release_bank")  # NIXL deregistration: the owner is done with NIXL
        exporter.call("fill_bank", seed=7, blocks=BLOCKS, block_bytes=BLOCK)  # and reuses the memory
        after = importer.call("load", blocks=blocks, block_bytes=BLOCK, seed=7, generation=1)
        assert after["matches"] is True, "the hazard: a deregistered region is still readable by the peer"

        importer.call("end_lease", why="revoked by the exporter")
        with pytest.raises(PeerError) as refused:
            importer.call("load", blocks=blocks, block_bytes=BLOCK, seed=None, generation=1)
        assert refused.value.kind == "kvstate.core.errors.TransferFailed:lease_ended" and "revoked by the exporter" in str(refused.value)
        assert importer.call("dst_untouched") is True


@needs_nixl
def test_expired_lease_refuses_loads() -> None:
    """A lease past its deadline refuses loads on its own, with no message from the exporter."""
    with peers(CMDS, 2) as (exporter, importer):
        name = exporter.call("start")
        importer.call("start")
        handle = exporter.call("export_bank", blocks=BLOCKS, block_bytes=BLOCK, seed=3, generation=1)
        importer.call("import_bank", handle=handle, size=SIZE, generation=1)
        importer.call("short_lease", agent=name, seconds=0.2)
        assert importer.call("load", blocks=[1, 2], block_bytes=BLOCK, seed=3, generation=1)["matches"] is True
        time.sleep(0.3)
        with pytest.raises(PeerError) as refused:
            importer.call("load", blocks=[1, 2], block_bytes=BLOCK, seed=None, generation=1)
        assert refused.value.kind == "kvstate.core.errors.TransferFailed:lease_ended" and "expired" in str(refused.value)
        assert importer.call("dst_untouched") is True


@needs_nixl
def test_read_after_owner_unmaps_kills_the_owner() -> None:
    """What NIXL does when a peer READs memory its owner deregistered and then unmapped:
    the READ fails on the peer, and the owner's process dies of SIGSEGV (UCX's TCP
    transport serves the READ from the unmapped address). Leases prevent exactly this."""
    with peers(CMDS, 2) as (exporter, importer):
        exporter.call("start")
        importer.call("start")
        handle = exporter.call("export_bank", blocks=BLOCKS, block_bytes=BLOCK, seed=1, generation=1,
                               owned_by_test=True)
        importer.call("import_bank", handle=handle, size=SIZE, generation=1)
        exporter.call("release_bank")
        exporter.call("unmap_bank")
        with pytest.raises(PeerError) as failed:
            importer.call("load", blocks=[0, 1], block_bytes=BLOCK, seed=None, generation=1, timeout=10.0)
        assert failed.value.kind in {"kvstate.core.errors.NativeError:nixl", "kvstate.core.errors.TimedOut:nixl"}
        exporter.process.join(10)
        assert exporter.process.exitcode == -signal.SIGSEGV


@needs_nixl
def test_stale_generation_rejected() -> None:
    """INV-STALE-REJECTED: metadata of an older generation is refused; a newer one retires the old view."""
    with peers(CMDS, 2) as (exporter, importer):
        exporter.call("start")
        importer.call("start")
        gen1 = exporter.call("export_bank", blocks=BLOCKS, block_bytes=BLOCK, seed=1, generation=1)
        importer.call("import_bank", handle=gen1, size=SIZE, generation=1)
        exporter.call("release_bank")
        gen2 = exporter.call("export_bank", blocks=BLOCKS, block_bytes=BLOCK, seed=2, generation=2)

        # the gen-1 record inside a gen-2 descriptor: refused by the decoder, before NIXL
        with pytest.raises(PeerError) as stale:
            importer.call("decode_only", handle=gen1, generation=2)
        assert stale.value.kind == "kvstate.core.errors.ImportFailed:handle/stale_generation"

        importer.call("import_bank", handle=gen2, size=SIZE, generation=2)
        assert importer.call("load", blocks=[3, 9], block_bytes=BLOCK, seed=2, generation=2)["matches"] is True
        with pytest.raises(PeerError) as retired:  # the superseded view no longer loads
            importer.call("load", blocks=[3], block_bytes=BLOCK, seed=None, generation=1)
        assert retired.value.kind == "kvstate.core.errors.ImportFailed:handle/stale_generation"
        with pytest.raises(PeerError) as older:  # a well-formed gen-1 descriptor after gen 2 was seen
            importer.call("import_bank", handle=gen1, size=SIZE, generation=1)
        assert older.value.kind == "kvstate.core.errors.ImportFailed:handle/stale_generation"
        with pytest.raises(PeerError) as wrong_size:
            importer.call("import_bank", handle=gen2, size=SIZE * 2, generation=2)
        assert wrong_size.value.kind.startswith("kvstate.core.errors.ImportFailed:handle/")


@needs_nixl
def test_metadata_of_another_agent_is_rejected() -> None:
    """A record naming one agent but carrying another's metadata is refused, and the
    metadata NIXL loaded for the check is dropped again: the real import still works."""
    with peers(CMDS, 2) as (exporter, importer):
        exporter.call("start")
        importer.call("start")
        handle = exporter.call("export_bank", blocks=BLOCKS, block_bytes=BLOCK, seed=6, generation=1)
        with pytest.raises(PeerError) as forged:
            importer.call("import_renamed", handle=handle, size=SIZE, generation=1, name="someone-else")
        assert forged.value.kind == "kvstate.core.errors.ImportFailed:handle/agent_name" and "agent_name" in str(forged.value)
        importer.call("import_bank", handle=handle, size=SIZE, generation=1)
        assert importer.call("load", blocks=[9], block_bytes=BLOCK, seed=6, generation=1)["matches"] is True


@needs_nixl
def test_teardown_order_and_closed_views() -> None:
    """Teardown in NIXL's order leaves both agents clean, and a closed view loads nothing."""
    with peers(CMDS, 2) as (exporter, importer):
        exporter.call("start")
        importer.call("start")
        handle = exporter.call("export_bank", blocks=BLOCKS, block_bytes=BLOCK, seed=4, generation=1)
        importer.call("import_bank", handle=handle, size=SIZE, generation=1)
        assert importer.call("load", blocks=[7], block_bytes=BLOCK, seed=4, generation=1)["matches"] is True
        importer.call("close_remote", generation=1)
        with pytest.raises(PeerError) as closed:
            importer.call("load", blocks=[7], block_bytes=BLOCK, seed=None, generation=1)
        assert closed.value.kind == "kvstate.core.errors.ImportFailed:handle/stale_generation"
        importer.call("close")
        exporter.call("release_bank")
        exporter.call("close")
        assert importer.stop() == 0 and exporter.stop() == 0


@needs_nixl
def test_one_agent_per_process_and_no_mapping() -> None:
    with peers(CMDS, 1) as (peer,):
        peer.call("start")
        with pytest.raises(PeerError) as second:
            peer.call("second_agent")
        assert second.value.kind == "kvstate.core.errors.NativeError:nixl" and "one agent per process" in str(second.value)
        assert peer.call("unsupported") == ["backend:True", "mapped:False", "reserve:absent", "map:absent",
                                            "set_access:absent", "unmap:absent",
                                            "exporter:BackendUnavailable", "importer:BackendUnavailable",
                                            "export_memfd:ArgumentInvalid"]


@needs_nixl
def test_hung_exporter_load_times_out_and_recovers() -> None:
    """Every wait has a timeout: a READ from a stopped exporter raises TimedOut (NIXL), the
    transfer is released, and loads work again once the exporter runs."""
    with peers(CMDS, 2) as (exporter, importer):
        exporter.call("start")
        importer.call("start")
        handle = exporter.call("export_bank", blocks=BLOCKS, block_bytes=BLOCK, seed=5, generation=1)
        importer.call("import_bank", handle=handle, size=SIZE, generation=1)
        assert importer.call("load", blocks=[1], block_bytes=BLOCK, seed=5, generation=1)["matches"] is True
        stop_process(exporter.process.pid)
        try:
            t0 = time.monotonic()
            with pytest.raises(PeerError) as hung:
                importer.call("load", blocks=list(range(BLOCKS)), block_bytes=BLOCK, seed=None, generation=1,
                              timeout=1.0)
            assert hung.value.kind == "kvstate.core.errors.TimedOut:nixl"
            assert time.monotonic() - t0 < 10
        finally:
            os.kill(exporter.process.pid, signal.SIGCONT)
        assert importer.call("load", blocks=[2, 3], block_bytes=BLOCK, seed=5, generation=1)["matches"] is True


@needs_nixl
def test_a_timed_out_read_keeps_its_target_pinned() -> None:
    """A READ that timed out may still land (UCX over TCP delivered the late reply after
    the transfer was released, and the importer crashed in ucp_get_rep_handler once the
    target was unmapped: issue 30). Its target stays pinned: its release is refused even
    after the exporter runs again, and nothing else is lost (loads into a new target work)."""
    with peers(CMDS, 2) as (exporter, importer):
        exporter.call("start")
        importer.call("start")
        handle = exporter.call("export_bank", blocks=BLOCKS, block_bytes=BLOCK, seed=5, generation=1)
        importer.call("import_bank", handle=handle, size=SIZE, generation=1)
        stop_process(exporter.process.pid)
        try:
            with pytest.raises(PeerError) as hung:
                importer.call("load", blocks=list(range(BLOCKS)), block_bytes=BLOCK, seed=None, generation=1,
                              timeout=1.0)
            assert hung.value.kind == "kvstate.core.errors.TimedOut:nixl"
        finally:
            os.kill(exporter.process.pid, signal.SIGCONT)
        assert importer.call("target_pins") == 1
        assert importer.call("release_target") == "Busy: pinned"
        importer.call("make_target", kind="created", size=SIZE)
        assert importer.call("load", blocks=[2, 3], block_bytes=BLOCK, seed=5, generation=1)["matches"] is True
        assert importer.call("release_target") == "released"


@needs_nixl
def test_a_load_target_is_not_deregistered_under_a_read() -> None:
    """The one pin rule for NIXL regions: a READ in flight pins its local target, so its
    release (deregistration) is refused until the transfer is done (issue 29)."""
    with peers(CMDS, 2) as (exporter, importer):
        exporter.call("start")
        importer.call("start")
        handle = exporter.call("export_bank", blocks=BLOCKS, block_bytes=BLOCK, seed=5, generation=1)
        importer.call("import_bank", handle=handle, size=SIZE, generation=1)
        stop_process(exporter.process.pid)  # the READ stays in flight
        try:
            importer.call("load_in_background", blocks=list(range(BLOCKS)), block_bytes=BLOCK, generation=1)
            assert importer.call("release_target") == "Busy: pinned"
        finally:
            os.kill(exporter.process.pid, signal.SIGCONT)
        assert importer.call("load_outcome") == "done"
        assert importer.call("release_target") == "released"  # nothing in flight: it goes


class _NixlTargets(RuleBasedStateMachine):
    """The one pin rule for NIXL load targets, over both kinds (docs/threat-model.md): a
    target ``created`` by the transport or caller memory ``registered`` with it. A READ is
    held in flight by stopping the exporter; releasing (deregistering) the target is
    ``Busy`` (``pinned``) while it is, and goes at quiescence; the importer's pin count
    equals the model's after every step. One exporter and importer serve every example."""

    exporter: Any
    importer: Any

    def __init__(self) -> None:
        super().__init__()
        self.target: str | None = None
        self.inflight = self.stopped = False

    @rule(kind=st.sampled_from(["created", "registered"]))
    def make_target(self, kind: str) -> None:
        if self.target is None:
            self.importer.call("make_target", kind=kind, size=SIZE)
            self.target = kind

    @precondition(lambda self: self.target is not None and not self.inflight)
    @rule(stall=st.booleans(), blocks=st.lists(st.integers(0, BLOCKS - 1), min_size=1, max_size=8))
    def load(self, stall: bool, blocks: list[int]) -> None:
        if stall:
            stop_process(self.exporter.process.pid)
            self.stopped = True
        self.importer.call("load_in_background", blocks=blocks, block_bytes=BLOCK, generation=1)
        self.inflight = True
        if not stall:
            self.finish()

    @precondition(lambda self: self.inflight)
    @rule()
    def finish(self) -> None:
        if self.stopped:
            os.kill(self.exporter.process.pid, signal.SIGCONT)
            self.stopped = False
        assert self.importer.call("load_outcome") == "done"
        self.inflight = False

    @precondition(lambda self: self.target is not None)
    @rule()
    def release(self) -> None:
        want = "Busy: pinned" if self.inflight else "released"
        got = self.importer.call("release_target")
        assert got == want, f"INV-NO-UNMAP-PINNED: release of a {self.target} target with the load " \
                            f"{'in flight' if self.inflight else 'done'}: expected {want!r}, got {got!r}"
        if got == "released":
            self.target = None

    @invariant()
    def pins_match_the_model(self) -> None:
        if self.target is not None:
            pins = self.importer.call("target_pins")
            assert pins == int(self.inflight), f"INV-OP-PINS: the target has {pins} pins, model {int(self.inflight)}"

    def teardown(self) -> None:
        if self.inflight:
            self.finish()
        if self.target is not None:
            assert self.importer.call("release_target") == "released"


@needs_nixl
def test_the_pin_rule_holds_for_every_kind_of_nixl_target() -> None:
    with peers(CMDS, 2) as (exporter, importer):
        exporter.call("start")
        importer.call("start")
        handle = exporter.call("export_bank", blocks=BLOCKS, block_bytes=BLOCK, seed=5, generation=1)
        importer.call("import_bank", handle=handle, size=SIZE, generation=1)
        assert importer.call("release_target") == "released"  # the machine makes its own
        _NixlTargets.exporter, _NixlTargets.importer = exporter, importer
        try:
            run_state_machine_as_test(_NixlTargets, settings=settings(
                max_examples=15, stateful_step_count=12, deadline=None, database=None))
        finally:
            os.kill(exporter.process.pid, signal.SIGCONT)
            del _NixlTargets.exporter, _NixlTargets.importer  # the peers' pipes close with them
        importer.call("close")
        exporter.call("close")
        assert importer.stop() == 0 and exporter.stop() == 0


@needs_nixl
def test_the_agent_locks_its_calls_and_its_progress_thread_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent kvstate makes is called from several threads (ranks, importers, remote
    loads): NIXL's default sync mode NONE crashed the process on concurrent calls
    (deregister_memory, two remote loads at once). And NIXL's Python API sets the UCX
    progress thread's wait to 0, a busy spin that burnt a core per engine worker; the agent
    gets a wait instead. Checked on the config NIXL's agent is built from."""
    import importlib

    from kvstate.transport.nixl import load_nixl
    from kvstate.transport.nixl import agent

    nixl = load_nixl()
    bind = importlib.import_module(nixl.__name__ + "._api").nixlBind
    seen: list[Any] = []
    real = bind.nixlAgent
    monkeypatch.setattr(bind, "nixlAgent", lambda name, config: seen.append(config) or real(name, config))
    agent.make_agent(nixl, f"cfg-check-{os.getpid()}", 0)
    (config,) = seen
    assert config.pthrDelay == agent.PROGRESS_DELAY_US > 0
    assert config.useProgThread  # an exporter's worker must progress for a peer's READ to finish
    assert config.syncMode == nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT.value
    assert bind.nixlAgentConfig is not type(config)  # the module's own class is put back


@needs_nixl
def test_an_importer_reads_two_banks_of_one_exporter_process() -> None:
    """One view per bank, not per agent: both banks of one exporter process are imported
    side by side and each reads its own bytes (the second import used to fail, "generation
    0 is already imported")."""
    with peers(CMDS, 2) as (exporter, importer):
        exporter.call("start")
        importer.call("start")
        descriptors = exporter.call("export_banks", banks=2, blocks=BLOCKS, block_bytes=BLOCK, seed=9)
        for d in descriptors:
            importer.call("import_descriptor", descriptor=d)
        assert importer.call("load_rank", rank=1, blocks=[0, 5], block_bytes=BLOCK, seed=9) is True
        assert importer.call("load_rank", rank=0, blocks=[3], block_bytes=BLOCK, seed=9) is True
        exporter.call("stop_exporter")


@needs_nixl
def test_two_parts_of_one_process_share_a_banks_view() -> None:
    """Two groups of one prefill worker lease the same bank at once: the second import of
    the bank at the same generation shares the first's view (it raised "generation 1 is
    already imported", and vLLM recomputed those blocks), and the view stays readable until
    its last user closes it."""
    with peers(CMDS, 2) as (exporter, importer):
        exporter.call("start")
        importer.call("start")
        (d,) = exporter.call("export_banks", banks=1, blocks=BLOCKS, block_bytes=BLOCK, seed=9)
        importer.call("import_descriptor", descriptor=d)
        assert importer.call("import_again", descriptor=d) is True
        assert importer.call("close_view", rank=0) is None             # one user left: still open
        assert importer.call("load_rank", rank=0, blocks=[2, 4], block_bytes=BLOCK, seed=9) is True
        assert importer.call("close_view", rank=0) == "closed by one part"  # the last one retires it
        exporter.call("stop_exporter")


@needs_nixl
def test_the_nixl_record_carries_the_banks_generation() -> None:
    """The record inside a descriptor names the bank's generation (it said 0 whatever the
    generation), so a record of an older generation is refused by the record's own check."""
    with peers(CMDS, 2) as (exporter, importer):
        exporter.call("start")
        importer.call("start")
        (first,) = exporter.call("export_banks", banks=1, blocks=BLOCKS, block_bytes=BLOCK, seed=9)
        got = importer.call("import_descriptor", descriptor=first)
        assert got["generation"] == got["record_generation"] == 1
        second = exporter.call("readvertise", rank=0)
        got = importer.call("import_descriptor", descriptor=second)  # a newer generation supersedes the view
        assert got["generation"] == got["record_generation"] == 2
        assert importer.call("load_rank", rank=0, blocks=[1], block_bytes=BLOCK, seed=9) is True
        with pytest.raises(PeerError) as stale:
            importer.call("import_descriptor", descriptor=first)
        assert stale.value.kind.startswith("kvstate.core.errors.ImportFailed:handle") and "stale_generation" in stale.value.kind
        exporter.call("stop_exporter")


@needs_nixl
def test_vram_path_on_a_machine_without_gpu() -> None:
    """Device memory is offered only when asked for; forced onto host memory, NIXL refuses
    the VRAM registration with a typed error (this machine has no GPU)."""
    with peers(CMDS, 2) as (plain, device):
        plain.call("start")
        device.call("start", device_memory=True)
        assert plain.call("register_vram") == ["host", "BackendUnavailable"]
        assert device.call("register_vram") == ["device,host", "NativeError"]


# -- optional-dependency rules (no NIXL needed) --------------------------------------


def _python(code: str, *, extra_path: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(extra_path or ""), str(ROOT)]))}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=60, check=False)


HIDE_NIXL = """
    import importlib.abc, sys
    class Hide(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {"nixl", "nixl_cu12", "nixl_cu13"}:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None
    sys.meta_path.insert(0, Hide())
"""


def test_importing_kvstate_loads_no_nixl() -> None:
    r = _python("""
        import sys, kvstate, kvstate.transport, kvstate.transport.nixl.transport, kvstate.transport.nixl.handle
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in {"nixl", "nixl_cu12", "nixl_cu13", "numpy"})
        print(loaded)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_missing_nixl_is_backend_unavailable() -> None:
    r = _python(textwrap.dedent(HIDE_NIXL) + textwrap.dedent("""
        from kvstate.core.errors import BackendUnavailable
        from kvstate.transport.nixl import NixlTransport
        try:
            NixlTransport()
        except BackendUnavailable as exc:
            print("unavailable", exc.backend, "|", exc.detail)
    """))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("unavailable nixl |") and "pip install --no-deps" in r.stdout


@pytest.mark.parametrize(("body", "error"), [
    ("import nixl_dependency_that_is_not_there\n", "ModuleNotFoundError: No module named 'nixl_dependency_that_is_not_there'"),
    ("raise ImportError('libucp.so.0: cannot open shared object file')\n", "ImportError: libucp.so.0"),
])
def test_other_import_errors_propagate(tmp_path: Path, body: str, error: str) -> None:
    """A broken NIXL install is not 'NIXL missing': its import error reaches the caller."""
    (tmp_path / "nixl").mkdir()
    (tmp_path / "nixl" / "__init__.py").write_text(body)
    r = _python("""
        from kvstate.transport.nixl import load_nixl
        load_nixl()
    """, extra_path=tmp_path)
    assert r.returncode == 1
    assert error in r.stderr and "BackendUnavailable" not in r.stderr
