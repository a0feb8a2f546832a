"""Authenticated, encrypted transport: CurveZMQ keys and the allow-list that binds identities to keys.

Every socket of a run speaks CurveZMQ (RFC 26: X25519 key agreement, XSalsa20-Poly1305 per frame) unless the
run is started with ``--insecure``. The coordinator's ZAP handler (pyzmq's :class:`ThreadAuthenticator`)
admits a connection only if its long-term public key is in the run's *roster*; a peer without a listed key
never completes the handshake, so it can send nothing and receive nothing.

Each roster entry (a *grant*) names the identities its key may speak for: an edge node's key its clients, a
per-device key one client, the GPU workers' key the workers. The server endpoint checks every received
message's sender against the grant of the connection it came on (libzmq attaches the ZAP ``User-Id`` to each
message), so a peer holding one node's key cannot send in another node's clients' names, make them leave or
take over their routes.

A key directory (written by :func:`write_keys`, read by :func:`load_server_keys` and
:class:`ClientKeyring`)::

    coordinator.key         the coordinator's public key: every node and worker needs it
    coordinator.key_secret  the coordinator's secret key: only the coordinator
    roster.json             public key (Z85) -> grant name and identities: only the coordinator
    <grant>.key_secret      one per grant (node-0, client-0004, gpu-workers): only the host it runs on
    secagg_signers.json     grant name -> its identities, its CurveZMQ public key and its Ed25519 signing public
                            key: every node needs it, beside coordinator.key

Certificates are pyzmq's ZPL key files (:func:`zmq.auth.create_certificates`), written with mode 0600. Each
grant's certificate also holds, in its metadata, the grant's Ed25519 signing key (``secagg-signing-key``, 32
raw bytes in hex): its clients sign the SecAgg+ public keys they advertise with it, and the other clients check
the signatures against ``secagg_signers.json``, which binds each signing key to the same grant as its
CurveZMQ key (:mod:`fcl_emu.secagg.identity`).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from zmq.auth.thread import ThreadAuthenticator

SERVER_NAME = "coordinator"
ROSTER_FILE = "roster.json"
SIGNERS_FILE = "secagg_signers.json"
SIGNING_METADATA = "secagg-signing-key"  # the metadata entry of a grant's certificate that holds its signing key
#: Why the allow-list refused a handshake: a key not in the roster (libzmq builds the ZAP request itself, so a
#: peer cannot make it refuse for another reason; one without a key or with another coordinator's fails earlier).
HANDSHAKE_REFUSALS = ("unknown_key",)


class KeyFileError(Exception):
    """A key directory or key file that cannot be used (the message names the file and what is wrong)."""


@dataclass(frozen=True)
class ServerKeys:
    """What the coordinator holds: its key pair and the roster (public key -> grant)."""

    public: bytes
    secret: bytes
    grants: Mapping[str, "Grant"]  # keyed by the Z85 public key, as ZAP reports it in User-Id


@dataclass(frozen=True)
class Grant:
    """A public key's name and the identities it may speak for."""

    name: str
    identities: frozenset[str]


@dataclass(frozen=True)
class ClientKeys:
    """What a connecting socket holds: the coordinator's public key and its own key pair; and its grant's Ed25519
    signing key (32 raw bytes), where its certificate holds one."""

    server_public: bytes
    public: bytes
    secret: bytes
    signing: bytes | None = None


def _secret_file(directory: Path, name: str) -> Path:
    return directory / f"{name}.key_secret"


def write_keys(directory: Path, grants: Mapping[str, Iterable[str]],
               relays: Mapping[str, Iterable[str]] | None = None) -> Path:
    """Write a key directory: the coordinator's key pair, and one key pair and signing key per grant (name ->
    identities) with the signers' list; and one key pair per relay (an edge aggregator: name -> the identities it
    relays and its own), in the roster but not among the signers (it signs nothing of a client's), its public key
    kept as ``<name>.key`` for the nodes that dial it.

    An existing coordinator key pair is kept (nodes already configured with its public key keep working);
    grant keys are always new. Returns the directory.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    if not _secret_file(directory, SERVER_NAME).is_file():
        _create(directory, SERVER_NAME)
    roster, signers = {}, {}
    for name, identities in grants.items():
        signing = Ed25519PrivateKey.generate()
        public, _ = _create(directory, name, {SIGNING_METADATA: signing.private_bytes_raw().hex()})
        (directory / f"{name}.key").unlink()  # the roster holds the public keys
        roster[public.decode()] = {"name": name, "identities": sorted(set(identities))}
        signers[name] = {"identities": sorted(set(identities)), "curve_key": public.decode(),
                         "signing_key": signing.public_key().public_bytes_raw().hex()}
    for name, identities in (relays or {}).items():
        public, _ = _create(directory, name)
        roster[public.decode()] = {"name": name, "identities": sorted(set(identities))}
    for file, content in ((ROSTER_FILE, roster), (SIGNERS_FILE, signers)):
        path = directory / file
        path.write_text(json.dumps(content, indent=1))
        os.chmod(path, 0o600)
    return directory


def _create(directory: Path, name: str, metadata: Mapping[str, str] | None = None) -> tuple[bytes, bytes]:
    public_file, secret_file = zmq.auth.create_certificates(directory, name, dict(metadata or {}))
    for path in (public_file, secret_file):
        os.chmod(path, 0o600)
    return zmq.auth.load_certificate(secret_file)


def _load(path: Path, *, secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"cannot read key file {path}: {exc}") from None
    if public is None or (secret and secret_key is None):
        raise KeyFileError(f"{path} holds no {'secret' if secret else 'public'} key "
                        f"(use the .key_secret file written by `fcl-emu keys`)")
    return public, secret_key


def load_server_keys(directory: Path) -> ServerKeys:
    """The coordinator's keys and roster from a key directory."""
    directory = Path(directory)
    if not directory.is_dir():
        raise KeyFileError(f"key directory {directory} does not exist (write one with `fcl-emu keys`)")
    public, secret = _load(_secret_file(directory, SERVER_NAME), secret=True)
    return ServerKeys(public, secret, load_roster(directory))


