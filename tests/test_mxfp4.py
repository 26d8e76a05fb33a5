"""MXFP4 (gpt-oss expert weights): our dequantizer against transformers', our quantizer's rounding,
and a tiny gpt-oss checkpoint in the shipped MXFP4 form loaded by transformers."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from mxfp4_checkpoint import GPT_OSS_MODULES_TO_NOT_CONVERT, make_float_gpt_oss_checkpoint, make_mxfp4_checkpoint
from rollout.models.quant.method import QUANT_METHODS, check_quantization_config
from rollout.models.quant.mxfp4 import (E2M1_VALUES, MXFP4_SUFFIXES, dequantize_checkpoint_tensor, dequantize_mxfp4,
                                        pair_mxfp4_names, quantize_mxfp4)

_INT_OF = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
           torch.float16: torch.int16}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a float tensor (tells -0.0 from 0.0 and compares NaN/inf exactly)."""
    return t.contiguous().view(_INT_OF[t.dtype])


def assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    assert torch.equal(bits(a), bits(b))


def random_mxfp4(shape: tuple[int, ...], seed: int, lo: int = 0, hi: int = 254) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks [*shape, 16] (every byte) and scales [*shape] in [lo, hi]."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(lo, hi + 1, shape, dtype=torch.uint8, generator=g)
    return blocks, scales


def transformers_dequantize(blocks, scales, dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=dtype)


# ---- format -------------------------------------------------------------------------------------

def test_e2m1_table_and_nibble_order_match_transformers():
    from transformers.integrations.mxfp4 import FP4_VALUES

    assert_bitwise(torch.tensor(E2M1_VALUES), torch.tensor(FP4_VALUES, dtype=torch.float32))
    # byte 0x2F: low nibble 0xF (-6) is the first value, high nibble 0x2 (+1) the second; scale 2**1
    blocks = torch.zeros(1, 1, 1, 16, dtype=torch.uint8)
    blocks[..., 0] = 0x2F
    scales = torch.full((1, 1, 1), 128, dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales)
    assert ours[0, 0, :3].tolist() == [-12.0, 2.0, 0.0]
    assert_bitwise(ours, transformers_dequantize(blocks, scales, torch.float32).transpose(1, 2))
    # scale bias 127: byte 0 is 2**-127 (subnormal in float32), byte 254 is 2**127
    scales = torch.tensor([0, 127, 254], dtype=torch.uint8).view(1, 3)
    blocks = torch.zeros(1, 3, 16, dtype=torch.uint8)
    blocks[..., 0] = 0x02                                      # value 1.0 first
    assert dequantize_mxfp4(blocks, scales)[0, ::32].tolist() == [2.0 ** -127, 1.0, 2.0 ** 127]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_dequantize_bitwise_equal_to_transformers_every_byte_and_scale(dtype):
    blocks, scales = random_mxfp4((3, 10, 4), seed=1)          # [E, rows, G], every scale 0..254
    ref = transformers_dequantize(blocks, scales, dtype)        # transformers transposes: [E, G*32, rows]
    assert_bitwise(dequantize_mxfp4(blocks, scales, dtype), ref.transpose(1, 2))
    name, ours = dequantize_checkpoint_tensor("model.layers.0.mlp.experts.down_proj", blocks, scales, dtype)
    assert name == "model.layers.0.mlp.experts.down_proj" and ours.is_contiguous()
    assert_bitwise(ours, ref)


