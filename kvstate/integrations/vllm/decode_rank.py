"""The decode side of one TP rank, in its worker process: the rank's bank, its exporter,
its inventory, and its link to the index.

- At registration the rank builds a bank of the configured size (the engine's layout,
  :mod:`.layout`), registers and advertises it, serves leases at a fixed socket name
  (``<source>.r<rank>``), and connects to the index in its scheduler process (a thread
  that retries until the scheduler side is up: vLLM builds workers first).
- Each step's :class:`~.orders.StoreOrder`\\ s are submitted with ``Bank.store`` at once.
  Their blocks enter the inventory (what leases pin) at submit, and the op engine itself
  sends the ``stored`` report as the store's last op ends (``Bank.store(report=...)``,
  armed inside the submit, before any op can end), from its own thread, on the rank's
  *report link*, a connection the index's native thread serves: the index advertises the
  blocks without waiting for this process's Python, whose GIL vLLM's worker holds while it
  busy-polls (up to 1 s after each step), nor for the scheduler process's. The index
  advertises nothing before that report, so no lease names a block still being written.
  When a store finishes, its request is reported finished so that vLLM frees its pages
  only then (:meth:`DecodeRank.finished`); a report the engine could not send (no link to
  the index yet, a full or lost report link) goes from here instead, on the main link,
  and failed blocks leave the inventory.
- The index's ``evict`` is answered with the keys the inventory dropped and those a lease
  still pins (it asks again later).
- Descriptors are re-advertised at half their time to live.
- A bank that drains (a lease expired: its importer may still read it, so the bank takes
  no new lease) is replaced once quiescent: a new bank of the same geometry gets the old
  one's blocks (one copy through host memory, nothing reads the old one any more), the
  old one is released, and the new one is advertised at the next generation, so stores
  and loads go on. Before, the rank refused every later store and lease (``draining``).

Nothing here raises into the engine once registered: a failed store is reported failed
(its blocks are not advertised) and its request still finishes.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Mapping
from typing import Any

from kvstate import channel as chan
from kvstate.channel.framing import pack
from kvstate.core.reasons import BusyReason, ChannelReason
from kvstate.core.errors import ChannelError, KvStateError, Busy, TransitionError
from kvstate.core.handles import HandleKind
from kvstate.integrations.vllm import wire
from kvstate.integrations.vllm.config import ConnectorConfig
from kvstate.integrations.vllm.hashing import Compat, source_id
from kvstate.integrations.vllm.layout import INVENTORY_GROUP, bank_blocks, bank_geometry
from kvstate.integrations.vllm.orders import StoreOrder
from kvstate.integrations.vllm.stats import Tally
from kvstate.reuse.inventory import Inventory
from kvstate.share.bank import Bank
from kvstate.share.exporter import Exporter
from kvstate.share.export_config import ExportConfig
from kvstate.share.transfer import TransferHandle
from kvstate.transport.host import HostTransport

log = logging.getLogger(__name__)

RETRY_S = 0.05


class DecodeRank:
    """See the module docstring."""

    def __init__(self, cfg: ConnectorConfig, compat: Compat, rank: int, kv_caches: Mapping[str, Any],
                 tally: Tally) -> None:
        self.cfg, self.compat, self.rank, self.tally = cfg, compat, rank, tally
        self.kv_caches = dict(kv_caches)
        self.num_blocks = bank_blocks(compat, cfg.retain_bytes)
        self.inventory = Inventory(budget_blocks=self.num_blocks)
        self.inventory.clear(INVENTORY_GROUP)  # the group exists from epoch 1 on
        self.nixl, transport, across = _transport(cfg, rank)
        try:
            self.exporter: Exporter[Any, Any, Any, Any, Any] = Exporter(
                ExportConfig(cfg.deployment, cfg.socket_dir, source_id(cfg.deployment, cfg.source), compat.tp,
                             lease_timeout_s=cfg.lease_timeout_s, descriptor_ttl_s=cfg.descriptor_ttl_s, **across),
                transport, name=cfg.exporter_name(rank), inventory=self.inventory)
        except BaseException:
            self.nixl = None
            raise
        self.bank: Bank[Any, Any, Any, Any, Any] = self.exporter.add_bank(rank, bank_geometry(compat, self.num_blocks))
        self.bank.register()
        self.bank.advertise()
        self.exporter.start()
        self._advertised_at = time.monotonic()
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}        # req id -> stores not finished on this rank
        self._done: set[str] = set()              # stores finished, not yet reported to vLLM
        self._announced: set[str] = set()         # vLLM named them finished, their stores still running here
        self._handles: list[TransferHandle] = []
        self._outbox: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._ch: chan.Channel | None = None      # the link to the index, once welcomed (under _lock)
        self._reports: chan.Channel | None = None  # the report link, while the index takes one (under _lock)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._link, name=f"kvstate-decode-r{rank}", daemon=True)
        self._thread.start()

    # -- stores -----------------------------------------------------------------------------

    def store(self, order: StoreOrder) -> None:
        with self._lock:
            self._pending[order.req_id] = self._pending.get(order.req_id, 0) + 1
        keys = list(order.keys)
        try:
            refused = set(self.inventory.store(INVENTORY_GROUP, keys).not_retained)
        except KvStateError as exc:
            log.error("kvstate: rank %d inventory refused blocks to store: %s", self.rank, exc)
            refused = set(keys)
        # cannot happen while the index assigns at most num_blocks blocks: reported failed
        ok = [k for k in keys if k not in refused]
        with self._lock:  # our own dup, taken under the lock: the link may close (and its number be reused)
            link = self._reports or self._ch
            sock = os.dup(link.fileno()) if link is not None else None
        try:
            # The report is armed inside the submit, before any op can end: a store that
            # ends at once is still reported by the op engine, not by this process's Python.
            report = None if sock is None else (
                sock, pack(wire.encode("stored", rank=self.rank, keys=ok, failed=sorted(refused)), 0, wire.LIMITS),
                pack(wire.encode("stored", rank=self.rank, keys=[], failed=keys), 0, wire.LIMITS))
            handle = self.bank.store(self.kv_caches, list(order.src_blocks), list(order.slots), report=report)
        except KvStateError as exc:
            log.warning("kvstate: rank %d could not store %s: %s", self.rank, order.req_id, exc)
            self._finish(order, frozenset(order.slots), 0, reported=False)
            return
        finally:
            if sock is not None:
                os.close(sock)  # the op engine keeps a dup of its own
        with self._lock:
            self._handles.append(handle)
        handle.add_done_callback(lambda h: self._stored(order, h))

    def _stored(self, order: StoreOrder, handle: TransferHandle) -> None:
        result = handle.result()
        failed = frozenset(order.slots) if result is None else result.failed_blocks
        if handle.report_status == "unsent":  # the link is gone or full: later stores report on the main link
            self._drop_report_link()
        self._finish(order, failed, 0 if result is None else result.bytes,
                     reported=handle.report_status in ("sent_ok", "sent_failed"))

    def _finish(self, order: StoreOrder, failed_slots: frozenset[int], nbytes: int, *, reported: bool) -> None:
        """The store ended: drop what failed from the inventory, report the outcome to the
        index unless the op engine did (``reported``), and let vLLM free the pages."""
        held = self.inventory.hashes(INVENTORY_GROUP)
        ok = [k for s, k in zip(order.slots, order.keys) if s not in failed_slots and k in held]
        bad = [k for k in order.keys if k not in ok]
        try:
            dropped = [k for k in bad if k in held]
            if dropped:  # never advertised (the index saw them fail), so no lease pins them
                self.inventory.remove(INVENTORY_GROUP, dropped)
        except KvStateError as exc:
            log.error("kvstate: rank %d could not drop failed blocks from its inventory: %s", self.rank, exc)
        try:
            if not reported:
                self._outbox.put(wire.encode("stored", rank=self.rank, keys=ok, failed=bad))
            self.tally.add("stores_ok" if not bad else "stores_failed")
            self.tally.add("bytes_stored", nbytes)
        finally:  # the request is done here whatever the report: vLLM frees its pages
            with self._lock:
                left = self._pending[order.req_id] - 1
                if left:
                    self._pending[order.req_id] = left
                else:
                    del self._pending[order.req_id]
                    self._done.add(order.req_id)

    def finished(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose stores all finished on this rank and that vLLM has named finished
        (it counts a request done once every rank reported it).

        Only ids with stores on this rank are remembered: vLLM names every finished request,
        most of which stored nothing (shorter than a block, prefix already kept). A request's
        store order and its id come in the same step's scheduler output, and vLLM binds the
        orders (:meth:`store`) before it asks this, so no store can follow its id."""
        # done() may run a store's callback (_stored takes the lock): poll outside the lock.
        with self._lock:
            polled = list(self._handles)
        ended = [h for h in polled if h.done()]
        with self._lock:
            self._handles = [h for h in self._handles if h not in ended]
            self._announced |= {r for r in finished_req_ids if r in self._pending or r in self._done}
            out = self._done & self._announced
            self._done -= out
            self._announced -= out
        for h in ended:
            h.close()
        return out

    def sizes(self) -> dict[str, int]:
        """Entries of every per-request structure of this rank (zero once every store vLLM
        named finished was reported), and the bank's leases and holds."""
        with self._lock:
            out = {"pending": len(self._pending), "done": len(self._done), "announced": len(self._announced),
                   "handles": len(self._handles)}
        out["leases"], out["holds"] = len(self.bank.leases), len(self.bank.holds)
        return out

    def busy(self) -> bool:
        """Stores in flight, or importers connected (lease requests are served by threads)."""
        with self._lock:
            pending = bool(self._pending or self._handles)
        return pending or self.exporter.connections() > 0

    # -- the link to the index ----------------------------------------------------------------

    def _link(self) -> None:
        path = self.cfg.index_path(self.cfg.source)
        while not self._stopping.is_set():
            try:
                ch = chan.connect(path, timeout=2.0, limits=wire.LIMITS)
            except (ChannelError, OSError):
                self._stopping.wait(RETRY_S)  # the scheduler side is not up yet
                continue
            try:
                if not self._serve(ch):
                    return  # refused for good (another rank holds ours, or an incompatible key)
            except ChannelError as exc:
                if not self._stopping.is_set():
                    log.info("kvstate: rank %d lost the index (%s); reconnecting", self.rank, exc)
            finally:
                with self._lock:
                    self._ch = None
                self._drop_report_link()
                ch.close()
            self._stopping.wait(RETRY_S)

    def _serve(self, ch: chan.Channel) -> bool:
        epoch = self.inventory.epoch(INVENTORY_GROUP) or 0
        ch.send(wire.encode("hello", rank=self.rank, tp=self.compat.tp, pid=os.getpid(), epoch=epoch,
                            compat=self.compat.as_dict()), timeout=2.0)
        with ch.recv(timeout=5.0) as msg:
            answer = wire.decode(msg.payload, "welcome", "refused")
        if answer["kind"] == "refused":
            log.error("kvstate: the index refused rank %d: %s (%s)", self.rank, answer["reason"], answer["detail"])
            return False
        reports = self._open_report_link()  # before the index can be ready: stores then use it
        self._advertise(ch, again=False)
        with self._lock:
            self._ch = ch  # stores from now on are reported by the op engine, on the report link if any
            self._reports = reports
        while not self._stopping.is_set():
            while True:
                try:
                    ch.send(self._outbox.get_nowait(), timeout=2.0)
                except queue.Empty:
                    break
            if self._replace_drained_bank():
                self._advertise(ch, again=False)
            elif time.monotonic() - self._advertised_at > self.cfg.descriptor_ttl_s / 2:
                self._advertise(ch, again=True)
            try:
                msg = ch.recv(timeout=0.02)
            except ChannelError as exc:
                if exc.reason is not ChannelReason.TIMEOUT:
                    raise
                continue
            with msg:
                cmd = wire.decode(msg.payload, "evict")
            self._evict(ch, cmd["keys"])
        return True

    def _open_report_link(self) -> chan.Channel | None:
        """The report link (see the module docstring), or None: the index refused it (not
        this rank's process any more, or tp above what its thread counts) or is gone."""
        try:
            ch = chan.connect(self.cfg.index_path(self.cfg.source), timeout=2.0, limits=wire.LIMITS)
        except (ChannelError, OSError) as exc:
            log.info("kvstate: rank %d has no report link (%s): it reports on its main link", self.rank, exc)
            return None
        try:
            ch.send(wire.encode("report_link", rank=self.rank), timeout=2.0)
            with ch.recv(timeout=2.0) as msg:
                answer = wire.decode(msg.payload, "linked")
            if answer["rank"] != self.rank:
                raise ChannelError(ChannelReason.PROTOCOL, f"linked as rank {answer['rank']}")
        except ChannelError as exc:
            ch.close()
            log.info("kvstate: rank %d has no report link (%s): it reports on its main link", self.rank, exc)
            return None
        return ch

    def _drop_report_link(self) -> None:
        with self._lock:
            reports, self._reports = self._reports, None
        if reports is not None:
            reports.close()

    def _advertise(self, ch: chan.Channel, again: bool) -> None:
        if again:
            self.bank.advertise()
            self._advertised_at = time.monotonic()
        ch.send(wire.encode("advertised", rank=self.rank, descriptor=self.exporter.descriptor(self.rank),
                            generation=self.bank.generation), timeout=2.0)

    def _replace_drained_bank(self) -> bool:
        """Replace a drained bank once it is quiescent (see the module docstring); True
        when a new one was advertised. A bank still leased, pinned or storing is left for
        the next round."""
        old: Bank[Any, Any, Any, Any, Any] = self.bank
        if old.state != "draining":
            return False
        try:
            old.fire("quiesce")
        except TransitionError:
            return False  # a lease, a pin or a store is left: the next round looks again
        try:
            blocks = bytes(old.view())  # what the inventory says is retained, kept for the new bank
            old.fire("release")
            new = self.exporter.replace_bank(self.rank)
            new.register()
            new.view()[:len(blocks)] = blocks
            del blocks
            new.advertise()
        except KvStateError as exc:
            log.error("kvstate: rank %d could not replace its drained bank: %s", self.rank, exc)
            return False
        self.bank = new
        self._advertised_at = time.monotonic()
        self.tally.add("banks_replaced")
        log.info("kvstate: rank %d replaced its drained bank (generation %d)", self.rank, new.generation)
        return True

    def _evict(self, ch: chan.Channel, keys: list[int]) -> None:
        removed, busy = [], []
        for key in keys:
            try:
                self.inventory.remove(INVENTORY_GROUP, [key])
                removed.append(key)
            except Busy as exc:
                if exc.reason is not BusyReason.BLOCKS:
                    raise
                busy.append(key)  # a lease pins it: the index asks again later
        ch.send(wire.encode("removed", rank=self.rank, keys=removed, busy=busy), timeout=2.0)

    # -- shutdown -------------------------------------------------------------------------------

    def close(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self._thread.join(2.0)
        self._drop_report_link()
        with self._lock:
            handles, self._handles = self._handles, []
        for h in handles:
            h.close()
        self.exporter.stop()
        try:
            self.exporter.drain(timeout)
        except KvStateError as exc:  # a prefill worker still holds a lease: its death ends it
            log.warning("kvstate: rank %d bank not drained at shutdown: %s", self.rank, exc)
            # its NIXL registration stays with the process's agent until the process ends


def _transport(cfg: ConnectorConfig, rank: int) -> tuple[Any, Any, dict[str, Any]]:
    """(NIXL agent or None, the exporter's transport, ExportConfig's cross-node fields):
    memfd banks for this node, or host banks registered with NIXL, their leases served over
    TCP at the rank's port (``listen`` + 1 + rank) for other nodes."""
    if not cfg.exports_nixl:
        return None, HostTransport(), {}
    from kvstate.integrations.vllm.nixl_agent import process_agent
    from kvstate.transport.nixl.exporting import NixlExportingHost

    nixl = process_agent()
    return nixl, NixlExportingHost(HostTransport(), nixl), {"handle_kind": HandleKind.NIXL,
                                                          "tcp_listen": cfg.lease_listen(rank)}

