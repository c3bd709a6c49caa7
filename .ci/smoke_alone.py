"""Run by .ci/run with the python of a venv that holds one package alone (its wheel and its
declared dependencies, nothing else): its command's --help, then one real tiny call.

    <venv>/bin/python .ci/smoke_alone.py weightsync|rewards|rollout|trainer
"""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
COMMANDS = {"rewards": "rlhf-rewards", "rollout": "rlhf-rollout", "trainer": "rlhf-train"}


def run(*command: str, status: int = 0, timeout: float = 120) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == status, f"{command}: status {done.returncode}\n{done.stderr}"
    return done.stdout + done.stderr


def weightsync() -> None:
    """examples/weightsync as written, over shared memory: versions and digests match."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    common = ["--transport", "ipc", "--port", port, "--receivers", "1"]
    examples = REPO / "examples" / "weightsync"
    receiver = subprocess.Popen(
        [sys.executable, str(examples / "receiver.py"), *common],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    sent = run(sys.executable, str(examples / "sender.py"), *common, "--steps", "2")
    received, errors = receiver.communicate(timeout=120)
    assert receiver.returncode == 0, errors
    digests = [line.rsplit(": ", 1)[1] for line in sent.splitlines() if line.startswith("sent")]
    assert [line.rsplit(": ", 1)[1] for line in received.splitlines()[:2]] == digests, received
    print(f"weightsync: the example sent and received 2 versions ({digests[-1][:12]}...)")


def rewards() -> None:
    """A built-in reward, and --model refused without the [model] extra, which is not here."""
    from ferrule_rewards.builtin import math_reward

    reward = math_reward("<think>2+2</think> The answer is 4", "4")
    assert reward["reward"] == 1.1, reward
    said = run(str(BIN / "rlhf-rewards"), "serve", "--model", "/nowhere", status=2)
    assert "install 'ferrule-rewards[model]'" in said, said
    print(f"rewards: math_reward {reward}; --model asks for the [model] extra")


def rollout() -> None:
    """One greedy draw through the sampler the transformers engine uses (no vLLM here)."""
    import importlib.util

    import torch

    from ferrule_rollout.sampling import sample, uniforms

    assert importlib.util.find_spec("vllm") is None, "vLLM came without the [cpu]/[gpu] extra"
    token, _ = sample(torch.tensor([[0.0, 2.0, 1.0]]), 0.0, 0, 1.0, uniforms([7], 1)[:, 0])
    assert token.tolist() == [1], token
    print("rollout: a greedy draw picked the largest logit")


def trainer() -> None:
    """GRPO advantages of one group of two, worked out by hand: (1 - 0.5) / std(0, 1)."""
    import torch

    from ferrule_trainer.advantages import grpo

    advantages = grpo(torch.tensor([0.0, 1.0]), torch.ones(2, 3, dtype=torch.bool), group_size=2)
    expected = torch.tensor([-0.5, 0.5]) / 0.5**0.5
    assert torch.allclose(advantages[:, 0], expected, atol=1e-5), advantages
    print(f"trainer: GRPO advantages {advantages[:, 0].tolist()}")


if __name__ == "__main__":
    name = sys.argv[1]
    if name in COMMANDS:
        usage = run(str(BIN / COMMANDS[name]), "--help")
        assert usage.startswith("usage: "), usage
    {"weightsync": weightsync, "rewards": rewards, "rollout": rollout, "trainer": trainer}[name]()
