"""A whole GRPO step at 1.5B on one GPU (or N): Ferrule's real `rlhf-launch` against the
single-process loop a TRL GRPOTrainer user runs, on the same work.

    python benchmarks/step_gpu.py [--steps 4] [--baseline-steps 3] [--prompts 64] [--tokens 512]
    python benchmarks/step_gpu.py --gpus 4       # ours on four GPUs, the baseline on one
    python benchmarks/step_gpu.py --gpus 4 --scaling --steps 4   # ours on four against one
    python benchmarks/step_gpu.py --set rollout.compile_decode=true   # ours with another key
    python benchmarks/step_gpu.py --lengths geometric --tokens 4096   # long-tailed lengths
    python benchmarks/step_gpu.py --model 7b --lora 64   # LoRA adapters on both sides

The work: a Qwen2.5-1.5B-shaped policy (real 151,936-token vocabulary, random init, bf16) and a
frozen reference, 64 prompts x 8 samples of up to 512 new tokens (a random policy rarely stops,
so nearly all run to 512), GRPO with k3 KL (0.001) in the loss, one optimizer step per batch.
  ours:      `rlhf-launch` (Ray, DeepSpeed, the transformers engine, the reward server), hybrid
             on one GPU (placement "colocate_all": policy, reference and engine share it),
             the [trainer] memory keys left "auto": the memory plan's choice, printed.
  baseline:  what TRL's GRPOTrainer does, in one process (TRL itself cannot be carried to the
             GPU machines): Hugging Face `generate`, the reward function, the reference's
             forward, then the same loss on the plan's micro-batches (its token budget and
             checkpointing; at most 8k tokens, where the loop's whole logits still fit) with
             torch's AdamW, gradients clipped at 1.0.
Seconds per step are medians after the first step (the warm-up). Per phase: ours from each
step's metrics (time/generate, score, train, sync, switch), the baseline timed the same way.
Train MFU: (6 N train tokens + 2 N reference tokens) / (train seconds x 989 TFLOP/s, an H100's
dense bf16 x the GPUs), N the parameters. Last line: one JSON object ending with ratio = ours
samples/s / the baseline's (on one GPU the same work, so baseline s/step / ours s/step; goal >= 3).
--gpus N: ours runs N policy ranks and N engines, one pair per GPU (colocate_all), on N x
--prompts prompts a step, so that each GPU has the one-GPU work; the baseline stays the one-GPU
loop on --prompts. --scaling (with --gpus N): no baseline; ours runs on one GPU and then on N
in the same invocation, ratio = samples/s on N / on one (issue 42's goal at four GPUs: >= 3.2).
--lora R: both sides train rank-R LoRA adapters on every linear layer of the decoder (ours:
[trainer] lora_rank, the engine receiving merged weights; the loop: peft on the policy, which
generates through its unmerged adapters, and the reference is that model with its adapters off,
as TRL does under peft: one model on the GPU, not two). The JSON's "lora" says R.
--lengths geometric (JSON name step_gpu_longtail): reasoning-like long-tailed lengths, as RL
users meet them. The policy has the kit's 512-token vocabulary instead of the real one, so a
random model ends a response with probability ~1/512 per token: lengths are geometric (mean
~500-700), a few run to the cap --tokens (4096 or 16384), and both sides honour EOS. Each side
samples its own stop points from the same model at temperature 1 (the same distribution, not
the same points: HF generate cannot take our engine's random stream); the JSON gives each
side's mean and longest length, and generation tokens/s (response tokens / generate seconds).
The smaller vocabulary makes the LM head cheap: the train phase is easier than at the real
vocabulary's, generation's tail is not.
"""

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny.toml"
H100_BF16 = 989e12
KL_COEF, LEARNING_RATE = 0.001, 1e-6
BASELINE_MAX_TOKENS = 8192


