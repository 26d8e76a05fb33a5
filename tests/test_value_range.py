"""rollout.value_range: one message for a value outside what a field allows, whichever config checks it
(EngineConfig, SamplingParams, ServerArgs, TrainConfig and its LossConfig)."""
from __future__ import annotations

import math

import pytest

from rollout.config import EngineConfig
from rollout.sampling_params import SamplingParams
from rollout.server.args import ServerArgs
from rollout.value_range import check_choice, check_range, describe_range
from trainer_bridge.losses import LossConfig
from trainer_bridge.train_config import ConfigError, TrainConfig


@pytest.mark.parametrize("kw, text", [
    ({"lo": 1, "integer": True}, "an integer >= 1"),
    ({"lo": 0, "hi": 65535, "integer": True}, "an integer in [0, 65535]"),
    ({"lo": 0.0, "hi": 1.0, "lo_open": True}, "a number in (0, 1]"),
    ({"lo": 0, "hi": 1, "hi_open": True}, "a number in [0, 1)"),
    ({"lo": 0, "lo_open": True, "or_none": True}, "a number > 0 or None"),
    ({"hi": 2.5}, "a number <= 2.5"),
    ({}, "a number"),
])
def test_describe_range(kw, text):
    assert describe_range(**kw) == text


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "3", None, [1]])
def test_out_of_range_names_field_range_and_value(value):
    with pytest.raises(ValueError) as e:
        check_range("dp_size", value, 1, integer=True)
    assert str(e.value) == f"dp_size must be an integer >= 1, got {value!r}"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.5, 1.5, 0.0, False])
def test_numbers_out_of_range_and_not_finite(value):
    with pytest.raises(ValueError, match=r"^top_p must be a number in \(0, 1\], got "):
        check_range("top_p", value, 0.0, 1.0, lo_open=True)


def test_in_range_values_pass_through():
    assert check_range("port", 0, 0, 65535, integer=True) == 0
    assert check_range("top_p", 1, 0.0, 1.0, lo_open=True) == 1
    assert check_range("x", None, 1, or_none=True) is None
    assert check_choice("dtype", "auto", ("auto", "float32")) == "auto"
    assert check_choice("backend", None, ("torch",), or_none=True) is None


def test_allowed_why_and_error_class():
    with pytest.raises(ValueError, match=r"^top_k must be -1 \(disabled\) or a positive integer, got -2$"):
        check_range("top_k", -2, -1, integer=True, allowed="-1 (disabled) or a positive integer")
    with pytest.raises(ConfigError, match=r"^eval_every must be an integer >= 0 \(0: only at the ends\), got -1$"):
        check_range("eval_every", -1, 0, integer=True, why="0: only at the ends", error=ConfigError)


def test_choice_matches_type_as_well_as_value():
    with pytest.raises(ValueError, match=r"^zero_stage must be one of \(0, 1, 2\), got True$"):
        check_choice("zero_stage", True, (0, 1, 2))
    with pytest.raises(ValueError, match=r"^moe_backend must be one of \('torch', 'triton'\) or None \(by device\), "
                                         r"got 'cutlass'$"):
        check_choice("moe_backend", "cutlass", ("torch", "triton"), or_none=True, why="by device")


@pytest.mark.parametrize("make, says", [
    (lambda: EngineConfig(dp_size=0), "dp_size must be an integer >= 1, got 0"),
    (lambda: EngineConfig(max_total_tokens=1), "max_total_tokens must be an integer >= 2 or None, got 1"),
    (lambda: EngineConfig(mem_fraction_static=1.5), "mem_fraction_static must be a number in (0, 1] or None, got 1.5"),
    (lambda: EngineConfig(dtype="fp8"), "dtype must be one of ('auto', 'float32', 'bfloat16', 'float16'), got 'fp8'"),
    (lambda: SamplingParams(temperature=-0.1), "temperature must be a number in [0, 100], got -0.1"),
    (lambda: SamplingParams(top_p=math.nan), "top_p must be a number in (0, 1], got nan"),
    (lambda: SamplingParams(n=0), "n must be an integer in [1, 1024], got 0"),
    (lambda: SamplingParams(logprob_mode="x"), "logprob_mode must be one of ('raw', 'scaled', 'processed'), got 'x'"),
    (lambda: ServerArgs(port=70000), "port must be an integer in [0, 65535], got 70000"),
    (lambda: ServerArgs(shutdown_drain_s=-1), "shutdown_drain_s must be a number in [0, 86400] (seconds), got -1"),
    (lambda: ServerArgs(log_level="loud"), "log_level must be one of ('critical', 'error', 'warning', 'info', "
                                           "'debug'), got 'loud'"),
    (lambda: TrainConfig(steps=0), "steps must be an integer >= 1, got 0"),
    (lambda: TrainConfig(lr=0.0), "lr must be a number > 0, got 0.0"),
    (lambda: TrainConfig(adam_betas=(0.9, 1.0)), "adam_betas must be a number in [0, 1), got 1.0"),
    (lambda: LossConfig(clip_eps=-1), "clip_eps must be a number >= 0, got -1"),
    (lambda: LossConfig(tis_cap=0), "tis_cap must be a number > 0 or None, got 0"),
])
def test_every_config_says_it_the_same_way(make, says):
    with pytest.raises(ValueError) as e:
        make()
    assert str(e.value) == says
