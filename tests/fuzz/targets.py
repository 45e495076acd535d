"""Fuzz targets: every untrusted input kvstate parses, driven with arbitrary input.

Each target feeds one input to real code (real socketpairs for the channel, a real
exporter for requests) and checks the contract of an input boundary:

- it returns or raises a :class:`~kvstate.core.errors.KvStateError` subclass, never anything
  else (an untyped exception is a crash);
- it finishes within :data:`HANG_S` (a SIGALRM watchdog turns a hang into a failure);
- it keeps nothing: fds received with a refused frame are closed.

The targets are shared by the Hypothesis tests (``test_fuzz.py``), the corpus replay and
the coverage-guided atheris driver behind ``make fuzz`` (``atheris_main.py``). :data:`CASES` counts the inputs each ran.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import socket
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from kvstate import channel as chan
from kvstate.core.descriptor import MAC_BYTES, MAGIC, VERSION, decode
from kvstate.core.errors import KvStateError
from kvstate.core.identity import Purpose, digest
from kvstate.reuse.policy import ReuseSettings
from kvstate.reuse.profile import parse_capabilities
from kvstate.core.validate import validate_group

from support.descriptors import DEPLOYMENT, expectation

HANG_S = 5.0
CASES: collections.Counter[str] = collections.Counter()
_HEAD = struct.Struct("<4sBI")


class Untyped(AssertionError):
    """An input boundary raised something other than a KvStateError."""


class Hang(AssertionError):
    """A target ran longer than HANG_S."""


@contextmanager
def _watchdog() -> Iterator[None]:
    def fire(signum: int, frame: Any) -> None:
        raise Hang(f"a fuzz target ran longer than {HANG_S} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, HANG_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old if old is not None else signal.SIG_DFL)  # None: set outside Python


def run(name: str, fn: Callable[[], object]) -> object:
    """Run one case of target ``name``: typed errors pass, anything else fails."""
    CASES[name] += 1
    with _watchdog():
        try:
            return fn()
        except KvStateError as exc:
            return exc
        except Hang:
            raise
        except Exception as exc:
            raise Untyped(f"{name}: untyped {type(exc).__name__}: {exc}") from exc


# -- descriptors ---------------------------------------------------------------------


def sign(body: bytes, version: int = VERSION) -> bytes:
    """A wire descriptor around ``body``, authenticated with the test deployment's key, so
    the fuzzer reaches the parser behind the MAC."""
    signed = _HEAD.pack(MAGIC, version, len(body)) + body
    return signed + digest(Purpose.DESCRIPTOR_MAC, signed, key=DEPLOYMENT.key, size=MAC_BYTES)


def descriptor_wire(data: bytes) -> object:
    """Decode arbitrary wire bytes; anything that decodes is validated as a group of one."""
    def go() -> object:
        d = decode(data, DEPLOYMENT)
        return validate_group([d], expectation(check_socket=False))
    return run("descriptor", go)


def descriptor_body(body: bytes) -> object:
    """Arbitrary body bytes behind a valid MAC: the strict JSON parser and validation."""
    return run("descriptor_body", lambda: _decode_validate(sign(body)))


def _decode_validate(wire: bytes) -> object:
    d = decode(wire, DEPLOYMENT)
    return validate_group([d], expectation(check_socket=False))


# -- channel framing -----------------------------------------------------------------

_LIMITS = chan.Limits(max_payload=1024, max_fds=4)


def frame(packet: bytes, nfds: int) -> object:
    """Send one raw packet with ``nfds`` fds over a real SOCK_SEQPACKET pair and receive it
    through a Channel with small caps. Every received fd must end closed or returned."""
    def go() -> object:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fds = [os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC) for _ in range(nfds)]
        try:
            if fds:
                socket.send_fds(a, [packet], fds)
            else:
                a.send(packet)
        except OSError:
            a.close()
            b.close()
            return None  # the kernel refused to send it (too large): nothing reaches kvstate
        finally:
            for fd in fds:
                os.close(fd)
        with chan.Channel(b, limits=_LIMITS) as ch:
            a.close()
            before = len(os.listdir("/proc/self/fd"))
            try:
                msg = ch.recv(timeout=1.0)
            except KvStateError:
                if len(os.listdir("/proc/self/fd")) != before:
                    raise AssertionError("a refused frame left received fds open") from None
                raise
            with msg:
                if len(msg.payload) > _LIMITS.max_payload or len(msg.fds) > _LIMITS.max_fds:
                    raise AssertionError(f"a frame over the caps was accepted: {len(msg.payload)} bytes")
                return chan.decode(msg.payload)
    return run("frame", go)


def message(data: bytes) -> object:
    """The channel's JSON codec on arbitrary bytes."""
    return run("message", lambda: chan.decode(data))


# -- settings and profiles -----------------------------------------------------------


def settings_mapping(mapping: dict[Any, Any]) -> object:
    return run("settings_mapping", lambda: ReuseSettings.from_mapping(mapping))


def settings_env(environ: dict[str, str]) -> object:
    return run("settings_env", lambda: ReuseSettings.from_env(environ))


def settings_cli(argv: list[str]) -> object:
    return run("settings_cli", lambda: ReuseSettings.from_cli(argv))


def capabilities(wire: Any) -> object:
    return run("capabilities", lambda: parse_capabilities(wire))


def capabilities_json(text: bytes) -> object:
    """Capabilities as the CLI reads them: JSON text, then the strict parser."""
    def go() -> object:
        try:
            wire = json.loads(text)
        except (ValueError, RecursionError):
            return None  # not JSON: refused by the reader before kvstate sees it
        return parse_capabilities(wire)
    return run("capabilities", go)


# -- exporter requests ----------------------------------------------------------------


def request(ch: chan.Channel, payload: bytes) -> dict[str, Any]:
    """Send an arbitrary request payload to a live exporter; the reply must be a well-formed
    refusal (or a grant, whose fd is closed), and the connection must stay usable."""
    def go() -> dict[str, Any]:
        ch.send(payload, timeout=2.0)
        try:
            notification = chan.decode(payload).get("op") == "mapped"
        except KvStateError:
            notification = False
        if notification:  # "mapped" is a notification: the exporter sends no answer
            return {"ok": None, "code": "notification"}
        with ch.recv(timeout=2.0) as msg:
            reply = chan.decode(msg.payload)
        if reply.get("ok") is not True and not isinstance(reply.get("code"), str):
            raise AssertionError(f"a refusal without a code: {reply}")
        return reply
    out = run("request", go)
    if not isinstance(out, dict):
        raise AssertionError(f"the exporter did not answer a request: {out!r}")
    return out