def model_path(lengths: str = "uniform", size: str = "1.5b") -> Path:
    """The 1.5B or 7B shape; uniform: the real vocabulary, geometric: the kit's (see the
    docstring). 7B is saved in bf16 (15 GB, initialised on the GPU)."""
    from ferrule_testkit import QWEN25_LARGE_VOCAB, QWEN25_SHAPES, QWEN25_VOCAB, tiny_model

    shape = QWEN25_SHAPES[size]
    kept = {} if size == "1.5b" else {"dtype": "bfloat16"}
    if lengths == "geometric":
        return tiny_model("qwen2", **kept, **shape)
    vocab = QWEN25_VOCAB if size == "1.5b" else QWEN25_LARGE_VOCAB
    return tiny_model("qwen2", vocab_size=vocab, **kept, **shape)


def overrides(args, model: Path, out: Path) -> list[str]:
    """Ours: on --gpus N, a policy rank and an engine on each GPU and N x --prompts prompts a
    step; each engine generates for --prompts of them (max_batch_size is one engine's rows)."""
    return [
        f'model.path="{model}"',
        'model.dtype="bfloat16"',
        "sft.steps=0",
        'rollout.backend="transformers"',
        f"rollout.prompts_per_step={args.prompts * args.gpus}",
        f"rollout.engines={args.gpus}",
        f"trainer.ranks={args.gpus}",
        "rollout.samples_per_prompt=8",
        f"rollout.max_tokens={args.tokens}",
        f"rollout.max_model_len={args.tokens + 64}",
        f"rollout.max_batch_size={args.prompts * 8}",
        "rollout.temperature=1.0",
        f"trainer.learning_rate={LEARNING_RATE}",
        f"trainer.kl_coef={KL_COEF}",
        f"trainer.lora_rank={args.lora}",
        f"loop.steps={args.steps}",
        "loop.eval_every=0",
        "task.eval_prompts=8",
        "eval.samples=1",
        "eval.pass_k=1",
        "output.checkpoint_every=0",
        "output.progress=false",
        "output.tensorboard=false",
        'ray.placement="colocate_all"',
        "ray.gpus_per_role=1",
        "ray.cpus_per_role=2",
        f"ray.num_cpus={2 * args.gpus}",  # a bundle of 2 CPUs per GPU (colocate_all)
        f'output.dir="{out}"',
        *args.set,
    ]


def one_gpu_plan(args, model: Path):
    """The [trainer] keys the memory plan picks for ours on one GPU: the baseline's micro-batches
    and checkpointing whatever --gpus is (ZeRO-2 over more ranks leaves room for larger ones)."""
    from ferrule_launcher.cli import parse_overrides
    from ferrule_launcher.load import load_config
    from ferrule_launcher.resolve import resolve

    one = argparse.Namespace(**{**vars(args), "gpus": 1})
    items = overrides(one, model, Path(tempfile.gettempdir()) / "step_gpu-plan")
    return resolve(load_config(EXAMPLE, parse_overrides(items))).config.trainer


class ProcessPeaks:
    """Each process's largest GPU memory (nvidia-smi, every second) while the run lasts."""

    def __init__(self):
        import threading

        self.peaks: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"]
        while not self._stop.wait(1.0):
            try:
                out = subprocess.run(query, capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.SubprocessError):
                return
            for line in out.splitlines():
                pid, used = (part.strip() for part in line.split(","))
                gib = float(used.split()[0]) / 1024  # MiB
                self.peaks[int(pid)] = max(self.peaks.get(int(pid), 0.0), gib)

    def by_role(self, roles_json: Path) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        where = json.loads(roles_json.read_text()) if roles_json.exists() else {}
        pids = {info["pid"]: role for role, info in where.items() if "pid" in info}
        return {pids.get(pid, str(pid)): round(gib, 2) for pid, gib in self.peaks.items()}


