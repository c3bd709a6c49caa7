"""Prompts as plain text or as chat messages, rendered the same way by every entry point.

    text = prompt_text(tokenizer, [{"role": "user", "content": "2 + 2?"}], where="data.jsonl:3")

A prompt that is a string is used as it is. A prompt that is a list of messages (each one
{"role": ..., "content": ...}, the form the tokenizer's chat template takes) is rendered with
that template, followed by the generation prompt that opens the assistant's turn. The response
(SFT's target, DPO's chosen and rejected responses, or what the rollout engines generate) then
follows the rendered prompt directly. SFT (sft.py), reward models and DPO (preference.py), and
rlhf-launch's datasets all call this function.
"""

ROLES = ("system", "user", "assistant", "tool")


def prompt_text(tokenizer, prompt, where: str) -> str:
    """Returns `prompt` as the text the model reads. Raises a ValueError naming `where` when
    `prompt` is neither a string nor a list of messages, or when `prompt` is a list of messages
    and the tokenizer has no chat template."""
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(
            f"{where}: a prompt is a string or a non-empty list of chat messages, got "
            f"{type(prompt).__name__}"
        )
    for number, message in enumerate(prompt, 1):
        if (
            not isinstance(message, dict)
            or message.get("role") not in ROLES
            or not isinstance(message.get("content"), str)
        ):
            raise ValueError(
                f"{where}: message {number} must be {{'role': one of {list(ROLES)}, 'content': "
                f"a string}}, got {message!r:.100}"
            )
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{where}: chat messages need a tokenizer with a chat template, and "
            f"{getattr(tokenizer, 'name_or_path', 'this one')} has none (give plain-text prompts)"
        )
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
