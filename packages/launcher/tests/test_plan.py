"""The memory plan of GPU runs: the "auto" keys chosen to fit, refusals that name the keys and
the numbers before anything starts, and `rlhf-launch --plan`."""

import json
import shutil
import subprocess

import pytest

from ferrule_launcher.config import ConfigError
from ferrule_launcher.load import load_config
from ferrule_launcher.plan import HEADROOM, make_plan
from ferrule_launcher.resolve import Machine, resolve
from ferrule_testkit import QWEN25_1_5B, QWEN25_VOCAB
from ferrule_trainer.config import AUTO_KEYS
from ferrule_trainer.memory import GiB

GPU_RUN = """
[model]
path = "model"
dtype = "bfloat16"
[rewards]
function = "ferrule_rewards.builtin:exact_text"
[rollout]
backend = "transformers"
prompts_per_step = 64
samples_per_prompt = 8
max_tokens = 512
max_model_len = 1024
[ray]
gpus_per_role = 1
"""


@pytest.fixture
def write(tmp_path):
    """A run of a Qwen2.5-1.5B-shaped model (its config.json: all the plan reads)."""
    (tmp_path / "model").mkdir()
    config = dict(model_type="qwen2", vocab_size=QWEN25_VOCAB, **QWEN25_1_5B)
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))

    def write(text: str = "", gpu_gb: float | None = 80.0) -> str:
        memory = f"gpu_memory_gb = {gpu_gb}\n" if gpu_gb else ""
        path = tmp_path / "run.toml"
        path.write_text(GPU_RUN + memory + text)
        return str(path)

    return write


def resolved(path: str, overrides: dict | None = None):
    """The config of `path` resolved for this machine (the plan's choices filled in)."""
    return resolve(load_config(path, overrides)).config


def error_of(path: str, **overrides) -> str:
    with pytest.raises(ConfigError) as info:
        resolved(path, overrides)
    return str(info.value)


def test_auto_keys_take_the_fastest_plan_that_fits(write):
    config = resolved(write())
    t = config.trainer
    assert t.auto == frozenset(AUTO_KEYS)
    plan = make_plan(config)
    assert plan.fits() and plan.peak()[0] <= HEADROOM * 80 * GiB
    # an H100 holds a 1.5B policy beside its engine without sharding or offloading
    assert (t.zero_stage, t.offload_optimizer, t.offload_params) == (2, False, False)
    assert t.micro_batch_tokens >= 8192
    assert (t.micro_batch_tokens, t.gradient_checkpointing) == (
        plan.trainer.micro_batch_tokens,
        plan.trainer.gradient_checkpointing,
    )


def test_a_smaller_gpu_gets_a_plan_that_needs_less(write):
    big = resolved(write(gpu_gb=80)).trainer
    small = resolved(write(gpu_gb=32)).trainer
    assert small.micro_batch_tokens <= big.micro_batch_tokens
    assert small.gradient_checkpointing or small.zero_stage == 3 or small.offload_optimizer
    assert make_plan(resolved(write(gpu_gb=32))).fits()


def test_the_users_own_keys_are_kept(write):
    config = resolved(write("[trainer]\nzero_stage = 3\nmicro_batch_tokens = 2048\n"))
    assert (config.trainer.zero_stage, config.trainer.micro_batch_tokens) == (3, 2048)
    assert "zero_stage" not in config.trainer.auto


def test_a_plan_that_cannot_fit_is_refused_naming_keys_and_numbers(write):
    text = "[trainer]\nmicro_batch_tokens = 65536\ngradient_checkpointing = false\nzero_stage = 0\n"
    error = error_of(write(text))
    assert "[trainer] micro_batch_tokens: the memory plan does not fit" in error
    assert "in the train phase GPU 0 needs" in error
    assert "of 90% x 80.0 GiB" in error
    for key in ("micro_batch_tokens", "gradient_checkpointing", "zero_stage"):
        assert f"[trainer] {key}" in error
    assert "--plan" in error
    assert "max_batch_size or kv_cache_tokens (transformers)" in error  # the engine's levers
    # the same plan starts anyway when the user says so
    assert resolved(write(text), {"ray.check_memory": False})
    shown = resolve(load_config(write(text)), refuse=False)  # --plan: shown, not refused
    assert not shown.plan.fits()


