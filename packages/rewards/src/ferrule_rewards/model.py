"""A Hugging Face sequence-classification reward model as a scoring backend (the `model` extra).

    scorer = ModelScorer("path/to/reward-model", device="auto", batch_size=32, batch_tokens=32768)
    scores = scorer.score([(prompt, response), ...])

The model reads `prompt + response` as one string, exactly as sent. No special tokens are
added, so apply the chat template and end-of-sequence token that the model was trained with
before sending. The reward is the model's single output logit (`num_labels=1`). Samples are
sorted by length and scored in micro-batches of at most `batch_size` samples and `batch_tokens`
tokens. The tokens of a micro-batch are its samples times the longest sample's tokens, which is
what the padded forward pass holds; a sample longer than `batch_tokens` goes alone. The server
runs the scorer in a scoring process of its own (child.py), one batch at a time. torch and
transformers are imported only in this module, so the rest of the package runs without them.
"""

import math
from pathlib import Path

from ferrule_rewards.records import NO_PROGRESS, Progress, Scores, Status


def _pick_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"reward model device {device!r}: torch sees no CUDA GPU")
    return device


def _pick_dtype(dtype: str, device: str):
    import torch

    if dtype == "auto":  # bf16 is emulated (slow) on most CPUs
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            dtype
        ]
    except KeyError:
        raise ValueError(
            f"reward model dtype {dtype!r}: use auto, float32, bfloat16 or float16"
        ) from None


STATS_FILE = "reward_stats.json"
"""The file beside a reward model that holds the mean and std of the model's scores on held-out
data, as {"mean": ..., "std": ...}."""


def _saved_moments(path: Path) -> tuple[float, float]:
    """The mean and std saved beside the model (--normalize subtracts the mean and divides by
    the std)."""
    import json

    stats_path = path / STATS_FILE
    try:
        stats = json.loads(stats_path.read_text())
        mean, std = float(stats["mean"]), float(stats["std"])
    except FileNotFoundError:
        raise ValueError(
            f"reward model {path}: --normalize needs {STATS_FILE} beside it (`rlhf-train rm` "
            "writes one)"
        ) from None
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{stats_path}: needs numbers 'mean' and 'std': {error}") from None
    if not (math.isfinite(mean) and math.isfinite(std) and std > 0):
        raise ValueError(f"{stats_path}: needs a finite mean and a std > 0, got {mean}, {std}")
    return mean, std


class ModelScorer:
    fields = ("prompt", "response")
    hang_after = None  # a forward has no per-sample timeout; the call's deadline bounds it

    def __init__(
        self,
        path: str | Path,
        *,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int = 32,
        batch_tokens: int = 32768,
        max_length: int | None = None,
        normalize: bool = False,
    ):
        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"reward model {path}: no config.json there (a local model folder)")
        self.shift, self.scale = (_saved_moments(path)) if normalize else (0.0, 1.0)
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.name = f"model {path}"
        self.device = _pick_device(device)
        if batch_size < 1 or batch_tokens < 1:
            raise ValueError(
                f"reward model {path}: batch_size and batch_tokens must be >= 1, "
                f"got {batch_size} and {batch_tokens}"
            )
        self.batch_size, self.batch_tokens = batch_size, batch_tokens
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=_pick_dtype(dtype, self.device)
        )
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"reward model {path}: has {self.model.config.num_labels} labels; "
                "a reward model has one output (num_labels=1)"
            )
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.padding_side = "right"  # _forward reads the last kept position
        self.max_length = max_length or getattr(self.model.config, "max_position_embeddings", None)
        self.model.to(self.device).eval()
        self._torch = torch

    def score(self, rows: list[tuple[str, str]], progress: Progress = NO_PROGRESS) -> Scores:
        progress.start(-1)
        return self.score_texts([prompt + response for prompt, response in rows])

    def score_texts(self, texts: list[str]) -> Scores:
        scores = Scores([0.0] * len(texts))
        ids = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        order = []
        for index, tokens in enumerate(ids):
            if not tokens:
                scores.fail(index, Status.INVALID_SAMPLE, "prompt + response is empty")
            elif self.max_length and len(tokens) > self.max_length:
                scores.fail(
                    index,
                    Status.INVALID_SAMPLE,
                    f"prompt + response is {len(tokens)} tokens; "
                    f"the reward model takes at most {self.max_length}",
                )
            else:
                order.append(index)
        order.sort(key=lambda index: len(ids[index]))  # similar lengths pad less
        for chunk in self._chunks(order, [len(tokens) for tokens in ids]):
            try:
                values = self._forward([ids[index] for index in chunk])
            except Exception as error:  # e.g. out of memory: fail this chunk, keep serving
                for index in chunk:
                    scores.fail(index, Status.ERROR, f"{type(error).__name__}: {error}"[:1000])
                continue
            for index, value in zip(chunk, values, strict=True):
                if math.isfinite(value):
                    scores.rewards[index] = (value - self.shift) / self.scale
                else:
                    scores.fail(index, Status.INVALID_REWARD, f"the model's reward is {value}")
        return scores

    def _chunks(self, order: list[int], lengths: list[int]) -> list[list[int]]:
        """Cut `order` (shortest first) into forward passes of at most batch_size samples and
        batch_tokens padded tokens. Each sample added to a chunk is the chunk's longest, so it
        sets the padded size."""
        chunks: list[list[int]] = []
        for index in order:
            chunk = chunks[-1] if chunks else None
            if (
                chunk is None
                or len(chunk) >= self.batch_size
                or (len(chunk) + 1) * lengths[index] > self.batch_tokens
            ):
                chunks.append([index])
            else:
                chunk.append(index)
        return chunks

    def _forward(self, ids: list[list[int]]) -> list[float]:
        batch = self.tokenizer.pad({"input_ids": ids}, return_tensors="pt").to(self.device)
        with self._torch.inference_mode():
            head = getattr(self.model, "score", None)
            if head is None:  # encoders read their first token: padding cannot mislead them
                return self.model(**batch).logits[:, 0].float().cpu().tolist()
            # Decoder classifiers find "the last token" as the last one that is not the pad id,
            # and many tokenizers pad with the end-of-sequence token a response ends with. Read
            # the head at the last position the attention mask keeps (right padding) instead.
            backbone = getattr(self.model, self.model.base_model_prefix)
            hidden = backbone(**batch).last_hidden_state
            last = batch["attention_mask"].sum(-1) - 1
            rows = self._torch.arange(len(ids), device=hidden.device)
            return head(hidden[rows, last])[:, 0].float().cpu().tolist()

    def close(self) -> None:
        pass
