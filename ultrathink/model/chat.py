"""The chat format of fine-tuned models: a Jinja template stored in the tokenizer, so `apply_chat_template` of
transformers (on our tokenizer dir or on the Hugging Face export) renders exactly what the model was trained on.

    <|user|>\n{question}<|endoftext|><|assistant|>\n{answer}<|endoftext|>

Role headers are plain text (no new tokens, so any pretrained tokenizer takes the template); the EOS token closes
every turn, which is where generation stops. A chat tokenizer therefore reads the EOS text as the EOS id (the
pretraining tokenizer splits it as ordinary text): a message containing the literal EOS text ends its turn, as in
other chat tokenizers.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from ultrathink.io import atomic_dir
from ultrathink.model.generate import stream_text

ROLES = ("system", "user", "assistant")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


NOT_A_CHAT_MODEL = ("not a chat model: its tokenizer has no chat template (fine-tune it: finetune.enabled: true; "
                    "or continue text with `ultrathink generate`)")


class NotAChatModelError(ValueError):
    """The model's tokenizer has no chat template: it was pretrained, not fine-tuned for chat."""


def chat_tokenizer(tokenizer_dir: str | Path) -> PreTrainedTokenizerFast:
    """The pretraining tokenizer of `tokenizer_dir` (same vocabulary and ids) with its own chat template when it has
    one (an open model's), else ours; reading special-token text in a rendered chat as the special ids."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True, split_special_tokens=False)
    tokenizer.chat_template = tokenizer.chat_template or CHAT_TEMPLATE
    return tokenizer


def save_chat_tokenizer(tokenizer_dir: str | Path, out_dir: str | Path) -> Path:
    with atomic_dir(out_dir) as tmp:
        chat_tokenizer(tokenizer_dir).save_pretrained(tmp)
    return Path(out_dir)


def is_chat_tokenizer(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_text(tokenizer, messages: list[dict]) -> str:
    """The chat so far with the assistant's header: the text the answer continues."""
    if not is_chat_tokenizer(tokenizer):
        raise NotAChatModelError(NOT_A_CHAT_MODEL)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def stream_reply(model, tokenizer, messages: list[dict], max_new_tokens: int, temperature: float,
                 top_k: int | None, seed: int, top_p: float | None = None, device=None) -> Iterator[str]:
    """The assistant's next turn, piece by piece, ending at the EOS that closes it; generated on `device` (the model
    is moved there) or, when None, on the model's device."""
    return stream_text(model, tokenizer, prompt_text(tokenizer, messages), max_new_tokens, temperature, top_k, seed,
                       top_p, device, document=False)


def reply(model, tokenizer, messages: list[dict], max_new_tokens: int, temperature: float, top_k: int | None,
          seed: int, top_p: float | None = None, device=None) -> str:
    return "".join(stream_reply(model, tokenizer, messages, max_new_tokens, temperature, top_k, seed, top_p, device))


def user(content: str) -> dict:
    return {"role": "user", "content": content}


def assistant(content: str) -> dict:
    return {"role": "assistant", "content": content}
