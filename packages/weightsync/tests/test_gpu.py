"""The GPU transports: NCCL broadcast between two GPUs, CUDA IPC between two processes on one.

Skipped without enough CUDA GPUs (see the root conftest.py); run on the GPU machines, with results
recorded in benchmarks/RESULTS.md. Same protocol code and checks as the CPU tests.
"""

import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from ferrule_weightsync import PeerTimeoutError, WeightSyncError, create_sender

PEER = Path(__file__).with_name("peer.py")
sys.path.insert(0, str(PEER.parent))
from peer import realistic_state_dict, scaled, trainer_weights  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_receiver(tmp_path, **options) -> tuple[subprocess.Popen, Path]:
    out = tmp_path / "receiver.pt"
    args = [sys.executable, str(PEER), "--out", str(out), "--updates", "2"]
    for key, value in options.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out


def check_results(proc, out, state) -> list[dict]:
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    results = torch.load(out, weights_only=False)
    assert "error" not in results[0], results[0].get("trace")
    assert [r["version"] for r in results] == [1, 2]
    for result, factor in zip(results, [1.0, 3.0], strict=True):
        for name, tensor in scaled(state, factor).items():
            assert torch.equal(result["state"][name], tensor), name
    return results


def send_two_updates(transport: str, port: int, secret: str | None = None) -> object:
    """From cuda:0: the state dict, then the same scaled by 3 (versions 1 and 2)."""
    sender = create_sender(
        transport,
        "127.0.0.1",
        port,
        1,
        device="cuda:0",
        bucket_bytes=4096,
        checksums=True,
        timeout=60,
        secret=secret,
    )
    for factor in (1.0, 3.0):
        state = scaled(realistic_state_dict(), factor)
        sender.send({k: v.to("cuda:0") for k, v in state.items()}.items())
    sender.close()
    return sender


@pytest.mark.gpu(count=2)
def test_nccl_broadcast_between_two_gpus(tmp_path):
    port = free_port()
    secret = "gpu-test-secret-0123456789abcdef"
    proc, out = start_receiver(
        tmp_path, transport="broadcast", port=port, device="cuda:1", secret=secret
    )
    send_two_updates("broadcast", port, secret)
    check_results(proc, out, realistic_state_dict())


@pytest.mark.gpu(count=1)
@pytest.mark.parametrize("secret", [None, "gpu-test-secret-0123456789abcdef"])
def test_cuda_ipc_between_two_processes_on_one_gpu(tmp_path, secret):
    """The buffers' CUDA handles travel as JSON (numbers and bytes, no pickle), signed with
    the group's secret when it has one."""
    port = free_port()
    proc, out = start_receiver(
        tmp_path, transport="ipc", port=port, **({"secret": secret} if secret else {})
    )
    sender = send_two_updates("ipc", port, secret)
    assert sender.handles_published == 2  # the second update reused both buffers
    results = check_results(proc, out, realistic_state_dict())
    assert results[-1]["handles_opened"] == 2


