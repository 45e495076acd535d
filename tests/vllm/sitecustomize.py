"""Imported at start-up by every engine process (tests/vllm is on their PYTHONPATH, not on
pytest's): kvstate's log records at INFO go to the engine's log, which vLLM's logging
setup would otherwise drop, so that a failed engine test shows what the connector did."""

import logging
import os
import sys

_handler = logging.StreamHandler(sys.stderr)
_handler.setFormatter(logging.Formatter(f"(kvstate pid={os.getpid()}) %(asctime)s %(levelname)s %(name)s: %(message)s"))
_log = logging.getLogger("kvstate")
_log.setLevel(logging.INFO)
_log.addHandler(_handler)
_log.propagate = False

# KVSTATE_TRACE_DIR=<dir>: diagnosis of slow hand-offs (issue 28). kvstate logs at DEBUG
# (the t=<monotonic> lines of a load's every hand-off, with each thread's native id), and
# SIGRTMIN+3 makes faulthandler dump every thread's stack to <dir>/stacks-<pid>.txt from the
# signal handler, which needs no GIL: where each thread stands while a load waits.
_trace = os.environ.get("KVSTATE_TRACE_DIR")
if _trace:
    import faulthandler
    import signal
    import threading
    import time

    class _Tid(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            record.tid = threading.get_native_id()  # matches /proc/<pid>/task/<tid>
            return True

    _log.setLevel(logging.DEBUG)
    _handler.addFilter(_Tid())
    _handler.setFormatter(logging.Formatter(f"(kvstate pid={os.getpid()}) %(asctime)s tid=%(tid)s "
                                            "%(threadName)s %(levelname)s %(name)s: %(message)s"))
    os.makedirs(_trace, exist_ok=True)
    _stacks = open(os.path.join(_trace, f"stacks-{os.getpid()}.txt"), "w")  # open for the process's life
    faulthandler.register(signal.SIGRTMIN + 3, file=_stacks, all_threads=True)

    def _sched_states(what: str) -> str:
        """Every thread named ``what`` on this host: its state (R runnable, S sleeping),
        where it sleeps (wchan), the CPU it last ran on, and its run and run-queue times
        (/proc/<pid>/task/<tid>/schedstat, ns)."""
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for tid in tids:
                base = f"/proc/{pid}/task/{tid}"
                try:
                    with open(f"{base}/comm") as f:
                        if f.read().strip() != what:
                            continue
                    with open(f"{base}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    with open(f"{base}/wchan") as f:
                        wchan = f.read().strip()
                    with open(f"{base}/schedstat") as f:
                        run_ns, wait_ns, slices = f.read().split()
                except OSError:
                    continue
                found.append(f"pid {pid} tid {tid} state {fields[0]} wchan {wchan} cpu {fields[36]} "
                             f"ran {int(run_ns) / 1e6:.1f} ms waited {int(wait_ns) / 1e6:.1f} ms in {slices} slices")
        return "; ".join(found) or f"no thread named {what}"

    def _watch_lookups() -> None:
        """A question to a decode index that timed out or took over 0.1 s from its send to
        its reply logs where every decode index thread stood then (issue 28: 1 of 4 suite
        runs had a lookup unanswered for 0.5 s after a tp=2 decode engine ran; the threads
        were runnable and waited for a CPU)."""
        from kvstate.integrations.vllm import index_client

        read = index_client.IndexClient._read_one

        def traced(self, until):  # type: ignore[no-untyped-def]
            head = self._asked[0]
            out = read(self, until)
            if out and (not self._asked or self._asked[0] is not head):  # the oldest question ended
                took = time.monotonic() - (head.deadline - self.timeout_s)
                reply = self._replies.get(head.token)
                timed_out = isinstance(reply, index_client.Refusal) and reply.reason == "timeout"
                if timed_out or took > 0.1:
                    with open("/proc/loadavg") as f:
                        load = f.read().strip()
                    _log.warning("slow index question (%.3f s, %s): load %s; kvs-index threads: %s", took,
                                 "timeout" if timed_out else "answered", load, _sched_states("kvs-index"))
            return out
        index_client.IndexClient._read_one = traced  # type: ignore[method-assign]

    def _watch_steps(module: object) -> None:
        """While a load waits, a step that does not come within 3 s dumps every thread's stack
        to stacks-<pid>.txt (faulthandler's own thread: it needs no GIL), and the next step logs
        the gap. Issue 28: a fresh tp=2 prefill engine went silent for 10.4 s with loads
        ordered, in runs J and CI's stop-40 run; these stacks showed it compiling."""
        armed = [0.0, 0]  # when the watch was armed, and the stacks file's size then

        def watch(pending: bool) -> None:
            now = time.monotonic()
            if armed[0]:
                faulthandler.cancel_dump_traceback_later()
                size = os.fstat(_stacks.fileno()).st_size
                if size > armed[1]:
                    _log.warning("step watch: no step for %.3f s while a load waited; stacks in %s",
                                 now - armed[0], _stacks.name)
                armed[0] = 0.0
            if pending:
                armed[:] = [now, os.fstat(_stacks.fileno()).st_size]
                faulthandler.dump_traceback_later(3.0, file=_stacks)

        def watched(step, side: str, waiting: str):  # type: ignore[no-untyped-def]
            """``step`` (called once per engine step), watched while ``side``'s ``waiting``
            holds a load."""
            def run(self, *args, **kwargs):  # type: ignore[no-untyped-def]
                watch(False)
                try:
                    return step(self, *args, **kwargs)
                finally:
                    part = getattr(self, side, None)
                    watch(bool(part is not None and getattr(part, waiting)))
            return run

        cls = module.KvStateConnector  # type: ignore[attr-defined]
        cls.start_load_kv = watched(cls.start_load_kv, "_prefill", "_loads")  # a worker
        cls.build_connector_meta = watched(cls.build_connector_meta, "_sched", "_active")  # the scheduler

    try:
        _watch_lookups()
    except ImportError:  # an engine without kvstate on its path
        pass

    # vLLM's shared-memory queue between the engine core and its workers: a reader idle
    # for over 1 s polls for its writer's notice, rechecking every 5 s. Issue 28's runs
    # saw a tp=2 prefill engine log nothing for 10.4 s (its workers were then late for
    # a load): a notice lost twice would read so. Every such wait of over 1 s is logged
    # (an idle engine logs one per reader every 5 s: what tells is one inside such a gap).
    # Patched once the module is imported: vLLM's logging set-up resets its own loggers,
    # so a handler on its logger would not last.
    _SHM = "vllm.distributed.device_communicators.shm_broadcast"

    def _patch_shm(module: object) -> None:
        cls = getattr(module, "SpinCondition", None)
        if cls is None:
            return
        wait = cls.wait

        def timed(self, timeout_ms=None):  # type: ignore[no-untyped-def]
            start = time.monotonic()
            wait(self, timeout_ms)
            took = time.monotonic() - start
            if took > 1.0:
                _log.info("vLLM shm queue: a reader waited %.3f s for its writer's notice (timeout %s ms)",
                          took, timeout_ms)
        cls.wait = timed

    _PATCHES = {_SHM: _patch_shm, "kvstate.integrations.vllm.connector": _watch_steps}

    class _AfterImport:
        """A finder that runs nothing itself: once a module of _PATCHES is imported, it
        patches it (importlib's machinery with the real loader; this only wraps exec).
        Importing them here instead would import vLLM into every process at start-up."""

        def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
            patch = _PATCHES.get(name)
            if patch is None:
                return None
            import importlib.machinery

            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return None
            run = spec.loader.exec_module

            def exec_module(module):  # type: ignore[no-untyped-def]
                run(module)
                patch(module)
            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, _AfterImport())  # type: ignore[arg-type]
