"""`python -m ferrule_rewards ...` runs the same command as `rlhf-rewards ...`."""

from ferrule_rewards.cli import main

main()
