"""How the RL step reaches the models. `Ranks` drives the data-parallel ranks of the policy, the
reference or the critic as one (ferrule-launcher's Ray groups). `LocalRanks` wraps one in-process
`Actor` or `Critic` (tests, notebooks, examples/rl_in_one_file.py). Every call returns a
`Pending`, so the passes of models in different processes run at the same time.
"""

from collections.abc import Callable
from typing import Protocol

from ferrule_trainer.batch import Batch
from ferrule_trainer.settings import EpochPlan, ForwardPlan, PolicyLoss, PreferenceLoss, ValueLoss

Pending = Callable[[], object]
"""A call in flight. Calling it waits for the result, and raises the error of the call if it
failed."""


class Ranks(Protocol):
    """The data-parallel ranks of the policy, the reference or the critic, driven as one. A
    batch is split into equal contiguous shards, one per rank. The results come back in order
    (log-probabilities, values); a training call returns the first rank's global metrics."""

    size: int

    def logprobs(
        self, batch: Batch, plan: ForwardPlan, temperature: float | None = None
    ) -> Pending: ...

    def values(self, batch: Batch, plan: ForwardPlan) -> Pending: ...

    def train_epochs(
        self, batch: Batch, plan: EpochPlan, loss: PolicyLoss | ValueLoss
    ) -> Pending: ...

    def likelihood_epochs(self, batch: Batch, plan: EpochPlan) -> Pending: ...

    def preference_epochs(self, batch: Batch, plan: EpochPlan, loss: PreferenceLoss) -> Pending: ...


class LocalRanks:
    """One in-process `Actor` or `Critic` as `Ranks` (a step without Ray: tests, notebooks)."""

    size = 1

    def __init__(self, model):
        self.model = model

    def logprobs(self, batch, plan, temperature=None) -> Pending:
        return _done(self.model.logprobs(batch, plan, temperature))

    def values(self, batch, plan) -> Pending:
        return _done(self.model.values(batch, plan))

    def train_epochs(self, batch, plan, loss) -> Pending:
        return _done(self.model.train_epochs(batch, plan, loss))

    def likelihood_epochs(self, batch, plan) -> Pending:
        return _done(self.model.likelihood_epochs(batch, plan))

    def preference_epochs(self, batch, plan, loss) -> Pending:
        return _done(self.model.preference_epochs(batch, plan, loss))


def _done(result) -> Pending:
    return lambda: result