def test_dequantize_in_chunks_is_the_same(monkeypatch):
    import rollout.models.quant.mxfp4 as mx

    blocks, scales = random_mxfp4((2, 5, 3), seed=7)
    whole = dequantize_mxfp4(blocks, scales)
    monkeypatch.setattr(mx, "_ROWS_PER_CHUNK", 7)              # 30 groups: 5 chunks, the last partial
    assert_bitwise(dequantize_mxfp4(blocks, scales), whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_random_weights_dequantize_like_transformers(dtype):
    g = torch.Generator().manual_seed(2)
    # magnitudes from 1e-6 to 1e4 across the groups: the scales vary over ~34 binades
    w = torch.randn(4, 48, 256, generator=g) * torch.logspace(-6, 4, 8).repeat_interleave(32)
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (4, 48, 8, 16) and scales.shape == (4, 48, 8)
    assert blocks.dtype == scales.dtype == torch.uint8
    assert int(scales.max()) - int(scales.min()) > 30
    ref = transformers_dequantize(blocks, scales, dtype)
    assert_bitwise(dequantize_mxfp4(blocks, scales, dtype), ref.transpose(1, 2))
    assert_bitwise(dequantize_checkpoint_tensor("x.gate_up_proj", blocks, scales, dtype)[1], ref)
    # nearest E2M1 value: off by at most half the widest gap (4 -> 6) times the group's scale
    dq = dequantize_mxfp4(blocks, scales).view(4, 48, 8, 32)
    step = torch.ldexp(torch.ones(scales.shape), scales.to(torch.int32) - 127)[..., None]
    assert bool(((dq - w.view(4, 48, 8, 32)).abs() <= step).all())


# ---- quantizer -------------------------------------------------------------------------------------

def test_round_trip_of_representable_values():
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (5, 7, 3, 32), dtype=torch.uint8, generator=g)
    # every group's largest |value| is 4 or 6 (codes 6, 7): then the quantizer picks back the same scale
    top = torch.randint(6, 8, (5, 7, 3), dtype=torch.uint8, generator=g)
    codes[..., 9] = top | (codes[..., 9] & 0x8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = torch.randint(1, 253, (5, 7, 3), dtype=torch.uint8, generator=g)   # 6 * 2**126 is inf
    w = dequantize_mxfp4(blocks, scales)
    b2, s2 = quantize_mxfp4(w)
    assert torch.equal(b2, blocks) and torch.equal(s2, scales)
    # any codes, scales 1..252 (groups of small codes get a smaller scale, same values)
    blocks, scales = random_mxfp4((6, 9), seed=5, lo=1, hi=252)
    w = dequantize_mxfp4(blocks, scales)
    assert_bitwise(dequantize_mxfp4(*quantize_mxfp4(w)), w)
    assert_bitwise(dequantize_mxfp4(*quantize_mxfp4(w.to(torch.bfloat16))), w)   # bf16 holds them exactly


def test_quantize_scale_rule_and_rounding():
    def quant(vals: list[float]) -> tuple[list[float], int]:
        x = torch.tensor(vals + [0.0] * (32 - len(vals)))
        b, s = quantize_mxfp4(x)
        return dequantize_mxfp4(b, s)[: len(vals)].tolist(), int(s)

    # scale: max|w| / 6 rounded up to a power of two
    assert quant([6.0])[1] == 127 and quant([4.0])[1] == 127 and quant([6.0001])[1] == 128
    assert quant([3.0])[1] == 126 and quant([-12.0])[1] == 128 and quant([0.0])[1] == 0
    assert quant([1e-39])[1] == 1                            # max/6 subnormal -> 2**-126
    # nearest E2M1 value, ties away from zero, saturating at the largest value
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -2.5, 0.2499, 1.2499, -4.99]
    assert quant(ties) == ([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 6.0, -0.5, -3.0, 0.0, 1.0, -4.0], 127)
    vals, _ = quant([6.0, -0.1, -0.0])                        # a negative that rounds to 0 keeps its sign
    assert [str(v) for v in vals] == ["6.0", "-0.0", "-0.0"]


# ---- checkpoint names and config -------------------------------------------------------------------

