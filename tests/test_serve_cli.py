"""`rollout-serve`'s command line as a user meets it: --help (every flag with its help and default),
SGLang's flags (accepted where they mean the same here, refused by name otherwise), --config presets,
and startup failures: one line on stderr and exit code 2 (a flag) or 1 (startup), Ctrl-C 130."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from rollout.config import EngineConfig
from rollout.config.engine_cli import engine_flags
from rollout.server.args import ServerArgs
from server_proc import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
TINY_PRESET = ROOT / "configs" / "engine" / "tiny-moe.yaml"
# the flags a first look at --help found without help text or default
ONCE_BARE = ("--dtype", "--max-running-requests", "--context-length", "--disable-prefix-caching", "--dp-size", "--seed",
             "--log-level")


def _serve(*flags: str, cwd: Path = ROOT, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "rollout.server", "--port", "0", *flags], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _one_line(err: str) -> str:
    assert err.count("\n") == 1 and err.endswith("\n") and "Traceback" not in err, err
    return err.rstrip("\n")


# ---- --help ----------------------------------------------------------------------------------------
def test_help_lists_every_flag_with_its_help_and_default():
    r = _serve("--help")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    shown = 0
    for action in ServerArgs.parser()._actions:
        if action.help == argparse.SUPPRESS or not action.option_strings:
            continue
        for option in action.option_strings:
            assert option in r.stdout, option
        if action.dest == "help":
            continue
        assert "(default: " in action.help and action.help.endswith(")"), (action.option_strings, action.help)
        shown += 1
    assert shown >= 50
    text = " ".join(r.stdout.split())
    for option in ONCE_BARE:
        action = next(a for a in ServerArgs.parser()._actions if option in a.option_strings)
        assert " ".join(action.help.split()) in text, option
    assert "--config FILE" in r.stdout and "never downloaded" in text


def test_the_command_line_is_checked_before_torch_is_imported():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    code = ("import sys; from rollout.server.startup import main; from rollout.server.args import ServerArgs; "
            "ServerArgs.from_cli(['--config', 'configs/engine/tiny-moe.yaml']); print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout == "False\n", r.stderr


# ---- SGLang's flags --------------------------------------------------------------------------------
def test_sglang_flags_that_mean_the_same_are_accepted():
    args = ServerArgs.from_cli(["--tp-size", "1", "--tensor-parallel-size", "1", "--pp-size", "1",
                                "--data-parallel-size", "2", "--ep", "2", "--enable-dp-attention", "--trust-remote-code",
                                "--skip-server-warmup", "--kv-cache-dtype", "auto", "--disable-radix-cache",
                                "--mem-fraction-static", "0.8", "--random-seed", "3", "--schedule-policy", "lpm",
                                "--num-continuous-decode-steps", "4"])
    e = args.engine
    assert (e.dp_size, e.enable_prefix_caching, e.mem_fraction_static, e.seed) == (2, False, 0.8, 3)
    assert args.engine == EngineConfig(dp_size=2, enable_prefix_caching=False, mem_fraction_static=0.8, seed=3,
                                       schedule_policy="lpm")


def test_sglang_cuda_graph_flags_choose_the_decode_buckets():
    """SGLang's --cuda-graph-bs / --cuda-graph-max-bs / --disable-cuda-graph(-padding) choose the decode
    static-shape buckets as SGLang chooses its capture sizes (capped at max_running_requests)."""
    def buckets(*argv):
        return ServerArgs.from_cli(list(argv)).engine.decode_graph_batch_sizes

    assert buckets("--cuda-graph-bs", "8", "1", "2") == (1, 2, 8) == buckets("--decode-graph-batch-sizes", "1", "2", "8")
    assert buckets("--cuda-graph-max-bs", "48") == (1, 2, 4, 8, 12, 16, 24, 32, 40, 48)
    assert buckets("--cuda-graph-max-bs", "600", "--max-running-requests", "1024")[-6:] == (464, 480, 496, 512,
                                                                                              544, 576)
    assert buckets("--cuda-graph-max-bs", "300")[-1] == 128            # max_running_requests' default
    assert buckets("--cuda-graph-max-bs", "5", "--disable-cuda-graph-padding") == (1, 2, 3, 4, 5)
    assert buckets("--cuda-graph-max-bs", "16", "--speculative-algorithm", "NGRAM") == (
        1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16)
    assert buckets("--cuda-graph-max-bs", "16", "--cuda-graph-bs", "3") == (3,)       # the list wins, as in SGLang
    assert buckets("--cuda-graph-max-bs", "16", "--disable-cuda-graph") == ()
    assert buckets("--cuda-graph-max-bs", "8", "--enable-torch-compile", "--torch-compile-max-bs", "2") == (1, 2, 4, 8)
    # the flags an engine process is started with give the same config (the derived buckets with them)
    for cfg in (EngineConfig(cuda_graph_max_bs=8), EngineConfig(cuda_graph_max_bs=8, disable_cuda_graph=True)):
        assert ServerArgs.from_cli(engine_flags(cfg)).engine == cfg
    for kw, says in ((dict(cuda_graph_max_bs=0), "cuda_graph_max_bs"), (dict(disable_cuda_graph="yes"), "disable_cuda_graph"),
                     (dict(disable_cuda_graph=True, enable_torch_compile=True), "disable_cuda_graph")):
        with pytest.raises(ValueError, match=says):
            EngineConfig(**kw)


@pytest.mark.parametrize("argv, says", [
    (["--pp-size", "2"], "--pp-size 2: pipeline parallelism is not supported; use --dp-size"),
    (["--dp-size", "2", "--ep-size", "4"], "--ep-size 4: the experts are sharded over the data-parallel ranks: the "
                                           "expert-parallel size is --dp-size (2); set --dp-size instead"),
    (["--kv-cache-dtype", "fp8_e5m2"], "--kv-cache-dtype fp8_e5m2: the KV cache holds the model's dtype; use --dtype"),
    (["--quantization", "awq"], "argument --quantization: invalid choice: 'awq'"),
    (["--speculative-algorithm", "EAGLE3"], "speculative_algorithm='EAGLE3': EAGLE3 draft heads are not supported; "
                                            "use NEXTN on a checkpoint with MTP layers, NGRAM, or STANDALONE with a "
                                            "small draft checkpoint"),
    (["--speculative-algorithm", "NGRAM", "--speculative-eagle-topk", "4"],
     "speculative_eagle_topk must be 1 (chain drafts; tree drafts are not supported), got 4"),
    (["--num-continuous-decode-steps", "0"], "--num-continuous-decode-steps 0: must be at least 1"),
    (["--schedule-policy", "dfs-weight"], "argument --schedule-policy: invalid choice: 'dfs-weight'"),
    (["--enable-lora"], "--enable-lora: LoRA adapters are not supported; merge the adapter into the checkpoint"),
    (["--lora-paths", "a", "b"], "--lora-paths a b: LoRA adapters are not supported"),
    (["--mem-fraction-static", "0.9", "--kv-cache-bytes", "1000000"],
     "mem_fraction_static=0.9 and kv_cache_bytes=1000000 both size the KV cache: give one"),
    (["--mem-fraction-static", "0"], "mem_fraction_static must be a number in (0, 1] or None, got 0.0"),
])
def test_sglang_flags_that_mean_something_else_are_refused_by_name(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        ServerArgs.from_cli(argv)
    assert e.value.code == 2
    assert _one_line(capsys.readouterr().err).startswith(f"rollout-serve: error: {says}")


def test_tp_size_2_is_refused_in_one_line_by_the_real_command():
    r = _serve("--tp-size", "2")
    assert r.returncode == 2 and r.stdout == ""
    assert _one_line(r.stderr) == ("rollout-serve: error: --tp-size 2: tensor parallelism is not supported; use "
                                   "--dp-size (data-parallel ranks, the experts sharded among them)")


def test_unknown_flag_is_one_line_naming_the_closest():
    r = _serve("--max-runing-requests", "8")
    assert r.returncode == 2
    assert _one_line(r.stderr) == ("rollout-serve: error: unrecognized arguments: --max-runing-requests 8 (did you "
                                   "mean --max-running-requests?); --help lists the flags")


# ---- --config --------------------------------------------------------------------------------------
def test_config_preset_with_command_line_overrides():
    preset = ServerArgs.from_cli(["--config", str(TINY_PRESET)]).engine
    assert preset.model_path == str(ROOT / "configs" / "tiny-moe") and preset.enable_return_routed_experts
    assert (preset.max_running_requests, preset.chunked_prefill_size, preset.moe_backend) == (32, 256, "torch")
    args = ServerArgs.from_cli(["--config", str(TINY_PRESET), "--max-running-requests", "7",
                                "--chunked-prefill-size", "-1", "--disable-prefix-caching", "--port", "0"])
    assert args.engine == preset.replace(max_running_requests=7, chunked_prefill_size=None, enable_prefix_caching=False)
    assert args.port == 0


def test_config_file_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  dp_size: 0\n")
    for path, says in ((bad, f"--config {bad}: engine.dp_size: dp_size must be an integer >= 1, got 0"),
                       (tmp_path / "none.yaml", f"--config {tmp_path / 'none.yaml'}: cannot read")):
        with pytest.raises(SystemExit) as e:
            ServerArgs.from_cli(["--config", str(path)])
        assert e.value.code == 2
        assert _one_line(capsys.readouterr().err).startswith(f"rollout-serve: error: {says}")


def test_server_starts_from_a_preset_and_the_command_line_wins():
    with ServerProcess(["--config", "configs/engine/tiny-moe.yaml", "--max-running-requests", "7",
                        "--tp-size", "1", "--trust-remote-code", "--disable-radix-cache",
                        "--cuda-graph-bs", "1", "2", "4"]) as srv:
        info = httpx.get(srv.url + "/server_info", timeout=30).json()
        assert (info["max_running_requests"], info["chunked_prefill_size"]) == (7, 256)
        assert info["disable_radix_cache"] is True and info["tp_size"] == 1 and info["max_total_tokens"] == 8192
        # SGLang's spelling of the decode buckets, over the preset's
        assert (info["cuda_graph_bs"], info["cuda_graph_max_bs"], info["disable_cuda_graph"]) == ([1, 2, 4], 4, False)
        r = httpx.post(srv.url + "/generate", timeout=60, json={
            "input_ids": [5, 6, 7], "return_routed_experts": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}})
        assert r.status_code == 200 and r.json()["meta_info"]["routed_experts"], r.text
        state = httpx.get(srv.url + "/server_info", timeout=30).json()["internal_states"][0]
        assert state["forwards_decode_graph"] >= 1


# ---- startup failures ------------------------------------------------------------------------------
def test_missing_model_directory_is_one_line_exit_1():
    r = _serve("--model-path", "/nonexistent")
    assert r.returncode == 1
    assert _one_line(r.stderr) == ("rollout-serve: error: --model-path '/nonexistent': no such directory (a "
                                   "checkpoint directory with config.json, *.safetensors and tokenizer.json)")


def test_hub_id_says_weights_are_never_downloaded(tmp_path):
    r = _serve("--model-path", "Qwen/Qwen3-30B-A3B", cwd=tmp_path)
    assert r.returncode == 1
    line = _one_line(r.stderr)
    assert line.startswith("rollout-serve: error: --model-path 'Qwen/Qwen3-30B-A3B' is not a local directory")
    assert "weights are never downloaded" in line
    assert "huggingface-cli download Qwen/Qwen3-30B-A3B --local-dir /models/Qwen3-30B-A3B" in line
    assert "(--model-path /models/Qwen3-30B-A3B)" in line


def test_failures_while_the_engine_starts_are_one_line_exit_1(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2}))
    r = _serve("--model-path", str(tmp_path))
    assert r.returncode == 1
    assert _one_line(r.stderr).startswith("rollout-serve: error: unsupported architecture 'LlamaForCausalLM'; "
                                          "supported: Qwen3MoeForCausalLM")
    # an error raised in the engine process (the capture buffer past its cap)
    r = _serve("--enable-return-routed-experts", "--max-capture-buffer-rows", "1")
    assert r.returncode == 1 and "listening" not in r.stdout
    assert "max_capture_buffer_rows" in _one_line(r.stderr)


def _engine_processes(pid: int) -> list[psutil.Process]:
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for c in children:
        try:
            if "rollout.core.engine_proc" in " ".join(c.cmdline()):
                out.append(c)
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.parametrize("when", ["importing", "engine starting"])
def test_ctrl_c_during_startup_is_one_line_exit_130(when):
    """Ctrl-C in a terminal: SIGINT to the whole foreground process group, engine processes included."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # NOTE: as a terminal starts it: SIGINT at its default (a suite run as a background job of a
    # non-interactive shell inherits SIGINT ignored, and so would the server)
    p = subprocess.Popen([sys.executable, "-m", "rollout.server", "--port", "0"], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    engines: list[psutil.Process] = []
    try:
        if when == "importing":
            time.sleep(1.0)   # NOTE: past the interpreter's own start, well before the model loads
        else:
            deadline = time.monotonic() + 120
            while not engines and p.poll() is None and time.monotonic() < deadline:
                engines = _engine_processes(p.pid)
                time.sleep(0.01)
            assert engines, "no engine process started"
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 130 and "listening" not in out, (p.returncode, out, err)
    assert _one_line(err) == "rollout-serve: interrupted before the server was up"
    psutil.wait_procs(engines, timeout=10)
    assert not any(e.is_running() and e.status() != psutil.STATUS_ZOMBIE for e in engines)


# ---- --mem-fraction-static -------------------------------------------------------------------------
def test_mem_fraction_static_sizes_the_kv_cache_from_free_memory(monkeypatch):
    from rollout.batch.kv_pool import KVPool
    from rollout.core import kv_budget
    from rollout.core.engine_core import EngineCore

    free = 64 * 2**20
    monkeypatch.setattr(kv_budget, "host_available_bytes", lambda: free)
    core = EngineCore(EngineConfig(mem_fraction_static=0.5))
    weights = sum(t.numel() * t.element_size() for t in (*core.model.parameters(), *core.model.buffers()))
    info = core.info
    per_slot = KVPool.bytes_per_slot(num_layers=info.num_hidden_layers, num_kv_heads=info.num_kv_heads,
                                     head_dim=info.head_dim, dtype=next(core.model.parameters()).dtype,
                                     latent_dim=info.kv_latent_dim)
    assert core.kv_pool.num_slots == (free // 2 - weights) // per_slot > 1000
    monkeypatch.setattr(kv_budget, "host_available_bytes", lambda: weights)
    with pytest.raises(ValueError, match=r"^mem_fraction_static=0.5: that share of the .* free on cpu at startup "
                                         r"is .*, which leaves no room for a KV cache beside the model's"):
        EngineCore(EngineConfig(mem_fraction_static=0.5))
