"""Handle kinds: what a descriptor's handle bytes mean, and their exact sizes.

Pure data. A descriptor names one kind and carries exact handle bytes for it; validation
refuses a length that does not match before anything is opened.

- ``memfd``: host backend. The fd itself travels by SCM_RIGHTS; the handle bytes are its
  identity, ``st_dev`` and ``st_ino`` as two little-endian u64, which the importer checks
  against ``fstat`` of the received fd before mapping it.
- ``posix_fd``: CUDA VMM shareable handle (CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR). Same
  rule as memfd: the fd travels by SCM_RIGHTS, the bytes are its (dev, ino) identity.
- ``fabric``: CUDA VMM fabric handle (CUmemFabricHandle), exactly 64 bytes.
- ``cuda_ipc``: legacy CUDA IPC memory handle (CUipcMemHandle), exactly 64 bytes.
- ``nixl``: serialized NIXL agent metadata plus the remote descriptor list; variable
  length, capped.
"""

from __future__ import annotations

import enum


class HandleKind(enum.Enum):
    MEMFD = "memfd"
    POSIX_FD = "posix_fd"
    FABRIC = "fabric"
    CUDA_IPC = "cuda_ipc"
    NIXL = "nixl"


FD_IDENTITY_BYTES = 16
CUDA_HANDLE_BYTES = 64  # sizeof(CUmemFabricHandle) == sizeof(CUipcMemHandle) == 64
NIXL_HANDLE_MAX_BYTES = 64 * 1024

#: Exact handle length per kind; ``None`` means variable, bounded by NIXL_HANDLE_MAX_BYTES.
HANDLE_BYTES: dict[HandleKind, int | None] = {
    HandleKind.MEMFD: FD_IDENTITY_BYTES,
    HandleKind.POSIX_FD: FD_IDENTITY_BYTES,
    HandleKind.FABRIC: CUDA_HANDLE_BYTES,
    HandleKind.CUDA_IPC: CUDA_HANDLE_BYTES,
    HandleKind.NIXL: None,
}

#: Kinds whose handle is a file descriptor passed over the control channel.
FD_KINDS = frozenset({HandleKind.MEMFD, HandleKind.POSIX_FD})

#: Kinds whose memory nobody counts across processes: a legacy cuIpc allocation is freed
#: by its exporter's cuMemFree whoever still has it open (memfds and VMM handles are
#: reference-counted by the kernel and the driver). The exporter keeps such memory alive
#: itself, for as long as any importer may have it open (kvstate.share.exporter).
UNCOUNTED_KINDS = frozenset({HandleKind.CUDA_IPC})


def fd_identity(st_dev: int, st_ino: int) -> bytes:
    """The handle bytes of an fd-backed handle: (dev, ino) as two little-endian u64."""
    return st_dev.to_bytes(8, "little") + st_ino.to_bytes(8, "little")
