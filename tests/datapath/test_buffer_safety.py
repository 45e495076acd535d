"""Memory safety at the cffi boundary: every buffer export is given back on every path.

Each failure path runs in a fresh process with memoryview destinations (or sources). The
caller keeps the exception (and with its traceback every frame of the failed call). Then
the process releases every memoryview (``release()`` raises BufferError
while an export is left), forces a collection, tears down and exits; the test checks its
exit status and that nothing was reported at collection or exit ("Exception ignored",
BufferError, a signal). A leaked export used to crash such a process with SIGSEGV at gc.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = textwrap.dedent('''
    import gc, os, sys, tempfile
    from pathlib import Path
    from kvstate.core import layouts
    from kvstate.core.reasons import NativeReason
    from kvstate.core.errors import KvStateError, NativeError
    from kvstate.core.identity import Deployment
    from kvstate.share.exporter import Exporter
    from kvstate.share.export_config import ExportConfig
    from kvstate.reuse.policy import ReuseSettings
    from kvstate.share.importer import Importer, ImportConfig
    from kvstate.transport.host import HostTransport
    from kvstate.transport.native import default

    dep = Deployment("safety", bytes(32))
    d = Path(tempfile.mkdtemp()); d.chmod(0o700)
    g = layouts.vllm_cpu(3, num_blocks=8, num_kv_heads=2, block_size=32, head_dim=32)
    ex = Exporter(ExportConfig(dep, d / "s", os.urandom(16), 1), HostTransport(granularity=65536))
    bank = ex.add_bank(0, g); bank.fire("register"); bank.fire("advertise"); ex.start()

    class FailThird:
        def __init__(self, inner): self.inner, self.name, self.calls = inner, inner.name, 0
        capabilities = property(lambda self: self.inner.capabilities)
        def __getattr__(self, n): return getattr(self.inner, n)
        def submit_blocks(self, *a, **kw):
            self.calls += 1
            if self.calls == 3:
                raise NativeError(NativeReason.FAILED, "injected submit failure")
            return self.inner.submit_blocks(*a, **kw)

    im = Importer(ImportConfig(dep, reuse=ReuseSettings(enable_decode_to_prefill_reuse=True)), FailThird(HostTransport(granularity=65536)))
    group = im.import_group([ex.descriptor(0)])
    def pages():  # one memoryview per region, shaped like the region, 16 pages
        return {r.name: memoryview(bytearray(16 * r.block_bytes)).cast("H", (16, *r.block_shape)) for r in g.regions}
    views = pages()
    flat = memoryview(bytearray(4 * g.block_bytes))
''')

EPILOGUE = textwrap.dedent('''
    for mv in [*views.values(), flat]:
        mv.release()  # BufferError here if an export outlived the call
    gc.collect()
    group.drain(10.0); im.close(); ex.stop(); ex.drain(10.0)
    bank = None
    gc.collect()
    assert default().stats().ops_live == 0
    print("clean")
''')

CASES = {
    "load_prefix, empty block list": "group.load_prefix([], {0: flat})",
    "load_prefix, float block id": "group.load_prefix([1.0, 2], {0: flat})",
    "load_prefix, bad timeout": "group.load_prefix([1, 2], {0: flat}, timeout=-1)",
    "load_prefix, buffer too small": "group.load_prefix([1, 2, 3, 4, 5], {0: flat})",
    "load, page out of range": "group.load([1, 2], views, [3, 16])",
    "load, last region refused": "group.load([1, 2], {**views, g.names[-1]: memoryview(bytes(10))}, [3, 4])",
    "load, submit fails at region 3": "group.load([1, 2], views, [3, 4])",
    "store, bad bank block": "bank.store(views, [1, 2], [3, 99])",
    "native, bad block list": ("default().submit_gather(group.parts[0].mapping.region, flat, [(0, 0.5, 8)])"),
}


def _run(body: str) -> subprocess.CompletedProcess[str]:
    script = PRELUDE + textwrap.dedent(body) + EPILOGUE
    return subprocess.run([sys.executable, "-X", "dev", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_refused_call_leaves_no_buffer_export_behind(case: str) -> None:
    # The caller keeps the exception, as an engine that logs or re-raises it later does:
    # its traceback keeps every frame of the failed call, and their locals, alive.
    body = f"try:\n    {CASES[case]}\nexcept KvStateError as exc:\n    kept = exc\nelse:\n    sys.exit(3)\n"
    r = _run(body)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    assert r.stdout.strip().endswith("clean")
    for bad in ("BufferError", "Exception ignored", "Fatal Python error"):
        assert bad not in r.stderr, r.stderr[-3000:]


def test_a_completed_load_gives_its_buffers_back_when_it_finishes() -> None:
    body = """
        im.transport.calls = -100  # no injected failure
        h = group.load([1, 2], views, [3, 4])
        assert h.wait(10.0) and not h.failed_blocks()
        h.close()
        assert group.load_prefix([1, 2], {0: flat}).bytes == 2 * g.block_bytes
    """
    r = _run(body)
    assert r.returncode == 0 and "BufferError" not in r.stderr, r.stderr[-3000:]


def test_the_check_catches_an_export_left_behind() -> None:
    """Negative control: an export that is never given back is caught by this harness."""
    body = "keep = default().ffi.from_buffer(views[g.names[0]])\n"
    r = _run(body)
    assert r.returncode != 0 and "BufferError" in r.stderr