def test_nothing_fits_a_gpu_too_small_even_with_every_key_auto(write):
    error = error_of(write(gpu_gb=4))
    assert "the memory plan does not fit" in error and "nothing left to choose" in error


def test_the_engine_gives_its_memory_back_only_asleep(write):
    awake = make_plan(resolved(write()))
    asleep = make_plan(resolved(write(), {"rollout.sleep_between_phases": True}))
    awake_engine, asleep_engine = (
        next(h for h in plan.gpus[0] if h.role == "engine") for plan in (awake, asleep)
    )
    assert awake_engine.train == awake_engine.generate > 5 * GiB
    assert asleep_engine.train < 1 * GiB < asleep_engine.generate


def test_the_roles_on_each_gpu_follow_the_placement(write):
    kl = {"trainer.kl_coef": 0.01}
    one = make_plan(resolved(write(), kl))
    assert [[h.role for h in gpu] for gpu in one.gpus] == [["policy", "reference", "engine"]]
    split = make_plan(resolved(write(), {**kl, "ray.placement": "colocate"}))
    assert [[h.role for h in gpu] for gpu in split.gpus] == [["policy", "reference"], ["engine"]]


def test_the_reference_gets_a_rank_beside_each_policy_rank_on_gpus(write):
    """reference_ranks "auto": one reference per policy GPU where they share bundles (measured on
    four H100s, one reference scoring every GPU's samples made the train phase 19.7 s against
    12.0 s); one where the reference has a GPU of its own, and on CPUs."""
    four = {"trainer.kl_coef": 0.01, "trainer.ranks": 4, "rollout.engines": 4}
    for placement, expected in (("colocate_all", 4), ("colocate", 4), ("separate", 1)):
        config = resolved(write(), {**four, "ray.placement": placement})
        assert config.trainer.reference_ranks == expected, placement
    assert resolved(write(), {**four, "ray.gpus_per_role": 0}).trainer.reference_ranks == 1
    chosen = resolved(write(), {**four, "trainer.reference_ranks": 2})
    assert chosen.trainer.reference_ranks == 2  # the user's own number is kept
    assert "reference_ranks = 4 (auto)" in make_plan(resolved(write(), four)).describe()


def test_several_ranks_choose_as_one_gpu_where_the_same_keys_fit(write):
    """benchmarks/step_gpu.py on four H200s (2026-11-28): the plan used to count ~0.17 s of
    gradient reduction per micro-batch and chose 32k-token micro-batches with checkpointing:
    16.4 s of training a step, where 16k without checkpointing (one GPU's choice) took 9.4 s.
    NCCL reduces the gradient in ~7 ms (benchmarks/nccl_ray.py)."""
    four = {
        **HYBRID,
        "rollout.sleep_between_phases": False,
        "rollout.prompts_per_step": 256,
        "trainer.ranks": 4,
        "rollout.engines": 4,
    }
    for gpu_gb in (79.6, 139.8):
        one_gpu = {**HYBRID, "rollout.sleep_between_phases": False}
        one = resolved(write(gpu_gb=gpu_gb), one_gpu).trainer
        several = resolved(write(gpu_gb=gpu_gb), four).trainer
        assert not several.gradient_checkpointing, gpu_gb
        if not one.gradient_checkpointing:  # one GPU's choice fits four ranks too
            assert several.micro_batch_tokens == one.micro_batch_tokens, gpu_gb


def test_a_machine_without_gpus_must_be_told_their_size(write, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi
    error = error_of(write(gpu_gb=None))
    assert "[ray] gpu_memory_gb: this machine shows no GPU" in error
    assert "micro_batch_tokens" in error
    every_key = (
        '[trainer]\nmicro_batch_tokens = 4096\nforward_batch_tokens = "none"\nzero_stage = 2\n'
        + "sequence_parallel = 1\n"
        + "".join(f"{k} = false\n" for k in AUTO_KEYS if k.startswith(("offload", "gradient")))
    )
    assert resolved(write(every_key, gpu_gb=None))  # nothing to choose: nothing to check


def test_cpu_runs_are_not_planned(write):
    config = resolved(write(), {"ray.gpus_per_role": 0})
    assert make_plan(config) is None
    assert (config.trainer.zero_stage, config.trainer.micro_batch_tokens) == (0, 8192)


def test_a_config_json_the_plan_cannot_read_is_named(write, tmp_path):
    path = write()
    (tmp_path / "model" / "config.json").write_text('{"hidden_size": 8}')
    assert "[model] path: the memory plan cannot read the model:" in error_of(path)


def run(*args):
    exe = shutil.which("rlhf-launch")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120)


