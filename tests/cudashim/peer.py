"""A second process on the shim driver, for tests that need one: ``python peer.py ROLE``.

``legacy SIZE``: create cuMemAlloc memory of SIZE bytes, fill it with a pattern, export a
legacy IPC handle and print it (hex); on stdin EOF release it and exit. The environment (KVSTATE_LIBCUDA, the shim's configuration) comes from the test.
"""

from __future__ import annotations

import sys

from kvstate.core.capabilities import Access
from kvstate.core.handles import HandleKind
from kvstate.transport.cuda import CudaTransport

UUID = b"KVSCUDASHIM-dev0"


def pattern(n: int) -> bytes:
    return bytes(i % 253 for i in range(n))


def legacy(size: int) -> None:
    t = CudaTransport(UUID, kind=HandleKind.CUDA_IPC, legacy_ipc=True)
    a = t.create(size)
    r = t.reserve(size)
    m = t.map(r, 0, a)
    t.set_access(m, Access.READ_WRITE)
    t.write(m, pattern(size))
    h = t.export(a, HandleKind.CUDA_IPC)
    print(h.identity.hex(), flush=True)
    sys.stdin.read()  # until the test closes our stdin
    t.unmap(m)
    t.free(r)
    t.release(a)
    t.close()


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    if role == "legacy":
        legacy(int(args[0]))
    else:
        raise SystemExit(f"unknown role {role!r}")
