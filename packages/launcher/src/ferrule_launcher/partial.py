"""Partial rollouts in sync mode ([loop] partial_rollout with the transformers engine). A step's
generation call is cut once only a few of the engine's rows still decode. The prompt groups the
cut left unfinished continue in the next step's call, under the new weights. A group is scored
and trained once all of its samples have ended; complete groups beyond a step's
prompts_per_step wait for the next step. Rollouts (rollouts.py) drives this class:

    partial = PartialRollouts(config, engines)
    groups = partial.take_ready(step, want)             # complete groups waiting, still fresh
    problems = problems[: partial.new_groups(want)]     # fewer new prompts while groups wait
    problems, samples, tokens = partial.play(problems, n)   # the groups that ended in this call
"""

from dataclasses import asdict, dataclass, replace

from ferrule_launcher.config import Config
from ferrule_launcher.task import Problem
from ferrule_rollout import Continuation, Sample, VersionSpan
from ferrule_trainer import Group
from ferrule_trainer.groups import chunks


@dataclass
class Unfinished:
    """A prompt group in which a cut call left some samples unfinished."""

    problem: Problem
    samples: list  # the group's n samples in order; unfinished ones have finish_reason "abort"


class PartialRollouts:
    def __init__(self, config: Config, engines):
        """engines: launcher.engines.Engines (its `generate`, and the weight version it holds)."""
        self.config, self.engines = config, engines
        self.unfinished: list[Unfinished] = []  # groups still generating
        self.ready: list[Group] = []  # scored complete groups beyond a step's prompts_per_step
        self.stale = 0  # ready groups the last take_ready dropped as too stale to train

    def take_ready(self, step: int, want: int) -> list[Group]:
        """Take up to `want` waiting complete groups, oldest first. Groups too stale for step
        `step` ([loop] max_staleness) are dropped."""
        fresh = [g for g in self.ready if g.staleness(step) <= self.config.loop.max_staleness]
        self.stale = len(self.ready) - len(fresh)
        taken, self.ready = fresh[:want], fresh[want:]
        return taken

    def new_groups(self, want: int) -> int:
        """The number of new prompts for this step's call: about `want` groups per step in all,
        fewer while complete groups wait (otherwise they would pile up and go stale)."""
        return max(0, want - len(self.ready))

    def play(self, problems: list[Problem], n: int) -> tuple[list[Problem], list, int]:
        """Generate `n` samples of each problem, and continue the unfinished samples of earlier
        calls' groups, in one call. The call is cut once fewer than [loop] partial_cut of the
        engine's rows still decode. Returns the groups whose samples have all ended (earlier
        groups first), as their problems and samples, and the number of tokens the call
        generated. The other groups wait for the next call. A sample already continued [loop]
        max_staleness times runs to its end."""
        c = self.config
        cut_below = max(1, int(c.loop.partial_cut * c.rollout.max_batch_size))
        settings = replace(c.rollout.sampling(n, c.rollout.temperature), cut_below=cut_below)
        earlier, self.unfinished = self.unfinished, []
        continued = [
            Continuation(s, final=self.engines.version - s.version >= c.loop.max_staleness)
            for group in earlier
            for s in group.samples
            if s.finish_reason == "abort"
        ]
        got = self.engines.generate([p.text for p in problems] + continued, settings)
        fresh, more = got[: len(problems) * n], iter(got[len(problems) * n :])
        groups = [
            Unfinished(
                g.problem, [next(more) if s.finish_reason == "abort" else s for s in g.samples]
            )
            for g in earlier
        ] + [Unfinished(p, list(s)) for p, s in zip(problems, chunks(fresh, n), strict=True)]
        done = []
        for group in groups:
            cut = any(s.finish_reason == "abort" for s in group.samples)
            (self.unfinished if cut else done).append(group)
        before = sum(len(c.sample.token_ids) for c in continued)
        tokens = sum(len(s.token_ids) for s in got) - before
        return [g.problem for g in done], [s for g in done for s in g.samples], tokens

    def metrics(self) -> dict:
        return {
            "rollout/unfinished_groups": len(self.unfinished),
            "rollout/ready_groups": len(self.ready),
            "rollout/stale_ready_groups": self.stale,
        }

    def state(self) -> dict:
        """The state for a checkpoint (JSON): the groups in flight with their samples so far
        (cut ones included), and the complete groups waiting. A resumed run continues them."""
        return {
            "unfinished": [
                {"problem": asdict(g.problem), "samples": [asdict(s) for s in g.samples]}
                for g in self.unfinished
            ],
            "ready": [
                {
                    "problem": asdict(g.prompt),
                    "samples": [asdict(s) for s in g.samples],
                    "scores": list(g.scores),
                }
                for g in self.ready
            ],
        }

    def restore(self, state: dict) -> None:
        self.unfinished = [
            Unfinished(_problem(g["problem"]), [_sample(s) for s in g["samples"]])
            for g in state.get("unfinished", [])
        ]
        self.ready = [
            Group(
                tuple(_sample(s) for s in g["samples"]), tuple(g["scores"]), _problem(g["problem"])
            )
            for g in state.get("ready", [])
        ]


def _sample(saved: dict) -> Sample:
    """Rebuild a Sample from its checkpointed dict (`asdict`, read back from JSON, which stores
    version spans and turn rewards as lists)."""
    versions = [VersionSpan(**span) for span in saved.get("versions", [])]
    turns = saved.get("turn_rewards")
    turns = None if turns is None else [tuple(turn) for turn in turns]
    return Sample(**{**saved, "versions": versions, "turn_rewards": turns})


def _problem(saved: dict) -> Problem:
    return Problem(**{**saved, "metadata": tuple(tuple(pair) for pair in saved["metadata"])})
