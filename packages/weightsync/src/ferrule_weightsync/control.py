"""The control plane: who is in the group, which update comes next, and who is done with it.

It runs over a `torch.distributed.TCPStore` hosted by the sender (rank 0) at `host:port`, apart
from the data plane (a broadcast group or shared buffers) and from the default process group,
which a DeepSpeed trainer already owns. Every wait has a deadline, so a dead peer is an error
that names it, never a hang; a dead sender takes its store with it, which receivers see at once.

One update, as both sides see it:

    sender                                  receiver r
    publish  u{seq}/manifest (version, layout key; the layout itself once per model)
                                            read manifest, check it against expectations
    handshake (a layout's first update):    publish  u{seq}/ack/r = "" or an error message
    wait for every ack; publish u{seq}/go = "" (or the errors, and raise)
    ... data plane moves the buckets ...    ... yields tensors ...
                                            publish  u{seq}/done/r = "" or an error message
    wait for every done; raise if any receiver failed

Once every receiver has accepted a layout, its later updates skip the handshake (two round trips
before the first byte moves, every step). The broadcast transport also replaces the "done"
round trip with a one-number all-reduce on its own group; only a failing receiver writes "done".
"""

import pickle
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ferrule_weightsync.errors import PeerTimeoutError, WeightSyncError

OK = b""
FORGET_EVERY = 32  # updates between sweeps of old control keys out of the store


