"""The connector's settings: ``kv_connector_extra_config``, parsed strictly. Pure.

vLLM hands the connector a plain dict in every process of an engine (front end,
EngineCore, each worker). :func:`parse` turns it into a :class:`ConnectorConfig` or raises
:class:`~kvstate.core.errors.ConfigInvalid` naming the key: an unknown key, a value of the
wrong type or range, or a missing deployment key. A refused config stops the engine at
start-up, which is where a wrong setting should surface; nothing here raises later.

The deployment key is never taken from the dict itself: vLLM logs its whole config at
start-up, so a key there would end up in logs. It comes from a file
(``deployment_key_file``: 32 raw bytes or 64 hex digits, owned by this user, no access for
group or others) or from the environment variable ``KVSTATE_DEPLOYMENT_KEY`` (64 hex
digits).

Every key, its default and its meaning are listed in :data:`KEYS` and in docs/vllm.md (a
test checks that the two agree).
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from kvstate.core.errors import ConfigInvalid
from kvstate.core.reasons import ConfigReason
from kvstate.core.identity import DEPLOYMENT_KEY_BYTES, Deployment
from kvstate.reuse.policy import ReuseSettings

KEY_ENV = "KVSTATE_DEPLOYMENT_KEY"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
#: HOST:PORT: a DNS name, an IPv4 address or a bracketed IPv6 address, then a port.
_HOSTPORT = re.compile(r"([A-Za-z0-9_.-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]):([0-9]{1,5})")
TCP = "tcp://"
TRANSPORTS = ("auto", "host", "nixl")
#: The key of ``kv_transfer_params`` by which a router names the decode engine to load from.
ROUTE_KEY = "kvstate_source"
#: Hosts that bind every interface: an address others must reach cannot be one.
_WILDCARDS = frozenset({"0.0.0.0", "[::]"})

#: Roles that retain finished requests' KV (decode side) and that load it (prefill side).
PRODUCERS = ("kv_producer", "kv_both")
CONSUMERS = ("kv_consumer", "kv_both")

#: key -> (default, meaning). The default ``None`` of ``socket_dir`` means
#: ``/tmp/kvstate-<uid>-<deployment>``.
KEYS: Mapping[str, tuple[object, str]] = {
    "deployment": ("kvstate", "deployment name; engines share KV only within one deployment"),
    "deployment_key_file": (None, "file holding the deployment's 32-byte key (else $KVSTATE_DEPLOYMENT_KEY)"),
    "socket_dir": (None, "private directory (0700) for the control sockets of every engine of the deployment"),
    "source": ("decode", "decode side: the name this engine's retained KV is looked up by"),
    "sources": (["decode"], "prefill side: the decode sources asked (all at once; their answers read in this "
                            "order): names (this node) or tcp://HOST:PORT (a decode engine's listen address, on any node)"),
    "transport": ("auto", "how bank bytes move: auto (decode: NIXL when listen is set, else memfd; prefill: "
                          "NIXL for sources given by address), host (memfd, this node only) or nixl (NIXL over UCX)"),
    "listen": (None, "decode side: HOST:PORT other nodes reach this engine at: its index at PORT, rank r's "
                     "leases at PORT+1+r (null: this node only)"),
    "retain_bytes": (256 << 20, "decode side: bytes of KV retained per TP rank (the bank's size)"),
    "policy": ({}, "prefill side: reuse settings (kvstate.reuse.policy); reuse is off unless enabled here"),
    "load_timeout_s": (10.0, "prefill side: how long a load may wait for its shares after it was ordered, and how "
                             "long its transfer may run; past either it fails (and is recomputed)"),
    "lookup_timeout_s": (0.5, "prefill side: the most one inventory lookup may wait for its answer (the "
                              "request waits; the engine's step does not)"),
    "lease_timeout_s": (30.0, "decode side: a lease not renewed or returned this long ends"),
    "descriptor_ttl_s": (3600.0, "decode side: descriptors expire after this; re-advertised at half"),
    "model_id": (None, "the model's identity in the compatibility key (default: vLLM's model name)"),
    "source_tp": (None, "prefill side: the TP size of the decode sources (null: this engine's); another size "
                        "opts into heterogeneous TP: each rank loads its KV heads from the decode ranks holding them"),
    "layer_loads": (False, "prefill side: load layer by layer in the forward pass (each layer's attention waits "
                           "for that layer only) instead of before the request runs"),
    "gil_switch_interval_s": (None, "every engine process with the connector: Python's thread switch interval, "
                                    "lowered to this (null: leave it)"),
}

#: The most ranks a decode engine's ``listen`` leaves ports for (PORT+1 .. PORT+MAX_TP).
MAX_TP = 64

#: The most ``gil_switch_interval_s`` may be: Python's own default (the setting only lowers it).
MAX_SWITCH_INTERVAL_S = 0.005


def _name(field: str, value: object) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ConfigInvalid.of(field, f"must be 1-64 characters of A-Z a-z 0-9 _ . -, not {value!r:.60}")
    return value


def host_port(field: str, value: object) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port), a port in 1..65535; ConfigInvalid otherwise."""
    m = _HOSTPORT.fullmatch(value) if isinstance(value, str) else None
    if m is None or m.group(1) in _WILDCARDS or not 0 < int(m.group(2)) < 65536:
        raise ConfigInvalid.of(field, f"must be HOST:PORT with a port in 1..65535 and a host others reach this "
                               f"one at (not a wildcard), not {value!r:.80}")
    return m.group(1).strip("[]"), int(m.group(2))


