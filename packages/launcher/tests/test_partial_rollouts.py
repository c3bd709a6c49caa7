"""Partial rollouts in sync mode (partial.PartialRollouts) on a real transformers engine: a step's
call is cut once few rows still decode; its unfinished prompt groups continue in the next
call, ahead of the new prompts, and come out whole, in sample order, each sample's earlier
tokens and logprobs kept and its version spans saying which weights drew what; a sample at the
staleness bound runs to its end."""

import json
import shutil

import pytest

from ferrule_launcher.load import load_config
from ferrule_launcher.partial import PartialRollouts
from ferrule_launcher.task import Problem
from ferrule_testkit import tiny_model
from ferrule_trainer.groups import Group

N = 8


class OneEngine:
    """What PartialRollouts uses of launcher.engines.Engines (a Ray actor per engine): generate, and
    the version of the weights the engines hold."""

    def __init__(self, engine):
        self.engine, self.version = engine, 0

    def generate(self, prompts, settings):
        return self.engine.generate(prompts, settings)

    def load(self, version: int) -> None:  # what a weight sync leaves: only the version moves
        self.version = self.engine._version = version


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The kit model with 24 end-of-sequence tokens: its random weights end a response with
    probability ~1/20 a token, so lengths are long-tailed."""
    path = tmp_path_factory.mktemp("partial") / "model"
    shutil.copytree(tiny_model("qwen2"), path)
    generation = json.loads((path / "generation_config.json").read_text())
    generation["eos_token_id"] = list(range(100, 124))
    (path / "generation_config.json").write_text(json.dumps(generation))
    return path


@pytest.mark.parametrize("reuse_cut_kv", [False, True])
def test_cut_groups_continue_in_the_next_call_and_come_out_whole(model, tmp_path, reuse_cut_kv):
    """And with [rollout] reuse_cut_kv, where the engine resumes the cut samples in their rows."""
    from ferrule_rollout.hf_engine import TransformersEngine

    run = tmp_path / "run.toml"
    run.write_text(
        f'[model]\npath = "{model}"\ndtype = "float32"\n'
        '[rewards]\nfunction = "ferrule_rewards.builtin:exact_text"\n'
        '[rollout]\nbackend = "transformers"\nprompts_per_step = 4\nsamples_per_prompt = 8\n'
        "max_tokens = 120\nmax_batch_size = 32\ntemperature = 1.0\n"
        "[loop]\npartial_rollout = true\npartial_cut = 0.25\n"
    )
    config = load_config(run)
    options = dict(max_batch_size=32, reuse_cut_kv=reuse_cut_kv)
    with TransformersEngine(model, dtype="float32", **options) as engine:
        engines = OneEngine(engine)
        rollouts = PartialRollouts(config, engines)
        first = [Problem(f"a b {k}") for k in range(4)]
        for _ in range(5):  # a call is cut unless its longest rows end together
            done, samples, tokens = rollouts.play(first, N)
            if rollouts.unfinished and done:
                break
            rollouts.unfinished = []
        assert rollouts.unfinished and done, "no call was cut with a group left whole in 5 tries"
        cut = {id(g.problem): g for g in rollouts.unfinished}
        assert len(done) + len(cut) == 4 and len(samples) == N * len(done)
        assert all(s.finish_reason in ("stop", "length") for s in samples)
        waiting = [s for g in cut.values() for s in g.samples if s.finish_reason == "abort"]
        assert 1 <= len(waiting) < 8  # fewer than partial_cut x max_batch_size rows
        before = {(id(g.problem), s.sample_index): s for g in cut.values() for s in g.samples}

        # a checkpoint keeps the groups in flight and the complete ones waiting, through JSON
        rollouts.ready = [Group(tuple(samples[:N]), (0.5,) * N, done[0])]
        saved = json.loads(json.dumps(rollouts.state()))
        resumed = PartialRollouts(config, engines)
        resumed.restore(saved)
        assert resumed.unfinished == rollouts.unfinished and resumed.ready == rollouts.ready
        rollouts.ready = []

        engines.load(1)  # the next step's weights
        second = [Problem(f"c d {k}") for k in range(4)]
        claims = []
        claim = type(engine._decoder)._claim
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(
                engine._decoder,
                "_claim",
                lambda *a: claims.append(claim(engine._decoder, *a)) or claims[-1],
            )
            done, samples, tokens = rollouts.play(second, N)
        assert len(claims[0]) == (len(waiting) if reuse_cut_kv else 0)  # resumed in their rows
        # the earlier groups come first, whole, in sample order (at the bound: never cut again)
        assert [id(p) for p in done[: len(cut)]] == list(cut)
        assert all(id(g.problem) not in cut for g in rollouts.unfinished)
        # the call's new tokens: the new prompts' samples, ended or not, and the continuations'
        expected = sum(len(s.token_ids) for g in rollouts.unfinished for s in g.samples)
        groups = [samples[i : i + N] for i in range(0, len(samples), N)]
        for problem, group in zip(done, groups, strict=True):
            assert [s.sample_index for s in group] == list(range(N))
            assert all(s.finish_reason in ("stop", "length") for s in group)
            if id(problem) not in cut:
                assert all(s.versions[0].version == 1 for s in group)
                expected += sum(len(s.token_ids) for s in group)
                continue
            for s in group:
                old = before[id(problem), s.sample_index]
                if old.finish_reason != "abort":
                    assert s is old or s == old
                    continue
                k = len(old.token_ids)
                expected += len(s.token_ids) - k
                assert s.token_ids[:k] == old.token_ids and s.logprobs[:k] == old.logprobs
                assert len(s.token_ids) > k and s.version == 0
                assert [(v.version, v.start, v.end) for v in s.versions] == [
                    (0, 0, k),
                    (1, k, len(s.token_ids)),
                ]
        assert tokens == expected