def test_the_plan_command_prints_every_process_and_says_whether_it_fits(write):
    result = run(write(), "--plan")
    assert result.returncode == 0, result.stderr
    for text in ("policy", "engine", "(auto)", "peak:", "fits", "GPU 0"):
        assert text in result.stdout
    too_big = run(
        write("[trainer]\ngradient_checkpointing = false\n"),
        "--plan",
        "--set",
        "trainer.micro_batch_tokens=65536",
    )
    assert too_big.returncode == 2 and "does NOT fit" in too_big.stdout
    cpu = run(write(), "--plan", "--set", "ray.gpus_per_role=0")
    assert cpu.returncode == 0 and "a CPU run" in cpu.stdout


HYBRID = {
    "trainer.kl_coef": 0.001,
    "rollout.max_batch_size": 512,
    "rollout.max_model_len": 576,
    "rollout.sleep_between_phases": True,
}


def test_the_whole_step_benchmark_fits_an_h100_without_moving_states_between_phases(write):
    """benchmarks/step_gpu.py's run: offloading between phases cost 4.2 s of a 26 s step; with
    the LM head on chunks of tokens the policy trains without checkpointing beside the reference
    and the sleeping engine."""
    config = resolved(write(gpu_gb=79.6), HYBRID)
    trainer = config.trainer
    assert not (trainer.offload_between_phases or trainer.offload_optimizer)
    assert not trainer.gradient_checkpointing and trainer.micro_batch_tokens >= 8192
    # the loop has the policy give its activations' cache back before the engine wakes
    policy = make_plan(config).gpus[0][0]
    assert policy.generate < 0.75 * policy.train
    # where it does not fit otherwise, the states leave the GPU while the engine generates
    smaller = resolved(write(gpu_gb=48), HYBRID).trainer
    assert smaller.offload_between_phases or smaller.offload_optimizer or smaller.zero_stage == 3


SAME_PASSES = {"trainer.micro_batch_tokens": 8192, "trainer.gradient_checkpointing": True}


def test_a_policy_whose_states_come_back_is_planned_larger(write):
    """Measured at 1.5B: a policy offloaded between phases reserved 1.2x at its next peak."""
    from ferrule_launcher.plan import RELOADED

    kept, moved = (
        make_plan(
            resolved(write(), dict(SAME_PASSES, **{"trainer.offload_between_phases": on}))
        ).gpus[0][0]
        for on in (False, True)
    )
    assert moved.train > kept.train * (RELOADED - 0.05)
    assert moved.generate < 3 * GiB < kept.generate


def test_loading_reads_only_the_file_and_resolving_fits_it_to_a_machine(write, monkeypatch):
    """Issue 59, item 2: load_config is the file's contents, validated (no config.json, no
    nvidia-smi: the same on any machine); resolve fills in the plan's choices for a machine."""
    import ferrule_launcher.plan as plan_module

    def no_probe(*args, **kwargs):
        raise AssertionError("loading asked the machine")

    path = write(gpu_gb=None)
    monkeypatch.setattr(plan_module.subprocess, "run", no_probe)
    monkeypatch.setattr(plan_module.ModelShape, "read", no_probe)
    config = load_config(path, {"trainer.kl_coef": 0.01})
    assert not config.resolved and config.trainer.auto == frozenset(AUTO_KEYS)
    assert config.trainer.reference_ranks_auto
    monkeypatch.undo()

    big = resolve(config, Machine(80 * GiB))
    small = resolve(config, Machine(32 * GiB))
    assert big.config.resolved and big.plan.fits() and small.plan.fits()
    assert big.plan.memory == 80 * GiB and small.plan.memory == 32 * GiB
    assert big.config.trainer.micro_batch_tokens >= small.config.trainer.micro_batch_tokens
    assert big.config.trainer.reference_ranks == 1  # one policy rank: one reference beside it
    assert not config.resolved  # the loaded config is left as it was
    # [ray] gpu_memory_gb wins over what the machine says
    sized = resolve(load_config(write(gpu_gb=32)), Machine(80 * GiB))
    assert sized.plan.memory == 32 * GiB
    # a machine that shows no GPU: refused naming the key, or left "auto" in a dry run
    with pytest.raises(ConfigError) as refused:
        resolve(config, Machine(None))
    assert f"{path}: [ray] gpu_memory_gb: this machine shows no GPU" in str(refused.value)
    dry = resolve(config, Machine(None), dry_run=True)
    assert dry.unplanned == frozenset(AUTO_KEYS) and dry.config.resolved


