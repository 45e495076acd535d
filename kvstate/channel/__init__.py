"""The control channel: AF_UNIX SOCK_SEQPACKET between the workers of one node.

Theory of operation
-------------------

Exporter and importer talk over one connected ``SOCK_SEQPACKET`` socket per importer.
Each message is one packet: a 12-byte header (magic, payload length, fd count), then the
payload bytes, with any file descriptors attached by SCM_RIGHTS. The kernel keeps packet
boundaries, so a frame is never split or merged; a packet larger than the receiver's
cap arrives truncated (MSG_TRUNC) and is refused as a :class:`ChannelError` (FRAME), with every fd
that came with it closed. Payloads are bytes; :func:`encode` / :func:`decode` are a
small strict JSON codec for them (no pickle, no eval).

Trust is checked, not assumed:

- the socket directory must be owned by the expected uid with mode 0700, and neither the
  directory path nor the socket path may contain a symlink (:func:`check_socket_dir`).
  In a 0700 directory only its owner (or root) can swap the entries we check;
- both ends read the peer's credentials (SO_PEERCRED) and refuse a uid outside
  ``allowed_uids`` (default: our own uid) with :class:`ChannelError` (REJECTED);
- each end opens a pidfd for the peer's pid at connect time, so a peer that dies is
  noticed even when a child it forked still holds the socket open (:class:`ChannelError` (PEER_DIED)).

Every blocking step (connect, accept, send, recv) takes a timeout and raises
:class:`ChannelError` (TIMEOUT) when it passes; there is no unbounded wait. Sockets are
non-blocking and timeouts are enforced with ``poll``, so one thread may ``recv`` while
another ``send``\\ s on the same channel.

A lease is bound to its connection: :class:`Watcher` runs one thread that polls many
channels for hang-up (POLLHUP/POLLRDHUP on the socket, readiness of the peer's pidfd)
without consuming their messages, and calls ``on_close(channel)`` exactly once per
closed channel, so the exporter can end that connection's leases.

Received fds belong to the receiver: close them (``Message.close()``) once imported.
"""

from kvstate.channel.conn import Channel, PeerCred, connect
from kvstate.channel.framing import (
    DEFAULT_MAX_FDS,
    DEFAULT_MAX_PAYLOAD,
    DEFAULT_TIMEOUT,
    HARD_MAX_FDS,
    HARD_MAX_PAYLOAD,
    HEADER,
    MAGIC,
    Limits,
    Message,
    decode,
    encode,
)
from kvstate.channel.paths import check_socket_dir, check_socket_path, make_socket_dir
from kvstate.channel.server import DEFAULT_MAX_CONNECTIONS, Server
from kvstate.channel.watcher import Watcher

__all__ = [
    "DEFAULT_MAX_CONNECTIONS", "DEFAULT_MAX_FDS", "DEFAULT_MAX_PAYLOAD", "DEFAULT_TIMEOUT", "HARD_MAX_FDS",
    "HARD_MAX_PAYLOAD", "HEADER", "MAGIC", "Channel", "Limits", "Message", "PeerCred", "Server", "Watcher",
    "check_socket_dir", "check_socket_path", "connect", "decode", "encode", "make_socket_dir",
]
