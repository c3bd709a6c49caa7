"""Configuration errors name the file, the table and the key, before anything starts."""

import subprocess
import sys
from pathlib import Path

import pytest

from ferrule_launcher.config import ConfigError, describe
from ferrule_launcher.load import load_config
from ferrule_trainer.config import ESTIMATORS

EXAMPLE = Path(__file__).parents[3] / "examples" / "tiny.toml"
REWARDS = '[rewards]\nfunction = "ferrule_rewards.builtin:exact_text"\n'
BASE = '[model]\npath = "model"\n' + REWARDS


@pytest.fixture
def write(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")

    def write(text: str, base: str = BASE) -> Path:
        if "[rewards]" in text:  # the test gives its own [rewards] table
            base = base.replace(REWARDS, "")
        path = tmp_path / "run.toml"
        path.write_text(base + text)
        return path

    return write


def error_of(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(info.value)


def test_minimal_config_resolves_paths_near_the_file(write):
    config = load_config(write(""))
    assert config.model.path == write("").parent / "model"
    assert config.trainer.estimator == "grpo"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[rollout]\ntemperature = -1\n", "[rollout] temperature: Input should be greater than 0"),
        ("[rollout]\nsamples_per_prompt = 'many'\n", "[rollout] samples_per_prompt:"),
        ("[rollout]\ntemprature = 1.0\n", "[rollout] temprature: unknown key (known: "),
        ("[rolout]\nn = 1\n", "table [rolout]: unknown table"),
        ("[trainer]\nestimator = 'ppo2'\n", "[trainer] estimator: Input should be 'grpo'"),
        ("[loop]\nmode = 'fast'\n", "[loop] mode:"),
        ("[ray]\nplacement = 'everywhere'\n", "[ray] placement:"),
    ],
)
def test_type_range_and_unknown_key_errors(write, text, expected):
    message = error_of(write(text))
    assert message.startswith(f"{write(text)}: ")
    assert expected in message


def test_missing_table_and_missing_model_files(write, tmp_path):
    assert "table [model]: is required" in error_of(write("", base=""))
    path = write('[model]\npath = "nowhere"\n[rewards]\nfunction = "json:b"\n', base="")
    assert "[model] path: no Hugging Face model at" in error_of(path)
    path = write('[rewards]\nfunction = ""\nmodel = "no_rm"\n', base='[model]\npath = "model"\n')
    assert "[rewards] model: no reward model folder" in error_of(path)
    path = write('[rewards]\nfunction = "missing.py:f"\n', base='[model]\npath = "model"\n')
    assert "[rewards] function: no file" in error_of(path)
    path = write("[task]\nname = 'data'\n[[task.sources]]\npath = 't.jsonl'\neval_path = 'e'\n")
    assert "[task] sources.0.path: no file or folder" in error_of(path)
    assert "[task] sources.0.eval_path: no file or folder" in error_of(path)
    path = write("[sft]\nsteps = 2\ndata = 's.jsonl'\n")
    assert "[sft] data: the warm start of a 'reversal' task uses its own answers" in error_of(path)
    path = write('[rewards]\nfunction = "no_such_module:f"\n', base='[model]\npath = "model"\n')
    assert "[rewards] function: no module 'no_such_module'" in error_of(path)


