"""The control plane: who is in the group, which update comes next, and who is done with it.

It runs over a `torch.distributed.TCPStore` that the sender (rank 0) hosts at `host:port`. The
store is separate from the data plane (a broadcast group or shared buffers) and from the default
process group, which a DeepSpeed trainer already owns. Every wait has a deadline, so a dead peer
causes an error that names it, never a hang. A dead sender takes its store with it, and the
receivers see that at once.

One update, as both sides see it:

    sender                                  receiver r
    publish  u{seq}/manifest (version, layout key; the layout itself once per model)
                                            read manifest, check it against expectations
    handshake (a layout's first update):    publish  u{seq}/ack/r = "" or an error message
    wait for every ack; publish u{seq}/go = "" (or the errors, and raise)
    ... data plane moves the buckets ...    ... yields tensors ...
                                            publish  u{seq}/done/r = "" or an error message
    wait for every done; raise if any receiver failed

Once every receiver has accepted a layout, later updates with that layout skip the handshake,
which would cost two round trips before the first byte moves, every step. The broadcast
transport also replaces the "done" round trip with a one-number all-reduce on its own group;
only a receiver that fails writes "done".

The sender's `close` ends the stream with one more manifest, END, under the next update's key.
Each receiver's `receive` returns None when it reads END, and the receiver reports `end/r`. The
sender waits briefly for these reports before its store, and with it the group, goes away. A
receiver that closes (or whose process exits) reports `end/r` too, so that a sender closing
later does not wait for it.

Every value is JSON, checked on arrival, and signed when the group has a secret (messages.py).
The store is open to anyone who reaches its port, so nothing read from it can run code.

Joining with a secret works like this. The sender publishes a random nonce. Each receiver
publishes its own nonce and a proof (an HMAC of its rank and both nonces under the secret).
The sender checks every proof, then publishes the list of receiver nonces, signed with the
session key that those nonces and the sender's nonce make. Every later message of the group,
in either direction, is signed with that key.
"""

import hmac
import logging
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ferrule_weightsync import messages
from ferrule_weightsync.errors import (
    ForgedMessageError,
    MalformedMessageError,
    PeerTimeoutError,
    WeightSyncError,
)
from ferrule_weightsync.messages import Seal, fields, integer

FORGET_EVERY = 32  # updates between sweeps of old control keys out of the store
WAIT_LOG_SECONDS = 30.0  # how often a long wait for receivers logs the ones still missing
END = {"end": True}  # the manifest that ends the stream (the sender's close)
logger = logging.getLogger("ferrule_weightsync")


@dataclass(frozen=True)
class Manifest:
    version: int
    layout: str  # key of the update's layout (its tensors' specs), published once
    checksums: bool
    generation: int = 0  # ipc: which generation of shared buffers to map (broadcast: 0)
    handshake: bool = True  # receivers ack before data moves (False: layout accepted before)

    def to_wire(self) -> dict:
        return {
            "version": self.version,
            "layout": self.layout,
            "checksums": self.checksums,
            "generation": self.generation,
            "handshake": self.handshake,
        }

    @classmethod
    def from_wire(cls, value: object, key: str) -> "Manifest":
        checks = {
            "version": integer,
            "layout": messages.layout_key,
            "checksums": messages.flag,
            "generation": integer,
            "handshake": messages.flag,
        }
        return cls(**fields(value, key, checks))


