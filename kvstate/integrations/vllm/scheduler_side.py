"""The connector's scheduler side, in vLLM's EngineCore process: plain values in, step
orders out. No vLLM import: :mod:`.connector` maps vLLM's calls onto these methods.

Decode (``kv_producer``/``kv_both``): :meth:`SchedulerSide.request_finished` names the
bank blocks for a finished request's full prefix blocks (:class:`~.slots.SlotTable`, in
the :class:`~.index.DecodeIndex` this process serves) and orders every rank to store them;
vLLM keeps the request's pages until every rank reported its stores finished.

Prefill (``kv_consumer``/``kv_both``), per request:

1. :meth:`SchedulerSide.match` (vLLM's ``get_num_new_matched_tokens``; it may be asked
   again for the same request, so it only remembers its answer): the reuse policy decides
   (off unless enabled), asking each decode source's index lazily within the lookup
   budget; the chosen source's descriptors (cached) are validated as a group here, before
   any load is promised. The answer is the tokens to load asynchronously, or None while
   a source's reply is on its way: every request running in the engine waits for the
   scheduling loop, so the questions of one step wait at most ``STEP_WAIT_S`` in all, and
   vLLM asks again at its next step (:mod:`.index_client`, "Questions in flight").
2. :meth:`SchedulerSide.allocated` (``update_state_after_alloc``): with vLLM's pages for
   those tokens, the group import starts through the :class:`Coordinator` this process
   hosts (it returns at once; every worker imports its own rank's part), or a live group
   whose lease already pins those blocks is shared; a load order goes to the workers.
3. :meth:`SchedulerSide.worker_output` (vLLM's aggregated ``finished_recving``, failed
   pages and the ranks' :class:`~.orders.LoadFailures`): the group is drained once no
   request uses it; a failed load is counted by reason in that step, and the source's
   cached descriptors are dropped.

Nothing here raises into the engine: every refusal is a miss or a rejection with a reason
(:mod:`.stats`), and the blocks are recomputed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence

import attrs

from kvstate.core.capabilities import MemoryKind
from kvstate.core.descriptor import decode_cached
from kvstate.core.errors import ConfigInvalid, DescriptorRejected, GroupRejected, KvStateError
from kvstate.core.reasons import DecisionReason
from kvstate.transport.native_rules import validate_group
from kvstate.integrations.vllm.config import ROUTE_KEY, ConnectorConfig, is_address, source_ref
from kvstate.integrations.vllm.hashing import Compat, block_key, prefix_hashes, root
from kvstate.integrations.vllm.index import DecodeIndex
from kvstate.integrations.vllm.index_client import Found, IndexClient, Refusal
from kvstate.integrations.vllm.layout import INVENTORY_GROUP, bank_blocks
from kvstate.integrations.vllm.orders import LoadFailures, LoadOrder, StepOrders, StoreOrder, failure_code
from kvstate.integrations.vllm.slots import SlotTable
from kvstate.integrations.vllm.stats import Tally
from kvstate.integrations.vllm.tp import SourceView, same_tp
from kvstate.integrations.vllm import wire
from kvstate.reuse.policy import Candidate, choose_transfer_source
from kvstate.share.coordinated_group import CoordinatedGroup
from kvstate.share.coordinator import Coordinator, CoordinatorConfig
from kvstate.share import part as part_mod
from kvstate.share.importer import BlockRequest

log = logging.getLogger(__name__)

#: Sources named by routers (``kv_transfer_params``) with a client kept at once.
MAX_ROUTED = 16
#: The longest the questions to decode indexes wait in one engine step, every request's
#: together (a native index answers in well under a millisecond). A reply not in by then
#: is read at a later step, until ``lookup_timeout_s`` after its question.
STEP_WAIT_S = 0.005


class _Pending(Exception):
    """A source's reply is on its way: vLLM asks again for the request at its next step."""


@attrs.define(eq=False)
class _Asking:
    """A request's questions so far: each source's lookup answer, once in."""

    hashes: list[bytes]                     # the prompt's prefix blocks', computed once
    answers: dict[str, Found | Refusal] = attrs.Factory(dict)
    sources: set[str] = attrs.Factory(set)  # every source asked: their tokens are forgotten at the end
    routed: bool = False                    # the router's source, if any, was looked at (and counted)
    first: str | None = None                # ...and is asked first