def is_address(source: str) -> bool:
    return source.startswith(TCP)


def source_ref(field: str, value: object) -> str:
    """A source as a name (this node) or ``tcp://HOST:PORT`` (any node), checked."""
    if isinstance(value, str) and is_address(value):
        host, port = host_port(field, value[len(TCP):])
        return f"{TCP}{f'[{host}]' if ':' in host else host}:{port}"
    return _name(field, value)


def _seconds(field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e6:
        raise ConfigInvalid.of(field, f"must be a number of seconds in (0, 1e6), not {value!r:.60}")
    return float(value)


#: The longest key file read: the key as hex, with room for whitespace around it.
MAX_KEY_FILE_BYTES = 4096


def _key_from_file(path: Path) -> bytes:
    """The key in ``path``, checked before it is read: a regular file of this uid that
    grants group and others nothing, at most MAX_KEY_FILE_BYTES (opened without blocking,
    so a FIFO or a device is refused, not read; a symlink to such a file, as secret mounts
    make, is fine)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigInvalid.of("deployment_key_file", f"{path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_KEY_FILE_BYTES:
            raise ConfigInvalid.of("deployment_key_file", f"{path} must be a regular file of at most "
                                   f"{MAX_KEY_FILE_BYTES} bytes")
        if st.st_uid != os.getuid() or st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigInvalid.of("deployment_key_file", f"{path} must belong to uid {os.getuid()} and grant group "
                                   f"and others nothing (mode {stat.S_IMODE(st.st_mode):o})")
        raw = os.read(fd, MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigInvalid.of("deployment_key_file", f"{path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(raw) == DEPLOYMENT_KEY_BYTES:
        return raw
    return _key_from_hex("deployment_key_file", raw.decode("ascii", "replace").strip())


def _key_from_hex(field: str, text: str) -> bytes:
    try:
        key = bytes.fromhex(text)
    except ValueError:
        key = b""
    if len(key) != DEPLOYMENT_KEY_BYTES:
        raise ConfigInvalid.of(field, f"must hold {DEPLOYMENT_KEY_BYTES} raw bytes or {2 * DEPLOYMENT_KEY_BYTES} "
                               "hex digits")
    return key


@attrs.frozen
class ConnectorConfig:
    """One engine's connector settings (see :data:`KEYS`)."""

    role: str
    deployment: Deployment
    socket_dir: Path
    source: str
    sources: tuple[str, ...]
    retain_bytes: int
    policy: ReuseSettings
    load_timeout_s: float
    lookup_timeout_s: float
    lease_timeout_s: float
    descriptor_ttl_s: float
    model_id: str | None
    gil_switch_interval_s: float | None
    source_tp: int | None = None
    layer_loads: bool = False
    transport: str = "auto"
    listen: tuple[str, int] | None = None

    @property
    def producer(self) -> bool:
        return self.role in PRODUCERS

    @property
    def consumer(self) -> bool:
        return self.role in CONSUMERS

    @property
    def exports_nixl(self) -> bool:
        """Decode side: banks exported through NIXL, leases served over TCP (other nodes)."""
        return self.producer and self.listen is not None and self.transport != "host"

    @property
    def reads_nixl(self) -> bool:
        """Prefill side: the workers read NIXL banks (an agent per rank)."""
        return self.consumer and (self.transport == "nixl"
                                  or (self.transport == "auto" and any(map(is_address, self.sources))))

    def check_remote(self, mixed_tp: bool) -> None:
        """Refuse what a prefill engine reading other nodes' banks cannot do: a remote load
        READs whole bank blocks into staging and scatters every head at once, so there are no
        head slices (``mixed_tp``: ``source_tp`` is not this engine's size) and no per-layer
        waits. Both are same-node only for now (issue 30 leaves them for later)."""
        if not self.reads_nixl:
            return
        if mixed_tp:
            raise ConfigInvalid.of("source_tp", "heterogeneous TP is same-node only: this engine reads banks of "
                                   "other nodes (transport nixl, or a source by address)")
        if self.layer_loads:
            raise ConfigInvalid.of("layer_loads", "per-layer loads are same-node only: this engine reads banks "
                                   "of other nodes (transport nixl, or a source by address)")

    def index_path(self, source: str) -> Path:
        """The decode source's inventory socket (served by its scheduler side)."""
        return self.socket_dir / f"{source}.index.sock"

    def index_address(self) -> str | None:
        """Decode side: the TCP address its index serves other nodes at."""
        return None if self.listen is None or not self.exports_nixl else self.tcp_address(0)

    def tcp_address(self, offset: int) -> str:
        assert self.listen is not None
        host, port = self.listen
        return f"{TCP}{f'[{host}]' if ':' in host else host}:{port + offset}"

    def lease_listen(self, rank: int) -> tuple[str, int] | None:
        """Decode side: where rank ``rank`` serves leases over TCP (None: this node only)."""
        if self.listen is None or not self.exports_nixl:
            return None
        return self.listen[0], self.listen[1] + 1 + rank

    def exporter_name(self, rank: int) -> str:
        """The decode rank's exporter socket name: fixed per source and rank, so a restarted
        engine serves at the same path and refuses its predecessor's descriptors as stale."""
        return f"{self.source}.r{rank}"

    def coordinator_name(self, engine_id: str) -> str:
        return f"p-{re.sub(r'[^A-Za-z0-9]', '', engine_id)[:12]}"


def parse(extra: Mapping[str, Any] | None, role: str, environ: Mapping[str, str] | None = None) -> ConnectorConfig:
    """The settings in ``kv_connector_extra_config`` for ``role`` (vLLM's ``kv_role``)."""
    if role not in ("kv_producer", "kv_consumer", "kv_both"):
        raise ConfigInvalid.of("kv_role", f"must be kv_producer, kv_consumer or kv_both, not {role!r:.40}")
    if extra is not None and not isinstance(extra, Mapping):
        raise ConfigInvalid.of("kv_connector_extra_config",
                               f"must be a mapping of settings, not {type(extra).__name__}")
    given = dict(extra or {})
    unknown = sorted(set(given) - set(KEYS), key=str)
    if unknown:
        raise ConfigInvalid.of(str(unknown[0]), f"unknown key; the keys are {sorted(KEYS)}")
    v: dict[str, Any] = {k: given.get(k, default) for k, (default, _) in KEYS.items()}
    env = os.environ if environ is None else environ

    name = _name("deployment", v["deployment"])
    if v["deployment_key_file"] is not None:
        if not isinstance(v["deployment_key_file"], str):
            raise ConfigInvalid.of("deployment_key_file", "must be a path")
        key = _key_from_file(Path(v["deployment_key_file"]))
    elif KEY_ENV in env:
        key = _key_from_hex(KEY_ENV, env[KEY_ENV].strip())
    else:
        raise ConfigInvalid.of("deployment_key_file", f"no deployment key: set deployment_key_file or ${KEY_ENV} "
                               "(the same key on every engine of the deployment)")

    socket_dir = v["socket_dir"]
    if socket_dir is None:
        socket_dir = f"/tmp/kvstate-{os.getuid()}-{name}"
    if not isinstance(socket_dir, str) or not os.path.isabs(socket_dir):
        raise ConfigInvalid.of("socket_dir", f"must be an absolute path, not {socket_dir!r:.80}")

    sources = v["sources"]
    if not isinstance(sources, (list, tuple)) or not sources:
        raise ConfigInvalid.of("sources", "must be a non-empty list of source names")
    retain = v["retain_bytes"]
    if isinstance(retain, bool) or not isinstance(retain, int) or not 1 <= retain <= 1 << 44:
        raise ConfigInvalid.of("retain_bytes", f"must be an int in 1..2**44, not {retain!r:.40}")
    policy = v["policy"]
    if not isinstance(policy, Mapping):
        raise ConfigInvalid.of("policy", "must be a mapping of reuse settings (docs/policy.md)")
    try:
        settings = ReuseSettings.from_mapping(policy, source="kv_connector_extra_config.policy")
    except ConfigInvalid as exc:
        if exc.reason not in (ConfigReason.UNKNOWN_SETTING, ConfigReason.INVALID_SETTING):
            raise
        raise ConfigInvalid.of("policy", str(exc)) from None
    model_id = v["model_id"]
    if model_id is not None and (not isinstance(model_id, str) or not model_id):
        raise ConfigInvalid.of("model_id", "must be a non-empty string")
    switch = v["gil_switch_interval_s"]
    if switch is not None and (isinstance(switch, bool) or not isinstance(switch, (int, float))
                               or not 0 < switch <= MAX_SWITCH_INTERVAL_S):
        raise ConfigInvalid.of("gil_switch_interval_s", f"must be null or seconds in (0, {MAX_SWITCH_INTERVAL_S}], "
                               f"not {switch!r:.40}")

    source_tp = v["source_tp"]
    if source_tp is not None and (isinstance(source_tp, bool) or not isinstance(source_tp, int)
                                  or not 1 <= source_tp <= 64):
        raise ConfigInvalid.of("source_tp", f"must be null or a TP size in 1..64, not {source_tp!r:.40}")

    layer_loads = v["layer_loads"]
    if not isinstance(layer_loads, bool):
        raise ConfigInvalid.of("layer_loads", f"must be true or false, not {layer_loads!r:.40}")

    transport = v["transport"]
    if transport not in TRANSPORTS:
        raise ConfigInvalid.of("transport", f"must be one of {', '.join(TRANSPORTS)}, not {transport!r:.40}")
    listen = None if v["listen"] is None else host_port("listen", v["listen"])
    if listen is not None and listen[1] + 1 + MAX_TP > 65535:
        raise ConfigInvalid.of("listen", f"port {listen[1]} leaves no room for the ranks' ports after it")
    if role in PRODUCERS and transport == "nixl" and listen is None:
        raise ConfigInvalid.of("listen", "a decode engine with transport nixl serves other nodes: give the "
                               "HOST:PORT they reach it at")

    return ConnectorConfig(
        role=role, transport=transport, listen=listen, deployment=Deployment(name, key), socket_dir=Path(os.path.normpath(socket_dir)),
        source=_name("source", v["source"]),
        sources=tuple(source_ref(f"sources[{i}]", s) for i, s in enumerate(sources)),
        retain_bytes=retain, policy=settings,
        load_timeout_s=_seconds("load_timeout_s", v["load_timeout_s"]),
        lookup_timeout_s=_seconds("lookup_timeout_s", v["lookup_timeout_s"]),
        lease_timeout_s=_seconds("lease_timeout_s", v["lease_timeout_s"]),
        descriptor_ttl_s=_seconds("descriptor_ttl_s", v["descriptor_ttl_s"]),
        model_id=model_id, gil_switch_interval_s=None if switch is None else float(switch), source_tp=source_tp,
        layer_loads=layer_loads,
    )
