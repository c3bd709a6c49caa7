"""What a run writes and shows: progress bar, metrics.jsonl, TensorBoard, reward curve, summary,
and the record of its checkpoints.

    out = Outputs(Path("runs/tiny"), total_steps=40, first_step=1, tensorboard=True, progress=True)
    out.log(step, {"reward": 0.4, "kl": 0.01, "time/generate": 1.2, ...})
    out.samples(step, [{"prompt": ..., "response": ..., "reward": 1.0, ...}])  # eval samples
    out.finish(summary)          # reward_curve.png and summary.json
    mark_checkpoint(Path("runs/tiny"), step=10, eval_before={"reward": 0.3}, wall_seconds=61.0, ...)

metrics.jsonl holds one JSON object per step, eval_samples.jsonl one per logged sample. On
--resume both are cut back to the checkpoint's step first, so every step appears exactly once
however often the run was interrupted. The same records go to TensorBoard and, when enabled,
to Weights & Biases (`wandb` holds wandb.init's arguments).
"""

import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

SHOWN = {"reward": "reward", "kl": "kl", "approx_kl": "kl_old", "tokens_per_s": "tok/s"}
PHASES = ("generate", "score", "train", "sync")
# metric of a role's update skipped for non-finite gradients (ferrule-trainer's nonfinite.py)
# -> (the role, the metric that says where the gradients were not finite)
SKIPPED = {
    "train/skipped": ("policy", "train/nonfinite"),
    "critic/skipped": ("critic", "critic/nonfinite"),
}


class Outputs:
    def __init__(
        self,
        directory: Path,
        total_steps: int,
        first_step: int,
        tensorboard: bool,
        progress: bool,
        wandb: dict | None = None,
    ):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.dir / "metrics.jsonl"
        self.samples_path = self.dir / "eval_samples.jsonl"
        self.history = _read_history(self.metrics_path, before=first_step)
        _write_lines(self.metrics_path, self.history)  # drop steps after the checkpoint
        _write_lines(self.samples_path, _read_history(self.samples_path, before=first_step))
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.dir / "tensorboard"), purge_step=first_step)
        self.wandb = None
        if wandb is not None:
            os.environ.setdefault("WANDB_SILENT", "true")
            import wandb as wandb_module

            self.wandb = wandb_module.init(**wandb)
        from tqdm import tqdm

        self.bar = tqdm(
            total=total_steps,
            initial=first_step - 1,
            unit="step",
            dynamic_ncols=True,
            disable=not progress,
            file=sys.stderr,
            desc="rl",
        )
        self.quiet = not progress

    def log(self, step: int, metrics: dict) -> None:
        # NaN (a metric that could not be computed) and inf (a skipped step's gradient norm)
        # are not valid JSON, so they are written as null.
        metrics = {
            k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in metrics.items()
        }
        record = {"step": step, **metrics}
        self.history.append(record)
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        numbers = {
            k: v
            for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        if self.writer is not None:
            for key, value in numbers.items():
                self.writer.add_scalar(key, value, step)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.log(numbers, step=step)
        postfix = {label: f"{metrics[key]:.3g}" for key, label in SHOWN.items() if key in metrics}
        if "kl" in postfix:  # KL to the reference says more than the step's own policy change
            postfix.pop("kl_old", None)
        phases = [metrics.get(f"time/{p}", 0.0) for p in PHASES]
        total = sum(phases) or 1.0
        postfix["gen/score/train/sync"] = "/".join(f"{100 * t / total:.0f}" for t in phases) + "%"
        for key, (role, where) in SKIPPED.items():
            if metrics.get(key):
                self.message(
                    f"step {step}: the {role}'s update was skipped, its gradients not finite: "
                    f"{metrics.get(where) or 'not located'}"
                )
        skipped = len(skipped_steps(self.history))  # steps before a resume included
        if skipped:
            postfix["skipped"] = str(skipped)
        if metrics.get("reward/failed"):
            postfix["reward_failed"] = str(metrics["reward/failed"])
        if "eval/reward" in metrics:
            postfix["eval"] = f"{metrics['eval/reward']:.2f}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)
        if self.quiet:
            print(
                f"step {step}: " + " ".join(f"{k} {v}" for k, v in postfix.items()),
                file=sys.stderr,
                flush=True,
            )

    def samples(self, step: int, rows: list[dict]) -> None:
        """An evaluation's sample rows ({"source", "prompt", "response", "label", "reward"}),
        as a table in every log."""
        if not rows:
            return
        with open(self.samples_path, "a") as f:
            f.writelines(json.dumps({"step": step, **row}) + "\n" for row in rows)
        columns = list(rows[0])
        if self.writer is not None:  # TensorBoard's text tab renders markdown
            lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(_cell(row[c]) for c in columns) + " |" for row in rows]
            self.writer.add_text("eval/samples", "\n".join(lines), step)
            self.writer.flush()
        if self.wandb is not None:
            import wandb

            table = wandb.Table(columns=columns, data=[[row[c] for c in columns] for row in rows])
            self.wandb.log({"eval/samples": table}, step=step)

    def message(self, text: str) -> None:
        self.bar.write(text, file=sys.stderr)

    def finish(self, summary: dict) -> None:
        self.close()
        (self.dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        try:  # plot last, so no result of the run depends on a plotting library
            plot_rewards(self.history, self.dir / "reward_curve.png")
        except ImportError as err:
            print(f"reward_curve.png not written: {err}", file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def _cell(value) -> str:
    """A markdown table cell: the value on one line, its pipes escaped."""
    text = f"{value:.3f}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", " ⏎ ")


def _read_history(path: Path, before: int) -> list[dict]:
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r["step"] < before]


