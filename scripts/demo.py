"""Demo: RL-style rollouts on the embedded tiny Qwen3-MoE with logprobs and routed experts."""
from __future__ import annotations

import argparse
import time

from rollout import Rollout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model-path", default=None, help="HF checkpoint dir (default: configs/tiny-moe)")
    ap.add_argument("--n", type=int, default=4, help="samples per prompt (GRPO group size)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    args = ap.parse_args()
    prompts = ["Q: 12+7= A:", "Q: 45-19= A:", "Q: 6*7= A:"]
    with Rollout(args.model_path, enable_return_routed_experts=True) as engine:
        t0 = time.perf_counter()
        outs = engine.generate(prompts, {"temperature": 1.0, "max_new_tokens": args.max_new_tokens,
                                         "n": args.n, "sampling_seed": 0},
                               return_logprob=True, return_routed_experts=True)
        dt = time.perf_counter() - t0
        info = engine.info
        print(f"model: {info.architecture}, {info.num_hidden_layers} layers, {info.num_experts} experts, "
              f"top-{info.top_k}")
        for out in outs:
            lps = ", ".join(f"{lp:.2f}" for lp in out.output_logprobs[:6])
            print(f"\n[{out.rid[-8:]}] {out.text!r}  finish={out.finish_reason} cached={out.cached_tokens}")
            print(f"  prompt {out.prompt_ids} -> output {out.output_ids}")
            print(f"  logprobs (first 6): [{lps}]")
            re = out.routed_experts
            print(f"  routed_experts {tuple(re.shape)} (rows = prompt + output - 1, layers, top_k); "
                  f"last row: {re[-1].tolist()}")
        n_tok = sum(len(o.output_ids) for o in outs)
        print(f"\n{len(outs)} rollouts, {n_tok} tokens in {dt:.2f}s ({n_tok / dt:.0f} tok/s); "
              f"wire: meta_info.routed_experts = {outs[0].to_dict()['meta_info']['routed_experts'][:48]}...")
        engine.check_integrity()


if __name__ == "__main__":
    main()
