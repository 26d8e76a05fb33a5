import base64
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capture.codec import (
    CompactHeader,
    RoutedExpertsFormat,
    compact_header,
    decode_routed_experts,
    encode_routed_experts,
    narrowest_dtype,
    routed_experts_format_of,
)

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_routing(seed, rows, num_layers, top_k, num_experts, dense=(), pad_frac=0.0):
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, num_experts, size=(rows, num_layers, top_k), dtype=np.int64)
    if pad_frac:
        arr[rng.random(arr.shape) < pad_frac] = -1
    arr[:, list(dense), :] = -1
    return torch.from_numpy(arr)  # [rows, num_layers, top_k]


@st.composite
def routings(draw):
    rows = draw(st.integers(0, 64))
    num_layers = draw(st.integers(1, 64))
    top_k = draw(st.integers(1, 8))
    num_experts = draw(st.one_of(st.integers(1, 512), st.sampled_from([1, 2, 254, 255, 256, 257, 512])))
    dense = draw(st.sets(st.integers(0, num_layers - 1), max_size=num_layers))
    pad_frac = draw(st.sampled_from([0.0, 0.0, 0.1]))
    dtype = draw(st.sampled_from([torch.int64, torch.int32, torch.int16]))
    seed = draw(st.integers(0, 2**32 - 1))
    t = make_routing(seed, rows, num_layers, top_k, num_experts, sorted(dense), pad_frac).to(dtype)
    return t, num_experts, sorted(dense)


def expected_code(t, layer_ids, num_experts):
    """The compact payload dtype code the module docstring's table picks (3, then 1, then 2)."""
    has_none = bool((t.numpy()[:, list(layer_ids), :] < 0).any())
    if num_experts <= 256 and not has_none:
        return 3
    return 1 if num_experts <= 255 else 2


CODE_DTYPE = {1: torch.uint8, 2: torch.int16, 3: torch.uint8}


# ----------------------------------------------------------------------------------------- int32


def test_int32_byte_identical_to_sglang_recipe_and_slime_decode():
    t = make_routing(0, 37, 48, 8, 128, dense=[0, 1])
    s = encode_routed_experts(t, fmt="int32")
    assert isinstance(s, str)
    assert s == base64.b64encode(t.numpy().astype("<i4").tobytes()).decode("ascii")
    tokens = list(range(38))  # rows = len(tokens) - 1
    slime = np.frombuffer(base64.b64decode(s), np.int32).reshape(len(tokens) - 1, 48, 8)
    assert np.array_equal(slime, t.numpy())


def test_int32_non_contiguous_and_dtypes():
    t = make_routing(1, 9, 6, 4, 64).to(torch.int32)
    nc = t.permute(1, 0, 2).contiguous().permute(1, 0, 2)
    assert not nc.is_contiguous()
    ref = encode_routed_experts(t)
    assert encode_routed_experts(nc) == ref
    for dt in (torch.int64, torch.int16):
        assert encode_routed_experts(t.to(dt)) == ref
    assert encode_routed_experts(t.numpy().astype(np.int64)) == ref


def test_int32_empty():
    t = torch.empty(0, 4, 2, dtype=torch.int64)
    assert encode_routed_experts(t) == ""
    out = decode_routed_experts("", fmt="int32", num_layers=4, top_k=2)
    assert out.shape == (0, 4, 2) and out.dtype == torch.int32


@FAST
@given(routings())
def test_int32_round_trip(case):
    t, num_experts, _ = case
    s = encode_routed_experts(t, fmt="int32", num_experts=num_experts)
    out = decode_routed_experts(s, fmt="int32", num_layers=t.shape[1], top_k=t.shape[2])
    assert out.dtype == torch.int32 and out.shape == t.shape
    assert torch.equal(out, t.to(torch.int32))
    out[...] = 0  # decoded tensors are writable and own their memory


# --------------------------------------------------------------------------------------- compact


