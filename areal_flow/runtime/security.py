"""A run's secret, and where its servers listen (docs/security.md).

When `security_needed(cfg)`, the launcher makes one `Security` per run: an HTTP API token and
ZeroMQ CURVE keys (a server keypair and a client keypair). It travels to every process inside
`spec.json` (written mode 0600). With it:

- every ZeroMQ socket that binds is a CURVE server whose ZAP handler accepts only the run's client
  public key, and every socket that connects is a CURVE client with the run's keys
  (`transport/channels.py: make_socket` applies `curve_server`/`curve_client`);
- the generation servers answer 401 to a request without `Authorization: Bearer <token>` (SGLang's
  `--api-key`), and every client of theirs sends it;
- servers bind to this host's address instead of loopback.

Without it nothing changes: loopback, plain ZeroMQ, no token.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import secrets
import socket
from typing import TYPE_CHECKING

import msgspec
import zmq
from zmq.auth.thread import ThreadAuthenticator

if TYPE_CHECKING:
    from areal_flow.config.schema import RunConfig

log = logging.getLogger("areal_flow.security")

API_KEY_ENV = "AREAL_FLOW_API_KEY"
"""The environment variable the launcher gives the embedded generation server its API key in: the
command line would show it to every user of the host (`ps`); a process's environment only to its
owner."""

ZAP_DOMAIN = "areal_flow"
"""The ZAP domain of every CURVE server socket; the ZAP handler judges requests of this domain."""

LOOPBACK = "127.0.0.1"


class Security(msgspec.Struct, frozen=True, kw_only=True):
    """One run's secrets. Keys are Z85 text, as `zmq.curve_keypair()` makes them."""

    api_key: str  # HTTP: `Authorization: Bearer <api_key>` to the generation servers
    server_public: str  # CURVE: the key clients check the server against
    server_secret: str
    client_public: str  # CURVE: the only client key the run's servers accept
    client_secret: str

    @classmethod
    def new(cls) -> Security:
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(api_key=secrets.token_urlsafe(32), server_public=server_public.decode(),
                   server_secret=server_secret.decode(), client_public=client_public.decode(),
                   client_secret=client_secret.decode())

    def __repr__(self) -> str:
        # A spec or a security object that ends up in a log or a traceback must not carry the secrets.
        return f"Security(client_public={self.client_public!r}, secrets hidden)"

    __str__ = __repr__


def security_needed(cfg: RunConfig) -> bool:
    """Whether the run gets a per-run secret and its servers bind to the host's address."""
    # Several nodes, or a launcher that may start processes on other hosts (Ray), put servers where
    # other machines reach them. Nothing else decides it: the launcher makes a Security exactly when
    # this says so, and every process follows the spec.
    return cfg.launcher.secure or cfg.cluster.n_nodes > 1 or cfg.launcher.type != "local"


def host_address() -> str:
    """The address other hosts reach this one at: what its name resolves to, unless that is a
    loopback address (as /etc/hosts often makes it); then the address of the interface that routes
    to the outside. Loopback only when the host has neither."""
    try:
        named = socket.gethostbyname(socket.gethostname())
    except OSError:
        named = LOOPBACK
    if not ipaddress.ip_address(named).is_loopback:
        return named
    try:
        # A UDP socket that "connects" sends nothing: the kernel only picks the route, and with it
        # the source address. Any address off this host will do (this one is TEST-NET-2's).
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("198.51.100.1", 9))
            routed = probe.getsockname()[0]
    except OSError:
        return named
    return routed if not ipaddress.ip_address(routed).is_unspecified else named


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps a server to this machine's own processes."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


# ---- ZeroMQ: CURVE on every socket, one ZAP handler per context --------------------------------


class _RunKeyOnly:
    """The ZAP handler's judge: only the run's client public key passes."""

    def __init__(self, client_public: str) -> None:
        self.client_public = client_public.encode()
        self.refused: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        if hmac.compare_digest(key, self.client_public):
            return True
        if key not in self.refused:  # a refused client reconnects every 100 ms: say it once
            self.refused.add(key)
            log.warning("refused a ZeroMQ client whose CURVE key is not this run's (its public key: %s)", key.decode())
        return False


_handlers: dict[zmq.Context, tuple[ThreadAuthenticator, str]] = {}
"""Each context's ZAP handler and the client key it accepts. libzmq asks the handler bound in the
socket's own context (inproc://zeromq.zap.01), so there is one per context, started by the first
CURVE server socket and kept until `release(ctx)` or the end of the process."""


def _zap_handler(ctx: zmq.Context, security: Security) -> None:
    found = _handlers.get(ctx)
    if found is not None:
        if found[1] != security.client_public:
            raise ValueError("this ZeroMQ context already serves another run's keys; make one context per run")
        return
    # A thread, in asyncio processes too: handshakes are answered while the event loop is busy
    # (the controller evaluating, a rollout worker tokenizing), and sockets are made both in
    # synchronous code (trainer ranks) and in coroutines.
    handler = ThreadAuthenticator(ctx, log=logging.getLogger("areal_flow.security.zap"))
    handler.start()
    handler.configure_curve_callback(ZAP_DOMAIN, _RunKeyOnly(security.client_public))
    _handlers[ctx] = (handler, security.client_public)


def curve_server(ctx: zmq.Context, sock: zmq.Socket, security: Security) -> None:
    """Make `sock` (not yet bound) a CURVE server that accepts only the run's client key."""
    _zap_handler(ctx, security)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, security.server_secret.encode())
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    # Fail closed: were the ZAP handler ever missing, libzmq would refuse every client rather than
    # let any CURVE client in.
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def curve_client(sock: zmq.Socket, security: Security) -> None:
    """Make `sock` (not yet connected) a CURVE client with the run's keys: it talks only to a
    server that holds the run's server secret key."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, security.server_public.encode())
    sock.setsockopt(zmq.CURVE_PUBLICKEY, security.client_public.encode())
    sock.setsockopt(zmq.CURVE_SECRETKEY, security.client_secret.encode())


def release(ctx: zmq.Context) -> None:
    """Stop `ctx`'s ZAP handler, if it has one: before `ctx.term()`, which waits for its sockets."""
    found = _handlers.pop(ctx, None)
    if found is not None:
        found[0].stop()
