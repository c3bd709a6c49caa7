"""The real `rlhf-launch` on GPUs (marked `gpu`: skipped without them; results in RESULTS.md).

A 132M-parameter Qwen2 from ferrule-testkit (random, then an SFT warm start in the same run)
learns the tiny example's task with GRPO through the transformers rollout engine (the GPU
machines have no vLLM). After the last sync every engine must hold exactly the policy's weights
(the launcher compares digests and writes them to summary.json). The last test runs the shipped
examples/grpo-gsm8k-gpu.toml itself at 1.5B on four GPUs.

    uv run pytest tests/test_launcher_gpu.py -m gpu          # on a machine with the GPUs
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[1] / "examples" / "tiny.toml"
# ~132M parameters: 14 layers of hidden 768 (the kit's 512-token vocabulary adds little).
SHAPE = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=14,
    num_attention_heads=12,
    num_key_value_heads=4,
)
COMMON = [
    'model.dtype="bfloat16"',
    "sft.steps=60",
    "sft.learning_rate=3e-4",
    'rollout.backend="transformers"',
    "trainer.learning_rate=2e-5",
    "trainer.zero_stage=2",
    "loop.steps=24",
    "loop.eval_every=0",
    "output.checkpoint_every=0",
    "output.progress=false",
    "output.tensorboard=false",
    "ray.cpus_per_role=1",
    "ray.gpus_per_role=1",
]


def model_100m() -> Path:
    from ferrule_testkit import tiny_model

    return tiny_model("qwen2", **SHAPE)


def launch(out: Path, *overrides: str) -> tuple[list[dict], dict]:
    """The tiny example with the 132M model and COMMON's keys, then `overrides`."""
    return rlhf_launch(EXAMPLE, out, [f'model.path="{model_100m()}"', *COMMON, *overrides])