@FAST
@given(routings(), st.integers(0, 2**63), st.booleans())
def test_compact_round_trip(case, start, explicit_layers):
    t, num_experts, dense = case
    rows, num_layers, top_k = t.shape
    moe = [i for i in range(num_layers) if i not in dense] or [0]
    s = encode_routed_experts(
        t, fmt=RoutedExpertsFormat.COMPACT if explicit_layers else "compact",
        num_experts=num_experts, start=start, layer_ids=moe if explicit_layers else None,
    )
    s.encode("ascii")
    out = decode_routed_experts(s, fmt="compact")
    assert out.dtype == torch.int32 and out.shape == t.shape
    assert torch.equal(out, t.to(torch.int32))

    info = compact_header(s)
    assert isinstance(info, CompactHeader)
    assert (info.rows, info.num_layers, info.top_k, info.start) == (rows, num_layers, top_k, start)
    if explicit_layers:
        assert info.layer_ids == tuple(moe)
    else:
        derived = tuple(np.flatnonzero((t.numpy() >= 0).any(axis=(0, 2))).tolist())
        assert info.layer_ids == (derived or tuple(range(num_layers)))
    code = base64.b64decode(s)[5]
    assert code == expected_code(t, info.layer_ids, num_experts)
    assert info.dtype == CODE_DTYPE[code]
    assert len(base64.b64decode(s)) == info.header_bytes + info.payload_bytes
    assert decode_routed_experts(s, "compact", num_layers=num_layers, top_k=top_k).shape == t.shape


@FAST
@given(st.integers(0, 48), st.integers(1, 12), st.integers(1, 8), st.sets(st.integers(0, 11)),
       st.sampled_from(["none", "pad", "dense_in_layer_ids"]), st.integers(0, 2**32 - 1))
