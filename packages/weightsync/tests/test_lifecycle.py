"""A group's beginning and end as a user meets them: the sender's close ends the receivers'
loops, shared memory goes away without a close, a sender waiting for receivers says which,
and `expected=` names what an update lacks."""

import contextlib
import logging
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from ferrule_weightsync import (
    MismatchError,
    PeerTimeoutError,
    WeightSyncError,
    at_exit,
    control,
    create_receiver,
    create_sender,
    ipc,
)

STATE = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _receive_all(transport: str, port: int, rank: int, receivers: int, out: dict, **options):
    """A receiver's whole life: its loop until the stream ends, then two more calls."""
    try:
        receiver = create_receiver(transport, "127.0.0.1", port, rank, receivers, timeout=20)
        versions = []
        while (update := receiver.receive(**options)) is not None:
            update.to_state_dict()
            versions.append(update.version)
        out[rank] = (versions, receiver.receive(), receiver.receive_into(dict(STATE)))
        receiver.close()
    except Exception as error:  # the test names it
        out[rank] = error


@pytest.mark.parametrize("transport", ["broadcast", "ipc"])
def test_the_senders_close_ends_every_receivers_loop_without_an_error(transport):
    # The receiver got "lost the weight-sync group ... Failed to recv" once the sender went.
    port, out = free_port(), {}
    threads = [
        threading.Thread(target=_receive_all, args=(transport, port, rank, 2, out))
        for rank in (1, 2)
    ]
    for thread in threads:
        thread.start()
    sender = create_sender(transport, "127.0.0.1", port, 2, timeout=20)
    for _ in range(3):
        sender.send(STATE.items())
    sender.close()
    for thread in threads:
        thread.join(30)
    assert out == {1: ([1, 2, 3], None, None), 2: ([1, 2, 3], None, None)}


@pytest.mark.parametrize("transport", ["broadcast", "ipc"])
def test_a_closed_sender_refuses_to_send_and_a_second_close_is_quiet(transport):
    # A closed sender's send failed with an AttributeError from deep inside (its store
    # connection was gone). The broadcast sender's gloo group is also destroyed at close now,
    # not left for the interpreter's teardown (which once aborted a process at exit in CI).
    port, out = free_port(), {}
    thread = threading.Thread(
        target=lambda: out.setdefault(
            "receiver", create_receiver(transport, "127.0.0.1", port, 1, 1, timeout=20)
        )
    )
    thread.start()
    sender = create_sender(transport, "127.0.0.1", port, 1, timeout=20)
    thread.join()
    sender.close(timeout=0)
    with pytest.raises(WeightSyncError, match="this sender is closed; create a new sender"):
        sender.send(STATE.items())
    sender.close()
    out["receiver"].close()
    out["receiver"].close()  # an ipc receiver's second close raised an AttributeError


@pytest.mark.parametrize("leaves", [True, False], ids=["receiver-closed", "timeout-0"])
def test_a_sender_closing_does_not_wait_for_receivers_that_left_or_with_timeout_0(leaves):
    port, out = free_port(), {}
    thread = threading.Thread(target=lambda: out.setdefault("receiver", _receiver(port)))
    thread.start()
    sender = create_sender("ipc", "127.0.0.1", port, 1, timeout=20)
    thread.join()
    if leaves:
        out["receiver"].close()
    started = time.monotonic()
    sender.close(**({} if leaves else {"timeout": 0}))
    assert time.monotonic() - started < 1  # not END_SECONDS (2 s)
    if not leaves:
        out["receiver"].close()


def _receiver(port: int):
    return create_receiver("ipc", "127.0.0.1", port, 1, 1, timeout=20)


FORGETFUL = """
import threading, torch
from ferrule_weightsync import create_receiver, create_sender
port = {port}
made = {{}}
thread = threading.Thread(target=lambda: made.setdefault("r", create_receiver("ipc", "127.0.0.1", port, 1, 1)))
thread.start()
sender = create_sender("ipc", "127.0.0.1", port, 1, bucket_bytes=1 << 16)
thread.join()
thread = threading.Thread(target=lambda: made["r"].receive().to_state_dict())
thread.start()
sender.send([("w", torch.ones(100))])
thread.join()
print(" ".join(buffer.shm.name for buffer in sender._buffers), flush=True)
{end}
"""