def test_exact_refuses_a_chosen_attention(write):
    base = '[model]\npath = "model"\nattn_implementation = "eager"\n' + REWARDS
    path = write("[rollout]\nbackend = 'transformers'\nexact = true\n", base=base)
    assert "[model] attn_implementation: [rollout] exact = true sets the attention" in error_of(
        path
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "[rewards]\nfunction = 'json:b'\naddress = ['127.0.0.1:1']\n",
            "[rewards] function: give exactly one of",
        ),
        ("[rollout]\nsamples_per_prompt = 1\n", "[rollout] samples_per_prompt: must be >= 2"),
        ("[trainer]\nestimator = 'gae'\n", '[trainer] estimator: "gae" needs a [critic]'),
        ("[critic]\nlearning_rate = 1e-4\n", "[critic] learning_rate: a [critic] is only used"),
        ("[trainer]\nkl_coef = 0.1\nkl_kind = 'k1'\n", "[trainer] kl_kind:"),
        ("[trainer]\nkl_in = 'reward'\n", "[trainer] kl_in:"),
        ("[rollout]\nmax_tokens = 200\n", "[rollout] max_tokens: must be < max_model_len"),
        ("[rollout]\nengines = 3\n", "[rollout] engines: must divide prompts_per_step"),
        ("[trainer]\nmini_batches = 7\n", "[trainer] mini_batches: mini_batches x ranks must"),
        ("[trainer]\nranks = 3\n", "[trainer] ranks: mini_batches x ranks must divide"),
        ("[rollout]\ntransport = 'ipc'\n[ray]\nplacement = 'separate'\n", "[rollout] transport:"),
        ("[loop]\nmax_staleness = 3\n", "[loop] max_staleness: only applies"),
        ("[ray]\nroles_on_nodes = {rollout = 'w'}\n", "[ray] roles_on_nodes: cannot pin"),
        ("[task]\nname = 'csv'\n", "[task] name: Input should be 'reversal', 'arithmetic'"),
        ("[task]\nname = 'data'\n", '[task] sources: "data" needs at least one [[task.sources]]'),
        ("[[task.sources]]\npath = 'e.jsonl'\n", '[task] sources: only read by name = "data"'),
        (
            "[task]\nname = 'data'\n[[task.sources]]\npath = 'e.jsonl'\n",
            "[task] sources: no source has an eval_path",
        ),
        (
            "[task]\nname = 'data'\n[[task.sources]]\npath = 'a/t.jsonl'\neval_path = 'e'\n"
            "[[task.sources]]\npath = 'b/t.parquet'\n",
            "[task] sources: two sources are named 't': set name",
        ),
        (
            "[task]\nname = 'data'\n[[task.sources]]\npath = 't'\neval_path = 'e'\nweight = 0\n",
            "[task] sources.0.weight: Input should be greater than 0",
        ),
        (
            "[task]\nname = 'data'\n[[task.sources]]\npath = 't'\neval_path = 'e'\n[sft]\nsteps = 5\n",
            '[sft] data: with name = "data" the warm start needs a data file',
        ),
        (
            "[task]\nname = 'data'\nmax_prompt_tokens = 121\n[[task.sources]]\npath = 't'\n"
            "eval_path = 'e'\n",
            "[task] max_prompt_tokens: must leave max_tokens (8) within max_model_len (128): at "
            "most 120, got 121",
        ),
        (
            "[trainer]\nzero_stage = 2\noffload_between_phases = true\n[ray]\nplacement = 'separate'\n",
            '[trainer] offload_between_phases: needs placement = "colocate_all"',
        ),
        (
            "[rollout]\nsleep_between_phases = true\n[loop]\nmode = 'async'\n",
            '[rollout] sleep_between_phases: needs loop mode = "sync"',
        ),
        (
            "[trainer]\nzero_stage = 0\noffload_between_phases = true\n",
            "[trainer] offload_between_phases: needs zero_stage >= 1",
        ),
        (
            "[trainer]\noffload_params = true\nzero_stage = 2\n",
            "[trainer] offload_params: needs zero_stage = 3",
        ),
        ("[trainer]\nbetas = [0.9, 1.5]\n", "[trainer] betas: must both be in [0, 1)"),
        (
            "[trainer]\nkl_coef = 0.01\nreference_ranks = 3\n",
            "[trainer] reference_ranks: must divide the rollout batch 128, got 3",
        ),
        (
            "[trainer]\nestimator = 'gae'\nmini_batches = 2\n[critic]\nranks = 3\n",
            "[critic] ranks: [trainer] mini_batches x ranks must divide the rollout batch 128, got 2 x 3",
        ),
        (
            "[trainer]\nranks = 2\n[ray]\ngpus_per_role = 1\n",
            '[rollout] engines: with placement = "colocate_all" on GPUs each GPU holds a policy rank and an engine: must equal [trainer] ranks 2, got 1',
        ),
        (
            "[rollout]\ntensor_parallel_size = 2\n[ray]\ngpus_per_role = 1\n",
            "[rollout] tensor_parallel_size: an engine's bundle has [ray] gpus_per_role = 1 GPUs",
        ),
        (
            "[rollout]\nbackend = 'transformers'\ntensor_parallel_size = 2\n",
            '[rollout] tensor_parallel_size: tensor_parallel_size > 1 needs backend = "vllm"',
        ),
        (
            "[rollout]\nbackend = 'sglang'\n",
            "[rollout] backend: Input should be 'vllm' or 'transformers'",
        ),
        # issue 16's keys
        ("[trainer]\ntis_floor = 2.0\n", "[trainer] tis_floor: must be below tis_cap = 2"),
        ("[trainer]\ntis_cap = 0\n", "[trainer] tis_cap: Input should be greater than 0"),
        ("[trainer]\nicepop_low = 6.0\n", "[trainer] icepop_low: must be below icepop_high = 5"),
        ("[trainer]\nicepop_high = 0\n", "[trainer] icepop_high: Input should be greater than 0"),
        (
            "[trainer]\nrollout_correction = 'is'\n",
            "[trainer] rollout_correction: Input should be 'none', 'tis' or 'icepop'",
        ),
        (
            "[trainer]\nsequence_mask = [1.5, 2.0]\n",
            "[trainer] sequence_mask: needs 0 <= low < 1 < high, got [1.5, 2.0]",
        ),
        ("[trainer]\nkl_target = 0.01\n", "[trainer] kl_target: needs kl_coef > 0"),
        ("[trainer]\nkl_horizon = 0\n", "[trainer] kl_horizon: Input should be greater than"),
        (
            "[trainer]\nkl_coef = 0.1\nkl_target = 0.01\nkl_horizon = 1\n",
            "[trainer] kl_horizon: must exceed the rollout batch / 5 = 25.6 samples",
        ),
        (
            "[trainer]\nreward_norm = 'group'\n",
            "[trainer] reward_norm: Input should be 'none', 'batch' or 'running'",
        ),
        ("[trainer]\nreward_clip = -1\n", "[trainer] reward_clip: Input should be greater than 0"),
        ("[trainer]\nlora_rank = -1\n", "[trainer] lora_rank: Input should be greater than"),
        ("[trainer]\nlora_alpha = 0\n", "[trainer] lora_alpha: Input should be greater than"),
        (
            "[trainer]\nlora_rank = 8\nlora_targets = []\n",
            "[trainer] lora_targets: needs at least one module name",
        ),
        (
            "[loop]\npartial_rollout = true\n",
            '[loop] partial_rollout: with mode = "sync" needs [rollout] backend = "transformers", '
            "got 'vllm'",
        ),
        (
            "[loop]\npartial_rollout = true\n[rollout]\nbackend = 'transformers'\nexact = true\n",
            "[loop] partial_rollout: needs exact = false",
        ),
        ("[loop]\npartial_cut = 0.5\n", "[loop] partial_cut: only applies with partial_rollout"),
        (
            "[rollout]\nbackend = 'transformers'\nreuse_cut_kv = true\n",
            "[rollout] reuse_cut_kv: only applies with partial_rollout = true",
        ),
        (
            "[loop]\nmode = 'async'\npartial_rollout = true\npartial_cut = 0.5\n",
            '[loop] partial_cut: only applies with partial_rollout = true and mode = "sync"',
        ),
        (
            "[rollout]\nreuse_cut_kv = true\n",
            '[rollout] reuse_cut_kv: reuse_cut_kv needs backend = "transformers"',
        ),
        (
            "[rollout]\nbackend = 'transformers'\nexact = true\nreuse_cut_kv = true\n",
            "[rollout] reuse_cut_kv: exact recomputes every sequence's keys and values",
        ),
        ("[loop]\npartial_cut = 0\n", "[loop] partial_cut: Input should be greater than 0"),
        ("[rollout]\nexact = true\n", '[rollout] exact: exact needs backend = "transformers"'),
        (
            "[rollout]\nbackend = 'transformers'\ntop_p = 0.9\nexact = true\n",
            "[rollout] exact: exact samples from the policy's own softmax",
        ),
        (
            "[rollout]\nbackend = 'transformers'\nexact = true\n[trainer]\nlora_rank = 8\n",
            "[rollout] exact: needs no LoRA",
        ),
        (
            "[loop]\npartial_rollout = true\nmode = 'async'\n[rollout]\nbackend = 'transformers'\n",
            '[loop] partial_rollout: with mode = "async" needs [rollout] backend = "vllm", got '
            "'transformers'",
        ),
        (
            "[loop]\nkeep_group_mean = [1.0, 0.0]\n",
            "[loop] keep_group_mean: needs low < high, got [1.0, 0.0]",
        ),
        ("[loop]\nmax_draws = 0\n", "[loop] max_draws: Input should be greater than or equal"),
        (
            "[trainer]\noverlong_buffer = 9\n[rollout]\nmax_tokens = 8\n",
            "[trainer] overlong_buffer: must be <= [rollout] max_tokens = 8",
        ),
        (
            "[trainer]\noverlong_penalty = -1\n",
            "[trainer] overlong_penalty: Input should be greater than or equal to 0",
        ),
        (
            "[trainer]\ntruncated_score = 'low'\n",
            "[trainer] truncated_score: Input should be a valid number",
        ),
        (
            "[trainer]\nratio_level = 'group'\n",
            "[trainer] ratio_level: Input should be 'token' or 'sequence'",
        ),
        (  # GSPO matches OpenRLHF's and verl's only per sequence: the mix is refused, both named
            "[trainer]\nratio_level = 'sequence'\nagg_mode = 'token-mean'\n",
            '[trainer] agg_mode: ratio_level = "sequence" (GSPO) is defined with agg_mode = '
            "\"seq-mean-token-mean\" (its default); got 'token-mean'",
        ),
        (
            "[rewards]\nfunction = 'ferrule_rewards.builtin:exact_text'\nmax_failed_fraction = 1.5\n",
            "[rewards] max_failed_fraction: Input should be less than or equal to 1",
        ),
        ("[eval]\nsamples = 2\npass_k = 4\n", "[eval] pass_k: must be <= samples = 2, got 4"),
        ("[eval]\nsamples = 0\n", "[eval] samples: Input should be greater than or equal to 1"),
        ("[rollout]\nmax_restarts = -1\n", "[rollout] max_restarts: Input should be greater"),
        (
            "[output]\nkeep_best = 'eval/pass@1'\ncheckpoint_every = 15\n[loop]\neval_every = 10\n",
            "[output] keep_best: 'eval/pass@1' is measured every [loop] eval_every = 10 steps: "
            "checkpoint_every (15) must be a multiple of it",
        ),
        ("[output]\nkeep_last = 0\n", "[output] keep_last: Input should be greater than or equal"),
        (
            "[trainer]\nestimator = 'gae'\n[critic]\ninit = 'reward_model'\n",
            '[critic] init: "reward_model" starts the critic from [rewards] model, which is not set',
        ),
        (
            "[rewards]\nfunction = 'json:b'\nnormalize = true\n",
            "[rewards] normalize: needs [rewards] model",
        ),
        (
            "[rewards]\nfunction = 'json:b'\ngpus = 1\n",
            "[rewards] gpus: sizes the reward model's role: needs [rewards] model",
        ),
        (
            "[ray]\nplacement = 'separate'\nroles_on_nodes = {judge = 'x'}\n",
            "unknown role 'judge'; roles are policy, rollout, critic, rewards",
        ),
    ],
)
def test_contradictory_settings(write, text, expected):
    assert expected in error_of(write(text))


