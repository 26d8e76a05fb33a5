"""configs/engine/*.yaml: loading, validation errors naming the key, and `python -m rollout.config --show`;
the engine flags generated from EngineConfig's fields (rollout/config/engine_cli.py)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from capture.buffer_sizing import capture_buffer_rows
from rollout.config import DEFAULT_MODEL_PATH, EngineConfig
from rollout.config.config_file import (ConfigFileError, ModelShape, implied_sizes, load_engine_config, load_engine_config_file,
                                        serve_flags)
from rollout.config.engine_cli import add_engine_arguments, engine_config_from_args, engine_flags
from rollout.config.flag import flag_of
from rollout.server.args import ServerArgs

ROOT = Path(__file__).resolve().parent.parent
PRESETS = sorted((ROOT / "configs" / "engine").glob("*.yaml"))


def _write(tmp_path: Path, text: str) -> str:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return str(p)


def test_presets_exist():
    assert {p.name for p in PRESETS} >= {"tiny-moe.yaml", "qwen3-30b-a3b.yaml", "deepseek-v3.yaml"}


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_presets_load_and_round_trip_through_serve_flags(path):
    cfg = load_engine_config(str(path))
    assert isinstance(cfg, EngineConfig) and cfg.enable_return_routed_experts
    args = ServerArgs.from_cli(serve_flags(cfg))
    assert args.engine == cfg


def test_tiny_preset_sizes_match_a_real_engine():
    """--show's numbers are the ones a running engine allocates (same ForwardShapeLimits)."""
    from rollout.core.engine_core import EngineCore

    cf = load_engine_config_file(str(ROOT / "configs/engine/tiny-moe.yaml"))
    sizes = implied_sizes(cf)
    core = EngineCore(cf.config)
    assert sizes["capture_buffer_rows"] == core.capturer.buffer.rows == capture_buffer_rows(core.forward_shape_limits)
    assert sizes["capture_buffer_bytes_per_rank"] == core.capturer.buffer.nbytes
    assert sizes["host_store_bytes_per_slot"] == core.capturer.store.bytes_per_slot
    assert sizes["host_store_bytes_per_rank"] == core.capturer.store.nbytes


def test_large_presets_sizes():
    q = implied_sizes(load_engine_config_file(str(ROOT / "configs/engine/qwen3-30b-a3b.yaml")))
    assert q["capture_buffer_rows"] == 8 * 8192 and q["host_store_bytes_per_slot"] == 48 * 8 * 1
    assert q["host_store_dtype"] == "uint8" and q["capture_buffer_fits_cap"]
    d = implied_sizes(load_engine_config_file(str(ROOT / "configs/engine/deepseek-v3.yaml")))
    assert d["num_moe_layers"] == 58 and d["host_store_dtype"] == "int16"   # 256 experts + sentinel
    assert d["host_store_bytes_per_slot"] == 61 * 8 * 2
    assert d["capture_buffer_rows"] == 16 * 4096


