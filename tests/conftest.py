import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# NOTE: without a GPU the Triton kernels run under Triton's interpreter; it must be chosen before
# anything imports triton (torch does not at import). Subprocesses (DP workers, servers) inherit it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tiny_models import tiny_checkpoint  # noqa: E402,F401  (session fixture)

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running tests (run by `bash scripts/test.sh --slow`)")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped without one")
    config.addinivalue_line("markers", "interpreter: Triton kernels on CPU tensors; needs TRITON_INTERPRET=1 "
                                       "(set above without a GPU), skipped elsewhere")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("TRITON_INTERPRET") != "1":
        skip = pytest.mark.skip(reason="Triton runs CPU tensors only under TRITON_INTERPRET=1 (the gpu tests compile)")
        for item in items:
            if "interpreter" in item.keywords:
                item.add_marker(skip)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