def test_a_cpu_config_resolves_to_itself(write):
    config = load_config(write(), {"ray.gpus_per_role": 0})
    result = resolve(config, Machine(None))
    assert result.plan is None and result.unplanned == frozenset()
    assert result.config.model_dump() == config.model_dump() and result.config.resolved


def seven_b(tmp_path, host_gb: float | None, **more):
    """GRPO at 7B (Qwen2.5-7B's widths, its config.json alone), hybrid on one 140 GiB GPU."""
    from ferrule_testkit import shape_config

    run = tmp_path / "7b.toml"
    host = f"host_memory_gb = {host_gb}\n" if host_gb else ""
    run.write_text(
        GPU_RUN.replace('path = "model"', f'path = "{shape_config("7b")}"')
        + "gpu_memory_gb = 140.4\ngpus_per_node = 1\n"
        + host
        + "[trainer]\nkl_coef = 0.001\n"
    )
    return load_config(run, {"rollout.max_batch_size": 512, **more})


def test_offloaded_states_are_planned_in_host_memory_and_a_host_too_small_is_refused(tmp_path):
    """7B on one 140 GiB GPU fits only with DeepSpeed's CPU Adam and the weights offloaded: 16
    bytes a parameter for the optimizer, 2 for the weights (127.7 GiB) on the host. The H200
    machines have 128 GiB (125.7 GiB seen): refused naming [ray] host_memory_gb and the bytes;
    with 512 GiB the same plan runs; LoRA offloads nothing."""
    small = resolve(seven_b(tmp_path, 125.7), refuse=False).plan
    assert small.gpu_fits() and not small.host_fits() and not small.fits()
    assert small.trainer.offload_optimizer and small.trainer.offload_params
    assert small.host.bytes == pytest.approx(7_615_487_488 * 18 + 3 * 3 * GiB, rel=1e-6)
    assert "host memory per node: 136.7 GiB of 80% x 126 GiB" in small.describe()
    assert "1 policy rank x 127.7 GiB offloaded, 3 processes x 3 GiB): does NOT fit" in (
        small.describe()
    )
    with pytest.raises(ConfigError) as refused:
        resolve(seven_b(tmp_path, 125.7))
    assert "[ray] host_memory_gb: the memory plan does not fit the host" in str(refused.value)
    assert "needs 136.7 GiB a node" in str(refused.value)
    large = resolve(seven_b(tmp_path, 512)).plan
    assert large.fits() and large.trainer.offload_optimizer
    lora = resolve(seven_b(tmp_path, 125.7, **{"trainer.lora_rank": 64})).plan
    assert lora.fits() and not lora.trainer.offload_optimizer
    assert lora.host.bytes == 3 * 3 * GiB  # the processes alone


def test_sizing_for_other_machines_never_reads_this_ones_host(tmp_path, monkeypatch):
    """[ray] gpu_memory_gb describes GPUs elsewhere (a cluster sized before it is rented): this
    machine's memory says nothing of theirs, so an unknown host is not checked, and
    host_memory_gb / gpus_per_node are the nodes' when given."""
    from ferrule_launcher import plan as plan_module

    def no_probe(*args, **kwargs):
        raise AssertionError("the plan asked this machine")

    monkeypatch.setattr(plan_module, "host_memory", no_probe)
    monkeypatch.setattr(plan_module, "gpu_sizes", no_probe)
    unknown = make_plan(seven_b(tmp_path, None))
    assert unknown.host_memory is None and unknown.fits()
    assert "(host memory unknown: set [ray] host_memory_gb)" in unknown.describe()
    eight = {"trainer.ranks": 8, "rollout.engines": 8, "trainer.offload_optimizer": True}
    one_node = resolve(seven_b(tmp_path, 2048, **{"ray.gpus_per_node": 8, **eight})).plan
    assert one_node.host_memory == 2048 * GiB
    # eight ranks on the node, each with an eighth of the states; 8 x 3 role processes
    assert one_node.host.bytes == pytest.approx(7_615_487_488 * 16 + 24 * 3 * GiB, rel=1e-6)
    two_nodes = resolve(seven_b(tmp_path, 2048, **{"ray.gpus_per_node": 4, **eight})).plan
    assert two_nodes.host.bytes == pytest.approx(7_615_487_488 * 8 + 12 * 3 * GiB, rel=1e-6)


