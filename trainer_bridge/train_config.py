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
from rollout.config.backends import QUANTIZATIONS
from rollout.value_range import check_choice, check_range

from .losses import LossConfig

__all__ = ["TrainConfig", "load_train_config", "ConfigError"]

SYNC_MODES = ("disk", "tensor", "distributed")
ROUTING_FORMATS = tuple(f.value for f in RoutedExpertsFormat)   # the codec's one list
SERVER_DTYPES = ("auto", "float32", "bfloat16", "float16")
TRAIN_DTYPES = ("float32", "bfloat16")
_LOSS_KEYS = tuple(f.name for f in dataclasses.fields(LossConfig) if f.name != "temperature")


class ConfigError(ValueError):
    pass


def _key(default: Any = dataclasses.MISSING, *, help: str, factory: Any = dataclasses.MISSING) -> Any:
    """A TrainConfig field and its help text: ``python -m trainer_bridge.train --help`` and the key
    table of docs/trainer.md are generated from these (trainer_bridge/config_keys.py)."""
    return field(default=default, default_factory=factory, metadata={"help": help})


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    # ---- model and servers
    model_path: str = _key("configs/tiny-moe", help="checkpoint directory the servers serve and the trainer trains "
                           "(config.json, weights, tokenizer)")
    server_urls: tuple[str, ...] = _key((), help="running rollout-serve URLs to use (the trainer's weights are pushed "
                                        "to them first); empty: start num_servers local servers")
    num_servers: int = _key(2, help="local rollout-serve processes to start when server_urls is empty")
    server_dtype: str = _key("bfloat16", help=f"dtype of the started servers, one of {', '.join(SERVER_DTYPES)} "
                             "(exact mode: float32)")
    quantization: Optional[str] = _key(None, help="the servers' --quantization: fp8 rolls out on FP8 copies of the "
                                       "trainer's weights (re-quantized at every sync); exact mode then trains "
                                       "through the same FP8 weights. null: full precision")
    server_flags: tuple[str, ...] = _key((), help="extra rollout-serve flags for the started servers, "
                                         "e.g. [--max-running-requests, '64']")
    server_kv_cache_bytes: int = _key(64 * 2**20, help="KV cache bytes of each started server (--kv-cache-bytes)")
    api_key: Optional[str] = _key(None, help="the servers' --api-key (given to started servers too)")
    admin_api_key: Optional[str] = _key(None, help="the servers' --admin-api-key (weight pushes, pause, flush)")
    routing_format: str = _key("compact", help=f"routing wire format asked for, one of {', '.join(ROUTING_FORMATS)}")
    stream: bool = _key(False, help="stream the generations (SSE) instead of one answer per request")
    # ---- task and data
    task: Optional[str] = _key("arithmetic", help="arithmetic: write the embedded task's train and eval JSONL into "
                               "run_dir/data; null: read train_files")
    train_files: tuple[str, ...] = _key((), help="JSON / JSONL / parquet prompt files (with task: null)")
    eval_files: tuple[str, ...] = _key((), help="held-out prompt files (with task: null)")
    prompt_key: str = _key("prompt", help="the field holding the prompt text in the data files")
    reward: str = _key("trainer_bridge.task:arithmetic_reward", help="'module:function', called as "
                       "function(response_text, record) -> float")
    num_train_prompts: int = _key(4096, help="training prompts the embedded task writes")
    num_eval_prompts: int = _key(128, help="held-out prompts scored (greedy); 0: no evaluation")
    eval_every: int = _key(5, help="held-out reward every N steps (0: only before and after training)")
    eval_max_new_tokens: int = _key(8, help="max new tokens of the held-out generations")
    # ---- rollout
    steps: int = _key(20, help="GRPO steps")
    prompts_per_step: int = _key(32, help="prompts per step")
    samples_per_prompt: int = _key(8, help="samples per prompt: the GRPO group (at least 2)")
    max_new_tokens: int = _key(8, help="max new tokens per rollout")
    temperature: float = _key(1.0, help="sampling temperature of the rollouts (the loss's log-probs use it too)")
    top_p: float = _key(1.0, help="nucleus sampling of the rollouts, in (0, 1]")
    # ---- training
    exact: bool = _key(False, help="exact on-policy: deterministic servers and the exact-mode trainer "
                       "(float32 or bfloat16; max|dlp| is 0 every step)")
    train_dtype: str = _key("float32", help="the trainer's forward dtype; bfloat16: DeepSpeed bf16 over fp32 "
                            "master weights (exact mode: the servers' dtype too)")
    router_replay: bool = _key(True, help="train with the rollout's routed experts (R3); false: live routing")
    compare_no_replay: bool = _key(True, help="also measure a live-routing forward on the same rollouts "
                                   "(the no_replay/... metrics)")
    lr: float = _key(5e-4, help="AdamW learning rate")
    weight_decay: float = _key(0.0, help="AdamW weight decay")
    adam_betas: tuple[float, ...] = _key((0.9, 0.99), help="AdamW betas, two numbers in [0, 1)")
    grad_clip: float = _key(1.0, help="gradient norm clip (0: none)")
    zero_stage: int = _key(1, help="DeepSpeed ZeRO stage: 0, 1 or 2")
    micro_batch_tokens: int = _key(4096, help="tokens per packed micro-batch (gradients accumulate over them)")
    loss: LossConfig = _key(factory=LossConfig, help="the loss settings: the loss.* keys")
    # ---- weight sync
    weight_sync: str = _key("tensor", help="how new weights reach the servers: disk (safetensors in sync_dir, "
                            "then /update_weights_from_disk), tensor (safetensors over HTTP) or distributed "
                            "(a torch.distributed broadcast)")
    sync_dir: Optional[str] = _key(None, help="disk sync: a directory the servers can read (null: run_dir/weights)")
    stale_tokens: str = _key("error", help="response tokens sampled by another weight version than the step's "
                             "(a request that lived across an update; meta_info.weight_versions): error stops the "
                             "run, mask leaves them out of the loss (loss_mask 0)")
    # ---- run
    seed: int = _key(0, help="seed of the data order, the rollouts and the trainer")
    run_dir: str = _key("runs/tiny", help="the run's directory: config.json, metrics.jsonl, summary.json, "
                        "server-logs/, wandb/ (one run per directory)")
    wandb_project: str = _key("rollout-grpo", help="wandb project")
    wandb_mode: str = _key("offline", help="wandb mode: offline, online or disabled")
    progress: bool = _key(True, help="a progress bar on a terminal (the step lines print either way)")

    def __post_init__(self):
        def rng(key: str, lo: float, hi: Optional[float] = None, **kw: Any) -> None:
            check_range(key, getattr(self, key), lo, hi, error=ConfigError, **kw)

        def choice(key: str, choices: Sequence[Any], **kw: Any) -> None:
            check_choice(key, getattr(self, key), choices, error=ConfigError, **kw)

        for key in ("num_servers", "steps", "prompts_per_step", "max_new_tokens", "eval_max_new_tokens",
                    "micro_batch_tokens", "num_train_prompts", "server_kv_cache_bytes"):
            rng(key, 1, integer=True)
        rng("samples_per_prompt", 2, integer=True, why="GRPO compares the samples of a prompt: groups of at least 2")
        rng("num_eval_prompts", 0, integer=True)
        rng("eval_every", 0, integer=True, why="0: only before and after training")
        rng("temperature", 0, lo_open=True, why="GRPO samples; greedy is for eval")
        rng("top_p", 0, 1, lo_open=True)
        rng("lr", 0, lo_open=True)
        rng("weight_decay", 0)
        rng("grad_clip", 0, why="0: no clipping")
        if len(self.adam_betas) != 2:
            raise ConfigError(f"adam_betas must be two numbers in [0, 1), got {self.adam_betas!r}")
        for beta in self.adam_betas:
            check_range("adam_betas", beta, 0, 1, hi_open=True, error=ConfigError)
        rng("zero_stage", 0, 2, integer=True)
        rng("seed", 0, integer=True)
        choice("weight_sync", SYNC_MODES)
        choice("stale_tokens", ("error", "mask"))
        choice("routing_format", ROUTING_FORMATS)
        choice("server_dtype", SERVER_DTYPES)
        choice("train_dtype", TRAIN_DTYPES)
        choice("wandb_mode", ("offline", "online", "disabled"))
        if ":" not in self.reward:
            raise ConfigError(f"reward must be 'module:function', got {self.reward!r}")
        choice("task", ("arithmetic",), or_none=True, why="null: give train_files")
        if self.task is None and not self.train_files:
            raise ConfigError(f"train_files must name prompt files when task is null, got {self.train_files!r}")
        for key, what in (("kl_coef", "reference policy"), ("router_align_coef", "router logits")):
            if getattr(self.loss, key) != 0:
                raise ConfigError(f"loss.{key}: the GRPO loop has no {what} to give rl_loss; must be 0 here, "
                                  f"got {getattr(self.loss, key)!r}")
        if self.exact and self.server_dtype != self.train_dtype:
            raise ConfigError(f"server_dtype: exact mode needs the trainer's dtype on the servers (train_dtype "
                              f"{self.train_dtype}), got {self.server_dtype!r}")
        choice("quantization", QUANTIZATIONS, or_none=True, why="null: full precision")
        if "--quantization" in self.server_flags:
            raise ConfigError("server_flags: give the servers' quantization as the quantization key (the trainer "
                              "must know it), not --quantization")
        if self.exact:
            _check_exact_model(self.model_path, self.quantization)

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


def _check_exact_model(model_path: str, quantization: Optional[str]) -> None:
    """exact: true needs a full-precision checkpoint whose architecture exact mode matches bit for
    bit (with the servers' quantization); refused here, before any server starts (the trainer would
    refuse it only after they are up)."""
    from .exact_fp8 import EXACT_FP8_UNSUPPORTED
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
    if cfg.get("quantization_config"):
        raise ConfigError(f"exact: exact mode trains a full-precision checkpoint; {model_path!r} is quantized "
                          f"({cfg['quantization_config'].get('quant_method')!r}): quantization: fp8 rolls out in "
                          "FP8 from a full-precision one")
    if quantization == "fp8" and archs[0] in EXACT_FP8_UNSUPPORTED:
        raise ConfigError(f"quantization: exact mode with FP8 rollouts does not support {archs[0]} (its expert "
                          "layout); exact: false trains it against FP8 rollouts with router replay")


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
