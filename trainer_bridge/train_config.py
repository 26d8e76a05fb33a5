"""``TrainConfig``: the frozen settings of ``python -m trainer_bridge.train``, loaded from YAML.

Keys are the field names below (``loss:`` is a nested mapping of ``LossConfig`` fields, except
``temperature``, which follows the rollout temperature). Every problem is a ``ValueError`` naming the
key (and the file): unknown keys, wrong types, out-of-range values. ``--set key=value`` overrides
(``loss.clip_eps=0.3``) are parsed as YAML scalars.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from capture.codec import RoutedExpertsFormat

from .losses import LossConfig

__all__ = ["TrainConfig", "load_train_config", "ConfigError"]

SYNC_MODES = ("disk", "tensor", "distributed")
ROUTING_FORMATS = tuple(f.value for f in RoutedExpertsFormat)   # the codec's one list
SERVER_DTYPES = ("auto", "float32", "bfloat16", "float16")
TRAIN_DTYPES = ("float32", "bfloat16")
_LOSS_KEYS = tuple(f.name for f in dataclasses.fields(LossConfig) if f.name != "temperature")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    # ---- model and servers
    model_path: str = "configs/tiny-moe"
    server_urls: tuple[str, ...] = ()       # connect to running servers; empty: start num_servers
    num_servers: int = 2
    server_dtype: str = "bfloat16"
    server_flags: tuple[str, ...] = ()      # extra rollout-serve flags for started servers
    server_kv_cache_bytes: int = 64 * 2**20
    api_key: Optional[str] = None
    admin_api_key: Optional[str] = None
    routing_format: str = "compact"
    stream: bool = False
    # ---- task and data
    task: Optional[str] = "arithmetic"      # writes the embedded task's JSONL files into run_dir
    train_files: tuple[str, ...] = ()       # JSON/JSONL/parquet prompt files (instead of task)
    eval_files: tuple[str, ...] = ()
    prompt_key: str = "prompt"
    reward: str = "trainer_bridge.task:arithmetic_reward"   # "module:function"(response_text, record)
    num_train_prompts: int = 4096
    num_eval_prompts: int = 128
    eval_every: int = 5
    eval_max_new_tokens: int = 8
    # ---- rollout
    steps: int = 20
    prompts_per_step: int = 32
    samples_per_prompt: int = 8
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    # ---- training
    exact: bool = False                     # exact on-policy: deterministic servers + exact-mode trainer
    train_dtype: str = "float32"            # the trainer's forward; bfloat16: DeepSpeed bf16 over fp32 master weights
    router_replay: bool = True
    compare_no_replay: bool = True          # also measure live routing on the same rollouts
    lr: float = 5e-4
    weight_decay: float = 0.0
    adam_betas: tuple[float, ...] = (0.9, 0.99)
    grad_clip: float = 1.0
    zero_stage: int = 1
    micro_batch_tokens: int = 4096
    loss: LossConfig = field(default_factory=LossConfig)
    # ---- weight sync
    weight_sync: str = "tensor"
    sync_dir: Optional[str] = None          # disk sync: a directory the servers can read (default: run_dir/weights)
    # ---- run
    seed: int = 0
    run_dir: str = "runs/tiny"
    wandb_project: str = "rollout-grpo"
    wandb_mode: str = "offline"
    progress: bool = True

    def __post_init__(self):
        def need(cond: bool, key: str, msg: str):
            if not cond:
                raise ConfigError(f"{key}: {msg}, got {getattr(self, key)!r}")
        for key in ("num_servers", "steps", "prompts_per_step", "samples_per_prompt", "max_new_tokens",
                    "eval_max_new_tokens", "micro_batch_tokens", "num_train_prompts", "server_kv_cache_bytes"):
            need(getattr(self, key) >= 1, key, "must be >= 1")
        need(self.num_eval_prompts >= 0, "num_eval_prompts", "must be >= 0")
        need(self.eval_every >= 0, "eval_every", "must be >= 0 (0: only before and after training)")
        need(self.temperature > 0, "temperature", "must be > 0 (GRPO samples; greedy is for eval)")
        need(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(self.lr > 0, "lr", "must be > 0")
        need(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        need(self.grad_clip >= 0, "grad_clip", "must be >= 0 (0: no clipping)")
        need(len(self.adam_betas) == 2 and all(0 <= b < 1 for b in self.adam_betas), "adam_betas",
             "must be two numbers in [0, 1)")
        need(self.zero_stage in (0, 1, 2), "zero_stage", "must be 0, 1 or 2")
        need(self.weight_sync in SYNC_MODES, "weight_sync", f"must be one of {SYNC_MODES}")
        need(self.routing_format in ROUTING_FORMATS, "routing_format", f"must be one of {ROUTING_FORMATS}")
        need(self.server_dtype in SERVER_DTYPES, "server_dtype", f"must be one of {SERVER_DTYPES}")
        need(self.train_dtype in TRAIN_DTYPES, "train_dtype", f"must be one of {TRAIN_DTYPES}")
        need(self.wandb_mode in ("offline", "online", "disabled"), "wandb_mode",
             "must be offline, online or disabled")
        need(":" in self.reward, "reward", "must be 'module:function'")
        need(self.task in (None, "arithmetic"), "task", "must be 'arithmetic' or null (then give train_files)")
        if self.task is None:
            need(bool(self.train_files), "train_files", "must name prompt files when task is null")
        if self.exact and self.server_dtype != self.train_dtype:
            raise ConfigError(f"server_dtype: exact mode needs the trainer's dtype on the servers (train_dtype "
                              f"{self.train_dtype}), got {self.server_dtype!r}")
        if self.samples_per_prompt < 2:
            raise ConfigError(f"samples_per_prompt: GRPO needs groups of at least 2, got {self.samples_per_prompt}")
        if self.exact:
            _check_exact_model(self.model_path)

    @property
    def loss_config(self) -> LossConfig:
        """The loss settings, with the temperature of the rollouts (log-probs of the scaled distribution)."""
        return dataclasses.replace(self.loss, temperature=self.temperature)

    @property
    def samples_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def resolved_sync_dir(self) -> str:
        return self.sync_dir or str(Path(self.run_dir) / "weights")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["loss"] = dataclasses.asdict(self.loss)
        return d


def _checkpoint_config(model_path: str) -> dict:
    """config.json of model_path: a local checkpoint directory, else what transformers resolves
    (its cache; offline runs never download)."""
    import json

    local = Path(model_path) / "config.json"
    if local.is_file():
        try:
            return json.loads(local.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"model_path: cannot read {local}: {exc}") from None
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model_path).to_dict()
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model_path: exact mode checks the checkpoint's architecture, but {model_path!r} "
                          f"has no readable config.json ({exc})") from None


def _check_exact_model(model_path: str) -> None:
    """exact: true needs a checkpoint whose architecture exact mode matches bit for bit; refused
    here, before any server starts (the trainer would refuse it only after they are up)."""
    from .exact_model import EXACT_ARCHITECTURES, check_exact_support

    cfg = _checkpoint_config(model_path)
    archs = cfg.get("architectures") or []
    if len(archs) != 1:
        raise ConfigError(f"exact: exact mode supports {list(EXACT_ARCHITECTURES)}; the checkpoint "
                          f"{model_path!r} names architectures {archs!r} (one expected)")
    try:
        check_exact_support(archs[0], cfg)
    except ValueError as exc:
        raise ConfigError(f"exact: {exc} (checkpoint {model_path!r}; exact: false runs it without exact mode)") from None


# ---- loading ------------------------------------------------------------------------------------
def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp, key: str) -> Any:
    """Check/convert a YAML value to the field type ``tp``; ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key)
    if origin is tuple:
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        elem = args[0] if args else Any
        return tuple(_coerce(v, elem, f"{key}[{i}]") for i, v in enumerate(value))
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {type(value).__name__} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # NOTE: YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
        return value
    if tp is LossConfig:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of {list(_LOSS_KEYS)}, got {type(value).__name__}")
        hints = typing.get_type_hints(LossConfig)
        kw = {}
        for k, v in value.items():
            if k not in _LOSS_KEYS:
                raise ConfigError(f"{key}.{k}: unknown key (known: {list(_LOSS_KEYS)})")
            kw[k] = _coerce(v, hints[k], f"{key}.{k}")
        try:
            return LossConfig(**kw)
        except ValueError as exc:
            raise ConfigError(f"{key}: {exc}") from None
    raise ConfigError(f"{key}: unsupported field type {_type_name(tp)}")