@attrs.frozen
class _Match:
    source: str
    first: int                      # the first block to load (the local prefix cache has those before)
    slots: tuple[int, ...]
    keys: tuple[int, ...]
    epochs: tuple[int, ...]
    descriptors: tuple[bytes, ...]


@attrs.define(eq=False)
class _Group:
    group: CoordinatedGroup
    source: str
    keys: frozenset[int]
    users: int = 0


@attrs.define(eq=False)
class _Active:
    """A request whose load was ordered, until every rank reported it finished: one with a
    group, or one refused before it had any (its order names why; the ranks report it
    failed)."""

    group: _Group | None
    pages: frozenset[int]
    failed: bool = False
    why: LoadFailures = LoadFailures()  # what the ranks said, over the steps until every rank finished
    done: bool = False                  # vLLM finished the request while its load was in flight


def failure_reason(group: CoordinatedGroup) -> str:
    """Why a coordinated group ended without loading: the first worker rejection's reason,
    the exporter's lease refusal code (``stale_incarnation``...), or the coordinator event."""
    if group.rejections:
        return str(group.rejections[0].reason.value)
    failure = group.failure
    if failure is None:
        return group.state
    code = failure_code(failure.detail)
    if code is not None and (code != "decode_gone" or failure.event == "part_failed"):
        return code
    return failure.event


