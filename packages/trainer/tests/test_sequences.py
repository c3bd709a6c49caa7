"""The RL batch layout: positions under left padding, response log-probs, shape errors."""

import pytest
import torch

from ferrule_trainer.sequences import check_batch, position_ids, response_tokens, token_logprobs


def test_position_ids_skip_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert position_ids(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]


def test_token_logprobs_is_log_softmax_with_temperature():
    logits = torch.randn(2, 3, 7)
    tokens = torch.randint(0, 7, (2, 3))
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, tokens[..., None])[..., 0]
    torch.testing.assert_close(token_logprobs(logits, tokens, temperature=0.7), expected)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, tokens, temperature=0)


def test_check_batch_names_the_bad_key():
    batch = dict(
        input_ids=torch.zeros(2, 6, dtype=torch.long),
        attention_mask=torch.ones(2, 6),
        response_mask=torch.ones(2, 4),
    )
    assert check_batch(batch) == 4
    assert response_tokens(batch).shape == (2, 4)
    with pytest.raises(ValueError, match="'advantages'"):
        check_batch(batch, "advantages")
    with pytest.raises(ValueError, match=r"batch\['advantages'\] has shape \(2, 3\)"):
        check_batch(dict(batch, advantages=torch.zeros(2, 3)), "advantages")
    with pytest.raises(ValueError, match="response_len < seq_len"):
        check_batch(dict(batch, response_mask=torch.ones(2, 6)))
