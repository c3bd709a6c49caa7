"""ferrule-launcher, the Ray launcher: `rlhf-launch config.toml` runs the whole RLHF loop."""

from importlib.metadata import version as _version

__version__ = _version("ferrule-launcher")