class Control:
    """One side's handle on the shared store. Rank 0 is the sender; ranks 1..N are receivers."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout: float,
        connect_timeout: float,
        secret: str | bytes | None = None,
    ):
        if world_size < 2:
            raise ValueError(
                f"a group needs the sender and at least one receiver, got {world_size}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.connect_timeout = connect_timeout
        self._secret = messages.as_secret(secret)
        self._seal = Seal()  # signs from the end of join() on, when there is a secret
        self._buckets: dict[int, int] = {}  # sender: bucket count of each update, for cleanup
        self._aborted = ""  # set by abort(), from any thread; every wait checks it
        self.closed = False  # by close(): the store connection is gone
        self._waiting: list[str] = []  # the keys a _wait_all blocks on, for abort() to set
        self._address = (host, port)
        self.where = f"weight-sync group at {host}:{port}"
        try:
            self.store = open_store(host, port, rank == 0, connect_timeout)
        except (RuntimeError, TimeoutError) as err:  # no sender listening, or port taken
            raise PeerTimeoutError(f"rank {rank}: cannot reach the {self.where}: {err}") from err

    # -- membership ------------------------------------------------------------------------

    def join(self, settings: dict[str, int | None] | None = None) -> dict[str, int | None]:
        """Register this rank. Fail with a clear error on a second join, on a different world
        size, or (with a secret) on a peer that does not know the secret. A different world size
        fails on both sides at once, because the receiver tells the sender.

        The sender passes the group's `settings`: what every rank must agree on, such as the
        number of connections, as names mapped to ints or None. Every rank gets the settings
        back, so receivers need not be told them."""
        if self.rank == 0:
            hello = {"world_size": self.world_size, "signed": self._secret is not None}
            if self._secret is not None:
                self._nonce = os.urandom(messages.NONCE_BYTES)
                hello["nonce"] = messages.to_b64(self._nonce)
            self.store.set("hello", messages.encode(hello))  # receivers wait for it
        self._check_hello()
        if self.store.add(f"joined/{self.rank}", 1) > 1:
            raise WeightSyncError(f"rank {self.rank} has already joined the {self.where}")
        if self._secret is not None and self.rank > 0:
            self._prove()
        if self.rank == 0:
            self._wait_all("joined", "join the group", self.connect_timeout)
            self._check_refused()
            if self._secret is not None:
                self._admit()
            self._put("settings", settings or {})
        elif self._secret is not None:
            self._enter()
        return self._take("settings", "the sender", self._settings)

    def _check_hello(self) -> None:
        """Read the sender's greeting: the group's size and, with a secret, the sender's nonce,
        which is kept in `self._nonce`."""
        raw = self._get("hello", "the sender", self.connect_timeout)
        checks = {"world_size": integer, "signed": messages.flag}
        value = messages.decode(raw, "hello")
        if isinstance(value, dict) and "nonce" in value:
            checks["nonce"] = messages.text
        hello = fields(value, "hello", checks)
        if hello["world_size"] != self.world_size:
            self._refuse(hello["world_size"])
            raise WeightSyncError(
                f"receiver rank {self.rank} expects {self.world_size - 1} receivers, but the sender "
                f"of the {self.where} was created for {hello['world_size'] - 1}"
            )
        if hello["signed"] != (self._secret is not None):
            mine = "has a secret" if self._secret is not None else "has no secret"
            raise WeightSyncError(
                f"rank {self.rank} {mine} but the {self.where} "
                + ("requires one" if hello["signed"] else "has none: give both sides the same")
            )
        if hello["signed"]:
            nonce = messages.from_b64(hello.get("nonce"), "hello", "nonce", messages.NONCE_BYTES)
            self._nonce = nonce

    def _refuse(self, world_size: int) -> None:
        """Called on a receiver whose group size differs from the sender's. Say so under
        `refused`, and wake the sender's wait for every rank to join (adding 0 creates a key
        without counting a join). The sender then fails at once rather than after its connect
        timeout."""
        self._put("refused", {"rank": self.rank, "receivers": self.world_size - 1})
        for rank in range(1, world_size):
            self.store.add(f"joined/{rank}", 0)

    def _check_refused(self) -> None:
        """Sender, once woken from its wait for the joins: fail if a receiver refused."""
        if not self.store.check(["refused"]):
            return
        checks = {"rank": integer, "receivers": integer}
        refused = self._take("refused", "a receiver", lambda v, key: fields(v, key, checks))
        raise WeightSyncError(
            f"receiver rank {refused['rank']} was started for {refused['receivers']} receivers, "
            f"but the sender of the {self.where} expects {self.world_size - 1}: give the sender "
            "and every receiver the same number of receivers"
        )

    def _prove(self) -> None:
        """Receiver: publish this rank's nonce and the proof that it knows the secret."""
        self._my_nonce = os.urandom(messages.NONCE_BYTES)
        proof = messages.join_proof(self._secret, self.rank, self._nonce, self._my_nonce)
        value = {"nonce": messages.to_b64(self._my_nonce), "proof": messages.to_b64(proof)}
        self.store.set(f"proof/{self.rank}", messages.encode(value))

    def _admit(self) -> None:
        """Sender: check every receiver's proof, then sign every later message with the session
        key."""
        nonces = []
        for rank in range(1, self.world_size):
            key = f"proof/{rank}"
            value = fields(
                messages.decode(self._get(key, f"receiver {rank}"), key),
                key,
                {"nonce": messages.text, "proof": messages.text},
            )
            nonce = messages.from_b64(value["nonce"], key, "nonce", messages.NONCE_BYTES)
            proof = messages.from_b64(value["proof"], key, "proof", messages.MAC_BYTES)
            expected = messages.join_proof(self._secret, rank, self._nonce, nonce)
            if not hmac.compare_digest(proof, expected):
                raise ForgedMessageError(
                    f"receiver {rank} joined the {self.where} without the group's secret "
                    f"(its proof, {key}, does not check out)"
                )
            nonces.append(nonce)
        self._seal = Seal(messages.session_key(self._secret, self._nonce, nonces))
        self._put("session", [messages.to_b64(n) for n in nonces])

    def _enter(self) -> None:
        """Receiver: read the sender's list of receiver nonces. Check that the list is signed
        with the session key these nonces make, and that it holds this rank's nonce."""
        raw = self._get("session", "the sender", self.connect_timeout)
        value = messages.decode(raw[messages.MAC_BYTES :], "session")
        if not isinstance(value, list) or len(value) != self.world_size - 1:
            raise MalformedMessageError(
                f"control message session: expected a list of {self.world_size - 1} nonces"
            )
        nonces = [messages.from_b64(n, "session", "nonce", messages.NONCE_BYTES) for n in value]
        self._seal = Seal(messages.session_key(self._secret, self._nonce, nonces))
        self._seal.open("session", raw)  # check the signature before the list is used further
        if nonces[self.rank - 1] != self._my_nonce:
            raise ForgedMessageError(
                f"rank {self.rank}: the {self.where}'s session does not hold this rank's nonce"
            )

    @staticmethod
    def _settings(value: object, key: str) -> dict[str, int | None]:
        messages.mapping(value, key, "settings")
        for name, setting in value.items():
            if setting is not None:
                integer(setting, key, name)
        return value

    # -- one update ------------------------------------------------------------------------

    def publish_manifest(self, seq: int, manifest: Manifest, buckets: int) -> None:
        self._buckets[seq] = buckets
        if len(self._buckets) > FORGET_EVERY:  # amortised: ~10 store round trips an update
            for old in sorted(self._buckets)[:-2]:
                self._forget(old)
        self._put(f"u{seq}/manifest", manifest.to_wire())

    def publish_layout(self, key: str, value: object) -> None:
        self._put(f"layouts/{key}", value)

    def read_layout(self, key: str, check):
        """The layout published under `key`, as `check(value, store key)` makes it."""
        return self._take(f"layouts/{key}", "the sender", check)

    def read_manifest(self, seq: int, timeout: float | None) -> Manifest | None:
        """The manifest of update `seq`, or None where the sender ended the stream."""
        return self._take(f"u{seq}/manifest", "the sender", _manifest_or_end, timeout)

    def end(self, seq: int, timeout: float) -> None:
        """Sender: publish END as update `seq`'s manifest and wait up to `timeout` seconds for
        every receiver to read it (or to have closed); log those that did not."""
        self._put(f"u{seq}/manifest", END)
        if timeout <= 0:
            return
        try:
            self._wait_all("end", "see the end of the stream", timeout)
        except WeightSyncError as err:  # close anyway: late receivers find the group gone
            logger.warning("closing without every receiver seeing the end: %s", err)

    def report_end(self) -> None:
        """Receiver: report that this rank has read END, or closes before reading it, so that a
        closing sender need not wait for it."""
        self._put(f"end/{self.rank}", "")

    def publish(self, key: str, value: object) -> None:
        """A transport's own message (JSON-able)."""
        self._put(key, value)

    def has(self, key: str) -> bool:
        """Whether a message was published under `key` (no wait)."""
        return self.store.check([key])

    def read(self, key: str, check, who: str = "the sender"):
        """A transport's own message, as `check(value, store key)` makes it."""
        return self._take(key, who, check)

    def report(self, seq: int, stage: str, error: str = "") -> None:
        """Receiver: tell the sender this rank passed `stage` ("ack" or "done"), or why not."""
        try:
            self._put(f"u{seq}/{stage}/{self.rank}", error)
        except dist.DistError as err:  # the sender, and its store, are gone
            raise WeightSyncError(self._lost(f"reporting '{stage}' for update {seq}", err)) from err

    def collect(self, seq: int, stage: str, timeout: float | None = None) -> list[str]:
        """Sender: wait for every receiver's report on `stage` (up to `timeout` seconds,
        default the group's); return their error messages."""
        found = self._wait_all(f"u{seq}/{stage}", f"report '{stage}' for update {seq}", timeout)
        return self._named_messages(range(1, self.world_size), found)

    def reported_errors(self, seq: int, stage: str) -> list[str]:
        """Sender: the messages of the receivers that have reported `stage`, without waiting
        for the others. (In the broadcast transport's finish, receivers report only on
        failure.)"""
        ranks = range(1, self.world_size)
        return self._messages(
            seq, stage, [r for r in ranks if self.store.check([f"u{seq}/{stage}/{r}"])]
        )

    def _messages(self, seq: int, stage: str, ranks) -> list[str]:
        """The non-empty reports of `ranks` on `stage`, each naming its receiver."""
        ranks = list(ranks)
        if not ranks:
            return []
        return self._named_messages(ranks, self._multi_get([f"u{seq}/{stage}/{r}" for r in ranks]))

    def _named_messages(self, ranks, found: list[tuple[str, bytes]]) -> list[str]:
        texts = [self._open(key, raw, messages.text) for key, raw in found]
        return [f"receiver {r}: {m}" for r, m in zip(ranks, texts, strict=True) if m]

    def decide(self, seq: int, errors: list[str]) -> None:
        """Sender: let the receivers go ahead, or abort the update with the collected errors."""
        self._put(f"u{seq}/go", "\n".join(errors))

    def await_decision(self, seq: int) -> str:
        return self._take(f"u{seq}/go", "the sender", messages.text)

    def signal(self, seq: int, bucket: int, what: str, value: object = None) -> None:
        self._put(self._bucket_key(seq, bucket, what), value)

    def await_signal(self, seq: int, bucket: int, what: str, who: str, check=None):
        """Wait for a signal and return its value, as `check(value, store key)` makes it. With
        no `check`, the value must be null."""
        return self._take(self._bucket_key(seq, bucket, what), who, check or _null)

    def await_all_signals(self, seq: int, bucket: int, what: str) -> None:
        """Sender: wait until every receiver has signalled `what` for this bucket."""
        prefix = f"u{seq}/b{bucket}/{what}"
        self._wait_all(prefix, f"signal '{what}' for bucket {bucket}")
        if self._seal.key is not None:  # anyone could have set these keys: check signatures
            keys = [f"{prefix}/{rank}" for rank in range(1, self.world_size)]
            for key, raw in self._multi_get(keys):
                self._open(key, raw, _null)

    def signal_mine(self, seq: int, bucket: int, what: str) -> None:
        """Receiver: signal `what` for this bucket under this rank."""
        self._put(f"u{seq}/b{bucket}/{what}/{self.rank}", None)

    @staticmethod
    def _bucket_key(seq: int, bucket: int, what: str) -> str:
        return f"u{seq}/b{bucket}/{what}"

    # -- helpers ---------------------------------------------------------------------------

    def abort(self, reason: str) -> None:
        """Make this side's current and later waits raise `WeightSyncError` with `reason`. A
        wait on every receiver ends at once; a wait on one key ends within a second. Meant to be
        called from another thread while this side waits: it sets a flag, and it sets the keys
        being waited on."""
        self._aborted = reason or "no reason given"
        if self._waiting:  # a _wait_all in progress: wake it through a connection of our own
            host, port = self._address
            waker = open_store(host, port, False, 5.0)
            for key in self._waiting:
                waker.set(key, b"")

    def check_aborted(self) -> None:
        if self._aborted:
            raise WeightSyncError(f"rank {self.rank}: aborted: {self._aborted} ({self.where})")

    def _put(self, key: str, value: object) -> None:
        self.store.set(key, self._seal.close(key, messages.encode(value)))

    def _take(self, key: str, who: str, check, timeout: float | None = -1.0):
        return self._open(key, self._get(key, who, timeout), check)

    def _open(self, key: str, raw: bytes, check):
        return check(messages.decode(self._seal.open(key, raw), key), key)

    def _lost(self, doing: str, err: Exception) -> str:
        """The error message for a lost connection to the store. A receiver's store is hosted
        by the sender, so a lost connection means the sender went away. A sender that exits,
        closed or not, ends the stream first, so receivers see this error only when the sender
        was killed outright."""
        if self.rank == 0:
            return f"rank 0: lost the {self.where} while {doing}: {err}"
        return (
            f"rank {self.rank}: the sender went away (killed, or its process ended without "
            f"ending the stream) while this rank was {doing} on the {self.where}"
        )

    def _multi_get(self, keys: list[str]) -> list[tuple[str, bytes]]:
        return list(zip(keys, self.store.multi_get(keys), strict=True))

    def _get(self, key: str, who: str, timeout: float | None = -1.0) -> bytes:
        """Wait for `key`; `timeout` None waits forever (while the store is alive), -1 uses the
        group's timeout."""
        limit = self.timeout if timeout == -1.0 else timeout
        deadline = None if limit is None else time.monotonic() + limit
        while True:
            self.check_aborted()
            try:  # one round trip: the store's get blocks until the key exists or a step passes
                self.store.set_timeout(timedelta(seconds=_step(deadline)))
                return self.store.get(key)
            except (RuntimeError, TimeoutError, dist.DistStoreError) as err:
                if not _timed_out(err):
                    raise WeightSyncError(self._lost(f"waiting for {who} ({key})", err)) from err
            finally:  # the other store calls keep the group's timeout
                self.store.set_timeout(timedelta(seconds=self.timeout))
            if deadline is not None and time.monotonic() >= deadline:
                raise PeerTimeoutError(
                    f"rank {self.rank}: {who} did not answer within {limit:g}s ({key}) "
                    f"on the {self.where}"
                )

    def _wait_all(
        self, prefix: str, what: str, timeout: float | None = None
    ) -> list[tuple[str, bytes]]:
        """Block until every receiver has set `prefix/<rank>`, and return (key, value) for each,
        in rank order. The wait happens in the store, not by polling, because CPU is scarce
        while data moves: it is one round trip, in which the store's get waits for the keys. A
        wait longer than WAIT_LOG_SECONDS logs the ranks still missing every WAIT_LOG_SECONDS,
        and the timeout error names them. An abort from another thread wakes the wait by
        setting the keys itself."""
        keys = [f"{prefix}/{rank}" for rank in range(1, self.world_size)]
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        self._waiting = keys  # before the check: abort() sets its flag, then reads this
        try:
            while True:
                self.check_aborted()
                step = min(WAIT_LOG_SECONDS, max(0.001, deadline - time.monotonic()))
                self.store.set_timeout(timedelta(seconds=step))
                try:
                    found = self._multi_get(keys)
                    break
                except dist.DistError as err:
                    missing = self._missing(keys)
                    if time.monotonic() >= deadline:
                        raise PeerTimeoutError(
                            f"receivers {missing} did not {what} within {timeout:g}s on the "
                            f"{self.where} ({self._count(missing)})"
                        ) from err
                    logger.warning(
                        "%s: waiting for receivers %s to %s (%s; %.0fs of %gs)",
                        self.where, missing, what, self._count(missing),
                        timeout - (deadline - time.monotonic()), timeout,
                    )  # fmt: skip
        finally:
            self._waiting = []
            self.store.set_timeout(timedelta(seconds=self.timeout))  # for the other calls
        self.check_aborted()  # raises if abort() woke the wait, not the receivers
        return found

    def _missing(self, keys: list[str]) -> list[int]:
        return [rank for rank, key in enumerate(keys, 1) if not self.store.check([key])]

    def _count(self, missing: list[int]) -> str:
        expected = self.world_size - 1
        return f"the sender expects {expected} receivers, ranks 1 to {expected}; " + (
            f"{expected - len(missing)} did"
        )

    def _forget(self, seq: int) -> None:
        """Drop an old update's keys so the store does not grow with every step."""
        keys = [f"u{seq}/manifest", f"u{seq}/go"]
        for bucket in range(self._buckets.pop(seq)):
            keys += [self._bucket_key(seq, bucket, what) for what in ("ready", "checksum")]
            keys += [f"u{seq}/b{bucket}/free/{rank}" for rank in range(1, self.world_size)]
        keys += [
            f"u{seq}/{stage}/{r}"
            for stage in ("ack", "done", "ready")
            for r in range(1, self.world_size)
        ]
        for key in keys:
            self.store.delete_key(key)

    def check_open(self) -> None:
        """For a sender's `send`: a closed sender says so (its store connection is gone)."""
        if self.closed:
            raise WeightSyncError(
                f"{self.where}: this sender is closed; create a new sender and receivers"
            )

    def close(self) -> None:
        if not self.closed:  # a receiver closed twice
            self.closed = True
            del self.store