def test_model_table_is_the_trainers(write):
    text = "[model]\npath = 'model'\nattn_implementation = 'fast'\n"
    assert "[model] attn_implementation: Input should be 'eager'" in error_of(
        write(text, base=REWARDS)
    )
    assert "[model] dtype: Input should be 'float32' or 'bfloat16', got 'fp16'" in error_of(
        write("[model]\npath = 'model'\ndtype = 'fp16'\n", base=REWARDS)
    )


def test_every_estimator_is_selectable(write):
    for estimator in ESTIMATORS:
        critic = "[critic]\n" if estimator == "gae" else ""
        text = f"[trainer]\nestimator = '{estimator}'\n{critic}"
        assert load_config(write(text)).trainer.estimator == estimator


def test_invalid_toml_names_the_file(write):
    assert "not valid TOML" in error_of(write("[rollout\n"))


def test_every_field_has_a_docstring():
    from ferrule_launcher import config

    for table in [config.Config, *[f.annotation for f in config.Config.model_fields.values()]]:
        table = next(a for a in getattr(table, "__args__", (table,)) if a is not type(None))
        for name, field in table.model_fields.items():
            assert field.description or table is config.Config, f"{table.__name__}.{name}"


def test_example_is_valid_and_dry_run_prints_it():
    text = describe(load_config(EXAMPLE))
    assert "[rollout]" in text and "samples_per_prompt" in text
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ferrule_launcher.cli",
            str(EXAMPLE),
            "--dry-run",
            "--set",
            "loop.steps=3",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "configuration is valid" in out.stdout and "steps = 3" in out.stdout


