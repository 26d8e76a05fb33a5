"""EngineConfig: the frozen settings an engine is built from; derived values are properties."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Optional

DEFAULT_MODEL_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                  "configs", "tiny-moe")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def _positive_int(name: str, value: Any, *, allow_none: bool = False, minimum: int = 1) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}{' or None' if allow_none else ''}, got {value!r}")


def _int_tuple(name: str, value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} must be a list of positive integers, got {value!r}")
    out = tuple(value)
    for v in out:
        _positive_int(name, v)
    if len(set(out)) != len(out):
        raise ValueError(f"{name} must not repeat values, got {list(out)}")
    return tuple(sorted(out))


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    model_path: str = DEFAULT_MODEL_PATH
    tokenizer_path: Optional[str] = None
    dtype: str = "auto"
    device: str = "cpu"
    max_running_requests: int = 128
    chunked_prefill_size: Optional[int] = 1024   # tokens per prefill forward; None = whole prompts
    max_total_tokens: Optional[int] = None        # KV slots; default from kv_cache_bytes
    kv_cache_bytes: Optional[int] = None          # default 512 MiB when max_total_tokens is unset
    context_length: Optional[int] = None          # default: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    enable_return_routed_experts: bool = False
    decode_graph_batch_sizes: tuple[int, ...] = ()
    prefill_graph_token_sizes: tuple[int, ...] = ()
    dp_size: int = 1
    seed: int = 0
    weight_version: str = "default"

    def __post_init__(self) -> None:
        if not isinstance(self.model_path, str) or not self.model_path:
            raise ValueError(f"model_path must be a non-empty path, got {self.model_path!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if not isinstance(self.device, str) or self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        _positive_int("max_running_requests", self.max_running_requests)
        _positive_int("chunked_prefill_size", self.chunked_prefill_size, allow_none=True)
        _positive_int("max_total_tokens", self.max_total_tokens, allow_none=True, minimum=2)
        _positive_int("kv_cache_bytes", self.kv_cache_bytes, allow_none=True)
        _positive_int("context_length", self.context_length, allow_none=True, minimum=2)
        _positive_int("dp_size", self.dp_size)
        _positive_int("seed", self.seed, minimum=0)
        for name in ("enable_prefix_caching", "enable_return_routed_experts"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        object.__setattr__(self, "decode_graph_batch_sizes",
                           _int_tuple("decode_graph_batch_sizes", self.decode_graph_batch_sizes))
        object.__setattr__(self, "prefill_graph_token_sizes",
                           _int_tuple("prefill_graph_token_sizes", self.prefill_graph_token_sizes))
        if not isinstance(self.weight_version, str):
            raise ValueError(f"weight_version must be a string, got {self.weight_version!r}")

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    @property
    def resolved_tokenizer_path(self) -> str:
        return self.tokenizer_path or self.model_path