class SchedulerSide:
    """See the module docstring. ``tp``: this engine's tensor-parallel size."""

    def __init__(self, cfg: ConnectorConfig, compat: Compat, engine_id: str, view: SourceView | None = None) -> None:
        self.cfg, self.compat = cfg, compat
        #: the decode sources' key and this engine's slices of their ranks (heterogeneous TP)
        self.view = same_tp(compat) if view is None else view
        self.tally = Tally()
        self.index: DecodeIndex | None = None
        self.coordinator: Coordinator | None = None
        self.clients: dict[str, IndexClient] = {}
        self._stores: list[StoreOrder] = []
        self._loads: list[LoadOrder] = []
        self._matches: dict[str, _Match] = {}
        self._asking: dict[str, _Asking] = {}   # requests with a question in flight or answered
        self.step_wait_s = STEP_WAIT_S            # and this step's wait left (_wait_left)
        # Every per-request entry below ends with the request: request_done, or the report of
        # its load when vLLM finished it while the load was in flight (sizes() shows them).
        self._active: dict[str, _Active] = {}     # req id -> its load, ordered and not yet reported finished
        self._groups: list[_Group] = []
        self._counted: set[str] = set()           # requests whose miss was counted
        self._failed: set[str] = set()            # live requests whose load failed: computed from then on
        # Per-layer loads (cfg.layer_loads) run in the step that orders them and never reach
        # finished_recving: ordered this step, then in the step whose output comes next.
        self._layer_ordered: list[str] = []
        self._layer_running: list[str] = []
        dep = cfg.deployment
        if cfg.producer:
            table = SlotTable(bank_blocks(compat, cfg.retain_bytes), compat.tp, lambda h, s: block_key(dep, h, s))
            self.index = DecodeIndex(cfg.index_path(cfg.source), compat, table, deployment=dep,
                                     tcp=cfg.listen if cfg.exports_nixl else None)
            self.index.start()
        if cfg.consumer:
            mixed = self.view.mixed
            self.coordinator = Coordinator(CoordinatorConfig(  # one part per slice: a rank at equal TP sizes
                dep, len(self.view.slices), cfg.socket_dir, name=cfg.coordinator_name(engine_id),
                phase_timeout_s=max(cfg.load_timeout_s / 2, 1.0), source_tp=self.view.compat.tp if mixed else 0,
                sources=tuple(s.src_rank for s in self.view.slices) if mixed else ()))
            self.coordinator.start()
            self.clients = {s: self._client(s) for s in cfg.sources}

    def _client(self, source: str) -> IndexClient:
        where = source if is_address(source) else self.cfg.index_path(source)
        return IndexClient(where, self.cfg.deployment, self.cfg.lookup_timeout_s)

    def _routed(self, route: object) -> str | None:
        """The source a router named in ``kv_transfer_params`` (asked first), with a client
        for it; None for none. A route that is not an address, or that this engine cannot
        read (transport host, or no NIXL agent in its workers), is counted and ignored."""
        if route is None:
            return None
        try:
            source = source_ref(ROUTE_KEY, route)
        except ConfigInvalid:
            self.tally.reason("routes_ignored", "malformed")
            return None
        if not self.cfg.reads_nixl and is_address(source):
            self.tally.reason("routes_ignored", "no_nixl")
            return None
        if source not in self.clients:
            routed = [s for s in self.clients if s not in self.cfg.sources]
            if len(routed) >= MAX_ROUTED:  # the oldest routed client goes; configured ones stay
                if any(g.source == routed[0] for g in self._groups):
                    self.tally.reason("routes_ignored", "busy")
                    return None
                self.clients.pop(routed[0]).close()
            self.clients[source] = self._client(source)
        return source

    @property
    def step_wait_s(self) -> float:
        """What a step's questions may wait, all together (tests that need a reply in the
        step that asks for it set more; from now on)."""
        return self._step_wait_s

    @step_wait_s.setter
    def step_wait_s(self, seconds: float) -> None:
        self._step_wait_s = self._wait_left = seconds

    @property
    def coordinator_path(self) -> str:
        assert self.coordinator is not None
        return str(self.coordinator.socket_path)

    # -- decode ---------------------------------------------------------------------------------

    def request_finished(self, req_id: str, tokens: Sequence[int], num_computed: int, block_ids: Sequence[int],
                         salt: str | None) -> bool:
        """Retain the request's full blocks; True when vLLM must keep its pages until the
        workers report the stores finished.

        Never for a request whose load is in flight (aborted in ``WAITING_FOR_REMOTE_KVS``):
        vLLM already counts its promised tokens as computed, but kvstate has not written
        those pages (and a failed load never will); and vLLM frees the request when the
        load reports, so a delayed free would later report an id vLLM no longer knows."""
        if self.index is None or req_id in self._active:
            return False
        bs = self.compat.block_size
        # At most the first wire.MAX_BLOCKS blocks: their report must fit one message.
        full = min(min(num_computed, len(tokens)) // bs, len(block_ids), wire.MAX_BLOCKS)
        if full == 0:
            return False
        hashes = prefix_hashes(self.cfg.deployment, root(self.cfg.deployment, self.compat, salt), tokens[:full * bs],
                               bs)
        reserved = self.index.reserve(hashes)
        counts = self.index.table.counts()
        self.tally.gauge("retained_blocks", counts["stored"])
        self.tally.gauge("free_blocks", counts["free"])
        if not reserved:
            return False
        self.tally.add("blocks_retained", len(reserved))
        self._stores.append(StoreOrder(req_id, tuple(block_ids[r.index] for r in reserved),
                                       tuple(r.slot for r in reserved), tuple(r.key for r in reserved)))
        return True

    # -- prefill --------------------------------------------------------------------------------

    def _miss(self, req_id: str, reason: str) -> int:
        log.debug("t=%.6f %s: miss (%s)", time.monotonic(), req_id, reason)
        if req_id not in self._counted:
            self._counted.add(req_id)
            self.tally.reason("misses", reason)
        self._matches.pop(req_id, None)
        return 0

    def match(self, req_id: str, tokens: Sequence[int], num_tokens: int, local_tokens: int,
              salt: str | None, route: object = None) -> int | None:
        """Tokens beyond ``local_tokens`` to load for this prompt (0: compute them; None: a
        reply is on its way, ask again at the next step). ``route``: the
        ``kv_transfer_params`` entry a router named a source with (asked first)."""
        if self.coordinator is None:
            return 0
        settings, bs = self.cfg.policy, self.compat.block_size
        if not settings.enable_decode_to_prefill_reuse:
            return self._miss(req_id, DecisionReason.REUSE_DISABLED.value)
        if req_id in self._failed:
            return self._miss(req_id, "after_failed_load")  # vLLM asks again after a failure: compute
        local, most = local_tokens // bs, (num_tokens - 1) // bs  # vLLM computes the last token itself
        if most <= local:
            return self._miss(req_id, "nothing_beyond_local")
        asking = self._asking.get(req_id)
        if asking is None or len(asking.hashes) != most:  # else asked before: a reply was on its way
            if asking is not None:  # asked again with another length: those answers counted other hashes
                self._end_asking(req_id)
            source = self.view.compat  # the decode engines' key: they named the blocks with it
            asking = self._asking[req_id] = _Asking(prefix_hashes(
                self.cfg.deployment, root(self.cfg.deployment, source, salt), tokens[:most * bs], bs))
        try:
            n = self._ask(req_id, asking, local, route)
        except _Pending:
            return None
        self._end_asking(req_id)
        return n

    def _spent(self, asking: _Asking, name: str, started: float) -> None:
        """A question to ``name`` waited since ``started``: out of this step's wait."""
        asking.sources.add(name)
        self._wait_left = max(0.0, self._wait_left - (time.monotonic() - started))

    def _end_asking(self, req_id: str) -> None:
        asking = self._asking.pop(req_id, None)
        for name in asking.sources if asking is not None else ():
            client = self.clients.get(name)
            if client is not None:
                client.forget((req_id, "lookup"))
                client.forget((req_id, "descriptors"))

    def _ask(self, req_id: str, asking: _Asking, local: int, route: object) -> int:
        """match, from the sources' replies (those in before are not asked again)."""
        settings, bs, source, hashes = self.cfg.policy, self.compat.block_size, self.view.compat, asking.hashes
        found: dict[str, Found] = {}
        refused: list[Refusal] = []

        if not asking.routed:
            asking.routed, asking.first = True, self._routed(route)
        first = asking.first if asking.first in self.clients else None
        order = ([first] if first is not None else []) + [s for s in self.clients if s != first]

        def lookup(name: str, wait_s: float) -> bool:
            """Ask ``name`` (once) and take its answer if it came within ``wait_s``."""
            if name not in asking.sources:
                log.debug("t=%.6f %s: asking %r", time.monotonic(), req_id, name)
            started = time.monotonic()
            reply = self.clients[name].lookup(source, hashes, token=(req_id, "lookup"), wait_s=wait_s)
            self._spent(asking, name, started)
            if reply is None:
                return False
            asking.answers[name] = reply
            self.tally.add("lookups")
            if isinstance(reply, Refusal):
                log.debug("t=%.6f %s: %r refused (%s)", time.monotonic(), req_id, name, reply.reason)
            else:
                log.debug("t=%.6f %s: %r has %d of %d block(s)", time.monotonic(), req_id, name, reply.blocks,
                          len(hashes))
            return True

        def candidates() -> Iterator[Candidate]:
            # Every source's question goes out at once: the decision waits for the slowest
            # answer, not for their sum. The policy then reads them in order.
            for name in order:
                if name not in asking.sources:
                    lookup(name, 0.0)
            for name in order:
                if name not in asking.answers and not lookup(name, self._wait_left):
                    raise _Pending
                answer = asking.answers[name]
                if isinstance(answer, Refusal):
                    refused.append(answer)
                    continue
                found[name] = answer
                yield Candidate(name, answer.blocks, MemoryKind.HOST)

        decision = choose_transfer_source(local, candidates(), settings, block_tokens=bs)
        if not decision.recommended or decision.source is None:
            reason = decision.reason.value
            if decision.reason is DecisionReason.NO_ELIGIBLE_SOURCE and not found and refused:
                reason = refused[0].reason  # why the lookups failed: unreachable, tp_mismatch, ...
            return self._miss(req_id, reason)
        name = decision.source.source_id
        hit, client = found[name], self.clients[name]
        if not hit.names(self.cfg.deployment, hashes, local):
            # Another prompt's blocks (an index's bug, or a reply read for another question):
            # never leased. The replies after it on that connection are not trusted either.
            client.distrust("a lookup's answer named blocks of another prompt")
            return self._miss(req_id, "protocol")
        log.debug("t=%.6f %s: found %d block(s) at %r", time.monotonic(), req_id, hit.blocks, name)
        started = time.monotonic()
        descriptors = client.descriptors(source, hit.generation, token=(req_id, "descriptors"), wait_s=self._wait_left)
        self._spent(asking, name, started)
        if descriptors is None:
            raise _Pending
        log.debug("t=%.6f %s: descriptors of %r", time.monotonic(), req_id, name)
        if isinstance(descriptors, Refusal):
            return self._miss(req_id, descriptors.reason)
        problem = self._precheck(descriptors)
        if problem is not None:
            client.drop_descriptors()
            self.tally.reason("rejections", problem)
            return self._miss(req_id, "rejected")
        # At most what one lease may pin (a longer prompt loads its first blocks, computes the rest).
        end = min(hit.blocks, local + part_mod.MAX_REQUEST_HASHES)
        self._matches[req_id] = _Match(name, local, hit.slots[local:end], hit.keys[local:end], hit.epochs,
                                       descriptors)
        return (end - local) * bs

    def _precheck(self, descriptors: Sequence[bytes]) -> str | None:
        """The whole group's validation, as the coordinator will do it: the first reason."""
        assert self.coordinator is not None
        try:
            # The objects the coordinator will decode again (decode_cached): one MAC check each.
            decoded = [decode_cached(d, self.cfg.deployment) for d in descriptors]
            tp = self.view.compat.tp
            if len(decoded) != tp or any(d.tp != tp for d in decoded):
                return "tp_mismatch"
            validate_group(decoded, self.coordinator.expectation())
        except DescriptorRejected as exc:
            return str(exc.reason.value)
        except GroupRejected as exc:
            return str(exc.reason.value)  # the first problem's (a group is never rejected without one)
        return None

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM allocated the request's pages (``block_ids``: all of them, in order)."""
        m = self._matches.pop(req_id, None)
        if m is None or num_external_tokens <= 0 or req_id in self._active:
            return
        bs = self.compat.block_size
        n = num_external_tokens // bs
        dst = tuple(block_ids[m.first:m.first + n])
        if n != len(m.slots) or len(dst) != n or num_external_tokens % bs:
            self.tally.reason("rejections", "block_mismatch")
            return self._order_refused(req_id, m, dst, "block_mismatch")
        shared = self._live_group(m)
        if shared is None:
            assert self.coordinator is not None
            try:
                group = self.coordinator.start_group(m.descriptors, blocks=BlockRequest(INVENTORY_GROUP, m.epochs,
                                                                                        m.keys))
            except KvStateError as exc:  # GroupRejected: its first rule; GroupFailed: the event; else the reason
                return self._refused(req_id, m, dst, exc.reason.value)
            shared = _Group(group, m.source, frozenset(m.keys))
            self._groups.append(shared)
        shared.users += 1
        self._active[req_id] = _Active(shared, frozenset(dst))
        self.tally.add("hits")
        self.tally.add("tokens_matched", num_external_tokens)
        self._loads.append(LoadOrder(req_id, shared.group.gid, m.slots, dst))
        log.debug("t=%.6f %s: ordered, group %s", time.monotonic(), req_id, shared.group.gid)
        if self.cfg.layer_loads:
            self._layer_ordered.append(req_id)

    def _refused(self, req_id: str, m: _Match, dst: tuple[int, ...], why: str) -> None:
        self.clients[m.source].drop_descriptors()
        self.tally.reason("rejections", why)
        log.warning("kvstate: load of %s from %r refused (%s): recomputing", req_id, m.source, why)
        self._order_refused(req_id, m, dst, why)

    def _order_refused(self, req_id: str, m: _Match, dst: tuple[int, ...], why: str) -> None:
        """A load order without a group: every rank reports it failed, and until then it is
        in flight like any other (vLLM waits for it; its pages hold nothing)."""
        self._active[req_id] = _Active(None, frozenset(dst), failed=True)
        self._loads.append(LoadOrder(req_id, None, m.slots, dst, why))
        if self.cfg.layer_loads:
            self._layer_ordered.append(req_id)

    def _live_group(self, m: _Match) -> _Group | None:
        """A group of the same source whose lease already pins every block wanted."""
        for g in self._groups:
            if g.source == m.source and g.group.state in ("checking", "importing", "ready") \
                    and g.keys.issuperset(m.keys):
                return g
        return None

    def worker_output(self, finished: Sequence[str], invalid_pages: set[int],
                      failures: LoadFailures = LoadFailures()) -> None:
        """What vLLM aggregated from the workers this step: loads every rank finished, pages
        some rank failed to load (possibly in an earlier step than the finish), and why.
        Per-layer loads finish with the output of the step that ran them."""
        finished = [*finished, *self._layer_running]
        self._layer_running = []
        if invalid_pages:
            for active in self._active.values():
                active.failed = active.failed or not active.pages.isdisjoint(invalid_pages)
        for item in failures.reasons:
            loading = self._active.get(item[0])
            if loading is not None:
                loading.why = loading.why.merge(LoadFailures((item,)))
        for req_id in finished:
            log.debug("t=%.6f %s: every rank finished its load", time.monotonic(), req_id)
            self._counted.discard(req_id)
            a = self._active.pop(req_id, None)
            if a is None:
                continue
            if a.failed and not a.done:
                self._failed.add(req_id)  # vLLM asks again for the request: it is computed
            g = a.group
            if g is None:
                continue                  # refused before it had a group: counted then
            g.users -= 1
            if a.failed:
                self._load_failed(req_id, g, a.why.of(req_id))
            if g.users == 0:
                self._drain(g)

    def _load_failed(self, req_id: str, g: _Group, rank_says: str | None) -> None:
        """Count a failed load by reason: a rank's own cause (sent with the failure), else
        what the coordinator learned, else ``load_failed``."""
        self.clients[g.source].drop_descriptors()
        group = g.group
        if rank_says is not None and not rank_says.startswith("share_"):
            why = rank_says                     # the rank's own cause
        elif group.failure is not None or group.rejections:
            why = failure_reason(group)         # another rank's, as the coordinator learned it
        else:
            why = rank_says or "load_failed"
        self.tally.reason("rejections", why)
        detail = group.failure.detail if group.failure is not None else ""
        log.warning("kvstate: load of %s from %r failed (%s%s): its blocks are recomputed", req_id, g.source, why,
                    f": {detail}" if detail else "")

    def _drain(self, g: _Group) -> None:
        group: CoordinatedGroup = g.group
        with group.locked():
            if group.may("drain"):
                group.fire("drain")  # the workers drain and close their parts; nothing waits here
        self._groups = [x for x in self._groups if x is not g]

    def request_done(self, req_id: str) -> None:
        """vLLM finished the request (its load, if any, still reports through worker_output,
        which then forgets it: vLLM finishes a request before it hands over the connector
        output that fails its load, under ``kv_load_failure_policy="fail"`` or an abort)."""
        self._matches.pop(req_id, None)
        self._end_asking(req_id)
        self._failed.discard(req_id)
        loading = self._active.get(req_id)
        if loading is None:
            self._counted.discard(req_id)
        else:
            loading.done = True

    # -- every step -----------------------------------------------------------------------------

    def step_orders(self, idle: bool = False) -> StepOrders:
        orders = StepOrders(tuple(self._stores), tuple(self._loads), idle)
        self._stores, self._loads = [], []
        self._wait_left = self._step_wait_s
        self._layer_running += self._layer_ordered
        self._layer_ordered = []
        return orders

    def pending(self) -> int:
        return len(self._active)

    def sizes(self) -> dict[str, int]:
        """Entries of every per-request (and per-group) structure of this side: all zero
        once no request is in the engine and every load and store reported."""
        out = {"matches": len(self._matches), "asking": len(self._asking),
               "questions": sum(c.in_flight() for c in self.clients.values()),
               "active": len(self._active), "groups": len(self._groups),
               "counted": len(self._counted), "failed": len(self._failed),
               "store_orders": len(self._stores), "load_orders": len(self._loads),
               "layer_loads": len(self._layer_ordered) + len(self._layer_running)}
        if self.coordinator is not None:
            out["coordinator_live_groups"] = sum(1 for g in list(self.coordinator.groups.values())
                                                 if not g.is_terminal)
        if self.index is not None:
            out["index_storing"] = self.index.table.counts()["storing"]
        return out

    def close(self) -> None:
        if self.coordinator is not None:
            self.coordinator.close()
        for c in self.clients.values():
            c.close()
        if self.index is not None:
            self.index.close()
