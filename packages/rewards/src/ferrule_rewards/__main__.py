"""`python -m ferrule_rewards ...` is `rlhf-rewards ...`."""

from ferrule_rewards.cli import main

main()