def test_pair_names_and_quantization_config():
    names = ["a.gate_up_proj_blocks", "a.gate_up_proj_scales", "a.gate_up_proj_bias", "b.weight"]
    assert pair_mxfp4_names(names) == {"a.gate_up_proj": ("a.gate_up_proj_blocks", "a.gate_up_proj_scales")}
    assert MXFP4_SUFFIXES == ("_blocks", "_scales")
    with pytest.raises(ValueError, match=r"a\.down_proj_blocks \(no a\.down_proj_scales\)"):
        pair_mxfp4_names(names + ["a.down_proj_blocks"])
    with pytest.raises(ValueError, match=r"c\.down_proj_scales \(no c\.down_proj_blocks\)"):
        pair_mxfp4_names(names + ["c.down_proj_scales"])

    assert check_quantization_config({"model_type": "gpt_oss"}) is None
    assert check_quantization_config({"quantization_config": None}) is None
    cfg = {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}}
    assert check_quantization_config(cfg) is QUANT_METHODS["mxfp4"]
    with pytest.raises(ValueError, match=r"'awq'.*supported: compressed-tensors, fp8, mxfp4"):
        check_quantization_config({"quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ValueError, match=r"None.*supported: compressed-tensors, fp8, mxfp4"):
        check_quantization_config({"quantization_config": {"bits": 4}})
    with pytest.raises(ValueError, match="quantization_config"):
        check_quantization_config({"quantization_config": "mxfp4"})


def test_bad_inputs_raise_value_error_naming_them():
    blocks, scales = random_mxfp4((2, 3, 2), seed=6)
    with pytest.raises(ValueError, match=r"scales for 'l\.down_proj' must have shape \[2, 3, 2\].*\[2, 3\]"):
        dequantize_checkpoint_tensor("l.down_proj", blocks, scales[..., 0], torch.float32)
    with pytest.raises(ValueError, match=r"blocks must have shape \[\.\.\., G, 16\], got \[2, 3, 2, 15\]"):
        dequantize_mxfp4(blocks[..., :15], scales)
    with pytest.raises(ValueError, match="uint8.*torch.int32"):
        dequantize_mxfp4(blocks, scales.to(torch.int32))
    with pytest.raises(ValueError, match="0xFF"):
        dequantize_mxfp4(blocks, torch.full_like(scales, 255))
    with pytest.raises(ValueError, match="'router'"):
        dequantize_checkpoint_tensor("model.layers.0.mlp.router", blocks, scales, torch.float32)
    with pytest.raises(ValueError, match=r"'x\.gate_up_proj' must be \[experts, rows, groups, 16\]"):
        dequantize_checkpoint_tensor("x.gate_up_proj", blocks[0], scales[0], torch.float32)
    with pytest.raises(ValueError, match=r"multiple of 32, got shape \[4, 48\]"):
        quantize_mxfp4(torch.zeros(4, 48))
    with pytest.raises(ValueError, match="finite"):
        quantize_mxfp4(torch.full((32,), float("inf")))
    with pytest.raises(ValueError, match="float tensor"):
        quantize_mxfp4(torch.zeros(32, dtype=torch.int32))


# ---- a tiny gpt-oss checkpoint in MXFP4, loaded by transformers -----------------------------------

@pytest.fixture(scope="module")
def gpt_oss_pair(tmp_path_factory):
    src = make_float_gpt_oss_checkpoint(tmp_path_factory.mktemp("gpt_oss_float"))
    return src, make_mxfp4_checkpoint(src, tmp_path_factory.mktemp("gpt_oss_mxfp4"))


def _tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(path.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_mxfp4_checkpoint_has_the_shipped_layout(gpt_oss_pair):
    src, dst = gpt_oss_pair
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "mxfp4",
                                          "modules_to_not_convert": GPT_OSS_MODULES_TO_NOT_CONVERT}
    assert (dst / "generation_config.json").read_text() == (src / "generation_config.json").read_text()
    e, h, i = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
    ours, theirs = _tensors(dst), _tensors(src)
    pairs = pair_mxfp4_names(ours)
    assert sorted(pairs) == [f"model.layers.{n}.mlp.experts.{p}"
                             for n in range(2) for p in ("down_proj", "gate_up_proj")]
    for n in range(2):
        pre = f"model.layers.{n}.mlp.experts."
        assert ours[pre + "gate_up_proj_blocks"].shape == (e, 2 * i, h // 32, 16)
        assert ours[pre + "gate_up_proj_scales"].shape == (e, 2 * i, h // 32)
        assert ours[pre + "down_proj_blocks"].shape == (e, h, i // 32, 16)
        assert ours[pre + "down_proj_scales"].shape == (e, h, i // 32)
        assert all(ours[pre + p + s].dtype == torch.uint8
                   for p in ("gate_up_proj", "down_proj") for s in MXFP4_SUFFIXES)
    plain = {k for k in theirs if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert plain == {k for k in ours if not k.endswith(MXFP4_SUFFIXES)}
    assert all(torch.equal(ours[k], theirs[k]) for k in plain)


def test_transformers_loads_it_as_we_dequantize(gpt_oss_pair):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    src, dst = gpt_oss_pair
    ckpt = _tensors(dst)
    # CPU: transformers only dequantizes MXFP4 (its MXFP4 kernels need Triton hub kernels)
    hf = AutoModelForCausalLM.from_pretrained(dst, quantization_config=Mxfp4Config(dequantize=True),
                                              dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    hf_params, ref_params = dict(hf.named_parameters()), dict(ref.named_parameters())
    assert hf_params.keys() == ref_params.keys()
    for base, (b, s) in pair_mxfp4_names(ckpt).items():
        name, w = dequantize_checkpoint_tensor(base, ckpt[b], ckpt[s], torch.float32)
        assert_bitwise(hf_params[name].detach(), w)
        assert w.shape == ref_params[name].shape
        assert (w - ref_params[name].detach()).abs().max() < 0.5     # quantization error, not a layout mix-up
        with torch.no_grad():
            ref_params[name].copy_(w)
    for name, p in hf_params.items():
        assert_bitwise(p.detach(), ref_params[name].detach())
    ids = torch.tensor([[5, 17, 99, 3, 42, 250, 7, 8, 9, 10, 11, 12]])
    with torch.no_grad():
        assert_bitwise(hf(ids).logits, ref(ids).logits)