CONNECT_ATTEMPT = 2.0  # seconds a connection to the store may take before a fresh one is tried
TORCH_RETRIES_AFTER = 5.0  # seconds after which torch's client tries a lost handshake again
OWN_STORE_CONNECT = 2 * TORCH_RETRIES_AFTER + CONNECT_ATTEMPT  # sender to its own store, seconds


def open_store(host: str, port: int, is_master: bool, timeout: float) -> dist.TCPStore:
    """Open a connection to the group's store within `timeout` seconds; the sender also
    creates the store itself.

    torch's store now and then leaves a new connection's handshake unanswered (6 in 150
    connections on loopback here) and tries again only after 5 s. So a connection given 5 s or
    less (`abort`'s waker, a short connect timeout) would fail outright. A receiver's
    connection given less than 15 s is therefore made in attempts of CONNECT_ATTEMPT seconds.
    A longer one is made in one attempt, because torch's own retry leaves enough time (and a
    receiver waiting for its sender then logs no failed attempts). The sender's store is
    created only once: creating it again closed the connections of early receivers and could
    meet the sender's own old listener. So the sender's connection to its own store gets room
    for torch's retry, whatever `timeout` says. That connection waits for nobody, and a short
    connect timeout made it fail (CI, 2026-12-01)."""
    connect = max(timeout, OWN_STORE_CONNECT) if is_master else timeout
    deadline = time.monotonic() + connect
    one_attempt = is_master or connect >= 3 * TORCH_RETRIES_AFTER
    step = connect if one_attempt else CONNECT_ATTEMPT
    while True:
        attempt = max(0.001, min(step, deadline - time.monotonic()))
        try:
            store = dist.TCPStore(
                host,
                port,
                is_master=is_master,
                timeout=timedelta(seconds=attempt),
                wait_for_workers=False,
            )
        except (RuntimeError, TimeoutError) as err:
            if not _timed_out(err) or time.monotonic() >= deadline:
                raise
            continue
        store.set_timeout(timedelta(seconds=timeout))  # the other calls' deadline, as before
        return store


def _step(deadline: float | None) -> float:
    """Seconds of the next blocking store call: a second, or what is left before `deadline`."""
    return 1.0 if deadline is None else max(0.001, min(1.0, deadline - time.monotonic()))


def _timed_out(err: Exception) -> bool:
    text = str(err).lower()
    return "timeout" in text or "timed out" in text


def _manifest_or_end(value: object, key: str) -> Manifest | None:
    return None if value == END else Manifest.from_wire(value, key)


def _null(value: object, key: str) -> None:
    if value is not None:
        raise MalformedMessageError(f"control message {key} must be null, got {value!r:.80}")
