"""A transformers checkpoint's own chat template, which renders its chat requests (docs/design.md §17.6).

A checkpoint ships one as tokenizer_config.json's "chat_template" (a string, or a list of named templates), or as
chat_template.jinja (others in additional_chat_templates/), the ways transformers saves it. It is rendered by
transformers itself, PreTrainedTokenizerFast.from_pretrained(DIR).apply_chat_template(messages, tokenize=False,
add_generation_prompt=True), so the template sees what it sees there: messages, add_generation_prompt, the special
tokens by role (bos_token, eos_token, ...), in the same sandboxed jinja environment with the same helpers
(raise_exception, tojson, strftime_now). A user of the checkpoint compares against exactly that. The text is
encoded by the checkpoint's tokenizer.json like any prompt, with no special tokens added, as transformers'
tokenize=True encodes it, so the served prompt ids equal apply_chat_template(..., tokenize=True)'s.

Only a checkpoint with a tokenizer.json of its own (tokenizer.FileTokenizer) is looked at; our own checkpoints (the
byte tokenizer) keep the plain template of server/protocol.py, and so does a checkpoint that ships no template.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

from latentmoe_lab.tokenizer import FileTokenizer

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"


class ChatTemplateError(ValueError):
    """The checkpoint's template did not render these messages (its raise_exception, or an error in it)."""


class CheckpointChatTemplate:
    """The chat template of the checkpoint in `directory`, rendered through transformers."""

    def __init__(self, directory: Path):
        try:
            from transformers import PreTrainedTokenizerFast
        except ImportError:
            raise ValueError(f"{directory}: the checkpoint ships a chat template, which is rendered with "
                             "transformers; install it (pip install transformers)") from None
        self.directory = directory
        self._tokenizer = PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)

    def render(self, messages: list[dict]) -> str:
        """[{"role": str, "content": str}, ...] -> the prompt text, the assistant's turn opened."""
        try:
            return self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as error:  # noqa: BLE001 - jinja2's TemplateError (raise_exception), or the template's own bug
            raise ChatTemplateError(f"the checkpoint's chat template ({self.directory}) did not render them: "
                                    f"{type(error).__name__}: {str(error)[:300]}") from None


def ships_chat_template(directory: Path) -> bool:
    """Whether the directory holds a chat template where transformers looks for one (read without transformers)."""
    if (directory / CHAT_TEMPLATE_FILE).is_file() or (directory / CHAT_TEMPLATE_DIR).is_dir():
        return True
    try:
        settings = json.loads((directory / TOKENIZER_CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(settings, dict) and settings.get("chat_template") is not None


def chat_template_of(tokenizer) -> CheckpointChatTemplate | None:
    """The chat template shipped beside a checkpoint's own tokenizer.json; None for the byte tokenizer or none."""
    if not isinstance(tokenizer, FileTokenizer):
        return None
    return _chat_template_in(str(Path(tokenizer.path).parent))


@functools.lru_cache(maxsize=8)  # read once per checkpoint: every chat request renders with it
def _chat_template_in(directory: str) -> CheckpointChatTemplate | None:
    path = Path(directory)
    return CheckpointChatTemplate(path) if ships_chat_template(path) else None