@pytest.mark.gpu(count=1)
@pytest.mark.parametrize("checksums", [False, True])
def test_cuda_ipc_in_place_reads_the_senders_own_memory(tmp_path, checksums):
    """A trainer's weights as they lie (views into one flat buffer, two tensors of their own):
    the receiver reads them there, sees in-place changes without new handles, gets the new
    allocation when a tensor is swapped, and a tensor that cannot be read in place (here a
    transposed view) makes the update packed. In place again after a packed update (the
    receivers map the packing buffers then), the same tensors are shared again."""
    port = free_port()
    proc, out = start_receiver(tmp_path, transport="ipc", port=port, updates=7)
    flat = torch.randn(10_000, device="cuda:0").bfloat16()
    state = {
        "layers.0.weight": flat[:1200].view(40, 30),
        "layers.0.bias": flat[1201:1204],  # odd offset: 2-byte aligned only
        "layers.0.empty": flat[1204:1204].view(0, 5),
        "norm.weight": torch.randn(17, device="cuda:0"),
        "step": torch.arange(7, device="cuda:0"),
    }
    sender = create_sender(
        "ipc", "127.0.0.1", port, 1, device="cuda:0", checksums=checksums, timeout=60
    )
    sent, published = [], []
    for update in range(7):
        if update in (1, 5, 6):
            flat.mul_(3)  # an optimizer step: in place
        if update == 2:
            state["norm.weight"] = torch.full((17,), 0.5, device="cuda:0")  # swapped
        if update == 3:
            state["layers.0.t"] = flat[2000:2600].view(20, 30).t()  # not contiguous
        if update == 4:
            del state["layers.0.t"]
        sender.send(state.items(), in_place=update != 5)  # 5: packed by the caller's choice
        sent.append({name: t.cpu() for name, t in state.items()})
        published.append(sender.handles_published)
    sender.close()
    # 3 allocations shared once; again after the swap; the two packing buffers; the three
    # allocations again after that packed update; the packing buffers again for the update
    # packed by choice, and then the three allocations once more
    assert published == [3, 3, 6, 8, 11, 13, 16]
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    results = torch.load(out, weights_only=False)
    assert "error" not in results[0], results[0].get("trace")
    for result, state_sent in zip(results, sent, strict=True):
        assert result["state"].keys() == state_sent.keys()
        for name, tensor in state_sent.items():
            assert torch.equal(result["state"][name], tensor), name
    assert [r["handles_opened"] for r in results] == published


@pytest.mark.gpu(count=1)
def test_cuda_ipc_in_place_send_returns_only_once_the_receivers_reads_have_run(tmp_path):
    """A receiver reports done as soon as its load is queued; here the second update's load
    waits ~300 ms behind other GPU work. The sender overwrites its tensors the moment `send`
    returns: the receiver must still have loaded what was sent (the sender waited on its
    event)."""
    port = free_port()
    proc, out = start_receiver(
        tmp_path, transport="ipc", port=port, updates=2, gpu_load_after_ms=300
    )
    flat = torch.randn(1 << 20, device="cuda:0")
    state = {"a": flat[: 1 << 19].view(512, 1024), "b": flat[1 << 19 :]}
    sender = create_sender("ipc", "127.0.0.1", port, 1, device="cuda:0", timeout=60)
    sent = []
    for update in range(2):
        sent.append({name: t.cpu() for name, t in state.items()})
        started = time.monotonic()
        sender.send(state.items(), in_place=True)
        waited = time.monotonic() - started
        flat.fill_(-1.0 - update)  # the next optimizer step, at once
    sender.close()
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    results = torch.load(out, weights_only=False)
    assert "error" not in results[0], results[0].get("trace")
    for result, state_sent in zip(results, sent, strict=True):
        for name, tensor in state_sent.items():
            assert torch.equal(result["state"][name], tensor), name
    assert sent[1]["a"].eq(-1.0).all()  # the second update sent the overwritten weights
    print(f"the last send waited {waited * 1e3:.0f} ms for the receiver's late load")


@pytest.mark.gpu(count=1)
def test_cuda_ipc_in_place_updates_load_into_an_engines_own_weights(tmp_path):
    """A receiver that loads each update into weights of its own (`receive_into`, as the
    transformers engine does) from a sender that sends in place and changes its weights the
    moment `send` returns: every byte as sent, five times."""
    port = free_port()
    proc, out = start_receiver(tmp_path, transport="ipc", port=port, updates=5, receive_into="yes")
    flat, state = trainer_weights()
    sender = create_sender("ipc", "127.0.0.1", port, 1, device="cuda:0", timeout=60)
    sent = []
    for _ in range(5):
        sent.append({name: t.cpu() for name, t in state.items()})
        sender.send(state.items(), in_place=True)
        flat.mul_(3)  # the next optimizer step, at once
        state["step"].add_(1)
    sender.close()
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    results = torch.load(out, weights_only=False)
    assert "error" not in results[-1], results[-1]
    assert [r["version"] for r in results] == [1, 2, 3, 4, 5]
    for result, state_sent in zip(results, sent, strict=True):
        assert result["state"].keys() == state_sent.keys()
        for name, tensor in state_sent.items():
            assert torch.equal(result["state"][name], tensor), name


