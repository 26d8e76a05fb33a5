"""GRPO with rollout routing replay: ``python -m trainer_bridge.train --config configs/train/tiny.yaml``.

One step: sample ``samples_per_prompt`` responses for each of ``prompts_per_step`` prompts from the
rollout servers (``RolloutClient``: token ids in, routing ``[T-1, L, K]`` out), reward them, compute
group-normalised advantages, train the trainer's copy of the model (transformers'
``AutoModelForCausalLM`` from the same checkpoint, wrapped by ``deepspeed.initialize`` with a torch
AdamW and the configured ZeRO stage) with the PPO-clip loss under ``RouterReplay(mode="replay")``,
then push the new weights to every server (``weight_sync``); the next rollouts carry the new
``weight_version``.

Metrics per step (wandb, offline by default, and printed): routing mismatch rate (share of
token x MoE-layer rows where the experts the trainer's forward *used* differ from the rollout's;
read from the expert modules' inputs, so 0 under replay is measured, not assumed), replay replace
rate (the trainer router's own top-k vs the replayed set), train/rollout log-prob abs diff, k3 KL,
F(tau=2), reward mean, response length; with ``compare_no_replay`` the same agreement metrics of a
live-routing forward over the same rollouts at the same weights (``no_replay/...``); and the
held-out reward (greedy) every ``eval_every`` steps.

With ``exact: true`` (configs/train/exact.yaml) the servers run deterministic inference and the
trainer exact mode (``trainer_bridge.exact_model``); each step's line then shows ``max|dlp|`` and
the mismatch rates as exact numbers, all ``0``.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from .client import RolloutClient
from .data import PromptStream, load_prompts, write_task_files
from .launch import LocalServers
from .losses import grpo_advantages
from .metrics import step_metrics
from .policy_trainer import PolicyTrainer
from .sample import Sample
from .step_report import step_header, step_line, step_table
from .train_config import TrainConfig, load_train_config
from .weight_sync import make_weight_sync

__all__ = ["PolicyTrainer", "TrainResult", "Hooks", "run", "run_async", "main", "load_reward"]

_HEADER_EVERY = 20   # steps between repeats of the step rows' header


# ---- reward ------------------------------------------------------------------------------------
def load_reward(spec: str) -> Callable[[str, dict], float]:
    """``"module:function"`` -> the callable ``f(response_text, record) -> float``."""
    mod, _, fn = spec.partition(":")
    try:
        f = getattr(importlib.import_module(mod), fn)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"reward: cannot load {spec!r}: {exc}") from None
    if not callable(f):
        raise ValueError(f"reward: {spec!r} is not callable")
    return f


# ---- the loop ----------------------------------------------------------------------------------
@dataclass
class Hooks:
    """Test/diagnostic callbacks: ``on_sample(step, sample)`` as each rollout arrives,
    ``on_step(step, metrics)`` after each step."""
    on_sample: Optional[Callable[[int, Sample], None]] = None
    on_step: Optional[Callable[[int, dict], None]] = None


@dataclass
class TrainResult:
    """What a run returns: one row of scalar metrics per step (``history``, also in metrics.jsonl),
    the held-out rewards, the servers' loads, and the samples of the last ``keep_samples`` steps
    only (``samples_per_step``, oldest first; none by default).

    NOTE: a step's samples carry their routing ([T-1, layers, top_k] per sample), so keeping every
    step's would grow a long run's memory without bound; ``Hooks.on_sample`` sees every sample."""
    history: list[dict] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)  # (step, held-out reward mean)
    keep_samples: int = 0
    samples_per_step: deque = field(init=False)   # deque[list[Sample]], at most keep_samples
    client_loads: dict = field(default_factory=dict)
    wall_s: float = 0.0

    def __post_init__(self):
        if self.keep_samples < 0:
            raise ValueError(f"keep_samples: must be >= 0, got {self.keep_samples}")
        self.samples_per_step = deque(maxlen=self.keep_samples)

    def summary(self) -> dict:
        def mean(key, rows=None):
            vals = [h[key] for h in (rows or self.history) if key in h and h[key] is not None]
            return sum(vals) / len(vals) if vals else float("nan")
        out = {"steps": len(self.history), "wall_s": self.wall_s}
        if self.evals:
            out["eval_reward_first"] = self.evals[0][1]
            out["eval_reward_last"] = self.evals[-1][1]
        out["max/train_rollout_logprob_max_abs_diff"] = max(
            (h["train_rollout_logprob_max_abs_diff"] for h in self.history), default=float("nan"))
        for k in ("reward_mean", "routing_mismatch_rate", "no_replay/routing_mismatch_rate",
                  "train_rollout_logprob_abs_diff", "no_replay/train_rollout_logprob_abs_diff", "k3_kl",
                  "no_replay/k3_kl", "f_tau2", "no_replay/f_tau2", "rollout_s", "train_s", "sync_s",
                  "bytes_per_sample"):
            out[f"mean/{k}"] = mean(k)
        return out


class _Wandb:
    def __init__(self, config: TrainConfig):
        self.run = None
        if config.wandb_mode == "disabled":
            return
        try:
            import wandb
        except ImportError:
            return
        os.environ.setdefault("WANDB_SILENT", "true")
        os.environ.setdefault("WANDB_CONSOLE", "off")
        self.run = wandb.init(project=config.wandb_project, mode=config.wandb_mode, dir=config.run_dir,
                              config=config.to_dict(), reinit="finish_previous")

    def where(self, config: TrainConfig) -> str:
        """Where this run's wandb data goes, for the start of the printout."""
        if self.run is None:
            why = "disabled" if config.wandb_mode == "disabled" else "not installed"
            return f"wandb: {why} (every step's metrics are in run_dir/metrics.jsonl)"
        if config.wandb_mode == "offline":
            path = Path(self.run.dir).parent
            return f"wandb: offline run {path} (`wandb sync` it to upload)"
        return f"wandb: {self.run.url or self.run.dir}"

    def log(self, metrics: dict, step: int) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)

    def finish(self, summary: dict, exit_code: int = 0) -> None:
        if self.run is not None:
            for k, v in summary.items():
                self.run.summary[k] = v
            self.run.finish(exit_code=exit_code)
            self.run = None


def _server_flags(config: TrainConfig) -> list[str]:
    return ["--model-path", config.model_path, "--enable-return-routed-experts", "--dtype", config.server_dtype,
            "--weight-version", "0", "--kv-cache-bytes", str(config.server_kv_cache_bytes),
            "--allowed-weight-dirs", str(Path(config.resolved_sync_dir).resolve()), "--seed", str(config.seed),
            "--log-level", "warning",
            *(["--api-key", config.api_key] if config.api_key else []),
            *(["--admin-api-key", config.admin_api_key] if config.admin_api_key else []),
            *(["--enable-deterministic-inference"] if config.exact else []),
            *(["--quantization", config.quantization] if config.quantization else []),
            *config.server_flags]


def _quiet_libraries() -> None:
    """Only the loop's own progress bar: no per-load bars from datasets / transformers."""
    with contextlib.suppress(Exception):
        import datasets
        datasets.disable_progress_bars()
    with contextlib.suppress(Exception):
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()


async def _evaluate(client: RolloutClient, prompts: list[list[int]], records: list[dict], reward_fn, decode,
                    config: TrainConfig, tag: str) -> float:
    if not prompts:
        return float("nan")
    samples = await client.generate_groups(prompts, 1, {"temperature": 0.0, "max_new_tokens":
                                                        config.eval_max_new_tokens}, rid_prefix=f"eval-{tag}-")
    return sum(reward_fn(decode(s.response_ids.tolist()), r) for s, r in zip(samples, records)) / len(samples)


async def run_async(config: TrainConfig, *, hooks: Optional[Hooks] = None, servers: Optional[LocalServers] = None,
                    log: Callable[[str], None] = print, keep_samples: int = 0) -> TrainResult:
    """The GRPO loop; ``servers`` (already started) are used when given, else ``config.server_urls``,
    else ``config.num_servers`` local servers are started (and stopped at the end). The result
    keeps the samples of the last ``keep_samples`` steps (TrainResult)."""
    hooks = hooks or Hooks()
    t_start = time.perf_counter()
    _quiet_libraries()
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(config.to_dict(), indent=2, default=str))
    (run_dir / "metrics.jsonl").write_text("")  # one run per run_dir: start the file afresh
    log(f"run directory: {run_dir.resolve()} (config.json, metrics.jsonl, summary.json, server-logs/)")
    wb = _Wandb(config)
    log(wb.where(config))
    try:
        return await _run(config, hooks, servers, log, wb, run_dir, t_start, keep_samples)
    except BaseException:
        wb.finish({}, exit_code=1)
        raise


