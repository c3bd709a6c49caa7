"""`python -m ferrule_rollout serve ...`: the same as `rlhf-rollout serve ...`."""

from ferrule_rollout.cli import main

main()