@pytest.mark.gpu(count=1)
def test_cuda_ipc_send_to_a_receiver_that_left_fails_within_its_timeout(tmp_path):
    """A receiver takes two in-place updates and exits without closing: the next send waits
    for it only as long as the group's timeout, then says so."""
    port = free_port()
    proc, _ = start_receiver(tmp_path, transport="ipc", port=port, updates=2, receive_into="yes")
    _, state = trainer_weights()
    sender = create_sender("ipc", "127.0.0.1", port, 1, device="cuda:0", timeout=5)
    try:
        for _ in range(2):
            sender.send(state.items(), in_place=True)
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, output
        started = time.monotonic()
        with pytest.raises(WeightSyncError):
            sender.send(state.items(), in_place=True)
        assert time.monotonic() - started < 20
    finally:
        proc.kill()
        sender.close()


@pytest.mark.gpu(count=1)
def test_cuda_ipc_in_place_send_fails_within_its_timeout_when_reads_do_not_end(tmp_path):
    """A receiver whose reads stay queued (here, in the second update, behind a minute of
    other GPU work; a hung or dying process alike) makes `send` fail within the group's
    timeout, naming it."""
    port = free_port()
    proc, _ = start_receiver(
        tmp_path, transport="ipc", port=port, updates=2, gpu_load_after_ms=60_000
    )
    flat = torch.randn(1 << 16, device="cuda:0")
    sender = create_sender("ipc", "127.0.0.1", port, 1, device="cuda:0", timeout=5)
    try:
        sender.send([("w", flat)], in_place=True)
        started = time.monotonic()
        with pytest.raises(PeerTimeoutError, match="receiver 1's reads of the update did not end"):
            sender.send([("w", flat)], in_place=True)
        assert time.monotonic() - started < 20
    finally:
        proc.kill()
        proc.communicate()
        sender.close()


@pytest.mark.gpu(count=2)
def test_nccl_receiver_failure_reaches_the_sender_through_the_end_all_reduce(tmp_path):
    port = free_port()
    proc, _ = start_receiver(
        tmp_path, transport="broadcast", port=port, device="cuda:1", updates=1, stop_after=3
    )
    sender = create_sender("broadcast", "127.0.0.1", port, 1, device="cuda:0", timeout=60)
    state = {k: v.to("cuda:0") for k, v in realistic_state_dict().items()}
    with pytest.raises(WeightSyncError, match="receiver 1: the consumer stopped before the end"):
        sender.send(state.items())
    sender.close()
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output


@pytest.mark.gpu(count=1)
def test_digest_of_gpu_tensors_is_the_digest_of_their_host_copies():
    """The digest reads each tensor's bytes on the host. For a GPU tensor that host copy is a
    new tensor; hashed after it was freed (what b516c95's digest did), the bytes were those of
    whatever reused the memory, and the launcher's end-of-run check failed on an H100."""
    from ferrule_weightsync import digest

    state = realistic_state_dict()
    on_gpu = {name: tensor.to("cuda:0") for name, tensor in state.items()}
    assert digest(on_gpu.items()) == digest(state.items())
    assert digest(on_gpu.items()) == digest(on_gpu.items())


@pytest.mark.gpu(count=2)
def test_nccl_abort_from_another_thread_ends_a_send_stuck_on_a_receiver(tmp_path):
    """The receiver stops mid-transfer but stays alive, so NCCL would wait out the timeout;
    abort() (a trainer that knows the receiver's engine died) ends the send at once."""
    port = free_port()
    proc, _ = start_receiver(
        tmp_path, transport="broadcast", port=port, device="cuda:1", updates=1, stall_at=4
    )
    try:
        sender = create_sender(
            "broadcast", "127.0.0.1", port, 1, device="cuda:0", bucket_bytes=4096, timeout=120
        )
        state = {k: v.to("cuda:0") for k, v in realistic_state_dict().items()}
        threading.Timer(3.0, sender.abort, ["engine 1 died"]).start()
        started = time.monotonic()
        with pytest.raises(WeightSyncError, match="aborted: engine 1 died"):
            sender.send(state.items())
        assert time.monotonic() - started < 3 + 10  # not the 120 s timeout
        sender.close()
    finally:
        proc.kill()
        proc.communicate()
