"""The trainer's batches (batch.py): the RL batch's layout checked where it is made, naming the
field; split, take, to and replace; it pickles as its tensors. The offline trainers'
SequenceBatch is checked the same way."""

import pickle

import pytest
import torch

from ferrule_trainer.batch import Batch, SequenceBatch


def _batch(B=3, T=7, R=4) -> Batch:
    """Row 0: a 2-token prompt and a 4-token response; row 1: 1 and 1; row 2: 2 and 2."""
    attention = torch.tensor([[0, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 0, 0]])
    ids = torch.arange(B * T).view(B, T)
    return Batch(ids, attention, attention[:, -R:].clone(), advantages=torch.randn(B, R))


def test_a_batch_is_checked_where_it_is_made_and_the_error_names_the_field():
    batch = _batch()
    assert (batch.rows, batch.response_len) == (3, 4)
    assert batch.response_tokens.shape == (3, 4)
    with pytest.raises(TypeError, match="response_mask"):
        Batch(batch.input_ids, batch.attention_mask)
    with pytest.raises(ValueError, match="advantages has 2 rows, input_ids 3"):
        batch.replace(advantages=torch.zeros(2, 4))
    with pytest.raises(ValueError, match=r"old_logprobs has shape \(3, 3\), expected .* \(3, 4\)"):
        batch.replace(old_logprobs=torch.zeros(3, 3))
    with pytest.raises(ValueError, match="response_mask has 2 rows, input_ids 3"):
        batch.replace(response_mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="response_len < seq_len"):
        batch.replace(response_mask=torch.ones(3, 7), advantages=None)
    with pytest.raises(ValueError, match="input_ids and attention_mask"):
        batch.replace(attention_mask=torch.ones(3, 6))
    batch.require("advantages")
    with pytest.raises(ValueError, match=r"the batch has no old_logprobs, returns; it has \["):
        batch.require("advantages", "old_logprobs", "returns")


def test_replace_sets_and_removes_fields_and_leaves_the_batch_as_it_was():
    batch = _batch()
    old = torch.zeros(3, 4)
    with_old = batch.replace(old_logprobs=old)
    assert with_old.old_logprobs is old and batch.old_logprobs is None
    assert with_old.replace(advantages=None).advantages is None
    assert with_old.input_ids is batch.input_ids  # no copies


def test_split_cuts_every_tensor_into_the_same_rows():
    batch = _batch()
    parts = batch.split(2)
    assert [p.rows for p in parts] == [2, 1]
    for name in ("input_ids", "attention_mask", "response_mask", "advantages"):
        torch.testing.assert_close(torch.cat([vars(p)[name] for p in parts]), vars(batch)[name])
    assert parts[1].old_logprobs is None


def test_take_picks_rows_and_drops_the_columns_that_are_padding_in_all_of_them():
    batch = _batch()
    part = batch.take([2, 1])  # prompts of 2 and 1 tokens, responses of 2 and 1
    assert part.input_ids.tolist() == [[15, 16, 17, 18], [8, 9, 10, 11]]  # columns 1 to 4
    assert part.attention_mask.tolist() == [[1, 1, 1, 1], [0, 1, 1, 0]]
    assert part.response_mask.tolist() == [[1, 1], [1, 0]]
    torch.testing.assert_close(part.advantages, batch.advantages[[2, 1], :2])
    every = batch.take([0, 1, 2])  # only column 0 is padding in every row
    torch.testing.assert_close(every.input_ids, batch.input_ids[:, 1:])
    torch.testing.assert_close(every.advantages, batch.advantages)


def test_to_moves_every_tensor_and_a_batch_pickles_as_its_tensors():
    batch = _batch()
    moved = batch.to("meta")
    assert {t.device.type for t in vars(moved).values() if t is not None} == {"meta"}
    assert moved.old_logprobs is None
    back = pickle.loads(pickle.dumps(batch))
    assert isinstance(back, Batch)
    for name, value in vars(batch).items():
        if value is None:
            assert vars(back)[name] is None
        else:
            torch.testing.assert_close(vars(back)[name], value)
    # no more than the tensors' own pickles and a few hundred bytes of names
    tensors = {k: v for k, v in vars(batch).items() if v is not None}
    assert len(pickle.dumps(batch)) < len(pickle.dumps(tensors)) + 400


def test_a_sequence_batch_is_checked_where_it_is_made_and_the_error_names_the_field():
    ids = torch.arange(8).view(4, 2)
    ones = torch.ones_like(ids)
    batch = SequenceBatch(ids, ones, ones, margin=torch.tensor([0.5, 1.0]))
    assert (batch.rows, batch.pairs) == (4, 2)
    with pytest.raises(TypeError, match="loss_mask"):
        SequenceBatch(ids, ones)
    with pytest.raises(ValueError, match=r"input_ids must be \(batch, seq_len\), got \(8,\)"):
        SequenceBatch(ids.flatten(), ones, ones)
    with pytest.raises(
        ValueError, match=r"attention_mask has shape \(4, 1\), expected .* \(4, 2\)"
    ):
        SequenceBatch(ids, ones[:, :1], ones)
    with pytest.raises(ValueError, match=r"loss_mask has shape \(3, 2\), expected .* \(4, 2\)"):
        SequenceBatch(ids, ones, ones[:3])
    with pytest.raises(
        ValueError, match=r"margin has shape \(4,\), expected one per pair .*\(2,\)"
    ):
        SequenceBatch(ids, ones, ones, margin=torch.zeros(4))
    with pytest.raises(ValueError, match=r"margin .* of the 3 rows .*\(1.5,\)"):
        SequenceBatch(ids[:3], ones[:3], ones[:3], margin=torch.zeros(1))
    moved = batch.to("meta")
    assert {t.device.type for t in vars(moved).values()} == {"meta"}
    assert SequenceBatch(ids, ones, ones).to("meta").margin is None
