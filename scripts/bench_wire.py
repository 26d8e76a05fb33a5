"""Wire-size and codec-throughput benchmark for routed-expert ids.

    python scripts/bench_wire.py [--tokens 4096] [--repeats 7] [--json PATH]

Throughput is MB/s of raw int32 routing data (rows * num_layers * top_k * 4 bytes), best of
``--repeats``. Host-store bytes per KV slot use ``narrowest_dtype(num_experts)`` (ids plus a
sentinel); the compact payload dtype is chosen per message (code 3 = uint8 without sentinel,
1 = uint8 with 255 = none, 2 = int16; see ``capture/codec.py``), shown as "dtype (code)".
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from capture.codec import (  # noqa: E402
    compact_header,
    decode_routed_experts,
    encode_routed_experts,
    narrowest_dtype,
)


@dataclass(frozen=True)
class Shape:
    name: str
    num_layers: int
    dense_layers: tuple[int, ...]
    top_k: int
    num_experts: int


SHAPES = (
    Shape("Qwen3-30B-A3B", 48, (), 8, 128),
    Shape("DeepSeek-V3", 61, (0, 1, 2), 8, 256),
    Shape("Kimi-K2", 61, (0,), 8, 384),
    Shape("GLM-4.5-Air", 46, (0,), 8, 128),
)


def random_routing(shape: Shape, rows: int, seed: int = 0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    out = np.empty((rows, shape.num_layers, shape.top_k), dtype=np.int32)
    chunk = max(1, (1 << 22) // (shape.num_layers * shape.num_experts))
    for r0 in range(0, rows, chunk):
        r1 = min(rows, r0 + chunk)
        keys = rng.random((r1 - r0, shape.num_layers, shape.num_experts), dtype=np.float32)
        out[r0:r1] = np.argpartition(keys, shape.top_k, axis=-1)[..., : shape.top_k]  # distinct
    out[:, list(shape.dense_layers), :] = -1
    return torch.from_numpy(out)  # [rows, num_layers, top_k]


def best_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench(shape: Shape, tokens: int, repeats: int) -> dict:
    t = random_routing(shape, tokens)
    raw_mb = t.numel() * 4 / 1e6
    L, K, E = shape.num_layers, shape.top_k, shape.num_experts
    row = {"model": shape.name, "tokens": tokens, "num_layers": L,
           "moe_layers": L - len(shape.dense_layers), "top_k": K, "num_experts": E}
    for fmt, enc_kw, dec_kw in (
        ("int32", {}, {"num_layers": L, "top_k": K}),
        ("compact", {"num_experts": E}, {}),
    ):
        s = encode_routed_experts(t, fmt=fmt, **enc_kw)
        assert torch.equal(decode_routed_experts(s, fmt=fmt, **dec_kw), t)
        enc = best_time(lambda: encode_routed_experts(t, fmt=fmt, **enc_kw), repeats)
        dec = best_time(lambda: decode_routed_experts(s, fmt=fmt, **dec_kw), repeats)
        row[f"{fmt}_bytes_per_token"] = len(s) / tokens
        row[f"{fmt}_encode_MBps"] = raw_mb / enc
        row[f"{fmt}_decode_MBps"] = raw_mb / dec
        row[f"{fmt}_roundtrip_MBps"] = raw_mb / (enc + dec)
        if fmt == "compact":
            row["compact_dtype"] = str(compact_header(s).dtype).replace("torch.", "")
            row["compact_code"] = base64.b64decode(s[:8])[5]
    row["compact_over_int32"] = row["compact_bytes_per_token"] / row["int32_bytes_per_token"]
    dt = narrowest_dtype(E)
    row["host_dtype"] = str(dt).replace("torch.", "")
    row["host_bytes_per_slot"] = L * K * torch.empty((), dtype=dt).element_size()
    return row


def print_table(rows: list[dict]) -> None:
    cols = [
        ("model", "model", "{}"),
        ("tokens", "tokens", "{}"),
        ("L/MoE/K/E", None, None),
        ("int32 B/tok", "int32_bytes_per_token", "{:.1f}"),
        ("compact B/tok", "compact_bytes_per_token", "{:.1f}"),
        ("ratio", "compact_over_int32", "{:.3f}"),
        ("compact dtype", None, None),
        ("int32 enc/dec/rt MB/s", None, None),
        ("compact enc/dec/rt MB/s", None, None),
        ("host B/slot", None, None),
    ]
    lines = []
    for r in rows:
        cells = []
        for title, key, f in cols:
            if title == "L/MoE/K/E":
                cells.append(f"{r['num_layers']}/{r['moe_layers']}/{r['top_k']}/{r['num_experts']}")
            elif title.endswith("MB/s"):
                p = title.split()[0]
                cells.append("/".join(f"{r[f'{p}_{k}_MBps']:.0f}" for k in ("encode", "decode", "roundtrip")))
            elif title == "compact dtype":
                cells.append(f"{r['compact_dtype']} ({r['compact_code']})")
            elif title == "host B/slot":
                cells.append(f"{r['host_bytes_per_slot']} ({r['host_dtype']})")
            else:
                cells.append(f.format(r[key]))
        lines.append(cells)
    titles = [c[0] for c in cols]
    widths = [max(len(t), *(len(l[i]) for l in lines)) for i, t in enumerate(titles)]
    fmt_row = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
    print(fmt_row(titles))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for l in lines:
        print(fmt_row(l))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.repeats < 1:
        ap.error("--tokens and --repeats must be >= 1")
    rows = [bench(s, args.tokens, args.repeats) for s in SHAPES]
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "numpy": np.__version__, "results": rows}, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
