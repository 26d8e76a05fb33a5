from setuptools import find_packages, setup

setup(
    name="rollout",
    version="0.1.0",
    description="RL rollout engine for Mixture-of-Experts models with routed-expert capture",
    python_requires=">=3.10",
    packages=find_packages(include=["rollout", "rollout.*", "capture", "capture.*",
                                    "trainer_bridge", "trainer_bridge.*"]),
    # NOTE: torch is a lower bound on purpose: GPU users bring their own CUDA build, and the
    # scripts install the pinned CPU wheel first when no torch is present.
    install_requires=[
        "torch>=2.4",
        "numpy>=1.24",
        "safetensors>=0.4",
        "tokenizers>=0.19",
        "transformers>=4.56",
        "fastapi>=0.110",
        "uvicorn[standard]>=0.29",   # httptools + uvloop: the HTTP parser and event loop in C
        "orjson>=3.9",        # response JSON (logprob lists), several times faster than json
        "httpx>=0.27",
        "pyyaml>=6.0",
        "tqdm>=4.66",
        "pyzmq>=25",          # front end <-> engine process messages (rollout/ipc/)
        "msgspec>=0.18",      # their typed msgpack encoding
        "pydantic>=2",        # the server's request models (/openapi.json)
        "google-re2>=1.1",    # stop_regex: linear-time matching (rollout/stop_pattern.py)
        "prometheus_client>=0.20",   # /metrics (rollout/server/metrics.py)
    ],
    extras_require={
        "train": ["deepspeed>=0.15", "datasets>=2.19", "wandb>=0.17"],
        "gpu": ["flashinfer-python>=0.2", "triton>=3.0"],
        # NOTE: triton in dev too: CI proves the kernels on CPU under its interpreter (Linux wheels only)
        "dev": ["pytest>=8", "aiohttp>=3.9", "hypothesis>=6.100", "pytest-timeout>=2.3", "openai>=1.30", "psutil>=5.9",
                "schemathesis>=4", "triton>=3.0; platform_system == 'Linux'",
                # the real router in front of two servers (tests/test_sglang_router.py, slow)
                "sglang-router>=0.3.2",
                # transformers' own FP8 loader, the reference of tests/test_fp8.py
                "accelerate>=1.0"],
    },
    entry_points={"console_scripts": ["rollout-serve=rollout.server:main"]},
)
