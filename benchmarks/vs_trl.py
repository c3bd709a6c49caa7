"""`rlhf-launch examples/tiny.toml` against TRL's GRPOTrainer on the same run, in one invocation.

    uv run python benchmarks/vs_trl.py                 # both sides, 80 steps each (~6 min, 2 cores)
    uv run python benchmarks/vs_trl.py --steps 20      # shorter

Each side runs as a command of its own, started by this script, which timestamps every record
the command writes as it appears (Ferrule's metrics.jsonl; the TRL side's records.jsonl), so
both are timed the same way, from the command's start, imports included.

Matched (TRL's GRPOConfig below): the model (examples/tiny/model, float32, CPU), the prompts
(the launcher's own `make_prompts`: the same 32 prompts at every step, the same 100 held-out),
the reward (ferrule-rewards' `char_match`), 8 samples per prompt at temperature 0.6, at most 6
new tokens, one optimiser step per 256 samples in 4 micro-batches of 64, AdamW lr 2e-4
(constant, betas 0.9 / 0.95, no weight decay, gradient norm clipped at 1), clip 0.2 / 0.28,
dual clip 3, token-mean loss over the batch, group-normalised advantages, k3 KL to the frozen
start in the loss with coefficient 0.001, one PPO epoch. Evaluation every 10 steps and at the
end: greedy exact match on the 100 held-out prompts (Ferrule's eval also draws one sample per
prompt for its pass@1: [eval] samples = 1; TRL's does not).

Not matched, because it is what each system is: Ferrule generates with vLLM in a Ray actor,
scores through its gRPC reward server and trains with DeepSpeed in another actor, weights synced
after every step; TRL does all of it in one process with Hugging Face generate.

Reported per side: held-out accuracy before and after, loop steps/s (between the first and the
last step's record, the evaluations at the same steps included), whole-command seconds, seconds
from the command's start to the first evaluation at accuracy >= 0.8. Last line, one JSON object:
ratio = TRL's time to 0.8 / ours (goal >= 1.5, with accuracies within 0.03).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny.toml"
TARGET = 0.8
EVAL_EVERY = 10


def ferrule_command(steps: int, out: Path) -> list[str]:
    overrides = [
        f"loop.steps={steps}",
        f"loop.eval_every={EVAL_EVERY}",
        "eval.samples=1",
        "eval.pass_k=1",
        "output.checkpoint_every=0",
        "output.progress=false",
        "output.tensorboard=false",
        f'output.dir="{out}"',
    ]
    command = [sys.executable, "-m", "ferrule_launcher.cli", str(EXAMPLE)]
    for item in overrides:
        command += ["--set", item]
    return command


def trl_side(steps: int, out: Path) -> None:
    """The TRL run (this script with --trl-side): records.jsonl gets one line per step and one
    per evaluation, written as they happen."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from ferrule_launcher.data import make_prompts
    from ferrule_launcher.load import load_config
    from ferrule_rewards.builtin import char_match, exact_text

    config = load_config(EXAMPLE, {})
    prompts = make_prompts(config)
    r = config.rollout
    rows = [
        {"prompt": p.text, "label": p.label}
        for step in range(1, steps + 1)
        for p in prompts.draw(step, 0, r.prompts_per_step)
    ]
    held_out = prompts.held_out
    model_path = str(config.model.path)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    records = open(out / "records.jsonl", "a", buffering=1)  # noqa: SIM115 - lives as long as the run

    @torch.no_grad()
    def greedy_accuracy(model) -> float:
        was_training = model.training
        model.eval()
        batch = tokenizer([p.text for p in held_out], return_tensors="pt", padding=True)
        generated = model.generate(
            **batch,
            max_new_tokens=r.max_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        texts = tokenizer.batch_decode(
            generated[:, batch["input_ids"].shape[1] :], skip_special_tokens=True
        )
        model.train(was_training)
        hits = sum(exact_text(t, p.label) for t, p in zip(texts, held_out, strict=True))
        return hits / len(held_out)

    class Records(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            records.write(json.dumps({"step": 0, "eval/accuracy": greedy_accuracy(model)}) + "\n")

        def on_step_end(self, args, state, control, model=None, **kwargs):
            record = {"step": state.global_step}
            if state.global_step % EVAL_EVERY == 0 or state.global_step == steps:
                record["eval/accuracy"] = greedy_accuracy(model)
            records.write(json.dumps(record) + "\n")

    def reward(prompts, completions, label, **kwargs) -> list[float]:
        return [char_match(c, a) for c, a in zip(completions, label, strict=True)]

    t = config.trainer
    batch = r.prompts_per_step * r.samples_per_prompt
    settings = GRPOConfig(
        output_dir=str(out / "trl"),
        max_steps=steps,
        seed=config.loop.seed,
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=EVAL_EVERY,
        disable_tqdm=True,
        shuffle_dataset=False,  # the prompts in the launcher's order, 32 per step
        num_generations=r.samples_per_prompt,
        generation_batch_size=batch,
        per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=batch // t.micro_batch_size,
        num_iterations=t.epochs,
        max_completion_length=r.max_tokens,
        temperature=r.temperature,
        top_p=1.0,
        top_k=0,
        learning_rate=t.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=t.betas[0],
        adam_beta2=t.betas[1],
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        epsilon=t.clip_low,
        epsilon_high=t.clip_high,
        delta=t.dual_clip,
        loss_type="dapo",  # token mean over the whole batch, as agg_mode "token-mean"
        scale_rewards="group",
        beta=t.kl_coef,  # k3 KL to the reference, in the loss
        disable_dropout=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=settings,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[Records()],
    )
    trainer.train()
    records.close()


class Watch:
    """A command, and every line its records file gets, timestamped as it appears."""

    def __init__(self, command: list[str], records: Path, log: Path):
        self.records, self.seen = records, []
        self.started = time.monotonic()
        with open(log, "w") as f:
            self.process = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        done = 0
        while True:
            finished = self.process.poll() is not None
            if self.records.exists():
                lines = self.records.read_text().splitlines()
                now = time.monotonic() - self.started
                for line in lines[done:]:
                    if line.endswith("}"):
                        self.seen.append((now, json.loads(line)))
                        done += 1
            if finished:
                return
            time.sleep(0.05)

    def wait(self, timeout: float) -> float:
        self.process.wait(timeout)
        seconds = time.monotonic() - self.started
        self.thread.join()
        return seconds


def figures(watch: Watch, seconds: float, log: Path) -> dict:
    if watch.process.returncode != 0:
        raise SystemExit(f"{log} exited {watch.process.returncode}:\n{log.read_text()[-4000:]}")
    steps = [(t, r) for t, r in watch.seen if r.get("step", 0) > 0]
    evals = [(t, r) for t, r in watch.seen if "eval/accuracy" in r]
    first, last = steps[0], steps[-1]
    reached = next((t for t, r in evals if r["eval/accuracy"] >= TARGET), None)
    return {
        "accuracy_before": evals[0][1]["eval/accuracy"],
        "accuracy_after": evals[-1][1]["eval/accuracy"],
        "accuracy_curve": [[r["step"], r["eval/accuracy"]] for _, r in evals],
        "loop_steps_per_s": round((last[1]["step"] - first[1]["step"]) / (last[0] - first[0]), 3),
        "command_s": round(seconds, 1),
        "first_step_s": round(first[0], 1),
        "to_accuracy_0.8_s": None if reached is None else round(reached, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--trl-side", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_side:
        trl_side(args.steps, Path(args.trl_side))
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        env_note = {"cpus": os.cpu_count()}
        for side in ("ferrule", "trl"):
            folder = out / side
            folder.mkdir()
            log = folder / "log.txt"
            if side == "ferrule":
                command = ferrule_command(args.steps, folder / "run")
                records = folder / "run" / "metrics.jsonl"
            else:
                command = [sys.executable, __file__, "--steps", str(args.steps)]
                command += ["--trl-side", str(folder)]
                records = folder / "records.jsonl"
            watch = Watch(command, records, log)
            seconds = watch.wait(timeout=3600)
            results[side] = figures(watch, seconds, log)
            if side == "ferrule":  # its evaluation before step 1 is in the summary only
                summary = json.loads((folder / "run" / "summary.json").read_text())
                results[side]["accuracy_before"] = summary["accuracy_before"]
                results[side]["accuracy_curve"].insert(0, [0, summary["accuracy_before"]])
            print(f"{side}: {json.dumps(results[side])}", file=sys.stderr)
    ours, theirs = results["ferrule"]["to_accuracy_0.8_s"], results["trl"]["to_accuracy_0.8_s"]
    ratio = round(theirs / ours, 3) if ours and theirs else None
    print(
        json.dumps(
            {
                "benchmark": "vs_trl",
                "steps": args.steps,
                **env_note,
                "ferrule": results["ferrule"],
                "trl": results["trl"],
                "ratio": ratio,
            }
        )
    )


if __name__ == "__main__":
    main()
