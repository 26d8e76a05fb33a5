"""The Triton kernels compile for a real GPU target (sm_90, PTX to cubin with Triton's own ptxas)
without a GPU: what the interpreter never checks (types, layouts, dot shapes, register limits).

Runs this file as a script in a subprocess without TRITON_INTERPRET (the test process has it set).
"""
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROUTER_SIG = {"logits_ptr": "*{dtype}", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i64",
              "capture_ptr": "*i32", "n_rows": "i32", "n_experts": "i32", "stride_logits": "i32",
              "stride_capture": "i32", "scale": "fp32"}
ROUTER_VARIANTS = {
    "softmax": dict(SIGMOID=False, RENORMALIZE=True, N_GROUP=1, TOPK_GROUP=1, GROUP_SIZE=60, BLOCK_G=1, BLOCK_E=64,
                    TOP_K=4, BLOCK_K=4, BLOCK_M=64, HAS_CAPTURE=True),
    "grouped_sigmoid": dict(SIGMOID=True, RENORMALIZE=True, N_GROUP=8, TOPK_GROUP=4, GROUP_SIZE=32, BLOCK_G=8,
                            BLOCK_E=256, TOP_K=8, BLOCK_K=8, BLOCK_M=16, HAS_CAPTURE=True),
    "topk_softmax": dict(SIGMOID=False, RENORMALIZE=False, N_GROUP=1, TOPK_GROUP=1, GROUP_SIZE=32, BLOCK_G=1,
                         BLOCK_E=32, TOP_K=4, BLOCK_K=4, BLOCK_M=64, HAS_CAPTURE=True, SOFTMAX_AFTER=True),
}
# the fused MoE kernels: default, and gpt-oss's (biases, clamped SwiGLU)
MOE_VARIANTS = {"": {}, "/gpt_oss": dict(HAS_BIAS=True, CLAMPED=True)}


def compile_all() -> list[str]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from rollout.models.kernels.fused_moe import _w2_kernel, _w13_kernel
    from rollout.models.kernels.fused_moe_exact import _w2_terms_kernel
    from rollout.models.kernels.topk import _router_kernel

    target = GPUTarget("cuda", 90, 32)
    done = []

    def build(fn, sig, const, label, *, has_atomics=False):
        signature = {n: sig.get(n, "constexpr") for n in fn.arg_names}
        kernel = triton.compile(ASTSource(fn, signature, constexprs=const), target=target)
        lines = (re.sub(r"^@!?%p\d+\s+", "", line.strip()) for line in kernel.asm["ptx"].splitlines())  # predicates
        atomics = [line for line in lines if line.startswith(("atom.", "red."))]
        # NOTE: the fused MoE's sum over k: relaxed atomics (the default acq_rel orders every add)
        if any(("acq_rel" in a or ".relaxed" not in a) for a in atomics):
            raise AssertionError(f"{label}: atomics not relaxed: {sorted(set(atomics))[:4]}")
        if has_atomics and not atomics:   # NOTE: else the check above would pass on a kernel without any
            raise AssertionError(f"{label}: no atom./red. instruction in its PTX (the sum over k lost its atomics?)")
        done.append(label)

    for dtype in ("fp32", "bf16"):
        for name, const in ROUTER_VARIANTS.items():
            build(_router_kernel, {k: v.format(dtype=dtype) for k, v in ROUTER_SIG.items()}, const,
                  f"router/{name}/{dtype}")
        ieee = dtype == "fp32"
        for fn, tensors in ((_w13_kernel, ("x_ptr", "w_ptr", "h_ptr", "b_ptr")),
                            (_w2_kernel, ("h_ptr", "w_ptr", "b_ptr")),
                            (_w2_terms_kernel, ("h_ptr", "w_ptr", "terms_ptr", "b_ptr"))):
            sig = {n: f"*{dtype}" for n in tensors}
            sig.update({"pairs_ptr": "*i32", "block_expert_ptr": "*i32", "out_ptr": "*fp32", "weights_ptr": "*fp32",
                        "limit": "fp32", "alpha": "fp32"})
            sig.update({n: "i32" for n in fn.arg_names if n.startswith("stride")
                        or n in ("num_pairs", "top_k", "hidden", "inter")})
            for suffix, flags in MOE_VARIANTS.items():
                if fn is not _w13_kernel:
                    flags = {k: v for k, v in flags.items() if k != "CLAMPED"}
                if fn is _w2_terms_kernel:
                    flags = dict(flags, ROWWISE=False)
                build(fn, sig, dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=32 if ieee else 64, IEEE=ieee, **flags),
                      f"{fn.__name__}{suffix}/{dtype}", has_atomics=fn is _w2_kernel)
    return done


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.split() == [f"{k}/{d}" for d in ("fp32", "bf16")
                                   for k in ("router/softmax", "router/grouped_sigmoid", "router/topk_softmax",
                                             "_w13_kernel", "_w13_kernel/gpt_oss", "_w2_kernel", "_w2_kernel/gpt_oss",
                                             "_w2_terms_kernel", "_w2_terms_kernel/gpt_oss")]


if __name__ == "__main__":
    print("\n".join(compile_all()))