def test_compact_256_experts_round_trip(rows, num_layers, top_k, dense, minus_one, seed):
    # 256 experts: uint8 without sentinel unless a carried layer holds -1, then int16.
    dense = sorted(d for d in dense if d < num_layers)
    t = make_routing(seed, rows, num_layers, top_k, 256, dense,
                     pad_frac=0.2 if minus_one == "pad" else 0.0)
    if rows:
        t[rows // 2, num_layers - 1, top_k - 1] = 255  # the byte code 1 would read as "none"
    layer_ids = list(range(num_layers)) if minus_one == "dense_in_layer_ids" else None
    s = encode_routed_experts(t, "compact", num_experts=256, layer_ids=layer_ids)
    info = compact_header(s)
    code = base64.b64decode(s)[5]
    assert code == expected_code(t, info.layer_ids, 256)
    has_none = bool((t.numpy()[:, list(info.layer_ids)] < 0).any())
    assert (code, info.dtype) == ((2, torch.int16) if has_none else (3, torch.uint8))
    assert torch.equal(decode_routed_experts(s, "compact"), t.int())


def test_compact_dense_layers_dropped_and_restored():
    # DeepSeek-V3-like: first 3 layers dense, 256 experts, no -1 in the MoE layers: uint8.
    t = make_routing(2, 10, 8, 4, 256, dense=[0, 1, 2])
    t[3, 5, 1] = 255
    s = encode_routed_experts(t, fmt="compact", num_experts=256, start=5)
    info = compact_header(s)
    assert info.layer_ids == (3, 4, 5, 6, 7) and info.dtype == torch.uint8 and info.start == 5
    assert info.payload_bytes == 10 * 5 * 4 * 1
    out = decode_routed_experts(s, fmt="compact")
    assert (out[:, :3] == -1).all() and torch.equal(out, t.int())


def test_compact_explicit_layer_ids_may_include_all_minus_one_layer():
    t = make_routing(3, 4, 5, 2, 16, dense=[1, 3])
    s = encode_routed_experts(t, "compact", num_experts=16, layer_ids=[4, 0, 2, 3])
    assert compact_header(s).layer_ids == (0, 2, 3, 4)
    assert torch.equal(decode_routed_experts(s, "compact"), t.int())


def test_compact_all_minus_one_keeps_all_layers():
    t = torch.full((5, 3, 2), -1)
    s = encode_routed_experts(t, "compact", num_experts=8)
    assert compact_header(s).layer_ids == (0, 1, 2)
    assert torch.equal(decode_routed_experts(s, "compact"), t.int())
    s = encode_routed_experts(t, "compact", num_experts=8, layer_ids=[1])
    assert compact_header(s).layer_ids == (1,)
    assert torch.equal(decode_routed_experts(s, "compact"), t.int())
    s = encode_routed_experts(t[:0], "compact", num_experts=8)
    assert compact_header(s).layer_ids == (0, 1, 2)


@pytest.mark.parametrize("rows,num_experts,code", [
    ([[[254, -1], [0, 253]]], 255, 1),  # -1 carried, 255 free: uint8 with sentinel
    ([[[254, 7], [0, 253]]], 255, 3),  # no -1: uint8 without sentinel, also below 256 experts
    ([[[255, 0], [1, 254]]], 256, 3),  # id 255 is an id, not "none"
    ([[[255, -1], [1, 254]]], 256, 2),  # 256 experts and a -1: int16
    ([[[255, -1], [0, 32766]]], 32767, 2),
    ([[[32767, 0], [0, 255]]], 32768, 2),  # largest id int16 holds next to the -1 sentinel
    ([[[32767, -1], [0, 255]]], 32768, 2),
    ([[[0, 1], [2, 3]]], 257, 2),  # > 256 experts: int16 even when ids are small
])
def test_compact_dtype_code_boundaries(rows, num_experts, code):
    t = torch.tensor(rows)
    s = encode_routed_experts(t, "compact", num_experts=num_experts)
    raw = base64.b64decode(s)
    assert raw[5] == code and compact_header(s).dtype == CODE_DTYPE[code]
    assert torch.equal(decode_routed_experts(s, "compact"), t.int())


def test_compact_uint8_byte_255_depends_on_code():
    # Same payload bytes, different code byte: 255 is id 255 under code 3, "none" under code 1.
    head = lambda code: struct.pack("<4sBBHHIQ", b"REXC", 2, code, 1, 2, 1, 0) + b"\x01"
    for code, want in ((3, [255, 7]), (1, [-1, 7])):
        s = base64.b64encode(head(code) + bytes([255, 7])).decode()
        assert decode_routed_experts(s, "compact").tolist() == [[want]]


def test_compact_header_layout_little_endian():
    # code 3: uint8, no sentinel (256 experts, id 255 carried as byte 255).
    t = make_routing(4, 3, 10, 2, 256, dense=[9])
    t[0, 0, 0] = 255
    raw = base64.b64decode(encode_routed_experts(t, "compact", num_experts=256, start=0x0102030405))
    magic, version, code, num_layers, top_k, rows, start = struct.unpack_from("<4sBBHHIQ", raw)
    assert (magic, version, code, num_layers, top_k, rows, start) == (b"REXC", 2, 3, 10, 2, 3, 0x0102030405)
    assert raw[:22] == b"REXC\x02\x03\x0a\x00\x02\x00\x03\x00\x00\x00\x05\x04\x03\x02\x01\x00\x00\x00"
    assert raw[22:24] == bytes([0xFF, 0x01])  # layers 0..8 present, bit i = layer i
    assert raw[24:] == t[:, :9].numpy().astype(np.uint8).tobytes() and raw[24] == 255
    assert len(raw) == 24 + 3 * 9 * 2

    # code 1: uint8, 255 = none (a -1 in a carried layer, <= 255 experts).
    t = torch.tensor([[[3, -1]], [[-1, 254]]])
    raw = base64.b64decode(encode_routed_experts(t, "compact", num_experts=255))
    assert raw[4:6] == b"\x02\x01" and raw[22:] == b"\x01" + bytes([3, 255, 255, 254])

    # code 2: int16 little-endian, -1 = none (> 256 experts).
    t = torch.tensor([[[255, -1]], [[0x0102, 0]]])
    raw = base64.b64decode(encode_routed_experts(t, "compact", num_experts=300))
    assert raw[4:6] == b"\x02\x02"
    assert raw[22:] == b"\x01" + struct.pack("<4h", 255, -1, 0x0102, 0)
    assert raw[23:] == b"\xff\x00\xff\xff\x02\x01\x00\x00"


def test_compact_size_at_most_quarter_of_int32_for_uint8():
    # 48 layers, 1 dense: dropping it more than pays for the header.
    t = make_routing(5, 256, 48, 8, 128, dense=[0])
    c, i = encode_routed_experts(t, "compact", num_experts=128), encode_routed_experts(t, "int32")
    assert len(c) <= len(i) / 4
    # All layers MoE: only the fixed header (22 B + bitmap) above a quarter.
    t = make_routing(6, 256, 48, 8, 128)
    c, i = encode_routed_experts(t, "compact", num_experts=128), encode_routed_experts(t, "int32")
    assert len(base64.b64decode(c)) == 22 + 6 + 256 * 48 * 8
    assert len(c) <= len(i) / 4 + 40


@pytest.mark.parametrize("rows", [64, 1024, 4096])
def test_compact_size_deepseek_v3_at_most_quarter_of_int32(rows):
    # DeepSeek-V3 shape: 61 layers, 0..2 dense, 256 experts, top-8: one byte per id.
    t = make_routing(11, rows, 61, 8, 256, dense=[0, 1, 2])
    c, i = encode_routed_experts(t, "compact", num_experts=256), encode_routed_experts(t, "int32")
    assert base64.b64decode(c)[5] == 3
    assert len(base64.b64decode(c)) == 22 + 8 + rows * 58 * 8
    assert len(c) <= 0.25 * len(i)
    assert torch.equal(decode_routed_experts(c, "compact"), t.int())


# ----------------------------------------------------------------------------------- narrowest dtype


@pytest.mark.parametrize("n,dt", [(1, torch.uint8), (255, torch.uint8), (256, torch.int16),
                                  (257, torch.int16), (32767, torch.int16),
                                  (32768, torch.int16)])
def test_narrowest_dtype(n, dt):
    assert narrowest_dtype(n) == dt


@pytest.mark.parametrize("n", [0, -1, 32769, 10**6, True, 2.0])
def test_narrowest_dtype_rejects(n):
    with pytest.raises(ValueError, match="num_experts"):
        narrowest_dtype(n)


# ------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("fmt", ["json", "uint8", "", None, "INT32"])
def test_unknown_format(fmt):
    t = make_routing(7, 2, 2, 2, 4)
    with pytest.raises(ValueError, match=r"routed_experts_format.*'int32', 'compact'"):
        encode_routed_experts(t, fmt=fmt, num_experts=4)
    if fmt is not None:  # decoding with fmt=None reads the format from the payload
        with pytest.raises(ValueError, match="routed_experts_format"):
            decode_routed_experts("", fmt=fmt, num_layers=2, top_k=2)


# --------------------------------------------------------------------------- format read from the payload


@FAST
@given(routings(), st.integers(0, 2**20))
def test_decode_without_fmt_reads_compact_header(case, start):
    # decode_routed_experts(payload): a compact payload carries its shape; nothing else is needed
    t, num_experts, _ = case
    s = encode_routed_experts(t, "compact", num_experts=num_experts, start=start)
    assert routed_experts_format_of(s) is RoutedExpertsFormat.COMPACT
    assert routed_experts_format_of(s.encode("ascii")) is RoutedExpertsFormat.COMPACT
    assert torch.equal(decode_routed_experts(s), t.int())
    assert torch.equal(decode_routed_experts(s.encode("ascii")), t.int())
    rows, num_layers, top_k = t.shape
    assert decode_routed_experts(s, num_layers=num_layers, top_k=top_k).shape == t.shape
    with pytest.raises(ValueError, match=f"num_layers={num_layers}, caller expected {num_layers + 1}"):
        decode_routed_experts(s, num_layers=num_layers + 1)


@FAST
@given(routings())
def test_decode_without_fmt_reads_int32_with_the_model_shape(case):
    t, _, _ = case
    s = encode_routed_experts(t, "int32")
    assert routed_experts_format_of(s) is RoutedExpertsFormat.INT32
    rows, num_layers, top_k = t.shape
    assert torch.equal(decode_routed_experts(s, num_layers=num_layers, top_k=top_k), t.int())


def test_int32_payload_can_never_look_compact():
    # the magic as a little-endian int32 is an id no model has (ids are < 32768)
    assert int(np.frombuffer(b"REXC", "<i4")[0]) == 1_129_858_386
    t = torch.tensor([[[32767, -1], [0, 255]]])
    assert routed_experts_format_of(encode_routed_experts(t, "int32")) is RoutedExpertsFormat.INT32
    assert routed_experts_format_of("") is RoutedExpertsFormat.INT32
    assert routed_experts_format_of("UkVY") is RoutedExpertsFormat.INT32   # 3 bytes: no room for the magic


def test_int32_without_shape_names_model_info_and_spots_a_compact_payload():
    t = make_routing(12, 5, 3, 2, 8)
    with pytest.raises(ValueError, match=r"needs num_layers and top_k \(/model_info's num_hidden_layers and "
                                          r"num_experts_per_tok\)$"):
        decode_routed_experts(encode_routed_experts(t, "int32"))
    with pytest.raises(ValueError, match="starts with the compact magic"):
        decode_routed_experts(encode_routed_experts(t, "compact", num_experts=8), "int32")


@pytest.mark.parametrize("fmt", ["int32", "compact"])
@pytest.mark.parametrize("bad", [-2, 4, 1000])
def test_out_of_range_ids(fmt, bad):
    t = make_routing(8, 3, 2, 2, 4)
    t[1, 1, 0] = bad
    with pytest.raises(ValueError, match=rf"id {bad} at \[row, layer, slot\]=\[1, 1, 0\]"):
        encode_routed_experts(t, fmt=fmt, num_experts=4)


def test_int32_rejects_values_past_int32_and_below_minus_one_without_num_experts():
    with pytest.raises(ValueError, match=str(2**31)):
        encode_routed_experts(torch.tensor([[[2**31]]]), "int32")
    with pytest.raises(ValueError, match="-5"):
        encode_routed_experts(torch.tensor([[[-5]]]), "int32")


def test_encode_rejects_bad_inputs():
    t = make_routing(9, 3, 4, 2, 8, dense=[1])
    with pytest.raises(ValueError, match="num_experts is required"):
        encode_routed_experts(t, "compact")
    with pytest.raises(ValueError, match="num_experts"):
        encode_routed_experts(t, "compact", num_experts=40000)
    with pytest.raises(ValueError, match="integer"):
        encode_routed_experts(t.float(), "int32")
    with pytest.raises(ValueError, match="shape"):
        encode_routed_experts(t[0], "int32")
    with pytest.raises(ValueError, match="top_k >= 1"):
        encode_routed_experts(torch.zeros(3, 4, 0, dtype=torch.long), "int32")
    with pytest.raises(ValueError, match=r"layers \[2\] hold expert ids"):
        encode_routed_experts(t, "compact", num_experts=8, layer_ids=[0, 3])
    with pytest.raises(ValueError, match="layer_ids entry 4"):
        encode_routed_experts(t, "compact", num_experts=8, layer_ids=[0, 4])
    with pytest.raises(ValueError, match="at least one layer"):
        encode_routed_experts(t[:, [1]], "compact", num_experts=8, layer_ids=[])
    with pytest.raises(ValueError, match="twice"):
        encode_routed_experts(t, "compact", num_experts=8, layer_ids=[0, 0, 2, 3])
    with pytest.raises(ValueError, match="start"):
        encode_routed_experts(t, "compact", num_experts=8, start=-1)


def _blob(**over):
    fields = dict(magic=b"REXC", version=2, code=1, num_layers=3, top_k=2, rows=2, start=0,
                  bitmap=b"\x05", payload=bytes(2 * 2 * 2))
    fields.update(over)
    head = struct.pack("<4sBBHHIQ", fields["magic"], fields["version"], fields["code"],
                       fields["num_layers"], fields["top_k"], fields["rows"], fields["start"])
    return base64.b64encode(head + fields["bitmap"] + fields["payload"]).decode("ascii")


def test_blob_helper_is_valid():
    out = decode_routed_experts(_blob(), "compact")
    assert out.shape == (2, 3, 2) and (out[:, 1] == -1).all() and (out[:, [0, 2]] == 0).all()


@pytest.mark.parametrize("s,msg", [
    ("not base64!", "base64"),
    ("QUJD\n", "base64"),
    ("AAA", "base64"),
    ("é", "ASCII"),
    (_blob(magic=b"XXXX"), "magic"),
    (_blob(version=1), "unsupported version 1"),
    (_blob(version=3), "unsupported version 3"),
    (_blob(code=0), "dtype code"),
    (_blob(code=4), "dtype code"),
    (_blob(num_layers=0, bitmap=b""), "num_layers"),
    (_blob(payload=bytes(7)), "header says"),
    (_blob(payload=bytes(9)), "header says"),
    (_blob(bitmap=b"\x0d"), "bitmap"),
    (_blob(bitmap=b"\x00", rows=2**32 - 1, payload=b""), "names no layer"),
    (_blob(code=2, payload=struct.pack("<8h", 0, 1, 2, 3, -1, -1, -2, 0)), "< -1"),
    (base64.b64encode(b"REXC\x02").decode(), "header"),
])
def test_compact_decode_rejects_malformed(s, msg):
    with pytest.raises(ValueError, match=msg):
        decode_routed_experts(s, fmt="compact")


def test_compact_header_rejects_like_decode():
    for s in (_blob(magic=b"XXXX"), _blob(payload=bytes(7)), "AAA", "", 17):
        with pytest.raises(ValueError):
            compact_header(s)


def test_compact_decode_shape_mismatch():
    with pytest.raises(ValueError, match="num_layers=3, caller expected 4"):
        decode_routed_experts(_blob(), "compact", num_layers=4)


def test_int32_decode_rejects_malformed():
    good = encode_routed_experts(make_routing(10, 3, 4, 2, 8), "int32")
    with pytest.raises(ValueError, match="multiple of"):
        decode_routed_experts(good, "int32", num_layers=5, top_k=2)
    with pytest.raises(ValueError, match="base64"):
        decode_routed_experts(good[:-1], "int32", num_layers=4, top_k=2)
    with pytest.raises(ValueError, match="needs num_layers and top_k"):
        decode_routed_experts(good, "int32")
    with pytest.raises(ValueError, match="top_k"):
        decode_routed_experts(good, "int32", num_layers=4, top_k=0)
    with pytest.raises(ValueError, match="base64 str"):
        decode_routed_experts(None, "int32", num_layers=4, top_k=2)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_decode_fuzz_only_value_errors(data):
    for s in (base64.b64encode(data).decode(), base64.b64encode(b"REXC\x02" + data).decode()):
        for call in (lambda: decode_routed_experts(s, "compact"), lambda: compact_header(s),
                     lambda: decode_routed_experts(s, "int32", num_layers=3, top_k=2)):
            try:
                call()
            except ValueError:
                pass


@FAST
@given(routings(), st.data())
def test_truncated_or_corrupted_compact_is_value_error(case, data):
    t, num_experts, _ = case
    s = encode_routed_experts(t, "compact", num_experts=num_experts)
    raw = bytearray(base64.b64decode(s))
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(ValueError):
        decode_routed_experts(base64.b64encode(raw[:cut]).decode(), "compact")
    raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
    try:
        out = decode_routed_experts(base64.b64encode(raw).decode(), "compact")
    except ValueError:
        return
    assert out.dtype == torch.int32 and out.dim() == 3
