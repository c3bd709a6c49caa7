"""GRPO in one file, on a CPU: the loop `rlhf-launch` runs, without Ray, gRPC or a config file.

    uv run python examples/rl_in_one_file.py            # 20 steps, about a minute
    uv run python examples/rl_in_one_file.py --steps 40

Each step does what the launcher's loop does, in this order:
1. generate: the rollout engine samples 8 answers to each of 16 prompts ("Reverse the string
   abc. Answer:") with the policy's current weights;
2. score: a reward function, called here in this process (the launcher calls the reward server);
3. train: `RLStep` computes GRPO advantages within each prompt's group of 8, the reference's
   log-probabilities for the KL term, and takes a PPO step of the policy;
4. sync: the policy's new weights go to the engine over ferrule-weightsync, as between
   processes (the launcher's hybrid engine uses the same transport between two processes).
The model is the tiny example's (examples/tiny/model, already warm-started on the task), so the
reward rises within a few steps. The real run, with every process of its own, is
`uv run rlhf-launch examples/tiny.toml`.
"""

import argparse
import random
import socket
import threading
from pathlib import Path

from ferrule_rewards.builtin import char_match
from ferrule_rollout import SamplingSettings
from ferrule_rollout.hf_engine import TransformersEngine
from ferrule_trainer import Actor, Group, LocalRanks, RLStep, TrainerConfig
from ferrule_weightsync import create_sender

MODEL = Path(__file__).parent / "tiny" / "model"
PROMPTS, SAMPLES = 16, 8  # a step: 16 prompts, a group of 8 answers to each


def reversal(rng: random.Random) -> tuple[str, str]:
    """A prompt and the answer the reward compares with."""
    word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(3))
    return f"Reverse the string {word}. Answer:", f" {word[::-1]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connect(engine: TransformersEngine):
    """The weight-sync group of one sender (this trainer) and one receiver (the engine): each
    side waits for the other, so the sender joins from a thread."""
    port, joined = free_port(), {}
    sender = threading.Thread(
        target=lambda: joined.update(sender=create_sender("ipc", "127.0.0.1", port, 1))
    )
    sender.start()
    engine.init_weight_sync("ipc", "127.0.0.1", port, rank=1, num_receivers=1, timeout=60)
    sender.join()
    return joined["sender"]


def sync(sender, policy: Actor, engine: TransformersEngine, version: int) -> None:
    """The policy's weights into the engine, in place: the sender streams them while the
    engine receives (both block until the other side has them all)."""
    sending = threading.Thread(
        target=sender.send,
        args=(policy.export_weights(),),
        kwargs=dict(version=version, specs=policy.weight_specs()),
    )
    sending.start()
    engine.update_weights(timeout=60)
    sending.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)

    # The [trainer] table of a config file, as an object: GRPO, a k3 KL to the reference.
    trainer = TrainerConfig(learning_rate=2e-4, kl_coef=0.001)
    policy = Actor(MODEL, dtype="float32", **trainer.optimizer_options(args.steps))
    reference = Actor(MODEL, dtype="float32", train=False)  # the warm start, frozen
    engine = TransformersEngine(MODEL, dtype="float32", max_model_len=64)
    step = RLStep(
        trainer,
        None,  # no critic: GRPO's baseline is the group's mean
        group_size=SAMPLES,
        pad_id=engine.tokenizer.pad_token_id,
        policy=LocalRanks(policy),
        reference=LocalRanks(reference),
    )
    sampling = SamplingSettings(n=SAMPLES, temperature=0.6, max_tokens=6)
    sender = connect(engine)
    try:
        for number in range(1, args.steps + 1):
            problems = [reversal(rng) for _ in range(PROMPTS)]
            samples = engine.generate([prompt for prompt, _ in problems], sampling)
            samples.sort(key=lambda s: (s.prompt_index, s.sample_index))  # groups, in order
            rewards = [char_match(s.text, problems[s.prompt_index][1]) for s in samples]
            scores, _ = step.shape(samples, rewards, max_tokens=sampling.max_tokens)
            metrics = step.train(number, Group.split(samples, scores, SAMPLES, problems))
            sync(sender, policy, engine, version=number)
            print(
                f"step {number}: reward {sum(rewards) / len(rewards):.3f}  "
                f"loss {metrics['train/loss']:+.4f}  kl {metrics.get('kl', 0.0):.2e}",
                flush=True,
            )
    finally:
        engine.close()  # the receiver leaves first: the sender then closes without waiting
        sender.close()


if __name__ == "__main__":
    main()