def _write_lines(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def plot_rewards(history: list[dict], path: Path) -> None:
    """Mean reward per step, with the held-out evaluation's mean reward and pass@k where they
    were measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in history if "reward" in r]
    axis.plot(steps, [r["reward"] for r in history if "reward" in r], label="mean reward")
    keys = sorted({k for r in history for k in r if k.startswith("eval/pass@")})
    for key, label in [("eval/reward", "held-out mean reward"), *[(k, k[5:]) for k in keys]]:
        evals = [(r["step"], r[key]) for r in history if key in r]
        if evals:
            axis.plot(*zip(*evals, strict=True), "o-", label=label)
    axis.set_xlabel("step")
    axis.set_ylim(-0.02, 1.02)
    axis.grid(alpha=0.3)
    axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def skipped_steps(history: list[dict]) -> list[int]:
    """The steps at which the policy's or the critic's update was skipped."""
    return [r["step"] for r in history if any(r.get(key) for key in SKIPPED)]


def reward_summary(history: list[dict]) -> dict:
    """The reward at the start and the end of a run: first and last step, first and last
    quarter of the steps."""
    rewards = [r["reward"] for r in history if "reward" in r]
    quarter = max(len(rewards) // 4, 1)
    return {
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "reward_first_quarter": _mean(rewards[:quarter]),
        "reward_last_quarter": _mean(rewards[-quarter:]),
    }


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


# -- checkpoints: the roles save states under dir/checkpoint; launcher.json names complete ones --


def mark_checkpoint(
    out: Path,
    step: int,
    eval_before: dict,
    wall_seconds: float,
    loop_state: dict,
    kept: list[dict] | None = None,
) -> None:
    """Record that the states of `step` are complete. A checkpoint counts only once
    launcher.json names it, so a run killed while the roles save resumes from the previous
    checkpoint. `loop_state` is the driver's own state (`Loop.state`: the KL coefficient, the
    reward moments). `kept` lists the checkpoints on disk ({"step", "value"} each, this one
    included)."""
    record = {
        "step": step,
        "eval_before": eval_before,
        "wall_seconds": wall_seconds,
        "loop": loop_state,
        "kept": kept or [{"step": step, "value": None}],
    }
    tmp = out / "checkpoint" / "launcher.json.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, out / "checkpoint" / "launcher.json")


def retained(
    kept: list[dict], keep_last: int, best: str | None = None, mode: str = "max"
) -> list[dict]:
    """The checkpoints to keep of `kept` ({"step", "value"} each, oldest first): the newest
    `keep_last`, and the one with the best value when `best` names a metric (the newest of
    equals; None values never win)."""
    keep = {c["step"] for c in kept[-keep_last:]}
    candidates = [c for c in kept if c["value"] is not None]
    if best and candidates:
        sign = 1 if mode == "max" else -1
        keep.add(max(candidates, key=lambda c: (sign * c["value"], c["step"]))["step"])
    return [c for c in kept if c["step"] in keep]


def drop_checkpoints(out: Path, steps: list[int]) -> None:
    """Delete the roles' states of `steps` (after launcher.json stopped naming them)."""
    for role in ("policy", "critic"):
        for step in steps:
            shutil.rmtree(out / "checkpoint" / role / f"step{step}", ignore_errors=True)