def ours(args, model: Path, out: Path) -> tuple[dict, object]:
    from ferrule_launcher.cli import parse_overrides
    from ferrule_launcher.load import load_config
    from ferrule_launcher.resolve import resolve

    items = overrides(args, model, out)
    config = resolve(load_config(EXAMPLE, parse_overrides(items))).config
    plan = subprocess.run(
        [sys.executable, "-m", "ferrule_launcher.cli", str(EXAMPLE), "--plan"]
        + [x for item in items for x in ("--set", item)],
        capture_output=True,
        text=True,
    )
    print(plan.stdout, file=sys.stderr)
    command = [sys.executable, "-m", "ferrule_launcher.cli", str(EXAMPLE)]
    command += [x for item in items for x in ("--set", item)]
    started = time.monotonic()
    peaks = ProcessPeaks()
    result = subprocess.run(command, capture_output=True, text=True, timeout=1500)
    process_gib = peaks.by_role(out / "roles.json")
    if args.log:  # the launcher's own log, kept
        with open(args.log, "a") as log:
            log.write(result.stderr)
    if result.returncode != 0:
        raise SystemExit(f"rlhf-launch failed ({result.returncode}):\n{result.stderr[-5000:]}")
    print(f"ours: {args.steps} steps in {time.monotonic() - started:.0f} s", file=sys.stderr)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # steps 2 .. N-1: the first warms up, the last ends with the held-out evaluation
    timed = records[1:-1]
    steps = [b["wall_seconds"] - a["wall_seconds"] for a, b in zip(records, timed, strict=False)]
    phases = {}
    for key in ("generate", "score", "train", "forward", "sync", "switch"):  # forward: of train
        phases[key] = statistics.median(r.get(f"time/{key}", 0.0) for r in timed)
    # the launcher compares the policy's weights with every engine's after the last sync
    summary = json.loads((out / "summary.json").read_text())
    used = {  # every process on the GPU, right after generating / training (GB -> GiB)
        phase: max(r.get(f"gpu/used_gb_{phase}", 0.0) for r in records) * 1e9 / 2**30
        for phase in ("generate", "train")
    }
    return dict(
        step_s=statistics.median(steps),
        phases=phases,
        # the slowest policy rank's training call, and graphs compiled in the timed steps (a
        # compiled layer meeting a new input form: seconds each, and every rank waits)
        rank_train_s=statistics.median(r.get("train/seconds", 0.0) for r in timed),
        compiles_timed=sum(r.get("train/compiles", 0) for r in timed),
        response_len=[r["response_length"] for r in timed],
        response_len_max=[r.get("response_length/max") for r in timed],
        generate_tokens_per_s=statistics.median(r["tokens_per_s"] for r in timed),
        # every step's, the first and last included; with [loop] partial_rollout also the
        # groups left generating, those dropped as too stale and the mean staleness trained on
        tokens_per_s_by_step=[round(r["tokens_per_s"]) for r in records],
        unfinished_groups=[r.get("rollout/unfinished_groups") for r in records],
        dropped_stale_groups=[r.get("dropped_stale_groups", 0) for r in records],
        staleness=[round(r.get("staleness", 0.0), 3) for r in records],
        used_gib=used,
        process_peak_gib=process_gib,
        weights_digest=summary["weights_digest"],
        # the launcher's start-up (Ray, reward server, roles, the evaluation before RL) and the
        # end of step 1, in seconds since it began
        startup_s={k: v for k, v in summary["startup_seconds"].items() if k != "role_phases"},
        step1_end_s=records[0]["wall_seconds"],
        compiles_step1=records[0].get("train/compiles", 0),
    ), config


# -- the baseline: one process, as TRL's GRPOTrainer -----------------------------------------


def response_logprobs(net, ids, mask, response_len: int):
    """(B, R) log-probabilities of the last R tokens, the LM head run on those positions only."""
    import torch.nn.functional as F

    logits = net(
        input_ids=ids, attention_mask=mask, logits_to_keep=response_len + 1, use_cache=False
    ).logits
    targets = ids[:, -response_len:]
    flat = F.cross_entropy(
        logits[:, :-1].float().flatten(0, 1), targets.flatten(), reduction="none"
    )
    return -flat.view(targets.shape)