def _set_dotted(raw: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    d = raw
    for p in parts[:-1]:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ConfigError(f"{dotted}: {p} is not a mapping")
    d[parts[-1]] = value


def load_train_config(path: Optional[Union[str, Path]] = None, overrides: Sequence[str] = (),
                      **kwargs: Any) -> TrainConfig:
    """Read ``path`` (YAML mapping), apply ``overrides`` (``"key=value"``, YAML-parsed values) and
    ``kwargs``, and build the config. Every error names the key (and the file)."""
    import yaml

    where = f"{path}: " if path else ""
    raw: dict = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read config {path}: {exc}") from None
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{where}invalid YAML: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}the config must be a mapping of keys to values")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value")
        k, v = item.split("=", 1)
        _set_dotted(raw, k.strip(), yaml.safe_load(v) if v.strip() else None)
    for k, v in kwargs.items():
        raw[k] = v
    hints = typing.get_type_hints(TrainConfig)
    known = [f.name for f in dataclasses.fields(TrainConfig)]
    kw = {}
    try:
        for k, v in raw.items():
            if k not in hints:
                import difflib
                near = difflib.get_close_matches(str(k), known, n=1)
                raise ConfigError(f"{k}: unknown key" + (f" (did you mean {near[0]!r}?)" if near else "")
                                  + f"; known keys: {known}")
            kw[k] = v if isinstance(v, LossConfig) else _coerce(v, hints[k], k)
        return TrainConfig(**kw)
    except ConfigError as exc:
        raise ConfigError(f"{where}{exc}") from None
    except ValueError as exc:
        raise ConfigError(f"{where}{exc}") from None
