"""EngineConfig: the frozen settings an engine is built from; derived values are properties.

The fields are the one list of engine settings: each carries its `rollout-serve` flag in its
metadata (rollout/config/flag.py), from which the CLI, ServerArgs and `--flags` are generated
(rollout/config/engine_cli.py)."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from capture.buffer_sizing import ForwardShapeLimits
from rollout.config.backends import ATTENTION_BACKENDS, MOE_BACKENDS, QUANTIZATIONS, check_attention_backend, default_attention_backend
from rollout.config.flag import flag
from rollout.config.speculative import DEFAULT_NUM_DRAFT_TOKENS, check_speculative, num_draft_tokens
from rollout.value_range import check_choice, check_host_port, check_range

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_MODEL_PATH = os.path.join(_REPO, "configs", "tiny-moe")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# SGLang's --schedule-policy names this engine runs (rollout/core/schedule_policy.py); SGLang's
# dfs-weight, priority and routing-key are not among them
SCHEDULE_POLICIES = ("fcfs", "lpm", "lof", "random")
UNSUPPORTED_SCHEDULE_POLICIES = "SGLang's dfs-weight, priority and routing-key are not supported"


MAX_BUCKET_BYTES = 2**40
DEFAULT_KV_CACHE_BYTES = 512 * 2**20
DEFAULT_DIST_TIMEOUT_S = 300
MAX_NODES = 1 << 12
MAX_COMPILE_BS = 1 << 16


def _int_tuple(name: str, value: Any, *, minimum: int = 1) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} must be a list of integers >= {minimum}, got {value!r}")
    out = tuple(value)
    for v in out:
        check_range(name, v, minimum, integer=True)
    if len(set(out)) != len(out):
        raise ValueError(f"{name} must not repeat values, got {list(out)}")
    return tuple(sorted(out))


def sglang_cuda_graph_sizes(max_bs: int, speculative: bool, padding: bool = True) -> tuple[int, ...]:
    """The decode batch sizes SGLang captures CUDA graphs for up to max_bs (its --cuda-graph-max-bs):
    every size without padding; denser small sizes with speculative decoding."""
    if not padding:
        sizes = list(range(1, max_bs + 1))
    elif speculative:
        sizes = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, 257, 8), *range(272, max_bs + 1, 16)]
    else:
        sizes = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, max_bs + 1, 32)]
    return tuple(s for s in sizes if s <= max_bs)


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    model_path: str = field(default=DEFAULT_MODEL_PATH, metadata=flag(
        help="checkpoint directory (config.json, safetensors weights, tokenizer.json); weights are never "
             "downloaded", default_text="the embedded tiny MoE model"))
    tokenizer_path: Optional[str] = field(default=None, metadata=flag(
        help="tokenizer directory", default_text="the model path"))
    dtype: str = field(default="auto", metadata=flag(
        choices=DTYPES, help="weights and activations dtype; auto: the checkpoint's torch_dtype, else float32"))
    # "fp8": quantize a float checkpoint's linear and expert weights on load and on every weight
    # update (rollout/models/quant/fp8.py); FP8 checkpoints are held in FP8 without it
    quantization: Optional[str] = field(default=None, metadata=flag(
        choices=QUANTIZATIONS, help="fp8: hold a float checkpoint's weights in FP8 (quantized on load and on "
                                    "every weight update); FP8 checkpoints load as FP8 without it",
        default_text="the checkpoint's own format"))
    device: str = field(default="cpu", metadata=flag(help="cpu or cuda[:N]"))
    max_running_requests: int = field(default=128, metadata=flag(
        type=int, help="requests an engine rank runs at once; the rest wait in its queue"))
    # tokens per prefill forward; None (or, as in SGLang, any value <= 0) = whole prompts
    chunked_prefill_size: Optional[int] = field(default=1024, metadata=flag(
        type=int, none_at_most=0, none_spelling="-1", help="tokens per prefill forward; -1 or 0 = whole prompts"))
    # KV slots; default from kv_cache_bytes or mem_fraction_static
    max_total_tokens: Optional[int] = field(default=None, metadata=flag(
        type=int, help="KV cache slots (tokens held at once) per engine rank",
        default_text="from --kv-cache-bytes or --mem-fraction-static"))
    # default DEFAULT_KV_CACHE_BYTES when max_total_tokens and mem_fraction_static are unset
    kv_cache_bytes: Optional[int] = field(default=None, metadata=flag(
        type=int, help="KV cache bytes per engine rank when --max-total-tokens is unset",
        default_text="512 MiB, unless --mem-fraction-static"))
    # SGLang's: the share of the device memory free when the engine starts that the weights and the KV
    # cache may take; the KV cache gets what the weights leave (rollout/core/kv_budget.py)
    mem_fraction_static: Optional[float] = field(default=None, metadata=flag(
        type=float, help="the fraction of the memory free at startup (GPU; host memory on CPU, shared "
                         "among the DP ranks) for the weights and the KV cache, which gets the rest (SGLang's "
                         "flag)", default_text="unset: the KV cache is --kv-cache-bytes"))
    # default: the model's max_position_embeddings
    context_length: Optional[int] = field(default=None, metadata=flag(
        type=int, help="longest prompt + output, in tokens", default_text="the model's max_position_embeddings"))
    # SGLang's switch: a prompt + max_new_tokens past context_length runs to the context length
    # instead of being refused (400 "Requested token count exceeds ...")
    allow_auto_truncate: bool = field(default=False, metadata=flag(
        help="let prompt + max_new_tokens exceed the context length (generation stops at it) instead of a 400"))
    enable_prefix_caching: bool = field(default=True, metadata=flag(
        name="--disable-prefix-caching", aliases=("--disable-radix-cache",), negate=True,
        help="turn the prefix (radix) cache off: every prompt is prefilled whole"))
    enable_return_routed_experts: bool = field(default=False, metadata=flag(
        help="capture routed experts so requests may ask for them"))
    decode_graph_batch_sizes: tuple[int, ...] = field(default=(), metadata=flag(
        type=int, aliases=("--cuda-graph-bs",),
        help="decode batch sizes run as static-shape runners (CUDA graphs on a GPU); a step takes the "
             "smallest that fits, larger batches run eagerly", default_text="none: eager decode"))
    # SGLang's other CUDA graph flags, which choose the same decode buckets
    cuda_graph_max_bs: Optional[int] = field(default=None, metadata=flag(
        type=int, help="without --decode-graph-batch-sizes: the decode buckets are SGLang's capture sizes up to "
                       "this (1, 2, 4, 8, 12, then every 8 to 256, every 16 to 512, every 32; with speculative "
                       "decoding 1-8, every 2 to 32, every 4 to 64, every 8 to 256, every 16), at most "
                       "--max-running-requests", default_text="none"))
    disable_cuda_graph_padding: bool = field(default=False, metadata=flag(
        help="with --cuda-graph-max-bs: every batch size from 1 to it is a bucket (no padding)"))
    disable_cuda_graph: bool = field(default=False, metadata=flag(
        help="no decode buckets: every decode step runs eagerly, whatever --decode-graph-batch-sizes or "
             "--cuda-graph-max-bs say"))
    prefill_graph_token_sizes: tuple[int, ...] = field(default=(), metadata=flag(
        type=int, help="prefill token counts run as static-shape piecewise runners; larger prefills run eagerly",
        default_text="none: eager prefill"))
    # torch.compile (SGLang's flags): the decode buckets up to torch_compile_max_bs run an inductor-
    # compiled forward, one specialization per bucket, compiled at startup; attention and the MoE
    # layers run inside it as opaque ops (rollout/models/opaque_step.py, rollout/exec/runners/compiled_backend.py)
    enable_torch_compile: bool = field(default=False, metadata=flag(
        help="compile the decode buckets' forward with torch.compile (inductor), one graph per bucket, at startup "
             "(without --decode-graph-batch-sizes: the powers of two up to --torch-compile-max-bs)"))
    torch_compile_max_bs: int = field(default=32, metadata=flag(
        type=int, help="--enable-torch-compile: the largest decode bucket compiled; larger buckets run as without it"))
    # the overlap schedule (SGLang's overlap scheduler): the next step is scheduled and the last
    # one's outputs processed while the forward runs on a thread of its own (rollout/core/forward_worker.py)
    enable_overlap_schedule: bool = field(default=False, metadata=flag(
        off_aliases=("--disable-overlap-schedule",),
        help="schedule the next step and process the last one's outputs while the forward runs (a forward "
             "thread); tokens and routing are the sequential loop's (bitwise with deterministic inference)"))
    dp_size: int = field(default=1, metadata=flag(
        type=int, aliases=("--data-parallel-size",),
        help="data-parallel engine ranks, one process each (on CUDA one GPU each), the routed experts "
             "sharded among them"))
    # many nodes (SGLang's flags): one server's dp_size ranks spread evenly over nnodes nodes; node 0
    # runs the HTTP front end and global ranks 0..k-1 (k = dp_size / nnodes), node R ranks R*k..;
    # every rank meets at dist_init_addr, a TCP store node 0 hosts (rollout/ipc/rendezvous.py)
    nnodes: int = field(default=1, metadata=flag(
        type=int, help="nodes one server spans: node 0 serves HTTP and runs its share of the DP ranks, the other "
                       "nodes only theirs (--dp-size counts the ranks of all nodes)"))
    node_rank: int = field(default=0, metadata=flag(
        type=int, help="this node's index, 0 .. nnodes-1 (node 0 serves HTTP)"))
    dist_init_addr: Optional[str] = field(default=None, metadata=flag(
        help="HOST:PORT on node 0 where the nodes meet (node 0 listens there); required when --nnodes > 1",
        default_text="one node: a free loopback port"))
    dist_timeout: int = field(default=DEFAULT_DIST_TIMEOUT_S, metadata=flag(
        type=int, help="seconds every node has to join at startup (a node that has not is a startup error naming "
                       "it)"))
    # CPU engines: torch intra-op threads of each engine process; None = the CPUs this process may
    # run on, shared out among the DP ranks (resolved_cpu_threads). Leave cores to the front end
    # and the caller's own work on small hosts (docs/architecture.md).
    cpu_threads: Optional[int] = field(default=None, metadata=flag(
        type=int, help="CPU device: torch threads per engine process", default_text="the usable CPUs / dp-size"))
    # CPU engines: threads given up in a forward that runs while the front end turns the previous
    # step's stream deltas into chunks, so that the two do not contend for a core
    # (rollout/core/cpu_threads.py). Off by default: a forward's float results depend on its thread
    # count, so with it a request's logprobs differ in the last bits between streamed and
    # non-streamed runs.
    cpu_reserve: int = field(default=0, metadata=flag(
        type=int, help="CPU device: threads an engine leaves to the front end while requests stream"))
    # CPUs (Linux CPU ids) the engine processes run on, shared out among the DP ranks in equal
    # contiguous parts (rank r runs on the r-th part); () = wherever the launching process may run.
    # With it, cpu_threads defaults to a rank's part. A caller that keeps its own work off these
    # CPUs (os.sched_setaffinity, taskset) no longer preempts the engine's threads
    # (docs/architecture.md; vLLM's CPU backend binds its threads likewise).
    cpu_affinity: tuple[int, ...] = field(default=(), metadata=flag(
        type=int, help="CPU ids the engine processes run on, split evenly among the DP ranks", default_text="any"))
    # NOTE: a device budget for the routed-expert capture buffer; a config whose forwards need more
    # rows (capture_buffer_rows) is rejected at startup, naming the values. None = no cap.
    max_capture_buffer_rows: Optional[int] = field(default=None, metadata=flag(
        type=int, help="refuse configs whose routed-expert capture buffer needs more rows", default_text="no cap"))
    # one torch.profiler trace per captured shape
    enable_profile_graph_capture: bool = field(default=False, metadata=flag(
        help="write one profiler trace per captured graph shape"))
    # default ./graph_capture_profile
    profile_graph_capture_dir: Optional[str] = field(default=None, metadata=flag(
        help="where --enable-profile-graph-capture writes", default_text="./graph_capture_profile"))
    seed: int = field(default=0, metadata=flag(
        type=int, aliases=("--random-seed",), help="seeds the sampling seeds of requests that set no sampling_seed"))
    weight_version: str = field(default="default", metadata=flag(help="initial weight_version label"))
    # distributed weight updates: each engine process receives the trainer's broadcasts into
    # scratch tensors of at most this many bytes at a time (a larger tensor alone) and copies each
    # bucket into its weights before the next (rollout/core/weight_receiver.py)
    weight_update_bucket_bytes: int = field(default=512 * 2**20, metadata=flag(
        type=int, help="distributed weight updates: bytes received per bucket before copying into the weights",
        default_text="512 MiB"))
    # streaming: tokens per chunk unless a request sets it
    stream_interval: int = field(default=1, metadata=flag(
        type=int, help="streaming: tokens per chunk unless a request sets sampling_params.stream_interval"))
    # the order of admission (rollout/core/schedule_policy.py), SGLang's flag and names
    schedule_policy: str = field(default="fcfs", metadata=flag(
        choices=SCHEDULE_POLICIES,
        help="the order in which waiting requests are admitted: fcfs (arrival), lpm (longest cached prefix "
             "first; fcfs beyond 128 waiting), lof (largest max_new_tokens first), random (seeded by --seed)"))
    # router + experts: "torch" | "triton"; None = by device
    moe_backend: Optional[str] = field(default=None, metadata=flag(
        choices=MOE_BACKENDS, help="router and experts kernels", default_text="triton on CUDA, torch on CPU"))
    # attention kernels: "torch", "triton" or "flashinfer"; None = by device (resolved_attention_backend)
    attention_backend: Optional[str] = field(default=None, metadata=flag(
        choices=ATTENTION_BACKENDS, help="attention kernels",
        default_text="flashinfer on CUDA when installed, else triton; torch on CPU"))

    # batch-invariant ops (rollout/exact/): a request's tokens, logprobs and routing rows do not
    # depend on the rest of the batch, chunking, prefix hits or DP rank (docs/architecture.md)
    enable_deterministic_inference: bool = field(default=False, metadata=flag(
        help="batch-invariant kernels: a request's tokens, logprobs and routing do not depend on the batch"))

    # speculative decoding (rollout/config/speculative.py): a draft proposes tokens, one verify
    # forward keeps those equal to the target's own samples, so outputs never change
    speculative_algorithm: Optional[str] = field(default=None, metadata=flag(
        help="NGRAM (drafts looked up in the prompt and output), STANDALONE (a small draft checkpoint) or "
             "NEXTN (the checkpoint's own MTP layers; EAGLE on such a checkpoint means the same); outputs equal "
             "those without it", default_text="off"))
    speculative_num_draft_tokens: Optional[int] = field(default=None, metadata=flag(
        type=int, help="verified positions per request and step: the drafts and the bonus token (SGLang's)",
        default_text=f"{DEFAULT_NUM_DRAFT_TOKENS}, or --speculative-num-steps + 1"))
    speculative_num_steps: Optional[int] = field(default=None, metadata=flag(
        type=int, help="draft tokens per step (chain drafts: --speculative-num-draft-tokens - 1)",
        default_text="--speculative-num-draft-tokens - 1"))
    speculative_eagle_topk: Optional[int] = field(default=None, metadata=flag(
        type=int, help="1 only: chain drafts (tree drafts are not supported)", default_text="1"))
    speculative_draft_model_path: Optional[str] = field(default=None, metadata=flag(
        help="STANDALONE: the draft checkpoint directory (same tokenizer as the target)", default_text="none"))
    speculative_ngram_min_match_window_size: int = field(default=1, metadata=flag(
        type=int, help="NGRAM: the shortest suffix of a request's tokens looked up in its prompt and output"))
    speculative_ngram_max_match_window_size: int = field(default=12, metadata=flag(
        type=int, help="NGRAM: the longest suffix looked up (the longest match wins, then the latest)"))

    def __post_init__(self) -> None:
        if not isinstance(self.model_path, str) or not self.model_path:
            raise ValueError(f"model_path must be a non-empty path, got {self.model_path!r}")
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("quantization", self.quantization, QUANTIZATIONS, or_none=True)
        if not isinstance(self.device, str) or self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        check_range("max_running_requests", self.max_running_requests, 1, integer=True)
        cps = self.chunked_prefill_size
        if isinstance(cps, int) and not isinstance(cps, bool) and cps <= 0:
            object.__setattr__(self, "chunked_prefill_size", None)   # NOTE: SGLang's -1 (any value <= 0): whole prompts
        check_range("chunked_prefill_size", self.chunked_prefill_size, 1, integer=True, or_none=True,
                    allowed="an integer >= 1 (tokens per prefill forward), or None, -1 or 0 (whole prompts)")
        check_range("max_total_tokens", self.max_total_tokens, 2, integer=True, or_none=True)
        check_range("kv_cache_bytes", self.kv_cache_bytes, 1, integer=True, or_none=True)
        check_range("mem_fraction_static", self.mem_fraction_static, 0, 1, lo_open=True, or_none=True)
        if self.mem_fraction_static is not None and self.kv_cache_bytes is not None:
            raise ValueError(f"mem_fraction_static={self.mem_fraction_static} and kv_cache_bytes="
                             f"{self.kv_cache_bytes} both size the KV cache: give one")
        check_range("context_length", self.context_length, 2, integer=True, or_none=True)
        check_range("dp_size", self.dp_size, 1, integer=True)
        check_range("nnodes", self.nnodes, 1, MAX_NODES, integer=True)
        check_range("node_rank", self.node_rank, 0, self.nnodes - 1, integer=True, why=f"nnodes={self.nnodes}")
        check_range("dist_timeout", self.dist_timeout, 1, 86400, integer=True, why="seconds")
        if self.dp_size % self.nnodes:
            raise ValueError(f"dp_size must be a multiple of nnodes (an equal share of DP ranks per node), got "
                             f"dp_size={self.dp_size}, nnodes={self.nnodes}")
        if self.dist_init_addr is not None:
            check_host_port("dist_init_addr", self.dist_init_addr)
        elif self.nnodes > 1:
            raise ValueError(f"dist_init_addr (HOST:PORT on node 0) is required when nnodes > 1, got nnodes="
                             f"{self.nnodes} and dist_init_addr=None")
        check_range("cpu_threads", self.cpu_threads, 1, integer=True, or_none=True)
        check_range("cpu_reserve", self.cpu_reserve, 0, integer=True)
        object.__setattr__(self, "cpu_affinity", _int_tuple("cpu_affinity", self.cpu_affinity, minimum=0))
        if len(self.cpu_affinity) % self.local_dp_size:
            per = f"dp_size={self.dp_size}" if self.nnodes == 1 else f"dp_size/nnodes={self.local_dp_size}"
            raise ValueError(f"cpu_affinity must list a multiple of {per} CPUs (an equal part per DP rank of this "
                             f"node), got {len(self.cpu_affinity)}: {list(self.cpu_affinity)}")
        check_range("max_capture_buffer_rows", self.max_capture_buffer_rows, 1, integer=True, or_none=True)
        if self.profile_graph_capture_dir is not None and (
                not isinstance(self.profile_graph_capture_dir, str) or not self.profile_graph_capture_dir):
            raise ValueError(f"profile_graph_capture_dir must be a non-empty path or None, "
                             f"got {self.profile_graph_capture_dir!r}")
        check_range("seed", self.seed, 0, integer=True)
        check_range("stream_interval", self.stream_interval, 1, integer=True)
        check_choice("schedule_policy", self.schedule_policy, SCHEDULE_POLICIES, why=UNSUPPORTED_SCHEDULE_POLICIES)
        check_range("weight_update_bucket_bytes", self.weight_update_bucket_bytes, 1, MAX_BUCKET_BYTES, integer=True)
        for name in ("enable_prefix_caching", "enable_return_routed_experts", "enable_profile_graph_capture",
                     "enable_deterministic_inference", "allow_auto_truncate", "enable_torch_compile",
                     "enable_overlap_schedule"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        object.__setattr__(self, "decode_graph_batch_sizes",
                           _int_tuple("decode_graph_batch_sizes", self.decode_graph_batch_sizes))
        object.__setattr__(self, "prefill_graph_token_sizes",
                           _int_tuple("prefill_graph_token_sizes", self.prefill_graph_token_sizes))
        check_range("torch_compile_max_bs", self.torch_compile_max_bs, 1, MAX_COMPILE_BS, integer=True)
        check_range("cuda_graph_max_bs", self.cuda_graph_max_bs, 1, MAX_COMPILE_BS, integer=True, or_none=True)
        for name in ("disable_cuda_graph", "disable_cuda_graph_padding"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if self.disable_cuda_graph:
            if self.enable_torch_compile:
                raise ValueError("enable_torch_compile compiles decode buckets and disable_cuda_graph turns them "
                                 "off: turn one of them off")
            object.__setattr__(self, "decode_graph_batch_sizes", ())
        elif self.cuda_graph_max_bs is not None and not self.decode_graph_batch_sizes:
            object.__setattr__(self, "decode_graph_batch_sizes", sglang_cuda_graph_sizes(
                min(self.cuda_graph_max_bs, self.max_running_requests), self.speculative_algorithm is not None,
                padding=not self.disable_cuda_graph_padding))
        if self.enable_torch_compile and not self.decode_graph_batch_sizes:
            # NOTE: SGLang's --enable-torch-compile alone compiles its decode batch sizes up to the max:
            # without buckets of its own, the powers of two up to torch_compile_max_bs
            object.__setattr__(self, "decode_graph_batch_sizes", tuple(
                1 << i for i in range(self.torch_compile_max_bs.bit_length())))
        if self.enable_torch_compile:
            self._check_torch_compile()
        check_choice("moe_backend", self.moe_backend, MOE_BACKENDS, or_none=True, why="by device")
        check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS, or_none=True, why="by device")
        if self.enable_deterministic_inference:
            # NOTE: moe_backend "triton" runs the batch-invariant experts kernel (moe_triton_exact.py)
            # NOTE: attention_backend "triton" runs the extend kernel's batch-invariant form
            check_choice("attention_backend", self.attention_backend, ("torch", "triton"), or_none=True,
                         why="enable_deterministic_inference runs batch-invariant attention kernels")
            if self.cpu_reserve:
                raise ValueError(f"enable_deterministic_inference needs the same threads in every forward: "
                                 f"cpu_reserve must be 0, got {self.cpu_reserve}")
        if not isinstance(self.weight_version, str):
            raise ValueError(f"weight_version must be a string, got {self.weight_version!r}")
        algo = check_speculative(self)
        if algo is not None:
            object.__setattr__(self, "speculative_algorithm", algo)
            if self.enable_overlap_schedule:
                # NOTE: a verify step's drafts come from the tokens the previous step kept
                raise ValueError(f"enable_overlap_schedule cannot be combined with speculative decoding "
                                 f"(speculative_algorithm={algo!r}): turn one of them off")

    def _check_torch_compile(self) -> None:
        """enable_torch_compile compiles decode buckets: there must be one to compile."""
        if not any(size <= self.torch_compile_max_bs for size in self.decode_graph_batch_sizes):
            raise ValueError(f"enable_torch_compile compiles the decode_graph_batch_sizes buckets up to "
                             f"torch_compile_max_bs={self.torch_compile_max_bs}, but there is none "
                             f"(decode_graph_batch_sizes={list(self.decode_graph_batch_sizes)})")
        if self.enable_deterministic_inference:
            # NOTE: measured (tests/test_torch_compile.py): inductor fuses the batch-invariant ops
            # (rollout.exact) into kernels that round differently, so compiled outputs are not
            # bitwise those of the same engine without enable_torch_compile
            raise ValueError("enable_torch_compile and enable_deterministic_inference cannot be combined: the "
                             "compiled forward is not bitwise equal to the uncompiled one; turn one of them off")

    def check_devices(self) -> None:
        """Raises ValueError when this machine lacks the GPUs the config asks for (DP rank r runs
        on cuda:r), or the kernels the backends ask for. Checked when an engine starts, not when a
        config is made (configs travel)."""
        check_attention_backend(self.resolved_attention_backend, self.device)
        if self.cpu_affinity:
            if not hasattr(os, "sched_setaffinity"):
                raise ValueError("cpu_affinity needs a platform with sched_setaffinity (Linux)")
            from rollout.cpu_affinity import unsettable_cpus  # noqa: PLC0415

            bad = unsettable_cpus(self.cpu_affinity)
            if bad:
                every = range(os.cpu_count() or 1)
                allowed = sorted(set(every) - set(unsettable_cpus(every)))
                raise ValueError(f"cpu_affinity: CPU(s) {bad} are offline or outside this process's cpuset, "
                                 f"allowed: {allowed}")
        if self.resolved_moe_backend == "triton":
            if importlib.util.find_spec("triton") is None:
                raise ValueError("moe_backend='triton' needs the triton package (pip install -e .[gpu])")
            if not self.device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
                raise ValueError(f"moe_backend='triton' on device={self.device!r} runs only under the Triton "
                                 f"interpreter (TRITON_INTERPRET=1 before triton is imported); use 'torch'")
        if not self.device.startswith("cuda"):
            return
        import torch  # noqa: PLC0415

        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(self.device.split(":")[1]) if ":" in self.device else 0
        if self.dp_size > 1 and have < self.local_dp_size:
            raise ValueError(f"dp_size={self.dp_size} over nnodes={self.nnodes} on device={self.device!r} needs one GPU "
                             f"per DP rank of this node ({self.local_dp_size}; its rank r uses cuda:r), but {have} "
                             f"are visible")
        if index >= have:
            raise ValueError(f"device={self.device!r}: {have} CUDA GPU(s) visible, allowed range "
                             f"cuda:0..cuda:{have - 1}" if have else f"device={self.device!r}: no CUDA GPU is visible")

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    # ---- the ranks of this node -------------------------------------------------------------------
    @property
    def local_dp_size(self) -> int:
        """DP ranks each node runs (dp_size / nnodes)."""
        return self.dp_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The global DP ranks this node runs: node_rank * local_dp_size, ..."""
        k = self.local_dp_size
        return range(self.node_rank * k, (self.node_rank + 1) * k)

    def node_of(self, rank: int) -> int:
        """The node that runs global DP rank `rank`."""
        return rank // self.local_dp_size

    def local_rank(self, rank: int) -> int:
        """Global DP rank `rank`'s index among its node's ranks (its cuda:N, its part of cpu_affinity)."""
        return rank % self.local_dp_size

    def cpu_affinity_of(self, rank: int) -> tuple[int, ...]:
        """The CPUs global DP rank `rank` runs on: its node-local part of cpu_affinity; () = not pinned."""
        part = len(self.cpu_affinity) // self.local_dp_size
        local = self.local_rank(rank)
        return self.cpu_affinity[local * part:(local + 1) * part]

    @property
    def resolved_cpu_threads(self) -> int:
        """torch intra-op threads of a CPU engine process: cpu_threads, else a rank's part of
        cpu_affinity, else the CPUs this process may run on (its affinity mask: SLURM and
        containers narrow it) divided among this node's DP ranks."""
        if self.cpu_threads is not None:
            return self.cpu_threads
        if self.cpu_affinity:
            return len(self.cpu_affinity) // self.local_dp_size
        usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return max(1, usable // self.local_dp_size)

    @property
    def resolved_attention_backend(self) -> str:
        """attention_backend, or by device: CUDA -> flashinfer when importable, else triton; CPU -> torch.
        Deterministic inference: torch (rollout.exact, the ops the exact-mode trainer computes
        with); its batch-invariant Triton form only when attention_backend is "triton"."""
        if self.attention_backend is not None:
            return self.attention_backend
        if self.enable_deterministic_inference:
            return "torch"
        return default_attention_backend(self.device)

    @property
    def verify_tokens_per_request(self) -> int:
        """Tokens a request feeds one decode step: 1, or with speculation its last token and drafts."""
        return num_draft_tokens(self)

    def shape_limits(self, context_length: int) -> ForwardShapeLimits:
        """The largest forwards an engine of this config issues (they size the capture buffer and
        build the runners: invariant 1); context_length: the engine's, resolved from the model."""
        return ForwardShapeLimits(dp_size=self.dp_size, max_running_requests=self.max_running_requests,
                                  chunked_prefill_tokens=self.chunked_prefill_size or context_length,
                                  decode_graph_batch_sizes=self.decode_graph_batch_sizes,
                                  prefill_graph_token_sizes=self.prefill_graph_token_sizes,
                                  verify_tokens_per_request=self.verify_tokens_per_request)

    @property
    def resolved_tokenizer_path(self) -> str:
        return self.tokenizer_path or self.model_path

    @property
    def resolved_moe_backend(self) -> str:
        """The MoE kernels (router and experts): moe_backend, else "triton" on CUDA when triton is
        installed and "torch" otherwise (on CPU Triton runs only under its interpreter, for tests).
        Deterministic inference: torch (the exact-mode trainer's ops) unless moe_backend is "triton"
        (the batch-invariant Triton experts kernel)."""
        if self.moe_backend is not None:
            return self.moe_backend
        if self.enable_deterministic_inference:
            return "torch"
        cuda = self.device.startswith("cuda") and importlib.util.find_spec("triton") is not None
        return "triton" if cuda else "torch"

    @property
    def resolved_profile_graph_capture_dir(self) -> Optional[str]:
        """Where capture traces go; None when graph-capture profiling is off."""
        if not self.enable_profile_graph_capture:
            return None
        return self.profile_graph_capture_dir or os.path.join(os.getcwd(), "graph_capture_profile")

