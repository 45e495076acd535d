"""A second process on the shim driver, for tests that need one: ``python peer.py ROLE``.

``legacy SIZE``: create cuMemAlloc memory of SIZE bytes, fill it with a pattern, export a
legacy IPC handle and print it (hex); on stdin EOF release it and exit.

``importer KIND``: read a descriptor (hex) from stdin, import its tp=1 group on a
transport of KIND (``posix_fd`` or ``cuda_ipc``), load every block and print
``mapped <sha256 of the bytes>``; on the line ``close`` drain and close the group and
print ``closed``; exit on stdin EOF. The environment (KVSTATE_LIBCUDA, the shim's configuration) comes from the test.
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


def importer(kind: HandleKind) -> None:
    import hashlib

    from kvstate.core.identity import Deployment
    from kvstate.harness.gpucheck import gpu_admission
    from kvstate.reuse.policy import ReuseSettings
    from kvstate.share.importer import ImportConfig, Importer

    t = CudaTransport(UUID, kind=kind, legacy_ipc=kind is HandleKind.CUDA_IPC)
    reuse = ReuseSettings(enable_decode_to_prefill_reuse=True, enable_decode_to_prefill_gpu_reuse=True)
    im = Importer(ImportConfig(Deployment(sys.argv[3], bytes(32)), reuse=reuse, admission=gpu_admission(t, UUID)), t)
    group = im.import_group([bytes.fromhex(sys.stdin.readline().strip())])
    part = group.parts[0]
    g = part.descriptor.geometry
    dst = t.alloc_buffer(g.num_blocks * g.block_bytes)
    group.load_prefix(list(range(g.num_blocks)), [dst])
    print("mapped", hashlib.sha256(t.read(dst, dst.nbytes)).hexdigest(), flush=True)
    for line in sys.stdin:
        if line.strip() == "close":
            group.drain(10.0)
            print("closed", flush=True)
    t.free_buffer(dst)
    im.close()
    t.close()


if __name__ == "__main__":
    role, *args = sys.argv[1:]
    if role == "legacy":
        legacy(int(args[0]))
    elif role == "importer":
        importer(HandleKind(args[0]))
    else:
        raise SystemExit(f"unknown role {role!r}")
