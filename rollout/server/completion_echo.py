"""`echo` on /v1/completions (SGLang's and OpenAI's): each choice's text starts with its prompt, and
with `logprobs` its logprobs start with the prompt tokens' (the first one null: nothing precedes it).
The prompt logprobs are the engine's prompt logprobs (`logprob_start_len` 0: the raw distribution)."""
from __future__ import annotations

from typing import Any, Callable, Optional

from rollout.generate_io import RolloutOutput
from rollout.server.http_io import ApiError


class CompletionEcho:
    """For one request: the prompt texts (by prompt index) and the logprob merging."""

    def __init__(self, *, prompts: Optional[list[str]], input_ids: Optional[list[list[int]]],
                 decode: Callable[[list[int]], str], prompt_index: dict[str, int]):
        self._texts = list(prompts) if prompts is not None else [decode(ids) for ids in input_ids or []]
        self._prompt_index = prompt_index
        self._echoed: set[str] = set()

    @staticmethod
    def check(stream: bool, logprobs: Optional[int]) -> None:
        if stream and logprobs is not None:
            raise ApiError(400, "echo with logprobs is not available with stream (the prompt logprobs come "
                                "with the finished request): drop one of echo, logprobs, stream", param="echo")

    def text(self, rid: str) -> str:
        return self._texts[self._prompt_index[rid]]

    def first_time(self, rid: str) -> bool:
        """True once per request: the streamed chunk that carries the prompt."""
        if rid in self._echoed:
            return False
        self._echoed.add(rid)
        return True

    @staticmethod
    def logprobs(out: RolloutOutput, build: Callable[..., dict]) -> dict:
        """build(ids, lps, tops, offset0) for the prompt tokens, then for the output, concatenated."""
        ids = list(out.prompt_ids)
        prompt_lps = [None, *(out.input_logprobs or [])]
        tops = out.input_top_logprobs
        head = build(ids[:1], prompt_lps[:1], None, 0)
        body = build(ids[1:], prompt_lps[1:], tops, _end(head))
        tail = build(out.output_ids, out.output_logprobs, out.output_top_logprobs, _end(body, head))
        parts = (head, body, tail)
        merged: dict[str, Any] = {k: [x for p in parts for x in p[k]] for k in ("tokens", "token_logprobs",
                                                                                  "text_offset")}
        if tops is None and out.output_top_logprobs is None:
            merged["top_logprobs"] = None
        else:
            merged["top_logprobs"] = [None, *(body["top_logprobs"] or [None] * len(body["tokens"])),
                                      *(tail["top_logprobs"] or [None] * len(tail["tokens"]))]
        return merged


def _end(part: dict, before: Optional[dict] = None) -> int:
    """The text offset just past part's tokens."""
    if part["tokens"]:
        return part["text_offset"][-1] + len(part["tokens"][-1])
    return _end(before) if before is not None else 0