def train_step(policy, optimizer, slices, ids, mask, advantages, ref, response_mask) -> None:
    """One on-policy GRPO optimizer step, as TRL's GRPOTrainer takes it: per micro-batch (a
    slice of rows) the policy-gradient loss (the ratio is 1 on-policy, so nothing clips) plus k3
    KL to `ref`, averaged over the step's response tokens; gradients clipped at 1.0."""
    import torch

    count = response_mask.sum()
    response_len = response_mask.shape[1]
    for s in slices:
        lp = response_logprobs(policy, ids[s], mask[s], response_len)
        ratio = torch.exp(lp - lp.detach())
        log_ratio = ref[s] - lp
        kl = torch.exp(log_ratio) - log_ratio - 1  # k3
        loss = ((-advantages[s] * ratio + KL_COEF * kl) * response_mask[s]).sum() / count
        loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in policy.parameters() if p.requires_grad], 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def with_lora(policy, rank: int):
    """The policy under peft LoRA adapters of `rank` on the targets and alpha ours defaults to."""
    from peft import LoraConfig, get_peft_model

    from ferrule_trainer.config import LORA_TARGETS, TrainerConfig

    alpha = TrainerConfig.model_fields["lora_alpha"].default
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(LORA_TARGETS))
    return get_peft_model(policy, config)


@contextlib.contextmanager
def adapters_off(policy, reference):
    """What scores the reference's logprobs: the reference, or under LoRA the policy with its
    adapters off."""
    if reference is not None:
        yield reference
        return
    with policy.disable_adapter():
        yield policy


