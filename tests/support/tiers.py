"""Test tiers: every test carries at least one kind marker, and maybe ``slow``.

The kinds say what a test touches (pyproject.toml registers them with their meaning);
a test may have several (a stateful test of the native engine is ``stateful`` and
``native``). ``make test-fast`` runs ``-m "not slow and not models"``; ``make test``
runs everything.

Markers come from :data:`DEFAULTS`, by path under tests/ (a file's own entry, else its
innermost directory's). A file that mixes kinds marks the odd tests explicitly: kind
markers a test declares replace the default kinds (``slow`` adds). A test file that no
entry covers is a collection error, so no test is left without a tier.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import PurePosixPath

KINDS = ("unit", "stateful", "native", "multiproc", "models", "vllm")
TIERS = (*KINDS, "slow")

#: path under tests/ (a directory ending in "/", or a file) -> default markers
DEFAULTS: Mapping[str, tuple[str, ...]] = {
    # directories: the kind of everything in them
    "api/": ("native",),                   # the public API on a real exporter and importer
    "bounds/": ("native",),
    "cuda/": ("native",),
    "cudashim/": ("native",),              # the C engine's CUDA path on the shim driver, in-process
    "cudashim/test_failures.py": ("native", "multiproc"),  # a peer process, subprocesses per driver setting
    "cudashim/test_processes.py": ("native", "multiproc"),
    "cudashim/test_op_stateful.py": ("stateful", "native"),
    "cudashim/test_gpucheck.py": ("native", "multiproc", "slow"),  # gpucheck and the GPU suite, end to end
    "datapath/": ("native",),              # a real exporter and importer, in-process, over the op engine
    "datapath/test_async_stateful.py": ("stateful", "native", "slow"),
    "datapath/test_buffer_safety.py": ("native", "multiproc", "slow"),  # a process per failure path
    "fuzz/": ("native",),                  # targets include the exporter's request handler
    "integrations/": ("native",),          # engine integrations without the engine (tests/vllm has it)
    "integrations/test_vllm_parts.py": ("unit",),
    "integrations/test_amx.py": ("multiproc",),  # a fresh process per check: the grant is per process
    "lifecycle/": ("native",),             # a real exporter on the host backend, in-process
    "lifecycle/test_coordinated_stateful.py": ("stateful", "multiproc", "slow"),
    "lifecycle/test_demo.py": ("multiproc",),
    "lifecycle/test_processes.py": ("multiproc", "slow"),
    "lifecycle/test_stateful_lifecycle.py": ("stateful", "native", "slow"),
    "native/": ("native",),
    "native/test_multiprocess.py": ("native", "multiproc"),
    "native/test_op_stateful.py": ("stateful", "native"),
    "native/test_machine_differential.py": ("stateful", "native"),
    "planted/": (),                        # run only by self-tests; each test declares its kind
    "soak/": ("multiproc", "slow"),
    "syscalls/": ("native", "multiproc"),  # a fresh process per injected syscall failure
    "trust/": ("native",),
    "vllm/": ("vllm", "slow"),              # only `make test-vllm` collects it (its own venv)
    "trust/test_threat_model_doc.py": ("unit",),
    # files at the top of tests/
    "test_bench_smoke.py": ("multiproc", "slow"),
    "test_args.py": ("unit",),
    "test_owned_tokens.py": ("unit",),
    "test_bench_summary.py": ("unit",),
    "test_check_cli.py": ("unit",),
    "test_children.py": ("multiproc",),
    "test_codemap.py": ("unit",),
    "test_conformance.py": ("unit",),
    "test_coordinator_model.py": ("models",),
    "test_contracts.py": ("unit", "slow"),  # crosshair
    "test_cuda_cpu.py": ("native",),
    "test_descriptor_canonical.py": ("unit",),
    "test_engine_quiet.py": ("multiproc",),   # a real spinning process, watched through /proc
    "test_docs.py": ("unit",),
    "test_error_catalogue.py": ("unit",),
    "test_generate.py": ("unit",),
    "test_geometry.py": ("unit",),
    "test_guide.py": ("native", "multiproc", "slow"),  # runs the guide's code in a fresh process
    "test_group_stateful.py": ("stateful",),
    "test_handoff.py": ("unit",),
    "test_imports.py": ("unit",),
    "test_inventory.py": ("unit",),
    "test_inventory_stateful.py": ("stateful",),
    "test_layout.py": ("unit",),
    "test_leak_checker.py": ("native",),
    "test_machine.py": ("unit",),
    "test_models.py": ("models",),
    "test_mutants.py": ("unit",),           # the mutation harness on a tiny tree; `make mutants` is the run
    "test_nixl_handle.py": ("unit",),
    "test_nixl_coordinated.py": ("native", "multiproc", "slow"),
    "test_nixl_transport.py": ("native", "multiproc", "slow"),
    "test_optable.py": ("unit",),
    "test_packaging.py": ("multiproc", "slow"),
    "test_policy.py": ("unit",),
    "test_policy_cli.py": ("unit",),
    "test_policy_contracts.py": ("unit", "slow"),  # crosshair
    "test_proposals.py": ("models",),
    "test_profile.py": ("unit",),
    "test_pure_core.py": ("unit",),
    "test_rules.py": ("unit",),
    "test_scenarios.py": ("unit",),
    "test_share_configs.py": ("unit",),
    "test_spec_loader.py": ("unit",),
    "test_spec_tables.py": ("unit",),
    "test_tempdirs.py": ("multiproc",),     # a child process sees the session's root
    "test_tiers.py": ("unit",),
}


class Untiered(Exception):
    """A test file that :data:`DEFAULTS` does not cover."""


def defaults(relpath: str, table: Mapping[str, tuple[str, ...]] = DEFAULTS) -> tuple[str, ...]:
    """The default markers of the test file at ``relpath`` (relative to tests/)."""
    path = PurePosixPath(relpath)
    candidates = [str(path)] + [f"{p}/" for p in path.parents if str(p) != "."]
    for key in candidates:  # the file first, then its directories, innermost first
        if key in table:
            return table[key]
    raise Untiered(f"tests/{relpath} has no tier: add it to DEFAULTS in tests/support/tiers.py")


def tiers(relpath: str, declared: Iterable[str], table: Mapping[str, tuple[str, ...]] = DEFAULTS) -> set[str]:
    """A test's tiers. Kind markers the test declares (on its function, class or module)
    replace its file's default kinds; ``slow`` comes from either."""
    default = set(defaults(relpath, table))
    own = set(declared) & set(TIERS)
    kinds = (own & set(KINDS)) or (default & set(KINDS))
    if not kinds:
        raise Untiered(f"tests/{relpath}: a test with no kind marker (one of {', '.join(KINDS)})")
    return kinds | ({"slow"} & (default | own))