@dataclass(frozen=True)
class Manifest:
    version: int
    layout: str  # key of the pickled `update.Layout` (specs and buckets), published once
    checksums: bool
    extra: dict  # transport-specific (e.g. which shared buffers to map)
    handshake: bool = True  # receivers ack before data moves (False: layout accepted before)


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
    ):
        if world_size < 2:
            raise ValueError(
                f"a group needs the sender and at least one receiver, got {world_size}"
            )
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.connect_timeout = connect_timeout
        self._buckets: dict[int, int] = {}  # sender: bucket count of each update, for cleanup
        self.where = f"weight-sync group at {host}:{port}"
        try:
            self.store = dist.TCPStore(
                host,
                port,
                is_master=rank == 0,
                timeout=timedelta(seconds=connect_timeout),
                wait_for_workers=False,
            )
        except (RuntimeError, TimeoutError) as err:  # no sender listening, or port taken
            raise PeerTimeoutError(f"rank {rank}: cannot reach the {self.where}: {err}") from err

    # -- membership ------------------------------------------------------------------------

    def join(self, settings: dict | None = None) -> dict:
        """Register this rank; fail clearly on a second join or a different world size.

        The sender passes the group's `settings` (what every rank must agree on, such as the
        number of connections); every rank gets them back, so receivers need not be told."""
        if self.rank == 0:
            self.store.set("settings", pickle.dumps(settings or {}))
            self.store.set("world_size", str(self.world_size))  # last: receivers wait for it
        declared = int(self._get("world_size", "the sender", self.connect_timeout))
        if declared != self.world_size:
            raise WeightSyncError(
                f"receiver rank {self.rank} expects {self.world_size - 1} receivers, but the sender "
                f"of the {self.where} was created for {declared - 1}"
            )
        if self.store.add(f"joined/{self.rank}", 1) > 1:
            raise WeightSyncError(f"rank {self.rank} has already joined the {self.where}")
        if self.rank == 0:
            self._wait_all("joined", "join the group", self.connect_timeout)
        return pickle.loads(self._get("settings", "the sender"))

    # -- one update ------------------------------------------------------------------------

    def publish_manifest(self, seq: int, manifest: Manifest, buckets: int) -> None:
        self._buckets[seq] = buckets
        if len(self._buckets) > FORGET_EVERY:  # amortised: ~10 store round trips an update
            for old in sorted(self._buckets)[:-2]:
                self._forget(old)
        self.store.set(f"u{seq}/manifest", pickle.dumps(manifest))

    def publish_layout(self, key: str, blob: bytes) -> None:
        self.store.set(f"layouts/{key}", blob)

    def read_layout(self, key: str) -> bytes:
        return self._get(f"layouts/{key}", "the sender")

    def read_manifest(self, seq: int, timeout: float | None) -> Manifest:
        return pickle.loads(self._get(f"u{seq}/manifest", "the sender", timeout))

    def report(self, seq: int, stage: str, error: str = "") -> None:
        """Receiver: tell the sender this rank passed `stage` ("ack" or "done"), or why not."""
        try:
            self.store.set(f"u{seq}/{stage}/{self.rank}", error.encode())
        except dist.DistError as err:  # the sender, and its store, are gone
            raise WeightSyncError(f"rank {self.rank}: lost the {self.where}: {err}") from err

    def collect(self, seq: int, stage: str) -> list[str]:
        """Sender: wait for every receiver's report on `stage`; return their error messages."""
        self._wait_all(f"u{seq}/{stage}", f"report '{stage}' for update {seq}")
        return self._messages(seq, stage, range(1, self.world_size))

    def reported_errors(self, seq: int, stage: str) -> list[str]:
        """Sender: the messages of the receivers that have reported `stage`, without waiting
        for the others (who report only on failure in the broadcast transport's finish)."""
        ranks = range(1, self.world_size)
        return self._messages(
            seq, stage, [r for r in ranks if self.store.check([f"u{seq}/{stage}/{r}"])]
        )

    def _messages(self, seq: int, stage: str, ranks) -> list[str]:
        """The non-empty reports of `ranks` on `stage`, each naming its receiver."""
        ranks = list(ranks)
        if not ranks:
            return []
        messages = self.store.multi_get([f"u{seq}/{stage}/{rank}" for rank in ranks])
        return [f"receiver {r}: {m.decode()}" for r, m in zip(ranks, messages, strict=True) if m]

    def decide(self, seq: int, errors: list[str]) -> None:
        """Sender: let the receivers go ahead, or abort the update with the collected errors."""
        self.store.set(f"u{seq}/go", "\n".join(errors).encode())

    def await_decision(self, seq: int) -> str:
        return self._get(f"u{seq}/go", "the sender").decode()

    def signal(self, seq: int, bucket: int, what: str, value: bytes = OK) -> None:
        self.store.set(self._bucket_key(seq, bucket, what), value)

    def await_signal(self, seq: int, bucket: int, what: str, who: str) -> bytes:
        return self._get(self._bucket_key(seq, bucket, what), who)

    def await_all_signals(self, seq: int, bucket: int, what: str) -> None:
        """Sender: wait until every receiver has signalled `what` for this bucket."""
        self._wait_all(f"u{seq}/b{bucket}/{what}", f"signal '{what}' for bucket {bucket}")

    def signal_mine(self, seq: int, bucket: int, what: str) -> None:
        """Receiver: signal `what` for this bucket under this rank."""
        self.store.set(f"u{seq}/b{bucket}/{what}/{self.rank}", OK)

    @staticmethod
    def _bucket_key(seq: int, bucket: int, what: str) -> str:
        return f"u{seq}/b{bucket}/{what}"

    # -- helpers ---------------------------------------------------------------------------

    def _get(self, key: str, who: str, timeout: float | None = -1.0) -> bytes:
        """Wait for `key`; `timeout` None waits forever (while the store is alive), -1 uses the
        group's timeout."""
        limit = self.timeout if timeout == -1.0 else timeout
        deadline = None if limit is None else time.monotonic() + limit
        while True:
            step = 1.0 if deadline is None else max(0.001, min(1.0, deadline - time.monotonic()))
            try:  # one round trip: the store's get blocks until the key exists or `step` passes
                self.store.set_timeout(timedelta(seconds=step))
                return self.store.get(key)
            except (RuntimeError, TimeoutError, dist.DistStoreError) as err:
                if "timeout" not in str(err).lower() and "timed out" not in str(err).lower():
                    raise WeightSyncError(
                        f"rank {self.rank}: lost the {self.where} while waiting for {who} "
                        f"({key}): {err}"
                    ) from err
            finally:  # the other store calls keep the group's timeout
                self.store.set_timeout(timedelta(seconds=self.timeout))
            if deadline is not None and time.monotonic() >= deadline:
                raise PeerTimeoutError(
                    f"rank {self.rank}: {who} did not answer within {limit:g}s ({key}) "
                    f"on the {self.where}"
                )

    def _wait_all(self, prefix: str, what: str, timeout: float | None = None) -> None:
        """Block (in the store, not by polling: CPU is scarce while data moves) until every
        receiver has set `prefix/<rank>`; on timeout, name the ranks still missing."""
        keys = [f"{prefix}/{rank}" for rank in range(1, self.world_size)]
        timeout = self.timeout if timeout is None else timeout
        try:
            self.store.wait(keys, timedelta(seconds=timeout))
        except dist.DistError as err:
            missing = [rank for rank, key in enumerate(keys, 1) if not self.store.check([key])]
            raise PeerTimeoutError(
                f"receivers {missing} did not {what} within {timeout:g}s on the {self.where}"
            ) from err

    def _forget(self, seq: int) -> None:
        """Drop an old update's keys so the store does not grow with every step."""
        keys = [f"u{seq}/manifest", f"u{seq}/go"]
        for bucket in range(self._buckets.pop(seq)):
            keys += [self._bucket_key(seq, bucket, what) for what in ("ready", "checksum")]
            keys += [f"u{seq}/b{bucket}/free/{rank}" for rank in range(1, self.world_size)]
        keys += [
            f"u{seq}/{stage}/{r}" for stage in ("ack", "done") for r in range(1, self.world_size)
        ]
        for key in keys:
            self.store.delete_key(key)

    def close(self) -> None:
        del self.store