def test_show_command_prints_sizes():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-m", "rollout.config", "--show", "configs/engine/qwen3-30b-a3b.yaml"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "capture buffer rows        65536" in r.stdout
    assert "host store bytes per slot  384" in r.stdout
    r = subprocess.run([sys.executable, "-m", "rollout.config", "--show", "configs/engine/tiny-moe.yaml", "--json"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and json.loads(r.stdout)["host_store_bytes_per_slot"] == 16


@pytest.mark.parametrize("text, key", [
    ("engine:\n  dp_sise: 2\n", "engine.dp_sise: unknown key"),
    ("engin:\n  dp_size: 2\n", "engin: unknown top-level key"),
    ("engine:\n  dp_size: 0\n", "engine.dp_size: dp_size must be an integer >= 1"),
    ("engine:\n  dp_size: two\n", "engine.dp_size:"),
    ("engine:\n  decode_graph_batch_sizes: [4, 4]\n", "engine.decode_graph_batch_sizes:"),
    ("engine:\n  enable_return_routed_experts: yes please\n", "engine.enable_return_routed_experts:"),
    ("engine:\n  dtype: fp8\n", "engine.dtype:"),
    ("engine: [1, 2]\n", "engine: must be a mapping"),
    ("- 1\n", "the top level must be a mapping"),
    ("engine:\n  dp_size: [\n", "not valid YAML"),
    ("model_shape:\n  num_layers: 4\n", "model_shape.num_layers: unknown key"),
    ("model_shape:\n  num_hidden_layers: 4\n", "missing key 'num_experts'"),
])
def test_errors_name_the_key(tmp_path, text, key):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigFileError) as e:
        implied_sizes(load_engine_config_file(path))
    assert path in str(e.value) and key in str(e.value), str(e.value)


def test_missing_file_and_missing_shape(tmp_path):
    with pytest.raises(ConfigFileError, match="cannot read"):
        load_engine_config(str(tmp_path / "nope.yaml"))
    path = _write(tmp_path, "engine:\n  model_path: /no/such/model\n")
    with pytest.raises(ConfigFileError, match="model_shape: no model_shape section"):
        implied_sizes(load_engine_config_file(path))


def test_relative_paths_resolve_against_the_file_and_overrides_win(tmp_path):
    (tmp_path / "sub").mkdir()
    p = tmp_path / "sub" / "c.yaml"
    p.write_text("engine:\n  model_path: ../m\n  dp_size: 2\n")
    cfg = load_engine_config(str(p), dp_size=4)
    assert cfg.model_path == str(tmp_path / "m") and cfg.dp_size == 4
    with pytest.raises(ConfigFileError, match="engine.bogus: unknown key"):
        load_engine_config(str(p), bogus=1)


def test_show_exit_code_and_message_on_error(tmp_path):
    path = _write(tmp_path, "engine:\n  max_running_requests: -3\n")
    r = subprocess.run([sys.executable, "-m", "rollout.config", "--show", path], cwd=ROOT,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "engine.max_running_requests" in r.stderr, r.stderr


# ---- the engine flags, generated from EngineConfig's fields -------------------------------------------

# rollout-serve's engine group: option -> (default, nargs, type, choices); every flag's help ends with
# "(default: ...)" (test_help_lists_every_flag_with_its_default)
ENGINE_FLAGS_BEFORE = {
    "--model-path": (DEFAULT_MODEL_PATH, None, None, None),
    "--tokenizer-path": (None, None, None, None),
    "--dtype": ("auto", None, None, ("auto", "float32", "bfloat16", "float16")),
    "--quantization": (None, None, None, ("fp8",)),
    "--device": ("cpu", None, None, None),
    "--dp-size": (1, None, int, None),
    "--nnodes": (1, None, int, None),
    "--node-rank": (0, None, int, None),
    "--dist-init-addr": (None, None, None, None),
    "--dist-timeout": (300, None, int, None),
    "--cpu-threads": (None, None, int, None),
    "--cpu-reserve": (0, None, int, None),
    "--cpu-affinity": ([], "*", int, None),
    "--enable-return-routed-experts": (False, 0, None, None),
    "--max-running-requests": (128, None, int, None),
    "--chunked-prefill-size": (1024, None, int, None),
    "--max-total-tokens": (None, None, int, None),
    "--kv-cache-bytes": (None, None, int, None),
    "--mem-fraction-static": (None, None, float, None),
    "--context-length": (None, None, int, None),
    "--disable-prefix-caching": (False, 0, None, None),
    "--decode-graph-batch-sizes": ([], "*", int, None),
    "--cuda-graph-max-bs": (None, None, int, None),
    "--disable-cuda-graph-padding": (False, 0, None, None),
    "--disable-cuda-graph": (False, 0, None, None),
    "--prefill-graph-token-sizes": ([], "*", int, None),
    "--enable-torch-compile": (False, 0, None, None),
    "--torch-compile-max-bs": (32, None, int, None),
    "--enable-overlap-schedule": (False, 0, None, None),
    "--disable-overlap-schedule": (False, 0, None, None),
    "--seed": (0, None, int, None),
    "--weight-version": ("default", None, None, None),
    "--stream-interval": (1, None, int, None),
    "--schedule-policy": ("fcfs", None, None, ("fcfs", "lpm", "lof", "random")),
    "--max-capture-buffer-rows": (None, None, int, None),
    "--enable-profile-graph-capture": (False, 0, None, None),
    "--profile-graph-capture-dir": (None, None, None, None),
    "--moe-backend": (None, None, None, ("torch", "triton")),
    "--attention-backend": (None, None, None, ("torch", "triton", "flashinfer")),
    "--enable-deterministic-inference": (False, 0, None, None),
    "--allow-auto-truncate": (False, 0, None, None),
    "--weight-update-bucket-bytes": (512 * 2**20, None, int, None),
    "--speculative-algorithm": (None, None, None, None),
    "--speculative-num-draft-tokens": (None, None, int, None),
    "--speculative-num-steps": (None, None, int, None),
    "--speculative-eagle-topk": (None, None, int, None),
    "--speculative-draft-model-path": (None, None, None, None),
    "--speculative-ngram-min-match-window-size": (1, None, int, None),
    "--speculative-ngram-max-match-window-size": (12, None, int, None),
}
# SGLang's spellings of the same settings
ENGINE_ALIASES = {"--disable-prefix-caching": ["--disable-radix-cache"], "--dp-size": ["--data-parallel-size"],
                  "--seed": ["--random-seed"], "--decode-graph-batch-sizes": ["--cuda-graph-bs"]}
CLI_OFF: set[str] = set()   # fields without a rollout-serve flag (no_flag)
# SGLang's switches the other way, accepted and left out of --help (Flag.off_aliases)
ENGINE_HIDDEN = {"--disable-overlap-schedule"}


def _engine_group(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    group = next(g for g in parser._action_groups if g.title == "engine")
    return {a.option_strings[0]: a for a in group._group_actions}


def test_engine_group_is_unchanged():
    """rollout-serve's engine flags keep their names, defaults, value types, choices and help."""
    actions = _engine_group(ServerArgs.parser())
    assert set(actions) == set(ENGINE_FLAGS_BEFORE)
    for option, (default, nargs, type_, choices) in ENGINE_FLAGS_BEFORE.items():
        a = actions[option]
        assert (a.default, a.nargs, a.type, a.choices) == (default, nargs, type_, choices), option
        assert a.option_strings[1:] == ENGINE_ALIASES.get(option, []), option
    help_text = ServerArgs.parser().format_help()
    assert all((option in help_text) != (option in ENGINE_HIDDEN) for option in ENGINE_FLAGS_BEFORE)


def test_every_engine_field_has_a_flag_or_says_why_not():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    dests = {a.dest for a in _engine_group(parser).values()}
    off = set()
    for f in dataclasses.fields(EngineConfig):
        fl = flag_of(f)
        if fl is None:
            off.add(f.name)
            assert f.metadata["no_flag"], f.name   # the reason
        else:
            assert fl.dest(f) in dests, f.name
    assert off == CLI_OFF
    assert len(dests) == len(dataclasses.fields(EngineConfig)) - len(CLI_OFF)


ROUND_TRIP = [
    EngineConfig(),
    EngineConfig(chunked_prefill_size=None, enable_prefix_caching=False, dp_size=4, seed=7),
    EngineConfig(model_path="/m", tokenizer_path="/t", dtype="bfloat16", device="cuda:1", max_total_tokens=4096,
                 kv_cache_bytes=2**20, context_length=512, max_capture_buffer_rows=10_000),
    EngineConfig(decode_graph_batch_sizes=(8, 1, 4), prefill_graph_token_sizes=(64,), enable_return_routed_experts=True,
                 enable_profile_graph_capture=True, profile_graph_capture_dir="/tmp/p", weight_version="v2",
                 stream_interval=3, max_running_requests=9, moe_backend="triton", attention_backend="flashinfer"),
    EngineConfig(chunked_prefill_size=1, moe_backend="torch", attention_backend="torch", dtype="float32"),
    EngineConfig(dp_size=16, nnodes=2, node_rank=1, dist_init_addr="10.0.0.1:5000", dist_timeout=60),
]


@pytest.mark.parametrize("cfg", ROUND_TRIP, ids=range(len(ROUND_TRIP)))
def test_flags_round_trip(cfg):
    flags = engine_flags(cfg)
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config_from_args(parser.parse_args(flags)) == cfg
    assert ServerArgs.from_cli(flags).engine == cfg
    assert serve_flags(cfg) == flags and (flags == []) == (cfg == EngineConfig())


def test_flags_spellings():
    assert engine_flags(EngineConfig(enable_prefix_caching=False, chunked_prefill_size=None)) == [
        "--chunked-prefill-size", "-1", "--disable-prefix-caching"]
    assert ServerArgs.from_cli(["--chunked-prefill-size", "0"]).engine.chunked_prefill_size is None
    # NOTE: the Python API as SGLang's Engine and as the flag: -1 (any value <= 0) means whole prompts
    assert EngineConfig(chunked_prefill_size=-1) == EngineConfig(chunked_prefill_size=0) == \
        EngineConfig(chunked_prefill_size=None)
    with pytest.raises(ValueError, match=r"^chunked_prefill_size must be an integer >= 1 .* or None, -1 or 0"):
        EngineConfig(chunked_prefill_size=True)
    assert engine_flags(EngineConfig(decode_graph_batch_sizes=[2, 1])) == ["--decode-graph-batch-sizes", "1", "2"]


@pytest.mark.parametrize("argv, says", [
    (["--dp-size", "0"], "dp_size must be an integer >= 1, got 0"),
    (["--dtype", "foo"], "argument --dtype: invalid choice: 'foo'"),
    (["--max-total-tokens", "1"], "max_total_tokens must be an integer >= 2"),
    (["--decode-graph-batch-sizes", "4", "4"], "decode_graph_batch_sizes must not repeat values"),
    (["--device", "tpu"], "device must be 'cpu' or 'cuda[:N]'"),
    (["--cpu-affinity", "-1"], "cpu_affinity must be an integer >= 0"),
    (["--cpu-affinity", "0", "--dp-size", "2"], "cpu_affinity must list a multiple of dp_size=2 CPUs"),
    (["--seed", "x"], "argument --seed/--random-seed: invalid int value: 'x'"),
    (["--port", "70000"], "port must be an integer in [0, 65535]"),
])
def test_bad_flag_exits_2_naming_the_field(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        ServerArgs.from_cli(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("rollout-serve: error: ") and says in err and err.count("\n") == 1, err


def test_flags_command_and_no_import_cycle():
    """`python -m rollout.config --flags` prints the preset's flags; the package runs as __main__
    without runpy's "found in sys.modules" warning (which an import cycle through it gives)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "rollout.config", "--flags",
                        "configs/engine/tiny-moe.yaml"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout == ("--max-running-requests 32 --chunked-prefill-size 256 --max-total-tokens 8192 "
                        "--enable-return-routed-experts --decode-graph-batch-sizes 1 2 4 8 16 32 "
                        "--prefill-graph-token-sizes 64 128 256 --moe-backend torch --attention-backend torch\n")
    for module in ("rollout.config.config_file", "rollout.config.engine_cli", "rollout.server.args"):
        r = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, (module, r.stderr)


@pytest.mark.parametrize("preset,config", [
    ("gpt-oss-20b.yaml", ("GptOssConfig", dict(num_hidden_layers=24, num_local_experts=32))),
    ("gpt-oss-120b.yaml", ("GptOssConfig", {})),       # transformers' defaults are gpt-oss-120b's
    ("minimax-m2.yaml", ("MiniMaxM2Config", {})),       # and MiniMax-M2's
])
def test_new_architecture_presets_match_their_configs(preset, config):
    """The preset's model_shape is what the architecture's own config.json implies (the same rule:
    capture/routing_shape.py), and the engine's spec reads that config the same way."""
    import transformers

    from rollout.models.registry import model_spec

    name, kw = config
    hf = getattr(transformers, name)(**kw).to_dict()
    hf["architectures"] = [name.replace("Config", "ForCausalLM")]
    shape = load_engine_config_file(str(ROOT / "configs" / "engine" / preset)).model_shape
    assert shape == ModelShape.from_dict(hf, "config.json")
    spec = model_spec(hf, None)
    assert (spec.num_hidden_layers, spec.num_experts, spec.top_k, spec.moe_layer_ids) == \
        (shape.num_hidden_layers, shape.num_experts, shape.num_experts_per_tok, shape.moe_layer_ids)
    assert (spec.num_kv_heads, spec.head_dim) == (shape.num_key_value_heads, shape.head_dim)
