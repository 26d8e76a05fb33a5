"""Peak extra memory of rollout-serve (front end + engine processes) during one distributed weight update.

Builds a Qwen3-MoE-shaped checkpoint locally (random bf16 weights, a transformers config; no
download), starts a real rollout-serve on CPU, joins its weight-update group as the trainer (rank
0, gloo) and pushes the whole model once with /update_weights_from_distributed, as
trainer_bridge's DistributedSync does. Measures, for every process of the server, the resident
memory before the update and its peak during it (the kernel's high-water mark VmHWM, reset first
through /proc/PID/clear_refs, plus a 10 ms sampler of the processes' summed RSS).

--code-root runs the server from another checkout (e.g. an older commit, to compare).
--quantization fp8 serves the bf16 checkpoint in FP8 (`--quantization fp8`): every pushed bf16
tensor is quantized as it is copied in; the model column is then the engine's own weight bytes
(/v1/loads). Prints a table; --json writes the numbers.

    python scripts/bench_weight_update_memory.py --layers 10 --bucket-bytes 536870912 --json out.json
    python scripts/bench_weight_update_memory.py --layers 10 --bucket-bytes 536870912 --quantization fp8
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from trainer_bridge.weight_sync import init_custom_process_group  # noqa: E402

MiB = 2**20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_checkpoint(path: Path, layers: int, seed: int, *, vocab: int = 32000,
                     experts: int = 64) -> dict[str, torch.Tensor]:
    """A Qwen3-MoE-shaped model (transformers' in-memory names: fused experts), random bf16
    (tests/test_weight_update_memory.py builds a smaller one with the same function)."""
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=1024, intermediate_size=2048, moe_intermediate_size=256,
                         num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                         num_experts=experts, num_experts_per_tok=8, max_position_embeddings=2048,
                         tie_word_embeddings=False, dtype="bfloat16", architectures=["Qwen3MoeForCausalLM"])
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in Qwen3MoeForCausalLM(cfg).named_parameters()}
    gen = torch.Generator().manual_seed(seed)
    tensors = {n: (torch.ones(s) if n.endswith("norm.weight") else torch.randn(s, generator=gen) * 0.02)
               .to(torch.bfloat16) for n, s in shapes.items()}
    path.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(path)
    shard, size, k = {}, 0, 0
    for n, t in tensors.items():
        shard[n] = t
        size += t.numel() * t.element_size()
        if size >= 512 * MiB:
            save_file(shard, str(path / f"model-{k:05d}.safetensors"), metadata={"format": "pt"})
            shard, size, k = {}, 0, k + 1
    if shard:
        save_file(shard, str(path / f"model-{k:05d}.safetensors"), metadata={"format": "pt"})
    return tensors


def pids_of(root: int) -> list[int]:
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def measure(url: str, server_pid: int, tensors: dict[str, torch.Tensor], timeout_s: float, repeats: int) -> list:
    pids = pids_of(server_pid)
    port = free_port()
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(init=httpx.post(url + "/init_weights_update_group", json={
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
        "group_name": "bench", "backend": "gloo", "timeout_s": timeout_s}, timeout=timeout_s)))
    t.start()
    pg = init_custom_process_group("gloo", f"tcp://127.0.0.1:{port}", 2, 0, "bench",
                                   datetime.timedelta(seconds=timeout_s))
    t.join()
    assert box["init"].status_code == 200, box["init"].text
    rows = [one_update(url, pids, pg, tensors, timeout_s, k) for k in range(repeats)]
    httpx.post(url + "/destroy_weights_update_group", json={}, timeout=60)
    dist.destroy_process_group(pg)
    return rows


def one_update(url: str, pids: list[int], pg, tensors: dict[str, torch.Tensor], timeout_s: float, k: int) -> dict:
    time.sleep(1.0)
    before = {p: status_kb(p, "VmRSS") for p in pids}
    for p in pids:
        Path(f"/proc/{p}/clear_refs").write_text("5")   # NOTE: resets VmHWM to the current RSS
    peak_sum = [sum(before.values())]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            try:
                peak_sum[0] = max(peak_sum[0], sum(status_kb(p, "VmRSS") for p in pids))
            except OSError:
                pass
            time.sleep(0.01)
    sampler = threading.Thread(target=sample)
    sampler.start()
    names = list(tensors)
    body = {"names": names, "dtypes": ["bfloat16"] * len(names), "shapes": [list(tensors[n].shape) for n in names],
            "weight_version": f"bench-{k}"}
    box: dict = {}
    t = threading.Thread(target=lambda: box.update(update=httpx.post(url + "/update_weights_from_distributed",
                                                                     json=body, timeout=timeout_s)))
    t0 = time.perf_counter()
    t.start()
    for n in names:
        dist.broadcast(tensors[n], src=0, group=pg)
    t.join()
    seconds = time.perf_counter() - t0
    stop.set()
    sampler.join()
    assert box["update"].status_code == 200, box["update"].text
    hwm = {p: status_kb(p, "VmHWM") for p in pids}
    return {"update": k + 1, "pids": len(pids), "rss_before_mib": sum(before.values()) / 1024,
            "peak_extra_hwm_mib": sum(hwm[p] - before[p] for p in pids) / 1024,
            "per_process_extra_mib": [(hwm[p] - before[p]) / 1024 for p in pids],
            "peak_extra_sampled_mib": (peak_sum[0] - sum(before.values())) / 1024, "seconds": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--bucket-bytes", type=int, default=None, help="--weight-update-bucket-bytes (omit for "
                                                                    "servers without the flag)")
    ap.add_argument("--code-root", default=str(ROOT), help="checkout the server runs from")
    ap.add_argument("--label", default="")
    ap.add_argument("--quantization", choices=["fp8"], default=None, help="the server's --quantization")
    ap.add_argument("--repeats", type=int, default=2, help="updates in a row (the first pays one-time costs)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeout-s", type=float, default=900.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-wu-") as tmp:
        ckpt = Path(tmp) / "qwen3-moe"
        tensors = build_checkpoint(ckpt, args.layers, seed=0)
        model_mib = pushed_mib = sum(t.numel() * t.element_size() for t in tensors.values()) / MiB
        port = free_port()
        flags = ["--model-path", str(ckpt), "--tokenizer-path", str(ROOT / "configs" / "tiny-moe"),
                 "--dtype", "bfloat16", "--max-total-tokens", "1024", "--context-length", "1024",
                 "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
        if args.bucket_bytes is not None:
            flags += ["--weight-update-bucket-bytes", str(args.bucket_bytes)]
        if args.quantization is not None:
            flags += ["--quantization", args.quantization]
        env = dict(os.environ, PYTHONPATH=args.code_root)
        log = open(Path(tmp) / "server.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "rollout.server", *flags], env=env, cwd=args.code_root,
                                stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 600
            while True:
                try:
                    if httpx.get(url + "/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("server did not start:\n" + (Path(tmp) / "server.log").read_text()[-3000:])
                time.sleep(0.5)
            if args.quantization is not None:
                loads = httpx.get(url + "/v1/loads", timeout=60).json()["loads"]
                model_mib = sum(ld["weight_bytes"] for ld in loads) / MiB
            rows = measure(url, proc.pid, tensors, args.timeout_s, args.repeats)
            out = httpx.post(url + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {
                "temperature": 0, "max_new_tokens": 2}}, timeout=300)
            assert out.status_code == 200 and out.json()["meta_info"]["weight_version"] == f"bench-{args.repeats - 1}", \
                out.text
        finally:
            proc.terminate()
            proc.wait(timeout=60)
            log.close()
    bucket = f"{args.bucket_bytes / MiB:.0f}" if args.bucket_bytes else "-"
    print("| label | model MiB | bucket MiB | update | server RSS before MiB | peak extra MiB (VmHWM, summed over "
          "processes) | front end / engine extra MiB | peak extra MiB (sampled) | extra / model | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        r.update(label=args.label, model_mib=model_mib, bucket_bytes=args.bucket_bytes, layers=args.layers,
                 quantization=args.quantization, pushed_mib=pushed_mib)
        split = " / ".join(f"{x:.0f}" for x in r["per_process_extra_mib"])
        print(f"| {args.label} | {model_mib:.0f} | {bucket} | {r['update']} | {r['rss_before_mib']:.0f} | "
              f"{r['peak_extra_hwm_mib']:.0f} | {split} | {r['peak_extra_sampled_mib']:.0f} | "
              f"{r['peak_extra_hwm_mib'] / model_mib:.2f} | {r['seconds']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