def test_a_zero3_policys_scoring_pass_holds_its_shard_not_the_whole_model(tmp_path):
    """The policy's old-log-prob pass was planned as a frozen model's, with every weight on
    each rank: at 32B (65.5 GB of bf16 weights) over 8 ZeRO-3 ranks that alone made 61 GiB a
    GPU, and every plan of 32B on 8 or 16 GPUs failed on the policy. Its states' shard and a
    forward batch's activations are what it holds."""
    from ferrule_testkit import shape_config

    run = tmp_path / "32b.toml"
    run.write_text(
        GPU_RUN.replace('path = "model"', f'path = "{shape_config("32b")}"')
        + 'gpu_memory_gb = 80\nplacement = "colocate"\n'
        + "[trainer]\nranks = 8\nzero_stage = 3\noffload_optimizer = true\n"
        + "micro_batch_tokens = 4096\nforward_batch_tokens = 4096\ngradient_checkpointing = true\n"
    )
    config = load_config(run, {"trainer.epochs": 2})  # off-policy: the old log-probs pass
    assert config.trainer.needs_old_logprobs()
    policy = resolve(config, refuse=False).plan.gpus[0][0]
    # its states' shard ~26 GiB (fp32 gradients counted on the GPU) and ~5 GiB of activations
    assert policy.role == "policy" and policy.train < 45 * GiB


def test_this_machines_host_counts_only_where_it_runs_the_gpus(tmp_path):
    """An H200 machine as `Machine` (140.4 GiB GPU, 125.7 GiB host, one GPU) plans 7B with its
    own host and refuses it; a machine that shows no GPU says nothing of the host either."""
    from ferrule_testkit import shape_config

    run = tmp_path / "7b.toml"
    run.write_text(
        GPU_RUN.replace('path = "model"', f'path = "{shape_config("7b")}"')
        + "[trainer]\nkl_coef = 0.001\n"
    )
    config = load_config(run, {"rollout.max_batch_size": 512})
    h200 = Machine(int(140.4 * GiB), int(125.7 * GiB), 1)
    with pytest.raises(ConfigError, match=r"\[ray\] host_memory_gb: the memory plan does not fit"):
        resolve(config, h200)
    laptop = resolve(config, Machine(None, 16 * GiB, None), dry_run=True).plan
    assert laptop.host_memory is None


def test_a_sequence_group_plans_each_rank_for_its_share_of_the_positions(write):
    """[trainer] sequence_parallel = N: a policy rank's activations are those of 1/N of each
    micro-batch's tokens; the model's heads and the ranks must divide by N, named before
    anything starts."""
    keys = {"trainer.ranks": 2, "rollout.engines": 2, "trainer.micro_batch_tokens": 16384}
    keys.update({"trainer.gradient_checkpointing": False, "trainer.zero_stage": 2})
    keys.update({"trainer.offload_optimizer": False, "trainer.offload_params": False})
    keys.update({"trainer.offload_between_phases": False})
    one = resolve(load_config(write(), {**keys, "trainer.sequence_parallel": 1}), refuse=False).plan
    two = resolve(load_config(write(), {**keys, "trainer.sequence_parallel": 2})).plan
    assert not one.fits() and two.fits()  # 16k-token micro-batches fit an 80 GB GPU only shared
    policy = [next(h for h in plan.gpus[0] if h.role == "policy") for plan in (one, two)]
    assert "8192 tokens per micro-batch (1/2 of each sequence)" in policy[1].how
    assert policy[1].train < policy[0].train - 10 * GiB  # 8192 tokens' activations fewer
    # the 1.5B's 12 heads do not split over 8 ranks; 3 ranks do not split into groups of 2
    eight = {**keys, "trainer.ranks": 8, "rollout.engines": 8, "trainer.sequence_parallel": 8}
    assert "[trainer] sequence_parallel" in error_of(write(), **eight)
    assert "12 attention heads" in error_of(write(), **eight)
    with pytest.raises(ConfigError, match="multiple of sequence_parallel = 2"):
        load_config(write(), {**keys, "trainer.ranks": 3, "trainer.sequence_parallel": 2})