def test_what_dry_run_prints_loads_back_as_the_same_config(write, tmp_path):
    """`describe` writes None as "none" (TOML has no null); a file saved from --dry-run, with
    keys turned off among them, must load as the configuration it describes (with the values
    "auto" chose written out: the same values, no longer the plan's to choose)."""
    config = load_config(
        write('[trainer]\ndual_clip = "none"\nkl_max = "none"\nsequence_mask = [0.5, 2.0]\n')
    )
    assert config.trainer.dual_clip is None and config.trainer.kl_max is None
    saved = tmp_path / "saved.toml"
    saved.write_text(describe(config))
    loaded = load_config(saved)
    assert loaded.model_dump() == config.model_dump()
    assert config.trainer.auto and not loaded.trainer.auto


def test_none_only_turns_off_keys_that_may_be_none(write):
    with pytest.raises(ConfigError, match=r"\[trainer\] clip_low: Input should be a valid number"):
        load_config(write('[trainer]\nclip_low = "none"\n'))
    with pytest.raises(ConfigError, match=r"\[trainer\] kl_max: Input should be greater than 0"):
        load_config(write("[trainer]\nkl_max = 0\n"))


def test_an_environment_is_checked_before_anything_starts(write, tmp_path):
    (tmp_path / "env.py").write_text(
        "from ferrule_rollout.environments import Environment\n"
        "class Good(Environment):\n"
        "    def reset(self, prompt, label, metadata):\n        return prompt\n"
        "    def step(self, model_output):\n        return None, 1.0, {}\n"
        "class NotOne:\n    pass\n"
    )
    model = '[model]\npath = "model"\n'
    config = load_config(write("[environment]\nname = 'env.py:Good'\n", base=model))
    assert config.environment.name == f"{tmp_path / 'env.py'}:Good"  # near the TOML file
    assert not config.needs_reward_server()  # scored by the environment: no [rewards] needed
    path = write("[environment]\nname = 'env.py:Missing'\n", base=model)
    assert "[environment] name: environment" in error_of(path)
    assert "has no 'Missing'" in error_of(path)
    path = write("[environment]\nname = 'env.py:NotOne'\n", base=model)
    assert "not a subclass of ferrule_rollout.environments.Environment" in error_of(path)
    path = write("[environment]\nname = 'nowhere.py:Good'\n", base=model)
    assert "no file" in error_of(path)
    # reward = "environment" leaves [rewards] unused: a function given anyway is a mistake
    path = write("[environment]\nname = 'env.py:Good'\n")
    assert '[rewards] function: unused: [environment] reward = "environment"' in error_of(path)
    # the reward server's score, or both: [rewards] as for single-turn runs
    for reward in ("reward_server", "sum"):
        config = load_config(write(f"[environment]\nname = 'env.py:Good'\nreward = '{reward}'\n"))
        assert config.needs_reward_server()
        path = write(f"[environment]\nname = 'env.py:Good'\nreward = '{reward}'\n", base=model)
        assert "[rewards] function: give exactly one of" in error_of(path)
    path = write(
        "[environment]\nname = 'env.py:Good'\n[loop]\nalgorithm = 'iterative_dpo'\n", base=model
    )
    assert '[environment] name: [loop] algorithm must be "rl"' in error_of(path)


