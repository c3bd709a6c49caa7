"""Each rule that spans tables (checks.py), alone: silent on a valid config, and naming the key
to change when its tables contradict one another."""

import importlib.util
from pathlib import Path

import pytest

from ferrule_launcher import checks
from ferrule_launcher.config import ConfigError, EnvironmentConfig
from ferrule_launcher.load import load_config
from ferrule_trainer.config import CriticConfig


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
    folder = tmp_path_factory.mktemp("run")
    (folder / "model").mkdir()
    (folder / "model" / "config.json").write_text("{}")
    path = folder / "run.toml"
    path.write_text(
        '[model]\npath = "model"\n[rewards]\nfunction = "ferrule_rewards.builtin:exact_text"\n'
        "[rollout]\nprompts_per_step = 4\n"
    )
    return load_config(path)


def changed(config, **tables):
    """`config` with some keys of some tables replaced, unchecked: {"rollout": {"exact": True}}."""
    update = {}
    for table, values in tables.items():
        current = getattr(config, table)
        update[table] = values if current is None else current.model_copy(update=values)
    return config.model_copy(update=update)


CASES = [
    (
        checks.check_reward_source,
        {"rewards": {"address": "127.0.0.1:1"}},
        "rewards.function",
        "exactly one",
    ),
    (
        checks.check_batch,
        {"rollout": {"samples_per_prompt": 1}},
        "rollout.samples_per_prompt",
        ">= 2",
    ),
    (
        checks.check_partial_rollout,
        {"loop": {"partial_rollout": True}},
        "loop.partial_rollout",
        'with mode = "sync" needs [rollout] backend = "transformers"',
    ),
    (
        checks.check_exact,
        {"rollout": {"exact": True}, "trainer": {"lora_rank": 8}},
        "rollout.exact",
        "LoRA",
    ),
    (
        checks.check_overlong_buffer,
        {"trainer": {"overlong_buffer": 10**6}},
        "trainer.overlong_buffer",
        "<=",
    ),
    (checks.check_data, {"task": {"name": "data"}}, "task.sources", "at least one"),
    (checks.check_recipe, {"loop": {"algorithm": "sft", "mode": "async"}}, "loop.mode", '"sync"'),
    (
        checks.check_reward_model_keys,
        {"rewards": {"gpus": 1.0}},
        "rewards.gpus",
        "needs [rewards] model",
    ),
    (
        checks.check_keep_best,
        {"output": {"keep_best": "eval/reward", "checkpoint_every": 10}, "loop": {"eval_every": 3}},
        "output.keep_best",
        "multiple",
    ),
    (
        checks.check_lengths,
        {"rollout": {"max_tokens": 10**6}},
        "rollout.max_tokens",
        "max_model_len",
    ),
    (checks.check_engines, {"rollout": {"engines": 3}}, "rollout.engines", "must divide"),
    (
        checks.check_transport,
        {"rollout": {"transport": "ipc"}, "ray": {"placement": "separate"}},
        "rollout.transport",
        "colocate_all",
    ),
    (checks.check_staleness, {"loop": {"max_staleness": 7}}, "loop.max_staleness", "async"),
    (
        checks.check_devices,
        {"rollout": {"sleep_between_phases": True}, "ray": {"placement": "colocate"}},
        "rollout.sleep_between_phases",
        "colocate_all",
    ),
    (
        checks.check_environment,
        {
            "environment": EnvironmentConfig(name="ferrule_rollout.environments:Echo"),
            "loop": {"partial_rollout": True},
        },
        "loop.partial_rollout",
        "[environment]",
    ),
    (checks.check_files, {"sft": {"data": Path("/nonexistent/sft.jsonl")}}, "sft.data", "no file"),
    (
        checks.check_sequence_parallel,
        {"trainer": {"sequence_parallel": 2, "ranks": 2}, "critic": CriticConfig()},
        "critic.ranks",
        "multiple of [trainer] sequence_parallel = 2",
    ),
]


def test_every_rule_is_exercised_here():
    assert {case[0] for case in CASES} == set(checks.CROSS_TABLE) - {checks.check_wandb} | {
        checks.check_files
    }


@pytest.mark.parametrize(
    ("check", "tables", "key", "words"), CASES, ids=lambda c: getattr(c, "__name__", None)
)
def test_a_rule_is_silent_on_a_valid_config_and_names_the_key_it_breaks(
    valid, check, tables, key, words
):
    assert check(valid) == []
    problems = check(changed(valid, **tables))
    assert [k for k, _ in problems] == [key], problems
    assert words in problems[0][1]


def test_wandb_needs_its_package(valid):
    assert checks.check_wandb(valid) == []
    problems = checks.check_wandb(changed(valid, output={"wandb": True}))
    installed = importlib.util.find_spec("wandb") is not None
    assert problems == ([] if installed else [("output.wandb", problems[0][1])])


def test_files_are_checked_only_once_no_rule_is_broken(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    path = tmp_path / "run.toml"
    base = '[model]\npath = "model"\n[rewards]\nfunction = "missing.py:f"\n'
    path.write_text(base + "[rollout]\nmax_tokens = 5000\nmax_model_len = 4096\n")
    with pytest.raises(ConfigError) as broken:
        load_config(path)
    assert "[rollout] max_tokens: must be < max_model_len" in str(broken.value)
    assert "missing.py" not in str(broken.value)  # the contradiction first, alone
    path.write_text(base)
    with pytest.raises(ConfigError) as missing:
        load_config(path)
    assert "missing.py" in str(missing.value)


def test_a_recipes_table_is_read_only_under_its_algorithm_and_old_keys_name_their_new_place(
    tmp_path,
):
    """[loop] dpo_beta, dpo_nll_coef and chosen_min_reward moved to the recipes' own tables: the
    old keys are refused naming the new place; a recipe's table set under another algorithm is
    refused (its defaults, as --dry-run prints them, are not)."""
    example = Path(__file__).parents[3] / "examples" / "tiny.toml"
    with pytest.raises(
        ConfigError, match=r"dpo_beta.*moved: write beta = 0.2 in \[iterative_dpo\]"
    ):
        load_config(example, {"loop.dpo_beta": 0.2})
    with pytest.raises(ConfigError, match=r"chosen_min_reward.*\[rejection_sampling\] or"):
        load_config(example, {"loop.chosen_min_reward": 1.0})
    with pytest.raises(
        ConfigError,
        match=r"\[iterative_dpo\] nll_coef: \[iterative_dpo\] is read "
        r"only with \[loop\] algorithm = 'iterative_dpo', got 'rl'",
    ):
        load_config(example, {"iterative_dpo.nll_coef": 1.0})
    assert load_config(example, {"iterative_dpo.beta": 0.1}).recipe() is None  # the default
    dpo = load_config(example, {"loop.algorithm": "iterative_dpo", "iterative_dpo.beta": 0.3})
    assert dpo.recipe().beta == 0.3