def reversal_prompts(count: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefgh") for _ in range(3)) for _ in range(count)]
    return [(f"Reverse the string {w}. Answer:", f" {w[::-1]}") for w in words]


def baseline(args, model: Path, tokens_per_micro: int, checkpointing: bool) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ferrule_rewards.builtin import char_match

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: a smoke run
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to(device)
    if checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.lora:
        policy, reference = with_lora(policy, args.lora), None
    else:
        reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).to(device)
        reference.eval().requires_grad_(False)
    trained = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=LEARNING_RATE, betas=(0.9, 0.95))

    def micro_batches(rows: int, length: int) -> list[slice]:
        per = max(1, tokens_per_micro // length)
        return [slice(i, min(i + per, rows)) for i in range(0, rows, per)]

    times = {k: [] for k in ("step", "generate", "score", "reference", "train")}
    lengths = []  # each step's response lengths
    for step in range(args.baseline_steps):
        began = time.perf_counter()
        pairs = reversal_prompts(args.prompts, step)
        texts = [p for p, _ in pairs for _ in range(8)]
        labels = [label for _, label in pairs for _ in range(8)]
        enc = tokenizer(texts, return_tensors="pt", padding=True).to(device)
        policy.eval()
        with torch.no_grad():
            out = policy.generate(
                **enc,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=args.tokens,
                pad_token_id=pad,
                use_cache=True,
            )
        sync()
        generated = time.perf_counter()
        response = out[:, enc["input_ids"].shape[1] :]
        done = (response == tokenizer.eos_token_id).int().cumsum(-1)
        response_mask = ((done == 0) | ((done == 1) & (response == tokenizer.eos_token_id))).long()
        lengths.append(response_mask.sum(1).tolist())
        decoded = tokenizer.batch_decode(response * response_mask + pad * (1 - response_mask))
        rewards = torch.tensor(
            [char_match(t, label) for t, label in zip(decoded, labels, strict=True)]
        )
        groups = rewards.view(-1, 8)
        advantages = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)
        advantages = advantages.flatten().to(device)
        scored = time.perf_counter()
        mask = torch.cat([enc["attention_mask"], response_mask], dim=1)
        rows, length, response_len = out.shape[0], out.shape[1], response.shape[1]
        slices = micro_batches(rows, length)
        with torch.no_grad(), adapters_off(policy, reference) as scorer:
            ref = torch.cat(
                [response_logprobs(scorer, out[s], mask[s], response_len) for s in slices]
            )
        sync()
        referenced = time.perf_counter()
        policy.train()
        train_step(policy, optimizer, slices, out, mask, advantages[:, None], ref, response_mask)
        sync()
        trained = time.perf_counter()
        for key, seconds in (
            ("step", trained - began),
            ("generate", generated - began),
            ("score", scored - generated),
            ("reference", referenced - scored),
            ("train", trained - referenced),
        ):
            times[key].append(seconds)
        print(f"baseline step {step}: {trained - began:.1f} s", file=sys.stderr)
    later = {k: v[1:] or v for k, v in times.items()}  # after the warm-up step
    medians = {k: statistics.median(v) for k, v in later.items()}
    timed = lengths[1:] or lengths
    return dict(
        step_s=medians.pop("step"),
        phases=medians,
        response_len=[statistics.mean(step) for step in timed],
        response_len_max=[max(step) for step in timed],
        generate_tokens_per_s=statistics.median(
            sum(step) / seconds for step, seconds in zip(timed, later["generate"], strict=True)
        ),
        peak_gib=torch.cuda.max_memory_reserved() / 2**30,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=5, help="ours: RL steps (the first and the last not timed)"
    )
    parser.add_argument("--baseline-steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=512, help="the cap on a response's tokens")
    parser.add_argument(
        "--lengths",
        choices=["uniform", "geometric"],
        default="uniform",
        help="geometric: long-tailed lengths (the kit's vocabulary; see the docstring)",
    )
    parser.add_argument(
        "--gpus", type=int, default=1, help="ours: GPUs, each with --prompts prompts a step"
    )
    parser.add_argument("--model", choices=["1.5b", "7b"], default="1.5b", help="the Qwen2.5 shape")
    parser.add_argument(
        "--lora", type=int, default=0, metavar="R", help="both sides train rank-R LoRA adapters"
    )
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument(
        "--skip-ours",
        action="store_true",
        help="the baseline alone, no ratio: where both do not fit one sitting (the long-tailed "
        "baseline at 4096 tokens takes minutes a step); ours with the same arguments in another "
        "run gives the other half, a ratio across runs that RESULTS must say is one",
    )
    parser.add_argument("--log", help="append the launcher's stderr (its roles' logs) to this file")
    parser.add_argument(
        "--scaling",
        action="store_true",
        help="with --gpus N: ours on one GPU and then on N, instead of the baseline; ratio = "
        "samples/s on N / on one",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="ours: another override"
    )
    args = parser.parse_args()
    if args.steps < 3 and not args.skip_ours:
        parser.error(f"--steps {args.steps}: ours times steps 2 .. N-1, so N must be 3 or more")
    if args.scaling and args.gpus < 2:
        parser.error(f"--scaling compares --gpus N >= 2 with one GPU, got --gpus {args.gpus}")
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")

    from ferrule_trainer.memory import ModelShape

    model = model_path(args.lengths, args.model)
    parameters = ModelShape.read(model).parameters
    name = "step_gpu_longtail" if args.lengths == "geometric" else "step_gpu"
    if args.model != "1.5b":
        name += f"_{args.model}"
    header = dict(name=name, device=_device(), gpus=args.gpus, parameters=parameters)
    header.update(lengths=args.lengths, max_tokens=args.tokens, lora=args.lora)
    if args.scaling:  # ours on one GPU, then on --gpus, one after the other on this machine
        one, _ = measure(args, model, parameters, gpus=1)
        print(json.dumps({"one_gpu": one}), file=sys.stderr, flush=True)
        mine, _ = measure(args, model, parameters, gpus=args.gpus)
        ratio = mine["samples_per_s"] / one["samples_per_s"]
        print(json.dumps(dict(header, one_gpu=one, ours=mine, ratio=ratio)))
        return
    if args.skip_baseline and args.skip_ours:
        parser.error("--skip-baseline and --skip-ours leave nothing to run")
    rows = args.prompts * 8  # one GPU's rows: the baseline's step, each of ours' GPUs' share
    if args.skip_ours:
        mine, train_tokens, result = None, None, dict(header)
    else:
        mine, train_tokens = measure(args, model, parameters, gpus=args.gpus)
        result = dict(header, ours=mine)
    if not args.skip_baseline:
        print(json.dumps({"ours": mine}), file=sys.stderr, flush=True)  # kept if the baseline fails
        one = one_gpu_plan(args, model)
        # The plain loop holds each micro-batch's logits whole (~1.8 MB a response token): past
        # 8k tokens it runs out of memory (32k: 18 GiB more in backward, measured), so it takes
        # the plan's micro-batches up to that size, checkpointing on where they were cut.
        tokens = min(one.micro_batch_tokens, BASELINE_MAX_TOKENS)
        checkpointing = one.gradient_checkpointing or tokens < one.micro_batch_tokens
        theirs = baseline(args, model, tokens, checkpointing)
        theirs["micro_batch_tokens"], theirs["checkpointing"] = tokens, checkpointing
        if train_tokens is None:  # --skip-ours: the baseline's own tokens
            train_tokens = rows * (12 + statistics.median(theirs["response_len"]))
        theirs["train_mfu"] = step_flops(parameters, train_tokens, lora=bool(args.lora)) / (
            (theirs["phases"]["train"] + theirs["phases"]["reference"]) * H100_BF16
        )
        theirs["tokens_per_s"] = train_tokens / theirs["step_s"]
        theirs["samples_per_s"] = rows / theirs["step_s"]
        result["baseline"] = theirs
        if mine is not None:
            result["ratio"] = mine["samples_per_s"] / theirs["samples_per_s"]
    print(json.dumps(result))


def measure(args, model: Path, parameters: int, gpus: int) -> tuple[dict, float]:
    """Ours on `gpus` GPUs: the run's figures with tokens/s, samples/s and the train phase's
    MFU (per GPU), and one GPU's train tokens a step."""
    run = argparse.Namespace(**{**vars(args), "gpus": gpus})
    with tempfile.TemporaryDirectory() as tmp:
        mine, config = ours(run, model, Path(tmp) / "run")
    t = config.trainer
    rows = args.prompts * 8  # each GPU's rows
    # a step's tokens on one GPU: prompts (~10 tokens) and responses, at most max_tokens each
    train_tokens = rows * (12 + statistics.median(mine["response_len"]))
    mine["gpus"] = gpus
    flops = step_flops(parameters, train_tokens, lora=bool(t.lora_rank))
    mine["train_mfu"] = flops / (mine["phases"]["train"] * H100_BF16)
    mine["tokens_per_s"] = gpus * train_tokens / mine["step_s"]
    mine["samples_per_s"] = gpus * rows / mine["step_s"]
    mine["plan"] = {k: getattr(t, k) for k in sorted(t.auto | {"micro_batch_tokens"})}
    from ferrule_launcher.plan import make_plan

    plan = make_plan(config)
    mine["plan_gib"] = {
        phase: sum(getattr(h, phase) for h in plan.gpus[0]) / 2**30
        for phase in ("generate", "train")
    }
    return mine, train_tokens


def step_flops(parameters: int, train_tokens: float, lora: bool = False) -> float:
    """One GPU's train-phase FLOPs a step: the policy's step (6 N a token; 4 N under LoRA, whose
    frozen weights get no gradient, only the activations do) and the reference's forward (2 N)."""
    return ((4 if lora else 6) + 2) * parameters * train_tokens


def _device() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    main()