def last_checkpoint(out: Path) -> dict | None:
    path = out / "checkpoint" / "launcher.json"
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    if "accuracy_before" in record:  # written before evaluations were reports
        record["eval_before"] = {"accuracy": record.pop("accuracy_before")}
    return record


def describe_eval(report: dict) -> str:
    """ "reward 0.412, pass@1 0.250, pass@4 0.610, accuracy 0.330": for the log."""
    shown = [k for k in report if "/" not in k and k != "reward_failed"]
    return ", ".join(f"{key} {report[key]:.3f}" for key in shown)


def describe_generation(report: dict) -> str:
    """ "51200 tokens in 2.1 s, longest 256, 12% cut at max_tokens": an evaluation's cost."""
    return (
        f"{report['generation/tokens']} tokens in {report['generation/seconds']:.1f} s, "
        f"longest {report['generation/response_length/max']}, "
        f"{report['generation/truncated']:.0%} cut at max_tokens"
    )


def clear_previous(out: Path) -> None:
    """Remove an old run's outputs, so that a fresh run (no --resume) in the same directory
    does not mix with them."""
    for name in ("checkpoint", "sft", "policy", "exports", "tensorboard"):
        shutil.rmtree(out / name, ignore_errors=True)
    for name in ("metrics.jsonl", "summary.json", "reward_curve.png"):
        (out / name).unlink(missing_ok=True)


class StartupTimeline:
    """Where a run's seconds go before its first step. It records each phase's seconds in
    order, when each role was ready after the roles began to start (they start concurrently),
    and how each role's own start-up time splits (`role_phases`: "process", then the phases the
    role timed itself: "imports", "distributed", "weights", "deepspeed" for the trainer's ranks;
    "imports" and "weights" or "engine" for a rollout engine). `describe()` returns what the run
    prints before step 1 (one line, then one per role); `as_dict()` goes to summary.json."""

    def __init__(self):
        self.started = self.last = time.monotonic()
        self.phases: dict[str, float] = {}
        self.roles_ready: dict[str, float] = {}
        self.role_phases: dict[str, dict[str, float]] = {}

    def mark(self, phase: str) -> None:
        """`phase` took the time since the previous mark."""
        now = time.monotonic()
        self.phases[phase] = round(now - self.last, 2)
        self.last = now

    def as_dict(self) -> dict:
        total = round(self.last - self.started, 2)
        return {
            **self.phases,
            "total": total,
            "roles_ready": dict(self.roles_ready),
            "role_phases": {role: dict(seconds) for role, seconds in self.role_phases.items()},
        }

    def describe(self) -> str:
        parts = []
        for phase, seconds in self.phases.items():
            part = f"{phase} {seconds:.1f} s"
            if phase == "roles" and self.roles_ready:
                ready = ", ".join(f"{role} {t:.1f}" for role, t in self.roles_ready.items())
                part += f" (ready at: {ready})"
            parts.append(part)
        lines = [f"start-up {self.last - self.started:.1f} s: " + "; ".join(parts)]
        for role, seconds in self.role_phases.items():
            spent = ", ".join(f"{phase} {t:.1f}" for phase, t in seconds.items())
            lines.append(f"  {role}: {spent} s")
        return "\n".join(lines)