def load_roster(directory: Path) -> dict[str, Grant]:
    """The roster of a key directory: each Z85 public key's grant."""
    try:
        roster = json.loads((Path(directory) / ROSTER_FILE).read_text())
        return {key: Grant(entry["name"], frozenset(entry["identities"])) for key, entry in roster.items()}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise KeyFileError(f"cannot read {Path(directory) / ROSTER_FILE}: {exc!r}") from None


def _signing_key(path: Path) -> bytes | None:
    """The grant's signing key from a certificate's metadata (None in one written without it)."""
    prefix = f"{SIGNING_METADATA} ="
    try:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip().startswith(prefix):
                return bytes.fromhex(line.split("=", 1)[1].strip(' \t"'))
    except (OSError, ValueError) as exc:
        raise KeyFileError(f"cannot read the signing key in {path}: {exc}") from None
    return None


def load_signers(path: Path) -> dict[str, bytes]:
    """Each identity's Ed25519 signing public key (32 raw bytes) from a signers' list."""
    try:
        return {identity: bytes.fromhex(entry["signing_key"])
                for entry in json.loads(Path(path).read_text()).values() for identity in entry["identities"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise KeyFileError(f"cannot read {path}: {exc!r}") from None


class ClientKeyring:
    """The keys of a node's (or worker's) sockets: the coordinator's public key file and either one
    ``.key_secret`` file for all of them, or a directory with ``<identity>.key_secret`` per device. Files are
    checked when the ring is made, per-device ones when first used. ``signers``: every identity's signing public
    key, from ``secagg_signers.json`` beside the coordinator's key (None where there is none)."""

    def __init__(self, server_key: Path, key: Path):
        self.server_public, _ = _load(Path(server_key), secret=False)
        self.key = Path(key)
        signers = Path(server_key).parent / SIGNERS_FILE
        self.signers = load_signers(signers) if signers.is_file() else None
        self._shared: ClientKeys | None = None
        if not self.key.is_dir():
            self._shared = self._read(self.key)

    def _read(self, path: Path) -> ClientKeys:
        public, secret = _load(path, secret=True)
        return ClientKeys(self.server_public, public, secret, _signing_key(path))

    @property
    def per_device(self) -> bool:
        """One key per identity (a directory of them), rather than one for all of this side's sockets."""
        return self._shared is None

    def for_identity(self, identity: str) -> ClientKeys:
        return self._shared or self._read(_secret_file(self.key, identity))


class Allowlist:
    """The ZAP handler of one ZeroMQ context: admits the roster's public keys, nothing else.

    Start it before the context's first CurveZMQ server socket binds: without a ZAP handler libzmq lets any
    CurveZMQ client in. Refusals are counted by reason (:attr:`refused`, :data:`HANDSHAKE_REFUSALS`) and each is
    passed to ``on_refused(address, reason)`` (the peer's IP address), in the handler's thread.
    """

    def __init__(self, ctx: zmq.Context, keys: ServerKeys, *,
                 on_refused: Callable[[str, str], None] | None = None):
        self._auth = _AddressedAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve_callback("*", credentials_provider=self)
        self.grants = keys.grants
        self.refused: Counter[str] = Counter({reason: 0 for reason in HANDSHAKE_REFUSALS})
        self.on_refused = on_refused

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP: is this Z85 public key in the roster? (Runs in the authenticator's thread.)"""
        known = key.decode("ascii", "replace") in self.grants
        if not known:
            self.refused["unknown_key"] += 1
            if self.on_refused is not None:
                self.on_refused(self._auth.address, "unknown_key")
        return known

    def stop(self) -> None:
        self._auth.stop()


class _AddressedAuthenticator(ThreadAuthenticator):
    """pyzmq's ZAP handler, remembering the address of the request it is answering (its credentials callback
    is given only the key)."""

    address = "?"

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self.address = msg[3].decode("utf-8", "replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)


def serve_curve(sock: zmq.Socket, keys: ServerKeys) -> None:
    """Make ``sock`` a CurveZMQ server (before it binds)."""
    sock.curve_server = True
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret


def connect_curve(sock: zmq.Socket, keys: ClientKeys) -> None:
    """Make ``sock`` a CurveZMQ client of the coordinator (before it connects)."""
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret
