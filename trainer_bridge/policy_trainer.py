"""``PolicyTrainer``: the trainer's copy of the model under DeepSpeed, one GRPO update per call.

The model is transformers' ``AutoModelForCausalLM`` from the rollout checkpoint (fp32), wrapped by
``deepspeed.initialize`` with a torch AdamW and the configured ZeRO stage (0-2; gloo on CPU,
NCCL where a GPU is present). ``train_step(samples, advantages)`` packs the samples into
micro-batches (``pack_samples``: tokens and routing through one index map), runs each under
``RouterReplay(mode="replay")`` with the rollout's experts, accumulates gradients (loss
normalised by the step's loss-token count) and takes one optimizer step. It measures, on the same
micro-batches: the experts each forward really used (``UsedExperts``, read from the expert
modules' inputs) against the rollout's, the trainer router's own top-k (replay replace rate),
and, with ``compare_no_replay``, a live-routing forward at the same weights. With ``exact`` the
model computes as the engine's deterministic mode (``trainer_bridge.exact_model``).

``train_dtype: bfloat16`` is DeepSpeed's bf16 mode (``bf16: {enabled: true}``): the module's
parameters are cast to bf16 and the forward and backward run in bf16, while the optimizer keeps
fp32 master weights (ZeRO-1/2's fp32 partitions; at stage 0 the fp32 copies of DeepSpeed's unfused
optimizer wrapper) and writes their bf16 rounding back into the module after each step. Buffers
stay as loaded (DeepSeek's fp32 ``e_score_correction_bias``). ``named_weights`` are then the bf16
parameters, the weights the forward computes with, and weight sync pushes exactly those.
"""
from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import time
from typing import Optional, Sequence

import torch

from .exact_fp8 import make_trainer_fp8
from .exact_model import make_trainer_exact
from .losses import rl_loss, token_logprobs
from .metrics import step_metrics
from .packing import enable_packed_masks, pack_samples
from .router_replay import RouterReplay
from .sample import Sample
from .train_config import TrainConfig

__all__ = ["PolicyTrainer", "UsedExperts", "init_deepspeed_cpu"]

_EXPERTS_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


# ---- the experts each forward actually used ----------------------------------------------------
class UsedExperts:
    """Records the expert ids the MoE blocks' expert modules receive (transformers 5.x ``*Experts``
    modules take ``(hidden_states, top_k_index, top_k_weights)``), per layer: the routing a forward
    really used, whatever produced it."""

    def __init__(self, model: torch.nn.Module, num_layers: int):
        self.num_layers = num_layers
        self.modules = {}
        for name, m in model.named_modules():
            mt = _EXPERTS_LAYER.search(name + ".")
            if mt and type(m).__name__.endswith("Experts") and name.endswith("experts"):
                self.modules[int(mt.group(1))] = m
        self.ids: dict[int, torch.Tensor] = {}

    @property
    def available(self) -> bool:
        return bool(self.modules)

    @contextlib.contextmanager
    def capture(self):
        self.ids = {}
        handles = []
        for layer, m in self.modules.items():
            def hook(mod, args, layer=layer):
                if len(args) >= 2 and torch.is_tensor(args[1]):
                    self.ids.setdefault(layer, args[1].detach())  # [num_tokens, top_k]
            handles.append(m.register_forward_pre_hook(hook))
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def stacked(self, top_k: int) -> torch.Tensor:
        """``[num_tokens, num_layers, top_k]`` int32 (-1 for layers without experts)."""
        n = next(iter(self.ids.values())).shape[0]
        out = torch.full((n, self.num_layers, top_k), -1, dtype=torch.int32)
        for layer, ids in self.ids.items():
            out[:, layer] = ids.to(torch.int32).cpu()
        return out


# ---- the trainer -------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_deepspeed_cpu():
    """Import deepspeed for a single-process run (gloo on CPU), creating the default group once."""
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    # NOTE: DeepSpeed's CPU shared-memory all-reduce op is JIT-compiled on first use (~50 s); a
    # single rank never all-reduces across processes, so skip building it.
    comm_torch = sys.modules.get("deepspeed.comm.torch")
    if comm_torch is not None and hasattr(comm_torch, "build_shm_op"):
        comm_torch.build_shm_op = lambda: None
    if not torch.distributed.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    return deepspeed


class PolicyTrainer:
    """The trainer's model under DeepSpeed; ``train_step(samples, advantages)`` does one update."""

    def __init__(self, config: TrainConfig, *, eos_id: int, model=None):
        from transformers import AutoModelForCausalLM

        self.config = config
        self.eos_id = eos_id
        deepspeed = init_deepspeed_cpu()
        torch.manual_seed(config.seed)
        if model is None:
            model = AutoModelForCausalLM.from_pretrained(config.model_path, dtype=torch.float32)
        model.config.use_cache = False
        if config.exact:
            make_trainer_exact(model)           # NOTE: its attention separates packed samples itself
            if config.quantization == "fp8":
                make_trainer_fp8(model)         # the FP8 weights the servers compute with
        else:
            enable_packed_masks(model)
        model.train()
        self.num_layers = int(model.config.num_hidden_layers)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=config.lr, betas=tuple(config.adam_betas),
                                weight_decay=config.weight_decay)
        ds_config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": float(config.grad_clip),
            "zero_optimization": {"stage": config.zero_stage, "overlap_comm": False, "contiguous_gradients": False,
                                  "reduce_scatter": False},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**31 - 1,
            "wall_clock_breakdown": False,
        }
        if config.train_dtype == "bfloat16":
            ds_config["bf16"] = {"enabled": True}
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
        self.model = self.engine.module
        self.device = next(self.model.parameters()).device  # deepspeed moved it to the accelerator
        probe = RouterReplay(self.model, mode="record")
        self.top_k, self.num_experts, self.moe_layers = probe.top_k, probe.num_experts, probe.moe_layers
        self.used = UsedExperts(self.model, self.num_layers)
        self.updates = 0

    def named_weights(self) -> dict[str, torch.Tensor]:
        """HF-named full weights (ZeRO stages 0-2 keep full parameters on every rank)."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def _forward(self, mb, *, replay: bool):
        """Forward over a packed micro-batch; returns (logits, used ids, live ids, the RouterReplay)."""
        mode = "replay" if replay else "record"
        kw = {"routed_experts": mb.routed_experts, "validate": False} if replay else {}
        rr = RouterReplay(self.model, mode=mode, **kw)
        with rr, self.used.capture():
            logits = self.engine(**mb.model_inputs()).logits
        used = self.used.stacked(self.top_k) if self.used.available else rr.routed_experts().cpu()
        return logits, used, rr.live_experts().cpu(), rr

    def train_step(self, samples: Sequence[Sample], advantages: torch.Tensor, *, replay: Optional[bool] = None,
                   compare_no_replay: Optional[bool] = None, record_routing: bool = True) -> dict:
        """One optimizer step over ``samples`` (packed into micro-batches of ``micro_batch_tokens``,
        gradients accumulated, loss normalised by the step's loss-token count).

        ``replay`` (default: the config's ``router_replay``): the MoE blocks use the rollout's
        experts; else live routing. ``record_routing=False`` skips the routing measurements (no
        hooks at all without replay: the plain model, for benchmarks)."""
        cfg = self.config
        compare = cfg.compare_no_replay if compare_no_replay is None else compare_no_replay
        replay = cfg.router_replay if replay is None else replay
        loss_cfg = cfg.loss_config
        batches = pack_samples(samples, max_tokens=cfg.micro_batch_tokens, pad_token_id=self.eos_id,
                               moe_layers=self.moe_layers)
        normalizer = float(sum(float(mb.loss_mask.sum()) for mb in batches)) or 1.0
        acc = {k: [] for k in ("lp", "rlp", "mask", "used", "live", "rollout", "rmask", "nr_lp", "nr_live")}
        stats_sum: dict[str, float] = {}
        t_compare = 0.0
        t0 = time.perf_counter()
        self.engine.train()
        advantages = torch.as_tensor(advantages, dtype=torch.float32).to(self.device)
        for i, mb_cpu in enumerate(batches):
            mb = mb_cpu.to(self.device)  # NOTE: metrics read mb_cpu; forward and loss use mb
            if compare:
                tc = time.perf_counter()
                with torch.no_grad():
                    logits_nr, used_nr, _, _ = self._forward(mb, replay=False)
                    acc["nr_lp"].append(token_logprobs(logits_nr, mb.target_ids, loss_cfg.temperature).cpu())
                    acc["nr_live"].append(used_nr)
                    del logits_nr
                t_compare += time.perf_counter() - tc
            self.engine.set_gradient_accumulation_boundary(i == len(batches) - 1)
            if replay:
                rr = RouterReplay(self.model, mode="replay", routed_experts=mb.routed_experts, validate=False)
            else:
                rr = RouterReplay(self.model, mode="record" if record_routing else "off")
            capture = self.used.capture() if record_routing else contextlib.nullcontext()
            with rr, capture:
                logits = self.engine(**mb.model_inputs()).logits
                loss, stats = rl_loss(loss_cfg, logits=logits, batch=mb, advantages=advantages,
                                      normalizer=normalizer)
                self.engine.backward(loss)
            acc["lp"].append(stats.pop("logprobs").cpu())
            acc["rlp"].append(mb_cpu.rollout_logprobs)
            acc["mask"].append(mb_cpu.loss_mask)
            acc["rollout"].append(mb_cpu.routed_experts)
            acc["rmask"].append(mb_cpu.routing_mask.reshape(-1))
            if record_routing:
                acc["used"].append(self.used.stacked(self.top_k) if self.used.available
                                   else rr.routed_experts().cpu())
                acc["live"].append(rr.live_experts().cpu())
            w = float(mb_cpu.loss_mask.sum()) / normalizer
            for k, v in stats.items():
                stats_sum[k] = stats_sum.get(k, 0.0) + float(v) * w
            del logits, loss
        self.engine.step()
        self.updates += 1
        train_s = time.perf_counter() - t0
        cat = {k: torch.cat([x.reshape(-1) if x.ndim <= 2 else x for x in v], dim=0) if v else None
               for k, v in acc.items()}
        m = step_metrics(train_logprobs=cat["lp"], rollout_logprobs=cat["rlp"], loss_mask=cat["mask"],
                         live_experts=cat["used"], replayed_experts=cat["rollout"] if record_routing else None,
                         routing_mask=cat["rmask"])
        if replay and record_routing:
            m["replay_replace_rate"] = step_metrics(live_experts=cat["live"], replayed_experts=cat["rollout"],
                                                    routing_mask=cat["rmask"])["routing_mismatch_rate"]
        if compare:
            nr = step_metrics(train_logprobs=cat["nr_lp"], rollout_logprobs=cat["rlp"], loss_mask=cat["mask"],
                              live_experts=cat["nr_live"], replayed_experts=cat["rollout"],
                              routing_mask=cat["rmask"])
            m.update({f"no_replay/{k}": v for k, v in nr.items()})
        m.update(stats_sum)
        m.update(train_s=train_s - t_compare, compare_s=t_compare, micro_batches=len(batches),
                 train_tokens=int(sum(mb.num_tokens for mb in batches)), loss_tokens=int(normalizer))
        return m