LAST_MONTH = """[model]
path = "model"
dtype = "fp32"
[task]
name = "jsonl"
train_file = "train.jsonl"
eval_file = "test.jsonl"
prompt_key = "question"
label_key = "answer"
[rewards]
function = "ferrule_rewards.builtin:exact_text"
attempts = 3
"""


@pytest.mark.parametrize(
    "hint",
    [
        "[model] dtype: 'fp32' was renamed: use 'float32'",
        '[task] name: "jsonl" was renamed: use name = "data" and one [[task.sources]] table per file',
        '[task] train_file: was renamed: use name = "data" and a [[task.sources]] table with '
        'path = "train.jsonl"',
        '[task] eval_file: was renamed: use eval_path = "test.jsonl" in a [[task.sources]] table',
        '[task] prompt_key: moved: write prompt_key = "question" in each [[task.sources]] table',
        '[task] label_key: moved: write label_key = "answer" in each [[task.sources]] table',
        "[rewards] attempts: was replaced by retry_for",
    ],
)
def test_last_months_keys_say_what_replaced_them(write, hint):
    """A config in the form before 0.1.0's data sources gets every hint at once."""
    assert f"run.toml: {hint}" in error_of(write(LAST_MONTH, base=""))


def test_the_new_form_of_last_months_config_loads(write, tmp_path):
    (tmp_path / "train.jsonl").write_text('{"question": "a", "answer": "b"}\n')
    (tmp_path / "test.jsonl").write_text('{"question": "a", "answer": "b"}\n')
    new = (
        LAST_MONTH.replace('"fp32"', '"float32"')
        .replace('"jsonl"', '"data"')
        .replace("attempts = 3", "retry_for = 20")
    )
    for old in ("train_file", "eval_file", "prompt_key", "label_key"):
        new = "\n".join(line for line in new.splitlines() if not line.startswith(old)) + "\n"
    new += '[[task.sources]]\npath = "train.jsonl"\neval_path = "test.jsonl"\n'
    new += 'prompt_key = "question"\nlabel_key = "answer"\n'
    config = load_config(write(new, base=""))
    assert config.task.sources[0].path == tmp_path / "train.jsonl"
    assert config.model.dtype == "float32"