def test_the_plan_shares_sequences_only_where_whole_ones_do_not_fit(tmp_path):
    """sequence_parallel "auto": 7B GRPO at 128k-token sequences on 4 + 4 x 80 GB GPUs (policy
    ranks, vLLM engines; computed on a machine without GPUs): no plan of whole sequences per rank
    fits (at 32k, checkpointing and CPU Adam still do), so the plan takes the smallest group
    that does; at 4k-token sequences it keeps them whole."""
    from ferrule_testkit import shape_config

    run = tmp_path / "7b-long.toml"
    run.write_text(
        GPU_RUN.replace('path = "model"', f'path = "{shape_config("7b")}"')
        .replace("max_tokens = 512", "max_tokens = 126976")
        .replace("max_model_len = 1024", "max_model_len = 131072")
        + "gpu_memory_gb = 80\nhost_memory_gb = 2048\ngpus_per_node = 8\n"
        + 'placement = "colocate"\n[trainer]\nranks = 4\n'
    )
    engines = {"rollout.engines": 4, "rollout.backend": "vllm"}
    long = resolve(load_config(run, engines)).plan
    assert long.fits() and long.trainer.sequence_parallel > 1
    assert "sequence_parallel = " in long.describe() and "(auto)" in long.describe()
    whole = resolve(
        load_config(run, {**engines, "trainer.sequence_parallel": 1}), refuse=False
    ).plan
    assert not whole.fits()
    short = resolve(
        load_config(run, {**engines, "rollout.max_tokens": 3072, "rollout.max_model_len": 4096})
    ).plan
    assert short.fits() and short.trainer.sequence_parallel == 1


def test_a_micro_batch_is_planned_at_no_less_than_one_whole_row(write):
    """A row longer than the token budget goes alone (sequences.group_by_length): under a
    512-token budget, rows of up to max_model_len = 1024 make 1024-token micro-batches."""
    keys = {"trainer.micro_batch_tokens": 512, "trainer.forward_batch_tokens": 512}
    plan = make_plan(resolved(write(), keys))
    policy = next(h for h in plan.gpus[0] if h.role == "policy")
    assert policy.how.startswith("1024 tokens per micro-batch"), policy.how


def test_a_paged_kv_cache_is_planned_at_its_tokens_not_rows_times_the_longest(write):
    """[rollout] kv_cache_tokens: the transformers engine's cache is that many tokens (and the
    page no row holds) whatever max_batch_size is: 512 rows in 128 x 16,384 tokens plan the
    cache of 128 rows at that length, plus 384 more rows' logits; below one sequence refused."""
    from ferrule_launcher.plan import _engine
    from ferrule_trainer.memory import FRAGMENTATION, ModelShape

    long = {"rollout.max_model_len": 16448, "rollout.max_tokens": 16384}
    rows = load_config(write(), {**long, "rollout.max_batch_size": 128})
    pages = load_config(
        write(), {**long, "rollout.max_batch_size": 512, "rollout.kv_cache_tokens": 128 * 16448}
    )
    shape = ModelShape.read(rows.model.path)
    (by_rows, _), (by_pages, how) = _engine(rows, shape, None), _engine(pages, shape, None)
    logits, per_token = 384 * QWEN25_VOCAB * 8, QWEN25_1_5B["num_hidden_layers"] * 2 * 256 * 2
    extra = FRAGMENTATION * (logits + 64 * per_token)
    assert by_pages - by_rows == pytest.approx(extra, rel=0.01)
    assert "KV cache of 2105408 tokens for 512 rows" in how
    with pytest.raises(ConfigError, match="kv_cache_tokens 8000 cannot hold one sequence"):
        load_config(write(), {**long, "rollout.kv_cache_tokens": 8000})
