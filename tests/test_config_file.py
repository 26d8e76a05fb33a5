"""configs/engine/*.yaml: loading, validation errors naming the key, and `python -m rollout.config --show`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from capture.buffer_sizing import capture_buffer_rows
from rollout.config import EngineConfig
from rollout.config_file import (ConfigFileError, implied_sizes, load_engine_config, load_engine_config_file,
                                 serve_flags)
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
    assert args.engine_config() == cfg


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