DROP = "del sender; import gc; gc.collect(); print('dropped', flush=True); input()"


@pytest.mark.e2e  # ~5-10 s of subprocesses (the fast tier stays under 10 minutes)
@pytest.mark.parametrize("end", ["pass", DROP], ids=["exit", "dropped"])
def test_a_senders_segments_go_when_it_is_never_closed(end):
    # Without close() two /dev/shm/ferrule-ws-* segments (1 GiB each by default) stayed until
    # the resource tracker removed them at exit, warning of "leaked shared_memory objects".
    process = subprocess.Popen(
        [sys.executable, "-c", FORGETFUL.format(port=free_port(), end=end)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    names = process.stdout.readline().split()
    assert len(names) == 2, process.communicate(timeout=30)
    if end == DROP:  # dropped, the process still running: gone already
        assert process.stdout.readline() == "dropped\n"
        assert not any((ipc.SEGMENTS / name).exists() for name in names)
    _, stderr = process.communicate("\n", timeout=60)
    assert process.returncode == 0, stderr
    assert not any((ipc.SEGMENTS / name).exists() for name in names)
    assert "leaked" not in stderr, stderr


def test_a_sender_waiting_for_receivers_says_which_and_how_many(monkeypatch, caplog):
    # It waited silently for connect_timeout (900 s by default), then named the ranks only.
    monkeypatch.setattr(control, "WAIT_LOG_SECONDS", 0.5)
    port = free_port()
    thread = threading.Thread(target=lambda: _receiver_of(port, 1, 2))
    thread.start()
    with (
        caplog.at_level(logging.WARNING, "ferrule_weightsync"),
        pytest.raises(PeerTimeoutError) as raised,
    ):
        create_sender("broadcast", "127.0.0.1", port, 2, connect_timeout=3, timeout=3)
    thread.join()
    assert "receivers [2] did not join the group within 3s" in str(raised.value)
    assert "the sender expects 2 receivers, ranks 1 to 2; 1 did" in str(raised.value)
    waits = [r.getMessage() for r in caplog.records if "waiting for receivers" in r.getMessage()]
    assert len(waits) >= 2, caplog.text
    # (rank 1, a thread here, may join after the first message)
    assert "waiting for receivers [2] to join the group (the sender expects 2" in waits[-1]


def _receiver_of(port: int, rank: int, receivers: int) -> None:
    with contextlib.suppress(WeightSyncError):  # the group never forms: it times out too
        create_receiver("broadcast", "127.0.0.1", port, rank, receivers, timeout=3)


@pytest.mark.parametrize("transport", ["broadcast", "ipc"])
def test_expected_names_an_update_lacks_are_refused_unless_partial(transport):
    # A partial update passed `expected=`: only names the receiver did not know were refused.
    port, out = free_port(), {}
    expected = {**STATE, "extra": torch.zeros(2)}

    def receive():
        receiver = create_receiver(transport, "127.0.0.1", port, 1, 1, timeout=20)
        try:
            receiver.receive(expected=expected)
        except MismatchError as error:
            out["refused"] = str(error)
        out["partial"] = receiver.receive(expected=expected, partial=True).to_state_dict()
        targets = {name: torch.zeros_like(t) for name, t in expected.items()}
        loaded = []
        out["into"] = (receiver.receive_into(targets, loaded), loaded)  # targets may be more
        receiver.close()

    thread = threading.Thread(target=receive)
    thread.start()
    sender = create_sender(transport, "127.0.0.1", port, 1, timeout=20)
    with pytest.raises(
        MismatchError, match=r"1 expected tensor\(s\) not in the update: \['extra'\]"
    ):
        sender.send(STATE.items())
    sender.send(STATE.items())
    sender.send(STATE.items())
    sender.close()
    thread.join(30)
    assert "receive with partial=True" in out["refused"]
    assert set(out["partial"]) == set(STATE)
    assert out["into"] == (2, ["w", "b"])  # the refused update took no version


@pytest.mark.parametrize(("rank", "receivers"), [(1, 1), (3, 3)])
def test_a_receiver_started_for_another_number_of_receivers_fails_the_sender_at_once(
    rank, receivers
):
    # The receiver failed at once, but the sender waited its whole connect timeout (900 s by
    # default) for the receiver, and its error did not say that the counts differed.
    port, out = free_port(), {}

    def receiver():
        try:
            create_receiver("broadcast", "127.0.0.1", port, rank, receivers, connect_timeout=30)
        except WeightSyncError as error:
            out["receiver"] = str(error)

    thread = threading.Thread(target=receiver)
    thread.start()
    started = time.monotonic()
    with pytest.raises(WeightSyncError) as raised:
        create_sender("broadcast", "127.0.0.1", port, 2, connect_timeout=30)
    thread.join()
    assert time.monotonic() - started < 10  # not the connect timeout
    assert not isinstance(raised.value, PeerTimeoutError)
    assert (
        f"receiver rank {rank} was started for {receivers} receivers, but the sender of the "
        f"weight-sync group at 127.0.0.1:{port} expects 2" in str(raised.value)
    )
    assert f"expects {receivers} receivers, but the sender" in out["receiver"]
    assert "was created for 2" in out["receiver"]


UNCLOSED = """
import os, signal, time, torch
from ferrule_weightsync import TensorSpec, create_sender
sender = create_sender({transport!r}, "127.0.0.1", {port}, 1, timeout=20, bucket_bytes=256)
sender.send([("w", torch.ones(100))])
print("sent", flush=True)
{end}
"""
IN_SEND = """
def stream():  # SIGTERM arrives between the update's two buckets
    yield "w", torch.full((100,), 2.0)
    os.kill(os.getpid(), signal.SIGTERM)
    yield "v", torch.ones(3)
specs = [TensorSpec("w", (100,), torch.float32), TensorSpec("v", (3,), torch.float32)]
sender.send(stream(), specs=specs)
print("went on after SIGTERM", flush=True)
"""
ENDS = {
    "return": "pass",
    "raise": "raise RuntimeError('the trainer failed')",
    "sigterm": "time.sleep(60)",  # the test sends SIGTERM
    "sigterm-in-send": IN_SEND,
}


@pytest.mark.e2e  # ~5-10 s of subprocesses (the fast tier stays under 10 minutes)
@pytest.mark.parametrize(
    ("transport", "end", "versions"),
    [
        ("broadcast", "return", [1]),
        ("broadcast", "raise", [1]),
        ("broadcast", "sigterm", [1]),
        ("ipc", "sigterm", [1]),
        ("broadcast", "sigterm-in-send", [1, 2]),  # the update completes, then the stream ends
    ],
)
def test_a_sender_that_exits_without_close_ends_the_stream(transport, end, versions):
    # The receiver got "WeightSyncError: rank 1: lost the weight-sync group ... Failed to
    # recv, got 0 bytes" (and torch's C++ stack) once the sender's process was gone.
    port, out = free_port(), {}
    thread = threading.Thread(target=_receive_all, args=(transport, port, 1, 1, out))
    thread.start()
    process = subprocess.Popen(
        [sys.executable, "-c", UNCLOSED.format(transport=transport, port=port, end=ENDS[end])],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stdout.readline() == "sent\n", process.communicate(timeout=30)
        if end == "sigterm":
            process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
    thread.join(30)
    assert out == {1: (versions, None, None)}, stderr
    expected = {"return": 0, "raise": 1}.get(end, -signal.SIGTERM)
    assert process.returncode == expected, stderr
    assert stdout == "" and "leaked" not in stderr, stdout + stderr


def test_the_sigterm_handler_stands_in_for_the_default_only_while_a_sender_is_open():
    port, out = free_port(), {}
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    thread = threading.Thread(target=lambda: out.setdefault("r", _receiver(port)))
    thread.start()
    sender = create_sender("ipc", "127.0.0.1", port, 1, timeout=20)
    thread.join()
    assert signal.getsignal(signal.SIGTERM) is at_exit._on_sigterm
    out["r"].close()
    sender.close()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # back once none is open

    def host(signum, frame):  # a program's own handler is never replaced
        pass

    signal.signal(signal.SIGTERM, host)
    try:
        port = free_port()
        thread = threading.Thread(target=lambda: out.update(r=_receiver(port)))
        thread.start()
        sender = create_sender("ipc", "127.0.0.1", port, 1, timeout=20)
        thread.join()
        assert signal.getsignal(signal.SIGTERM) is host
        out["r"].close()
        sender.close()
        assert signal.getsignal(signal.SIGTERM) is host
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
