"""SamplingParams: per-request generation settings with SGLang's field names, validated up front."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from rollout.stop_pattern import compile_stop_pattern
from rollout.value_range import check_choice, check_range

GREEDY_TEMPERATURE = 1e-6  # temperatures below this mean greedy (SGLang's convention)
LOGPROB_MODES = ("raw", "scaled", "processed")
MAX_SEED = 2**63 - 1


def _check_stop_regex(value: Any) -> tuple[str, ...]:
    pats = () if value is None else (value,) if isinstance(value, str) else value
    if not isinstance(pats, (list, tuple)) or not all(isinstance(r, str) and r for r in pats):
        raise ValueError(f"stop_regex must be a non-empty string or a list of them, got {value!r}"[:300])
    if len(pats) > 16 or any(len(r) > 512 for r in pats):
        raise ValueError("stop_regex must hold at most 16 patterns of at most 512 characters each")
    for r in pats:
        rx = compile_stop_pattern(r)
        if rx.search("") is not None:
            raise ValueError(f"stop_regex {r!r} matches the empty string"[:300])
    return tuple(pats)


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Generation settings. temperature 0 is greedy; top_k -1 (or 0) disables top-k.

    logprob_mode chooses the distribution the returned logprobs are of: "raw" (log-softmax of
    the model's logits), "scaled" (of logits / temperature, SGLang's default) or "processed"
    (after temperature, top-k, top-p and min-p, renormalised: the distribution actually sampled).
    Greedy requests use temperature 1 and no truncation for "scaled"/"processed".
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    stop_regex: tuple[str, ...] = ()         # stop when the output text matches one (SGLang's stop_regex)
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    sampling_seed: Optional[int] = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprob_mode: str = "scaled"
    stream_interval: Optional[int] = None   # streaming: tokens per chunk (None: the engine's default)

    def __post_init__(self) -> None:
        check_range("temperature", self.temperature, 0.0, 100.0)
        check_range("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        check_range("top_k", self.top_k, -1, 2**31 - 1, integer=True,
                    allowed="-1 (disabled), 0 (disabled) or a positive integer")
        check_range("min_p", self.min_p, 0.0, 1.0)
        check_range("max_new_tokens", self.max_new_tokens, 0, 2**31 - 1, integer=True)
        check_range("min_new_tokens", self.min_new_tokens, 0, 2**31 - 1, integer=True)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be <= max_new_tokens ({self.max_new_tokens}), "
                             f"got {self.min_new_tokens}")
        check_range("n", self.n, 1, 1024, integer=True)
        check_range("sampling_seed", self.sampling_seed, 0, MAX_SEED, integer=True, or_none=True)
        check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        check_range("repetition_penalty", self.repetition_penalty, 0.0, 2.0, lo_open=True)
        check_range("stream_interval", self.stream_interval, 1, 2**31 - 1, integer=True, or_none=True)
        for name in ("ignore_eos", "no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        check_choice("logprob_mode", self.logprob_mode, LOGPROB_MODES)
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        if len(stop) > 64:
            raise ValueError(f"stop must hold at most 64 strings, got {len(stop)}")
        object.__setattr__(self, "stop", tuple(stop))
        ids = () if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        for t in ids:
            check_range("stop_token_ids", t, 0, 2**31 - 1, integer=True)
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        object.__setattr__(self, "stop_regex", _check_stop_regex(self.stop_regex))
        self._derive()

    @classmethod
    def trusted(cls, fields: Mapping[str, Any]) -> "SamplingParams":
        """Builds from the fields of a SamplingParams already checked (the engine decoding a request
        the front end built): the same value as SamplingParams(**fields), without checking it again."""
        obj = object.__new__(cls)
        for f in dataclasses.fields(cls):
            value = fields.get(f.name, f.default)
            if f.name in ("stop", "stop_token_ids", "stop_regex"):
                value = tuple(value)   # NOTE: msgpack decodes tuples as lists
            object.__setattr__(obj, f.name, value)
        obj._derive()
        return obj

    def _derive(self) -> None:
        # NOTE: not a field: the compiled stop_regex patterns (checked after each token)
        object.__setattr__(self, "stop_patterns", tuple(compile_stop_pattern(r) for r in self.stop_regex))
        # NOTE: not a field (no effect on ==, hash or replace): what the sampler does with this row,
        # so a batch whose rows share one key is sampled with scalars, not per-row tensors.
        greedy = self.is_greedy
        object.__setattr__(self, "sampler_key", (
            greedy, 1.0 if greedy else self.temperature, self.top_k if self.top_k > 0 else -1,
            self.top_p, self.min_p, self.logprob_mode, self.has_penalty))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalty(self) -> bool:
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    def check_vocab(self, vocab_size: int) -> None:
        """Field checks that need the model: token ids must be in [0, vocab_size)."""
        for t in self.stop_token_ids:
            if t >= vocab_size:
                raise ValueError(f"stop_token_ids must be in [0, {vocab_size}), got {t}")

    @staticmethod
    def from_any(value: "SamplingParams | Mapping[str, Any] | None") -> "SamplingParams":
        if value is None:
            return SamplingParams()
        if isinstance(value, SamplingParams):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"sampling_params must be a dict or SamplingParams, got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(SamplingParams)}
        unknown = sorted(k for k in value if k not in known)
        if unknown:
            raise ValueError(f"sampling_params has unknown field(s) {unknown}; allowed: {sorted(known)}")
        kwargs = dict(value)
        # NOTE: JSON clients send null for "use the default"; treat it so.
        kwargs = {k: v for k, v in kwargs.items() if v is not None or k == "sampling_seed"}
        return SamplingParams(**kwargs)

    def replace(self, **changes: Any) -> "SamplingParams":
        return dataclasses.replace(self, **changes)
