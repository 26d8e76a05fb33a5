"""Tokenizer: text <-> token ids for a checkpoint directory (tokenizer.json via `tokenizers`)."""
from __future__ import annotations

import json
import os
import threading
from typing import Any, Optional

from tokenizers import Tokenizer as _HFTokenizer

GIL_FREE_CHARS = 4096   # longer texts are encoded without holding the GIL


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


class Tokenizer:
    def __init__(self, path: str):
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise ValueError(f"tokenizer_path {path!r} has no tokenizer.json")
        self.path = path
        self._tok = _HFTokenizer.from_file(file)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # NOTE: a vocabulary entry's own spelling is at least as long as the text it decodes to (byte-level
        # entries spell one character per byte); a normalizer may compose characters (NFC, NFKC), so
        # twice that. Hence a text of more than context_length * max_chars_per_token characters never
        # fits: it is refused before it is tokenized (a 30 MB text took ~4 GB and minutes to tokenize).
        longest = max((len(k) for k in self._tok.get_vocab(with_added_tokens=True)), default=1)
        self.max_chars_per_token = longest * (2 if self._tok.normalizer is not None else 1)
        self._chat_tokenizer = None
        self._chat_lock = threading.Lock()
        self._chat_rendered = False

    @staticmethod
    def eos_token_ids(model_path: str) -> list[int]:
        """eos ids from generation_config.json (preferred, may be a list) and config.json."""
        ids: list[int] = []
        for name in ("generation_config.json", "config.json"):
            file = os.path.join(model_path, name)
            if os.path.isfile(file):
                with open(file) as f:
                    ids += [i for i in _as_id_list(json.load(f).get("eos_token_id")) if i not in ids]
        return ids

    def encode(self, text: str) -> list[int]:
        if len(text) > GIL_FREE_CHARS:
            # NOTE: encode_batch releases the GIL while it works (encode holds it: a 1 MB text on a worker
            # thread stalled the server's event loop for its whole ~2 s)
            return self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        return self._tok.encode(text, add_special_tokens=False).ids

    def max_chars(self, max_tokens: int) -> int:
        """The longest text that may encode to at most max_tokens tokens (a cheap bound, no tokenizing)."""
        return max_tokens * self.max_chars_per_token

    def check_length(self, chars: int, name: str, context_length: int) -> None:
        """ValueError naming `name` when a text of `chars` characters cannot fit the context, whatever it
        encodes to: checked before tokenizing (the HTTP front end and Rollout.generate share it)."""
        limit = self.max_chars(context_length)
        if chars > limit:
            raise ValueError(f"{name} has {chars} characters: more than the context length ({context_length} "
                             f"tokens) can hold at {self.max_chars_per_token} characters per token at most "
                             f"({limit} characters)")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: Optional[list] = None) -> list[int]:
        # NOTE: the chat tokenizer is created on first use, often from several server threads at
        # once; transformers' lazy imports are not safe to race (ImportError: cannot import name
        # 'AutoTokenizer'), so creation and the first render happen under a lock
        if not self._chat_rendered:
            with self._chat_lock:
                text = self._render(messages, add_generation_prompt, tools)
                self._chat_rendered = True
        else:
            text = self._render(messages, add_generation_prompt, tools)
        return self.encode(text)

    def _render(self, messages: list[dict], add_generation_prompt: bool, tools: Optional[list]) -> str:
        if self._chat_tokenizer is None:
            from transformers import AutoTokenizer  # noqa: PLC0415 (only chat needs it)

            self._chat_tokenizer = AutoTokenizer.from_pretrained(self.path)
        return self._chat_tokenizer.apply_chat_template(messages, tokenize=False, tools=tools,
                                                        add_generation_prompt=add_generation_prompt)
