"""Issue 14, class 9: the reuse gates are enforced where the data moves, not only advised.

Reuse is off by default: an importer that was not enabled refuses to import, before it
decodes a descriptor, connects or opens anything. A GPU import (a transport over device
memory) also needs GPU reuse and a deployment profile admitted with GPU reuse allowed
(kvstate.reuse.profile.admit) that publishes this very transport.
"""

from __future__ import annotations

import threading
from typing import Any

import attrs
import pytest

from conftest import DEPLOYMENT, GEOMETRY, make_exporter
from kvstate.core.capabilities import Capabilities, FabricTrial, MemoryKind, Scope
from kvstate.core.errors import ReuseRefused
from kvstate.core.reasons import DecisionReason
from kvstate.core.handles import HandleKind
from kvstate.reuse.policy import DecisionReason, ReuseSettings
from kvstate.reuse.profile import (PROTOCOL_VERSION, DeploymentProfile, PublishedCapabilities, TransportCapabilities,
                                   admit)
from kvstate.share.importer import ImportConfig, Importer
from kvstate.transport.host import HostTransport

GPU_ON = ReuseSettings(enable_decode_to_prefill_reuse=True, enable_decode_to_prefill_gpu_reuse=True)


class Touching:
    """The real host transport, recording every call (nothing may be touched when refused)."""

    def __init__(self, inner: HostTransport, memory: MemoryKind = MemoryKind.HOST, name: str = "host") -> None:
        self._inner, self.name, self.memory = inner, name, memory
        self.calls: list[str] = []
        self._lock = threading.Lock()

    @property
    def capabilities(self) -> Capabilities:
        return attrs.evolve(self._inner.capabilities, memory_kinds=frozenset({self.memory}))

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._inner, name)
        if not callable(target) or name in ("granularity", "device_uuid"):
            return target

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.calls.append(name)
            return target(*args, **kwargs)
        return call


def admission(profile: DeploymentProfile, transport: str, memory: MemoryKind) -> Any:
    kinds = frozenset({HandleKind.POSIX_FD}) if memory is MemoryKind.DEVICE else frozenset({HandleKind.MEMFD})
    caps = Capabilities(handle_kinds=kinds, memory_kinds=frozenset({memory}), scopes=frozenset({Scope.SAME_NODE}))
    published = PublishedCapabilities(device_uuids=(b"\x11" * 16,), handle_kinds=kinds, fabric_trial=FabricTrial.NOT_RUN,
                                      transports=(TransportCapabilities(transport, caps),),
                                      geometry_fingerprint=GEOMETRY.fingerprint(), protocol_version=PROTOCOL_VERSION)
    return admit(profile, published)


def test_reuse_is_off_by_default_and_the_importer_refuses(transport: HostTransport) -> None:
    ex = make_exporter(2, transport, name="gate-off")
    touching = Touching(transport)
    importer = Importer(ImportConfig(DEPLOYMENT), touching)  # type: ignore[arg-type]
    try:
        assert ImportConfig(DEPLOYMENT).reuse.enable_decode_to_prefill_reuse is False
        for wire in ([ex.descriptor(0), ex.descriptor(1)], [b"garbage"], []):
            with pytest.raises(ReuseRefused) as info:
                importer.import_group(wire)
            assert info.value.reason is DecisionReason.REUSE_DISABLED and "off" in info.value.detail
        assert touching.calls == [] and importer.groups == []
        assert not any(b.leases for b in ex.banks.values()), "the exporter was contacted"
        enabled = Importer(ImportConfig(DEPLOYMENT, reuse=ReuseSettings(enable_decode_to_prefill_reuse=True)), touching)  # type: ignore[arg-type]
        try:
            group = enabled.import_group([ex.descriptor(0), ex.descriptor(1)])
            assert group.state == "ready"
            group.drain(5.0)
        finally:
            enabled.close()
    finally:
        importer.close()


@pytest.mark.parametrize("reuse, admitted, reason", [
    (ReuseSettings(enable_decode_to_prefill_reuse=True), None, DecisionReason.GPU_REUSE_DISABLED),
    (GPU_ON, None, DecisionReason.GPU_PROFILE_NOT_ADMITTED),
    (GPU_ON, (DeploymentProfile.HOST_LOCAL, "gpu", MemoryKind.HOST), DecisionReason.GPU_PROFILE_NOT_ADMITTED),
    (GPU_ON, (DeploymentProfile.GPU_SINGLE_NODE, "other-gpu", MemoryKind.DEVICE),
     DecisionReason.GPU_PROFILE_NOT_ADMITTED),
    (GPU_ON, (DeploymentProfile.GPU_SINGLE_NODE, "gpu", MemoryKind.DEVICE), None),
], ids=["gpu-reuse-off", "no-profile", "host-profile", "profile-of-another-transport", "admitted"])
def test_gpu_import_needs_gpu_reuse_and_an_admitted_profile(transport: HostTransport, reuse: ReuseSettings,
                                                            admitted: Any, reason: DecisionReason | None) -> None:
    """A transport over device memory (here the host backend publishing DEVICE memory)."""
    ex = make_exporter(1, transport, name="gate-gpu")
    gpu = Touching(transport, MemoryKind.DEVICE, name="gpu")
    adm = None if admitted is None else admission(*admitted)
    importer = Importer(ImportConfig(DEPLOYMENT, reuse=reuse, admission=adm), gpu)  # type: ignore[arg-type]
    try:
        if reason is None:
            group = importer.import_group([ex.descriptor(0)])
            assert group.state == "ready"
            group.drain(5.0)
            return
        with pytest.raises(ReuseRefused) as info:
            importer.import_group([ex.descriptor(0)])
        assert info.value.reason is reason
        assert gpu.calls == [] and not ex.banks[0].leases
    finally:
        importer.close()