async def _run(config: TrainConfig, hooks: Hooks, servers: Optional[LocalServers], log: Callable[[str], None],
               wb: _Wandb, run_dir: Path, t_start: float, keep_samples: int) -> TrainResult:
    from transformers import AutoTokenizer
    from tqdm.auto import tqdm

    torch.manual_seed(config.seed)
    tok = AutoTokenizer.from_pretrained(config.model_path)
    eos_id = tok.eos_token_id
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    reward_fn = load_reward(config.reward)

    # data
    if config.task == "arithmetic" and not config.train_files:
        train_files, eval_files = write_task_files(run_dir / "data", seed=config.seed,
                                                   num_train=config.num_train_prompts,
                                                   num_eval=max(config.num_eval_prompts, 1))
        train_files, eval_files = [str(train_files)], [str(eval_files)]
    else:
        train_files, eval_files = list(config.train_files), list(config.eval_files)
    cache = str(run_dir / "datasets-cache")
    stream = PromptStream(load_prompts(train_files, prompt_key=config.prompt_key, cache_dir=cache), seed=config.seed)
    eval_records = []
    if eval_files and config.num_eval_prompts:
        eval_records = [dict(r) for r in load_prompts(eval_files, prompt_key=config.prompt_key, cache_dir=cache)]
        eval_records = eval_records[:config.num_eval_prompts]
    encode = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    eval_prompts = [encode(r[config.prompt_key]) for r in eval_records]

    own_servers = None
    if servers is None and not config.server_urls:
        Path(config.resolved_sync_dir).mkdir(parents=True, exist_ok=True)
        log(f"starting {config.num_servers} rollout-serve process(es) ({config.server_dtype}) ...")
        own_servers = servers = await asyncio.to_thread(
            LocalServers(config.num_servers, _server_flags(config), log_dir=str(run_dir / "server-logs"),
                         progress=log).start)
    urls = servers.urls if servers is not None else list(config.server_urls)
    result = TrainResult(keep_samples=keep_samples)
    try:
        client = RolloutClient(urls, api_key=config.api_key, admin_api_key=config.admin_api_key,
                               routing_format=config.routing_format, stream=config.stream)
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(client)
            log(f"servers: {', '.join(urls)}; model {client.info.architecture}: {client.info.num_layers} layers, "
                f"{client.info.num_experts} experts, top-{client.info.top_k}")
            log(f"loading the trainer's model from {config.model_path} (DeepSpeed ZeRO-{config.zero_stage}"
                f"{', exact mode' if config.exact else ''}) ...")
            t0 = time.perf_counter()
            trainer = await asyncio.to_thread(PolicyTrainer, config, eos_id=eos_id)
            n_params = sum(p.numel() for p in trainer.model.parameters())
            log(f"trainer ready in {time.perf_counter() - t0:.1f}s: {n_params / 1e6:.2f}M parameters")
            sync = make_weight_sync(config.weight_sync, client, sync_dir=config.resolved_sync_dir)
            stack.push_async_callback(sync.close)  # NOTE: before the client closes (LIFO)
            version = 0
            # NOTE: servers started by this loop begin at weight_version "0"; ones we connect to are
            # brought in line by pushing the trainer's (identical) weights first. A bf16 trainer
            # pushes too: the servers keep some tensors in fp32 (sigmoid routers' gates, gpt-oss's
            # sinks) unrounded from an fp32 checkpoint, while DeepSpeed's module holds them in bf16.
            if own_servers is None or config.train_dtype != "float32":
                log(f"pushing the trainer's weights to {len(urls)} server(s) (weight_sync={config.weight_sync}) ...")
                await sync.push(trainer.named_weights(), str(version))
            if eval_prompts:
                log(f"evaluating {len(eval_prompts)} held-out prompts (greedy) ...")
            eval_reward = await _evaluate(client, eval_prompts, eval_records, reward_fn, decode, config, "0")
            result.evals.append((0, eval_reward))
            log(f"held-out reward before training: {eval_reward:.3f} ({len(eval_prompts)} prompts, greedy)")
            # NOTE: disable=None: the bar only on a terminal; the per-step lines are printed either way
            bar = tqdm(range(1, config.steps + 1), desc="GRPO", disable=None if config.progress else True,
                       dynamic_ncols=True, file=sys.stdout)
            for step in bar:
                rec: dict[str, Any] = {"step": step}
                # rollout
                t0 = time.perf_counter()
                records = stream.next_batch(config.prompts_per_step)
                prompts = [encode(r[config.prompt_key]) for r in records]
                on_sample = (lambda s, step=step: hooks.on_sample(step, s)) if hooks.on_sample else None
                samples = await client.generate_groups(
                    prompts, config.samples_per_prompt,
                    {"temperature": config.temperature, "top_p": config.top_p,
                     "max_new_tokens": config.max_new_tokens},
                    group_ids=[f"{step}-{i}" for i in range(len(prompts))], seed=config.seed * 100_003 + step,
                    rid_prefix=f"s{step}-", metas=[{"record": r} for r in records], on_sample=on_sample)
                rec["rollout_s"] = time.perf_counter() - t0
                current = [s.version_mask(version) for s in samples]
                stale = sum(int(len(m) - m.sum()) for m in current)
                if stale and config.stale_tokens == "error":
                    versions = sorted({str(v) for s in samples for v, _ in s.version_spans} - {str(version)})
                    raise RuntimeError(f"step {step}: {stale} response tokens were sampled by weight_version "
                                       f"{versions}, expected {version!r} (stale_tokens: mask leaves them out)")
                for s, m in zip(samples, current):
                    s.loss_mask = s.loss_mask * m
                rec["stale_tokens"] = stale
                rec["weight_version"] = str(version)
                for s in samples:
                    s.reward = float(reward_fn(decode(s.response_ids.tolist()), s.meta["record"]))
                adv = grpo_advantages([s.reward for s in samples], [s.group_id for s in samples])
                rec["bytes_per_sample"] = sum(s.meta["wire_bytes"] for s in samples) / len(samples)
                rec["routing_bytes_per_sample"] = sum(s.meta["routing_bytes"] for s in samples) / len(samples)
                rec["retried_samples"] = sum(1 for s in samples if s.meta["attempts"] > 1)
                rec.update(step_metrics(samples=samples))
                rec["zero_adv_groups"] = float((adv.abs() < 1e-8).float().mean())
                # train
                t0 = time.perf_counter()
                rec.update(await asyncio.to_thread(trainer.train_step, samples, adv))
                rec["train_total_s"] = time.perf_counter() - t0
                # sync
                version += 1
                res = await sync.push(trainer.named_weights(), str(version))
                rec["sync_s"], rec["sync_bytes"] = res.seconds, res.bytes
                rec["servers_alive"] = len(client.alive_urls)
                if config.num_eval_prompts and ((config.eval_every and step % config.eval_every == 0)
                                                or step == config.steps):
                    t0 = time.perf_counter()
                    rec["eval_reward"] = await _evaluate(client, eval_prompts, eval_records, reward_fn, decode,
                                                         config, str(step))
                    rec["eval_s"] = time.perf_counter() - t0
                    result.evals.append((step, rec["eval_reward"]))
                result.history.append(rec)
                result.samples_per_step.append(samples)
                wb.log(rec, step)
                with open(run_dir / "metrics.jsonl", "a") as f:
                    f.write(json.dumps({k: v for k, v in rec.items()}, default=str) + "\n")
                bar.set_postfix(reward=f"{rec['reward_mean']:.3f}", mismatch=f"{rec['routing_mismatch_rate']:.3f}",
                                refresh=False)
                lines = [step_line(rec, exact=config.exact)]
                if (step - 1) % _HEADER_EVERY == 0:
                    lines.insert(0, step_header(rec, exact=config.exact))
                for line in lines:
                    if config.progress:
                        tqdm.write(line, file=sys.stdout)
                    else:
                        log(line)
                if hooks.on_step:
                    hooks.on_step(step, rec)
            bar.close()
            result.client_loads = client.loads()
    finally:
        if own_servers is not None:
            await asyncio.to_thread(own_servers.close)
    result.wall_s = time.perf_counter() - t_start
    summary = result.summary()
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    wb.finish(summary)
    log("\n" + step_table(result.history, exact=config.exact))
    if result.evals:
        log("held-out reward (greedy): " + ", ".join(f"step {s}: {r:.3f}" for s, r in result.evals))
    log("client per-server: " + "; ".join(f"{u}: {d['completed']} done, {d['failures']} failed, "
                                            f"alive={d['alive']}" for u, d in result.client_loads.items()))
    log(f"wall time {result.wall_s:.1f}s")
    return result


def run(config: TrainConfig, **kw) -> TrainResult:
    return asyncio.run(run_async(config, **kw))


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .config_keys import keys_help

    ap = argparse.ArgumentParser(prog="python -m trainer_bridge.train", description=__doc__.split("\n\n")[0],
                                 epilog=keys_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="YAML file (e.g. configs/train/tiny.yaml)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key (repeatable), e.g. --set steps=5 --set loss.clip_eps=0.3")
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        config = load_train_config(args.config, args.overrides)
    except ValueError as exc:
        ap.error(str(exc))
    run(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
