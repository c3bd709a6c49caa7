"""TOML files of tables: every problem at once, each naming the file, the table and the key;
paths near the file; "none" for None; renamed keys and dtypes; describe writes TOML back."""

from pathlib import Path
from typing import ClassVar, Literal

import pytest
from pydantic import Field, model_validator

from ferrule_config import ConfigError, InputPath, Problems, Table, describe, load_config


class Train(Table):
    renamed: ClassVar[dict[str, str]] = {"lr": "was renamed: use learning_rate = {value}"}
    learning_rate: float = Field(1.0, gt=0)
    """Step size."""
    clip: float | None = 0.2
    """Clipping ("none": off)."""
    mode: Literal["sync", "async"] = "sync"
    """How steps overlap."""


class Data(Table):
    path: InputPath
    """Where the data is, relative to the file."""
    workers: int = 1
    """Readers."""

    @model_validator(mode="after")
    def _consistent(self):
        if self.workers > 1 and self.path.suffix == ".txt":
            raise Problems([("workers", "one reader for a .txt file")])
        return self


class File(Table):
    data: Data
    train: Train = Train()


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_loads_with_paths_near_the_file_and_none(tmp_path):
    path = write(tmp_path, '[data]\npath = "d.jsonl"\n[train]\nclip = "none"\n')
    config = load_config(path, File, overrides={"train.mode": "async"})
    assert config.data.path == tmp_path / "d.jsonl"
    assert config.train.clip is None and config.train.mode == "async"
    assert load_config(write(tmp_path, describe(config)), File) == config  # describe is TOML


def test_every_problem_at_once_naming_file_table_and_key(tmp_path):
    path = write(
        tmp_path,
        '[data]\npath = "d.txt"\nworkers = 2\n[train]\nlr = 0.5\nlearning_rate = -1\n'
        'mode = "later"\n[extra]\nx = 1\n',
    )
    with pytest.raises(ConfigError) as info:
        load_config(path, File)
    assert sorted(str(info.value).splitlines()) == sorted(
        [
            f"{path}: [data] workers: one reader for a .txt file",
            f"{path}: [train] lr: was renamed: use learning_rate = 0.5",
            f"{path}: [train] learning_rate: Input should be greater than 0, got -1",
            f"{path}: [train] mode: Input should be 'sync' or 'async', got 'later'",
            f"{path}: table [extra]: unknown table (known: data, train)",
        ]
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[train]\n", r"run.toml: table \[data\]: is required"),
        ("[data]\n", r"run.toml: \[data\] path: is required"),
        ('[data]\npath = "d"\nreaders = 2\n', r"\[data\] readers: unknown key \(known: path, "),
        ("[data\n", r"run.toml: not valid TOML"),
    ],
)
def test_errors(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, text), File)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"nowhere.toml: config file does not exist"):
        load_config(tmp_path / "nowhere.toml", File)


class Whole(Table):
    train: Train = Train()

    @model_validator(mode="after")
    def _across_tables(self):
        if self.train.mode == "async":
            raise ValueError("async needs a second table")  # names no key
        return self


def test_a_check_across_the_whole_file_that_names_no_key_is_still_reported(tmp_path):
    with pytest.raises(ConfigError, match=r"run.toml: the file as a whole: async needs a second"):
        load_config(write(tmp_path, '[train]\nmode = "async"\n'), Whole)