def rlhf_launch(config: Path, out: Path, items: list[str]) -> tuple[list[dict], dict]:
    command = [sys.executable, "-m", "ferrule_launcher.cli", str(config)]
    for item in [f'output.dir="{out}"', *items]:
        command += ["--set", item]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stderr[-6000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    print(json.dumps({"summary": summary, "rewards": [r["reward"] for r in records]}))
    return records, summary


def assert_learns_and_engines_hold_the_policy(records: list[dict], summary: dict) -> None:
    rewards = [r["reward"] for r in records]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last > first + 0.03, f"reward did not rise: {rewards}"
    assert_engines_hold_the_policy(summary)


def assert_engines_hold_the_policy(summary: dict) -> None:
    digests = summary["weights_digest"]
    assert digests["engines"] and all(d == digests["policy"] for d in digests["engines"])


@pytest.mark.gpu(count=1)
def test_hybrid_engine_on_one_gpu_ipc_offload_and_sleep(tmp_path):
    """colocate_all: the policy, the reference and the engine share the GPU; weights go over CUDA
    IPC; between phases the policy's states and the engine's weights leave the GPU."""
    records, summary = launch(
        tmp_path / "hybrid",
        'ray.placement="colocate_all"',
        "trainer.offload_between_phases=true",
        "rollout.sleep_between_phases=true",
    )
    assert_learns_and_engines_hold_the_policy(records, summary)
    assert all(r["time/sync"] > 0 for r in records)


@pytest.mark.gpu(count=1)
def test_exact_mode_on_one_gpu_samples_with_the_trainers_own_logprobs(tmp_path):
    """[rollout] exact = true, hybrid on one GPU: every step's vllm_kl is exactly 0 (the engine's
    logprobs are the trainer's bit for bit), and the run learns as the others do."""
    records, summary = launch(
        tmp_path / "exact", 'ray.placement="colocate_all"', "rollout.exact=true"
    )
    assert_learns_and_engines_hold_the_policy(records, summary)
    assert all(r["vllm_kl"] == 0.0 for r in records), [r["vllm_kl"] for r in records]


@pytest.mark.gpu(count=1)
def test_resident_engine_on_one_gpu_takes_the_policys_weights_in_place(tmp_path):
    """colocate_all with nothing offloaded: CUDA IPC in place. Every sync the engine reads
    the policy's own memory (no packing copy); every sync lands bit for bit."""
    records, summary = launch(tmp_path / "resident", 'ray.placement="colocate_all"')
    assert_learns_and_engines_hold_the_policy(records, summary)
    assert all(r["time/sync"] > 0 for r in records)


@pytest.mark.gpu(count=2)
def test_separate_policy_and_engine_gpus_nccl(tmp_path):
    """separate: the policy on one GPU, the engine on the other; weights by NCCL broadcast."""
    records, summary = launch(
        tmp_path / "separate", 'ray.placement="separate"', "trainer.kl_coef=0.0"
    )
    assert_learns_and_engines_hold_the_policy(records, summary)


@pytest.mark.gpu(count=2)
def test_a_killed_engine_is_replaced_and_joins_a_new_nccl_group(tmp_path):
    """separate: the engine's process is killed after a few steps; a new one takes its GPU, a new
    NCCL group opens (a send blocked on the dead engine is aborted) and the run goes on."""
    out = tmp_path / "replaced"
    command = [sys.executable, "-m", "ferrule_launcher.cli", str(EXAMPLE)]
    items = [f'model.path="{model_100m()}"', *COMMON, f'output.dir="{out}"']
    for item in [*items, 'ray.placement="separate"', "trainer.kl_coef=0.0"]:
        command += ["--set", item]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 900
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert time.monotonic() < deadline and process.poll() is None, "no third step"
            time.sleep(0.2)
        os.kill(json.loads((out / "roles.json").read_text())["rollout-0"]["pid"], signal.SIGKILL)
        _, stderr = process.communicate(timeout=900)
    finally:
        process.kill()
    assert process.returncode == 0, stderr[-6000:]
    assert "replaced by a new actor" in stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    print(
        json.dumps(
            {"summary": summary, "restart": [r for r in stderr.splitlines() if "replaced" in r]}
        )
    )
    assert [r["step"] for r in records] == list(range(1, 25))
    assert records[-1]["rollout/restarts"] == 1
    digests = summary["weights_digest"]
    assert digests["engines"] == [digests["policy"]] and digests["engine_versions"] == [24]


@pytest.mark.gpu(count=2)
def test_zero3_policy_on_two_gpus_exports_to_an_engine_on_each(tmp_path):
    """The hybrid engine on two GPUs: a ZeRO-3 policy sharded over two ranks gathers its
    weights, and each rank sends them over CUDA IPC to the engine on its own GPU."""
    records, summary = launch(
        tmp_path / "zero3",
        'ray.placement="colocate_all"',
        "trainer.ranks=2",
        "rollout.engines=2",
        "trainer.zero_stage=3",
        "trainer.offload_between_phases=true",
        "rollout.sleep_between_phases=true",
    )
    assert_learns_and_engines_hold_the_policy(records, summary)


@pytest.mark.gpu(count=1)
def test_lora_rollout_correction_running_norm_adaptive_kl_and_dapo_on_one_gpu(tmp_path):
    """Issue 16's keys on the hybrid engine: a LoRA policy (only the adapter trains; the engine
    gets merged weights), TIS with a sequence mask, running reward normalisation with a clip,
    adaptive KL, DAPO group filtering and the overlong penalty."""
    out = tmp_path / "options"
    records, summary = launch(
        out,
        'ray.placement="colocate_all"',
        "trainer.lora_rank=16",
        "trainer.lora_alpha=32",
        "trainer.learning_rate=2e-4",
        'trainer.rollout_correction="tis"',
        "trainer.sequence_mask=[0.5, 2.0]",
        'trainer.reward_norm="running"',
        "trainer.reward_clip=3.0",
        "trainer.kl_target=0.002",
        "trainer.kl_horizon=2000",
        "loop.keep_group_mean=[0.0, 1.0]",
        "trainer.overlong_buffer=3",
        "trainer.overlong_penalty=0.2",
    )
    assert_learns_and_engines_hold_the_policy(records, summary)
    # The engine samples from the weights the trainer holds: bf16 rounding only.
    assert all(0 <= r["vllm_kl"] < 0.05 for r in records), [r["vllm_kl"] for r in records]
    assert len({r["kl_coef"] for r in records}) > 1  # the controller moved the coefficient
    assert (out / "policy" / "adapter" / "adapter_config.json").exists()


@pytest.mark.gpu(count=2)
def test_classic_rlhf_reward_model_on_its_own_gpu(tmp_path):
    """The ladder on GPUs: `rlhf-train rm` trains a reward model on preference pairs, then PPO
    in `rlhf-launch` against it: the policy, its engine and the critic (started from the reward
    model) share GPU 0; the reward model is served by its own Ray role on the other GPU."""
    from ferrule_testkit import reversal_pairs

    def write(path: Path, rows: list[dict]) -> Path:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    train = write(tmp_path / "pairs.jsonl", reversal_pairs(2048, seed=1))
    test = write(tmp_path / "pairs_test.jsonl", reversal_pairs(200, seed=2))
    (tmp_path / "rm.toml").write_text(
        f'[model]\npath = "{model_100m()}"\ndtype = "bfloat16"\nzero_stage = 0\n'
        f'[data]\npath = "{train}"\neval_path = "{test}"\nmax_length = 32\n'
        "[train]\nepochs = 3\nbatch_size = 64\nmicro_batch_size = 64\nlearning_rate = 1e-4\n"
        f'warmup_steps = 10\n[output]\ndir = "{tmp_path / "rm"}"\n'
    )
    trained = subprocess.run(
        [sys.executable, "-m", "ferrule_trainer.cli", "rm", str(tmp_path / "rm.toml")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert trained.returncode == 0, trained.stderr[-4000:]
    saved = [line for line in trained.stdout.splitlines() if line.startswith("saved ")][-1]
    reward_model_accuracy = json.loads(saved.split(": ", 1)[1])["eval/accuracy"]
    out = tmp_path / "classic"
    records, summary = launch(
        out,
        'ray.placement="colocate_all"',
        'trainer.estimator="gae"',
        'critic.init="reward_model"',
        "critic.learning_rate=1e-5",
        'rewards.function=""',
        f'rewards.model="{tmp_path / "rm" / "model"}"',
        "rewards.normalize=true",
        "rewards.gpus=1",
    )
    roles = json.loads((out / "roles.json").read_text())
    print(json.dumps({"reward_model_accuracy": reward_model_accuracy, "roles": roles}))
    assert reward_model_accuracy >= 0.9
    assert roles["rewards"]["gpus"] and roles["policy-0"]["gpus"]
    assert not set(roles["rewards"]["gpus"]) & set(roles["policy-0"]["gpus"])  # its own GPU
    assert roles["critic"]["gpus"] == roles["policy-0"]["gpus"]
    assert all("critic/loss" in r for r in records)
    digests = summary["weights_digest"]
    assert digests["engines"] and all(d == digests["policy"] for d in digests["engines"])
    assert summary["eval_after"]["reward"] > summary["eval_before"]["reward"]  # the RM's score


def step_split(records: list[dict], warmup: int = 4) -> dict:
    """Seconds per step and the weight sync's share of a step, medians over the steps after the
    first `warmup`."""
    import itertools
    import statistics

    timed = records[warmup:]
    walls = [b["wall_seconds"] - a["wall_seconds"] for a, b in itertools.pairwise(timed)]
    step = statistics.median(walls)
    sync = statistics.median(r["time/sync"] for r in timed)
    return {"s_per_step": round(step, 3), "sync_s": round(sync, 4), "sync_share": sync / step}


# Issue 23: the two placements of a four-GPU host on the same model and task, KL off in both so
# that they run the same roles apart from where they sit.
FOUR_GPUS = ["trainer.zero_stage=3", "trainer.kl_coef=0.0", "ray.num_cpus=8"]


@pytest.mark.gpu(count=4)
def test_hybrid_engine_on_four_gpus_zero3_ipc_offload_and_sleep(tmp_path):
    """colocate_all on four GPUs: four ZeRO-3 policy ranks and four engines, one pair per GPU;
    each rank sends the gathered weights over CUDA IPC to the engine on its GPU; between phases
    the policy's states and the engines' weights leave the GPUs."""
    records, summary = launch(
        tmp_path / "hybrid4",
        *FOUR_GPUS,
        'ray.placement="colocate_all"',
        "trainer.ranks=4",
        "rollout.engines=4",
        "trainer.offload_between_phases=true",
        "rollout.sleep_between_phases=true",
    )
    print(json.dumps({"hybrid_4_gpus": step_split(records)}))
    assert_learns_and_engines_hold_the_policy(records, summary)
    assert len(summary["weights_digest"]["engines"]) == 4
    assert_a_pair_on_each_of_four_gpus(tmp_path / "hybrid4" / "roles.json")


def assert_a_pair_on_each_of_four_gpus(roles_json: Path) -> None:
    roles = json.loads(roles_json.read_text())
    for i in range(4):  # policy rank i and engine i share a GPU, a GPU of its own
        assert roles[f"policy-{i}"]["gpus"] == roles[f"rollout-{i}"]["gpus"]
    assert len({tuple(roles[f"policy-{i}"]["gpus"]) for i in range(4)}) == 4


@pytest.mark.gpu(count=4)
def test_separate_placement_on_four_gpus_zero3_nccl_to_two_engines(tmp_path):
    """separate on four GPUs: two ZeRO-3 policy ranks on two GPUs, two engines on the other two;
    rank 0 broadcasts the gathered weights over NCCL to both engines."""
    records, summary = launch(
        tmp_path / "separate4",
        *FOUR_GPUS,
        'ray.placement="separate"',
        "trainer.ranks=2",
        "rollout.engines=2",
    )
    print(json.dumps({"separate_4_gpus": step_split(records)}))
    assert_learns_and_engines_hold_the_policy(records, summary)
    assert len(summary["weights_digest"]["engines"]) == 2
    roles = json.loads((tmp_path / "separate4" / "roles.json").read_text())
    gpus = [
        tuple(roles[name]["gpus"]) for name in ("policy-0", "policy-1", "rollout-0", "rollout-1")
    ]
    assert len(set(gpus)) == 4  # every role on a GPU of its own


GPU_EXAMPLE = Path(__file__).parents[1] / "examples" / "grpo-gsm8k-gpu.toml"


def gsm8k_rows(name: str, folder: Path) -> Path:
    """examples/gsm8k_style's one-step word problems (`name`.jsonl) as the GPU example reads
    GSM8K: the prompt asks for the final number after "####" (as examples/gsm8k/prepare.py's
    instruction does), the label is that number."""
    ask = 'End your answer with a last line of the form "#### <number>".'
    rows = (Path(__file__).parents[1] / "examples" / "gsm8k_style" / f"{name}.jsonl").read_text()
    path = folder / f"{name}.jsonl"
    with path.open("w") as out:
        for row in map(json.loads, rows.splitlines()):
            prompt = row["prompt"].replace("\nAnswer:", f" {ask}\nAnswer:")
            out.write(json.dumps({"prompt": prompt, "label": str(row["answer"])}) + "\n")
    return path


@pytest.mark.gpu(count=4)
def test_the_gpu_example_at_1_5b_runs_three_steps_on_four_gpus(tmp_path):
    """examples/grpo-gsm8k-gpu.toml itself on four GPUs (it names eight): a Qwen2.5-1.5B-shaped
    policy (random init, the real vocabulary) on GSM8K-style rows, 128 prompts x 8 samples a
    step, its [trainer] memory keys left to the memory plan, which offloads nothing on 80 GB
    GPUs. Three steps run without running out of memory; every engine ends with the policy's
    weights."""
    from ferrule_testkit import QWEN25_1_5B, QWEN25_VOCAB, tiny_model

    model = tiny_model("qwen2", vocab_size=QWEN25_VOCAB, **QWEN25_1_5B)
    train, test = gsm8k_rows("one_step", tmp_path), gsm8k_rows("one_step_test", tmp_path)
    items = [
        f'model.path="{model}"',
        f'task.sources=[{{name="gsm8k", path="{train}", eval_path="{test}"}}]',
        "task.eval_prompts=8",
        'rollout.backend="transformers"',  # the GPU machines have no vLLM
        "rollout.engines=4",
        "trainer.ranks=4",
        # A random policy rarely stops, so max_tokens sets the time: 256, not 1024, keeps the
        # test to minutes. The plan still sizes memory for the example's max_model_len (2048);
        # the engines' caches are then shorter than planned, the training micro-batches as
        # large (they are counted in tokens).
        "rollout.max_tokens=256",
        "loop.steps=3",
        "loop.eval_every=0",  # evaluations at the start and the end only
        "output.progress=false",
        "output.tensorboard=false",  # the GPU bundle leaves tensorboard out
        "ray.num_cpus=8",  # as the other four-GPU tests: 4 bundles x the example's 2 CPUs
    ]
    plan = subprocess.run(
        [sys.executable, "-m", "ferrule_launcher.cli", str(GPU_EXAMPLE), "--plan"]
        + [x for item in [*items, "ray.gpu_memory_gb=80"] for x in ("--set", item)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    print(plan.stdout)
    assert plan.returncode == 0, plan.stdout + plan.stderr  # it fits
    for key in ("offload_optimizer", "offload_params", "offload_between_phases"):
        assert f"{key} = False (auto)" in plan.stdout

    out = tmp_path / "gsm8k4"
    records, summary = rlhf_launch(GPU_EXAMPLE, out, items)
    phases = {
        key: [round(r.get(f"time/{key}", 0.0), 2) for r in records]
        for key in ("generate", "score", "train", "sync", "switch")
    }
    used = {p: max(r.get(f"gpu/used_gb_{p}", 0.0) for r in records) for p in ("generate", "train")}
    print(
        json.dumps(
            {
                # step 2: after the warm-up, before the last step's evaluation
                "gsm8k_example_4_gpus": step_split(records[:2], warmup=0),
                "phases": phases,
                "used_gb": used,
                "startup_seconds": summary.get("startup_seconds"),
            }
        )
    )
    assert [r["step"] for r in records] == [1, 2, 3]
    assert_engines_hold_the_policy(summary)
    digests = summary["weights_digest"]
    assert len(digests["engines"]) == 4 and digests["engine_versions"] == [3] * 4
    assert_a_pair_on_each_of_four_gpus(out / "roles.json")
