"""Round trips and failures of both CPU transports, with receivers in their own processes.

gloo broadcast and shared memory run the same protocol code as NCCL and CUDA IPC; the GPU
versions of these tests are in test_gpu.py.
"""

import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.distributed import TCPStore

from ferrule_weightsync import (
    MismatchError,
    PeerTimeoutError,
    TensorSpec,
    WeightSyncError,
    create_receiver,
    create_sender,
)
from ferrule_weightsync.packing import BucketViews, plan_buckets

PEER = Path(__file__).with_name("peer.py")
sys.path.insert(0, str(PEER.parent))
import peer  # noqa: E402
from peer import realistic_state_dict, scaled  # noqa: E402

TRANSPORTS = ["broadcast", "ipc"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Peers are forked from one server process that has imported torch and weightsync already:
# a fresh interpreter took ~2.6 s to import them here, for each of ~40 peers.
FORKSERVER = multiprocessing.get_context("forkserver")
FORKSERVER.set_forkserver_preload(["torch", "ferrule_weightsync", "peer"])


class Peer:
    """One peer process, with what a test uses of subprocess.Popen's verbs."""

    def __init__(self, argv: list[str], log: Path):
        self.log = log
        self.process = FORKSERVER.Process(target=peer.main_logged_to, args=(str(log), argv))
        self.process.start()

    def send_signal(self, sig: int) -> None:
        os.kill(self.process.pid, sig)

    def kill(self) -> None:
        self.process.kill()

    def poll(self) -> int | None:
        return self.process.exitcode

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        """Wait for it to end (subprocess.TimeoutExpired after `timeout`); its output."""
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(f"peer {self.process.pid}", timeout)
        return (self.log.read_text() if self.log.exists() else ""), None


class Peers:
    """Receiver (or sender) processes running peer.py, with their saved results."""

    def __init__(self, tmp_path: Path):
        self.tmp_path, self.procs = tmp_path, []

    def start(self, n: int = 1, role: str = "receiver", **options) -> list[Peer]:
        started = []
        for rank in range(1, n + 1):
            argv = ["--role", role, "--rank", str(rank)]
            argv += ["--out", str(self.tmp_path / f"{role}{rank}.pt")]
            for key, value in options.items():
                argv += [f"--{key.replace('_', '-')}", str(value)]
            proc = Peer(argv, self.tmp_path / f"{role}{rank}.log")
            self.procs.append(proc)
            started.append(proc)
        return started

    def results(self, rank: int) -> list[dict]:
        proc = self.procs[rank - 1]
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, output
        return torch.load(self.tmp_path / f"receiver{rank}.pt", weights_only=False)

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate()


@pytest.fixture
def peers(tmp_path):
    p = Peers(tmp_path)
    yield p
    p.kill_all()


def assert_same(received: dict, sent: dict) -> None:
    assert list(received) == list(sent)  # every tensor, in order
    for name, tensor in sent.items():
        got = received[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got, tensor), name


# gloo's default is several connections with several buckets in flight; one connection is the
# other path through the same code. Receivers are never told: they learn it from the sender.
# With a secret, every control message is signed and every receiver proves it knows it.
SECRET = "weight-sync-test-secret-0123456789"


@pytest.mark.parametrize(
    ("transport", "options"),
    [
        ("broadcast", {}),
        ("broadcast", {"streams": 1}),
        ("ipc", {}),
        ("broadcast", {"secret": SECRET}),
        ("ipc", {"secret": SECRET}),
    ],
    ids=["broadcast", "broadcast-1-stream", "ipc", "broadcast-secret", "ipc-secret"],
)
@pytest.mark.parametrize("receivers", [1, 3])
def test_round_trip_with_versions(transport, options, receivers, peers):
    port = free_port()
    secret = {"secret": options["secret"]} if "secret" in options else {}
    peers.start(
        receivers, transport=transport, port=port, num_receivers=receivers, updates=3, **secret
    )
    sender = create_sender(
        transport,
        "127.0.0.1",
        port,
        receivers,
        bucket_bytes=4096,
        checksums=True,
        timeout=30,
        **options,
    )
    state = realistic_state_dict()
    assert sender.send(state.items()) == 1  # versions count up from 1 ...
    assert sender.send(list(scaled(state, 2.0).items())) == 2
    assert sender.send(scaled(state, -1.0).items(), version=10) == 10  # ... or are given
    assert sender.version == 10
    sender.close()
    for rank in range(1, receivers + 1):
        results = peers.results(rank)
        assert [r["version"] for r in results] == [1, 2, 10]
        for result, factor in zip(results, [1.0, 2.0, -1.0], strict=True):
            assert_same(result["state"], scaled(state, factor))
        if transport == "ipc":  # two buffers mapped once, then reused by every later update
            assert results[-1]["handles_opened"] == 2


def test_lazy_stream_with_specs_is_sent_bucket_by_bucket(peers):
    port = free_port()
    peers.start(1, port=port, updates=1)
    sender = create_sender("broadcast", "127.0.0.1", port, 1, bucket_bytes=4096, timeout=30)
    state = realistic_state_dict()
    pulled = []

    def stream():  # what a ZeRO-3 trainer does: gather each tensor only when it is needed
        for name, tensor in state.items():
            pulled.append(name)
            yield name, tensor

    sender.send(stream(), specs=[TensorSpec.of(n, t) for n, t in state.items()])
    sender.close()
    assert pulled == list(state)
    assert_same(peers.results(1)[0]["state"], state)


def test_tensors_of_half_a_bucket_or_more_are_sent_unpacked(peers):
    port = free_port()
    peers.start(1, port=port, updates=1)
    sender = create_sender("broadcast", "127.0.0.1", port, 1, bucket_bytes=8192, timeout=30)
    # 4096 bytes each (half a bucket): three buckets, each one tensor sent from its own memory,
    # so the sender never fills (or even allocates) a staging buffer
    state = {"a": torch.randn(64, 16), "b": torch.randn(1024), "c": torch.randn(32, 32)}
    sender.send(state.items())
    assert all(buffer is None for buffer in sender._group.buffers)
    sender.close()
    assert_same(peers.results(1)[0]["state"], state)


def test_tensors_laid_out_in_the_senders_buckets_are_sent_from_where_they_lie(peers):
    """What ferrule-trainer's ZeRO-3 export does: the tensors are views of buffers laid out by
    plan_buckets at the sender's bucket size, so the sender never packs a bucket."""
    port = free_port()
    peers.start(1, port=port, updates=1)
    sender = create_sender("broadcast", "127.0.0.1", port, 1, bucket_bytes=4096, timeout=30)
    state = realistic_state_dict()
    specs = [TensorSpec.of(name, tensor) for name, tensor in state.items()]
    laid_out = []
    for bucket in plan_buckets(specs, sender.bucket_bytes):
        buffer = torch.empty(bucket.nbytes, dtype=torch.uint8)
        views = BucketViews()(buffer, bucket)
        for spec, view in zip(bucket.specs, views, strict=True):
            view.copy_(state[spec.name])
            laid_out.append((spec.name, view))
    sender.send(laid_out, specs=specs)
    assert all(buffer is None for buffer in sender._group.buffers)  # no staging buffer
    sender.close()
    assert_same(peers.results(1)[0]["state"], state)


@pytest.mark.parametrize("load_into", ["", "all"])  # iterating the update, or Update.load_into
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_cast_to_the_receivers_dtypes(transport, load_into, peers):
    port = free_port()
    options = {"load_into": load_into} if load_into else {}
    peers.start(1, transport=transport, port=port, expect="float32", cast="true", **options)
    sender = create_sender(transport, "127.0.0.1", port, 1, bucket_bytes=4096, timeout=30)
    state = realistic_state_dict()
    assert len(plan_buckets([TensorSpec.of(n, t) for n, t in state.items()], 4096)) > 2
    sender.send(state.items())
    sender.close()
    received = peers.results(1)[0]["state"]
    assert set(received) == set(state)
    for name, tensor in state.items():
        want = tensor.float() if tensor.is_floating_point() else tensor
        assert received[name].dtype == want.dtype and torch.equal(received[name], want), name


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_load_into_without_a_target_fails_the_update_naming_the_tensor(transport, peers):
    port = free_port()
    peers.start(1, transport=transport, port=port, load_into="missing")
    sender = create_sender(transport, "127.0.0.1", port, 1, bucket_bytes=4096, timeout=30)
    with pytest.raises(WeightSyncError, match=r"receiver 1: .*no target for \['layers.0.odd'\]"):
        sender.send(realistic_state_dict().items())
    sender.close()
    assert "no target for ['layers.0.odd']" in peers.results(1)[0]["error"]


def test_mismatch_is_refused_before_any_data_and_names_the_tensor(peers):
    port = free_port()
    peers.start(1, port=port, expect="wrong-shape")
    sender = create_sender("broadcast", "127.0.0.1", port, 1, bucket_bytes=4096, timeout=30)
    with pytest.raises(
        MismatchError,
        match=r"'layers.0.odd': sender shape \(7, 13, 3\), receiver expects \(7, 13\)",
    ):
        sender.send(realistic_state_dict().items())
    sender.close()
    [result] = peers.results(1)
    assert "MismatchError" in result["error"] and "layers.0.odd" in result["error"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_accepted_layout_skips_the_handshake_but_a_changed_receiver_still_refuses(transport, peers):
    port = free_port()
    peers.start(1, transport=transport, port=port, updates=4, refuse_update=3)
    sender = create_sender(transport, "127.0.0.1", port, 1, bucket_bytes=4096, timeout=30)
    state = realistic_state_dict()
    assert sender.send(state.items()) == 1
    assert sender.send(state.items()) == 2
    # The receiver's expectations changed after it took this layout: the data moved without a
    # handshake, so the refusal comes with the "done" report, still naming the tensor.
    with pytest.raises(MismatchError, match=r"(?s)receiver 1: MismatchError: .*'layers.0.odd'"):
        sender.send(state.items())
    assert sender.send(scaled(state, 3.0).items()) == 3  # in step; the refused one is no version
    sender.close()
    first, second, refused, fourth = peers.results(1)
    assert [first["handshake"], second["handshake"], fourth["handshake"]] == [True, False, True]
    assert fourth["version"] == 3
    assert refused["error"].startswith("MismatchError") and "'layers.0.odd'" in refused["error"]
    assert_same(second["state"], state)
    assert_same(fourth["state"], scaled(state, 3.0))


def test_dtype_mismatch_without_cast_is_refused(peers):
    port = free_port()
    peers.start(1, port=port, expect="float32")
    sender = create_sender("broadcast", "127.0.0.1", port, 1, timeout=30)
    with pytest.raises(
        MismatchError,
        match=r"'embed.weight': sender dtype torch.bfloat16, receiver expects torch.float32 \(receive with cast=True",
    ):
        sender.send(realistic_state_dict().items())
    sender.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_consumer_that_stops_early_fails_the_update_but_not_the_group(transport, peers):
    port = free_port()
    peers.start(1, transport=transport, port=port, stop_after=3)
    sender = create_sender(transport, "127.0.0.1", port, 1, bucket_bytes=4096, timeout=30)
    with pytest.raises(WeightSyncError, match="receiver 1: the consumer stopped before the end"):
        sender.send(realistic_state_dict().items())
    sender.close()
    assert len(peers.results(1)[0]["state"]) == 3


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_receiver_killed_mid_transfer_is_an_error_within_the_timeout(transport, peers):
    port = free_port()
    [proc] = peers.start(1, transport=transport, port=port, stall_at=4)
    sender = create_sender(transport, "127.0.0.1", port, 1, bucket_bytes=4096, timeout=4)
    threading.Timer(2.0, proc.send_signal, [signal.SIGKILL]).start()
    started = time.monotonic()
    with pytest.raises(WeightSyncError):
        sender.send(realistic_state_dict().items())
    assert time.monotonic() - started < 4 + 3  # the timeout, plus slack for a loaded machine
    sender.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_abort_from_another_thread_ends_a_stuck_send_at_once(transport, peers):
    """A trainer that learns a receiver died (its engine's actor is gone) must not wait out
    the group's timeout: abort() ends the blocked send at once."""
    port = free_port()
    peers.start(1, transport=transport, port=port, updates=0)  # joins, then is gone
    sender = create_sender(transport, "127.0.0.1", port, 1, bucket_bytes=4096, timeout=120)
    threading.Timer(2.0, sender.abort, ["rollout engine 1 died"]).start()
    started = time.monotonic()
    with pytest.raises(WeightSyncError, match="aborted: rollout engine 1 died"):
        sender.send(realistic_state_dict().items())  # waits for the receiver's ack
    assert time.monotonic() - started < 2 + 5  # not the 120 s timeout
    with pytest.raises(WeightSyncError, match="aborted: rollout engine 1 died"):
        sender.send(realistic_state_dict().items())  # a new group is needed now
    sender.close()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sender_killed_mid_transfer_is_an_error_for_receivers(transport, peers):
    port = free_port()
    [proc] = peers.start(1, role="sender", transport=transport, port=port, stall_at=5)
    receiver = create_receiver(transport, "127.0.0.1", port, 1, 1, timeout=4)
    update = receiver.receive(timeout=20)
    threading.Timer(1.0, proc.send_signal, [signal.SIGKILL]).start()
    started = time.monotonic()
    with pytest.raises(WeightSyncError):
        for _ in update:
            pass
    assert time.monotonic() - started < 4 + 3


@pytest.mark.e2e  # ~10 s: it waits out a timeout
def test_receiver_that_never_joins_times_out_with_its_rank(peers):
    port = free_port()
    peers.start(1, port=port, num_receivers=2)  # rank 1 joins, rank 2 never comes
    started = time.monotonic()
    # 10 s: rank 1 is a fresh process that must import torch first, on a busy 2-core machine
    with pytest.raises(
        PeerTimeoutError, match=r"receivers \[2\] did not join the group within 10s"
    ):
        create_sender("broadcast", "127.0.0.1", port, 2, connect_timeout=10)
    assert time.monotonic() - started < 10 + 3


def test_receiver_joining_twice_gets_a_clear_error():
    port = free_port()
    outcomes = {}
    sender = threading.Thread(target=lambda: outcomes.setdefault("sender", _try_sender(port, 2)))
    first = threading.Thread(target=lambda: outcomes.setdefault("first", _try_receiver(port, 1, 2)))
    sender.start()
    time.sleep(0.5)
    first.start()
    probe = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
    probe.wait(["joined/1"])  # the real rank 1 is in
    with pytest.raises(WeightSyncError, match="rank 1 has already joined the weight-sync group"):
        create_receiver("broadcast", "127.0.0.1", port, 1, 2, timeout=5)
    sender.join()
    first.join()
    assert isinstance(outcomes["sender"], PeerTimeoutError)  # rank 2 never came


def _try_receiver(port: int, rank: int, receivers: int):
    try:
        create_receiver(
            "broadcast", "127.0.0.1", port, rank, receivers, timeout=4, connect_timeout=4
        )
    except WeightSyncError as err:
        return err
    return None


def _try_sender(port: int, receivers: int):
    try:
        create_sender("broadcast", "127.0.0.1", port, receivers, timeout=4, connect_timeout=4)
    except WeightSyncError as err:
        return err
    return None


def test_checksum_catches_corruption(monkeypatch):
    """A flipped byte on the wire fails the update on both sides, naming the bucket."""
    port = free_port()
    state = realistic_state_dict()
    errors = {}

    def receive():
        receiver = create_receiver("broadcast", "127.0.0.1", port, 1, 1, timeout=10)
        original = receiver._receive_buckets

        def corrupted(seq, layout, manifest):
            for bucket, buffer in original(seq, layout, manifest):
                if bucket.index == 1:
                    buffer[0] ^= 1
                yield bucket, buffer

        receiver._receive_buckets = corrupted
        try:
            receiver.receive().to_state_dict()
        except WeightSyncError as err:
            errors["receiver"] = str(err)
        finally:
            receiver.close()

    thread = threading.Thread(target=receive)
    thread.start()
    sender = create_sender(
        "broadcast", "127.0.0.1", port, 1, bucket_bytes=4096, checksums=True, timeout=10
    )
    with pytest.raises(
        WeightSyncError, match=r"receiver 1: .*checksum mismatch in bucket 1 of version 1"
    ):
        sender.send(state.items())
    thread.join()
    assert "checksum mismatch in bucket 1" in errors["receiver"]
    sender.close()


def test_bad_arguments_fail_before_connecting():
    with pytest.raises(ValueError, match="unknown weight-sync transport 'carrier-pigeon'"):
        create_sender("carrier-pigeon", "127.0.0.1", 1, 1)
    with pytest.raises(ValueError, match=r"receiver rank must be in \[1, 2\], got 3"):
        create_receiver("broadcast", "127.0.0.1", 1, 3, 2)
    with pytest.raises(ValueError, match="at least one receiver"):
        create_sender("broadcast", "127.0.0.1", free_port(), 0)
    with pytest.raises(ValueError, match="streams must be a positive integer, got 0"):
        create_sender("broadcast", "127.0.0.1", free_port(), 1, streams=0)
    with pytest.raises(ValueError, match="streams=2 is for the gloo"):
        create_sender("broadcast", "127.0.0.1", free_port(), 1, device="cuda:0", streams=2)


def test_lazy_stream_that_breaks_its_announced_specs_is_an_error(peers):
    port = free_port()
    peers.start(1, port=port)
    sender = create_sender("broadcast", "127.0.0.1", port, 1, bucket_bytes=4096, timeout=30)
    state = realistic_state_dict()
    specs = [TensorSpec.of(n, t) for n, t in state.items()]
    state["layers.0.odd"] = torch.zeros(2, 2)  # the stream no longer matches what was announced
    with pytest.raises(MismatchError, match=r"stream tensor 'layers.0.odd' \(2, 2\)"):
        sender.send(iter(state.items()), specs=specs)
    with pytest.raises(WeightSyncError, match="out of step since update to version 1 failed"):
        sender.send(realistic_state_dict().items())
