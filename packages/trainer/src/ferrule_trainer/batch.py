"""The trainer's batches. `Batch` holds the RL layout and the per-token tensors that a step adds.
`SequenceBatch` holds whole right-padded sequences for `rlhf-train sft | rm | dpo`.

    batch = rl.build_batch(samples, pad_id)  # input_ids, attention_mask, response_mask
    batch = batch.replace(advantages=adv, old_logprobs=old)  # checked against the layout
    shards = batch.split(batch.rows // ranks); part = batch.take([0, 3]); batch.to("cuda")

Each sequence is a prompt followed by its response. Prompts are left-padded and responses are
right-padded (as rollout engines return them), so every response starts at the same column, T - R:

    input_ids       (B, T)  token ids
    attention_mask  (B, T)  1 for real tokens, 0 for padding (left or right)
    response_mask   (B, R)  1 for response tokens that count in the loss

The per-token tensors (B, R) line up with the last R columns of input_ids, as in OpenRLHF's
`action_mask` and the losses' `mask`. A batch pickles as its tensors, since it crosses Ray
between the launcher and the ranks.

The offline trainers' sequences are whole and right-padded, with a loss mask of the same width:

    batch = sft.collate(examples, pad_id)                     # input_ids, attention_mask, loss_mask
    pairs = preference.pair_batch(tokenizer, pairs, 512, 0)   # (2B, T) and margin (B,)

Imports torch only.
"""

import dataclasses
from dataclasses import dataclass

import torch

PER_TOKEN = (
    "old_logprobs",
    "ref_logprobs",
    "rollout_logprobs",
    "advantages",
    "is_weights",
    "old_values",
    "returns",
)


@dataclass(frozen=True)
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    """The policy's log-probabilities from before the step. None: the step is on-policy and
    takes them from its own training forward."""
    ref_logprobs: torch.Tensor | None = None
    """The reference model's log-probabilities, for a KL term in the loss or for DPO."""
    rollout_logprobs: torch.Tensor | None = None
    """The rollout engine's log-probabilities, from which an on-policy step reports "vllm_kl"."""
    advantages: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None
    """Per-token weights of the policy loss, from the rollout correction."""
    old_values: torch.Tensor | None = None
    """The critic's values from before the step."""
    returns: torch.Tensor | None = None
    """The critic's targets."""

    def __post_init__(self):
        ids, attention, response = self.input_ids, self.attention_mask, self.response_mask
        if ids.dim() != 2 or attention.shape != ids.shape:
            raise ValueError(
                f"input_ids and attention_mask must be (batch, seq_len) of one shape, got "
                f"{tuple(ids.shape)} and {tuple(attention.shape)}"
            )
        if response.dim() != 2 or response.shape[1] >= ids.shape[1]:
            raise ValueError(
                f"response_mask must be (batch, response_len) with response_len < seq_len "
                f"{ids.shape[1]}, got {tuple(response.shape)}"
            )
        for name, value in self._tensors().items():
            if value.shape[0] != ids.shape[0]:
                raise ValueError(f"{name} has {value.shape[0]} rows, input_ids {ids.shape[0]}")
            if name in PER_TOKEN and value.shape != response.shape:
                raise ValueError(
                    f"{name} has shape {tuple(value.shape)}, expected response_mask's "
                    f"{tuple(response.shape)}"
                )

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in vars(self).items() if v is not None}

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_len(self) -> int:
        return self.response_mask.shape[1]

    @property
    def response_tokens(self) -> torch.Tensor:
        """(B, R) the response columns of input_ids."""
        return self.input_ids[:, -self.response_len :]

    def lengths(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's real prompt and response tokens, (B,) and (B,)."""
        attention = self.attention_mask
        return attention[:, : -self.response_len].sum(-1), attention[:, -self.response_len :].sum(
            -1
        )

    def require(self, *names: str) -> None:
        """Raises a ValueError that names the tensors among `names` that the batch lacks."""
        missing = [name for name in names if vars(self)[name] is None]
        if missing:
            raise ValueError(
                f"the batch has no {', '.join(missing)}; it has {sorted(self._tensors())}"
            )

    def replace(self, **tensors: torch.Tensor | None) -> "Batch":
        """Returns a copy with these fields set (None removes a field), checked against the
        layout."""
        return dataclasses.replace(self, **tensors)

    def split(self, size: int) -> list["Batch"]:
        """Consecutive parts of at most `size` rows (every tensor split the same way)."""
        tensors = self._tensors()
        return [
            Batch(**{k: v[i : i + size] for k, v in tensors.items()})
            for i in range(0, self.rows, size)
        ]

    def take(self, rows: list[int]) -> "Batch":
        """Returns the batch of `rows`, without the columns that are padding in all of those
        rows: the prompt columns left of their longest prompt and the response columns right of
        their longest response. The per-token tensors lose the same response columns."""
        index = torch.tensor(rows, dtype=torch.long)
        picked = {k: v[index] for k, v in self._tensors().items()}
        part = Batch(**picked)
        prompt, response = part.lengths()
        start = self.input_ids.shape[1] - self.response_len
        keep_prompt, keep_response = max(int(prompt.max()), 1), max(int(response.max()), 1)
        columns = slice(start - keep_prompt, start + keep_response)
        trimmed = {
            k: v[:, columns] if k in ("input_ids", "attention_mask") else v[:, :keep_response]
            for k, v in picked.items()
        }
        return Batch(**trimmed)

    def to(self, device: torch.device | str) -> "Batch":
        """The batch on `device` (batches travel between processes on the host)."""
        return Batch(**{k: v.to(device, non_blocking=True) for k, v in self._tensors().items()})


@dataclass(frozen=True)
class SequenceBatch:
    """Whole right-padded sequences, as the offline trainers read them. SFT reads single
    sequences. Reward models and DPO read pairs: the B / 2 chosen sequences come first, then the
    rejected ones in the same order. The forward passes on these batches take no attention
    mask: under causal attention no real token sees the padding behind it, and without a mask
    sdpa runs its causal kernel (`sequences.model_inputs`). A reward model's score is still read
    at the last token that is not `pad_token_id`."""

    input_ids: torch.Tensor
    """(B, T) token ids of prompt + response."""
    attention_mask: torch.Tensor
    """(B, T) 1 for real tokens, 0 for the padding on the right."""
    loss_mask: torch.Tensor
    """(B, T) 1 on the tokens that the loss counts: the response (in SFT, also its end token)."""
    margin: torch.Tensor | None = None
    """(B / 2,) for preference pairs: each pair's reward-model margin (0: no margin)."""

    def __post_init__(self):
        ids = self.input_ids
        if ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, seq_len), got {tuple(ids.shape)}")
        for name in ("attention_mask", "loss_mask"):
            if vars(self)[name].shape != ids.shape:
                raise ValueError(
                    f"{name} has shape {tuple(vars(self)[name].shape)}, expected input_ids' "
                    f"{tuple(ids.shape)}"
                )
        if self.margin is not None and (ids.shape[0] % 2 or self.margin.shape != (self.pairs,)):
            raise ValueError(
                f"margin has shape {tuple(self.margin.shape)}, expected one per pair of the "
                f"{ids.shape[0]} rows (chosen, then rejected): ({ids.shape[0] / 2:g},)"
            )

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def pairs(self) -> int:
        """The number of preference pairs in a pair batch (rows / 2)."""
        return self.rows // 2

    def to(self, device: torch.device | str) -> "SequenceBatch":
        moved = {k: v.to(device) for k, v in vars(self).items() if v is not None}
        return SequenceBatch(**moved)
