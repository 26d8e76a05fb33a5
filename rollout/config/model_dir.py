"""The model directory check: a local checkpoint directory with its config.json, or a ValueError that
says what is wrong in one line. A Hugging Face Hub id is never downloaded: the message says so and
how to fetch the weights into a directory first. Light (no torch), so that `rollout-serve` fails
on a wrong path in a second, before anything loads.
"""
from __future__ import annotations

import os
import re

# NOTE: "org/name": one slash, no leading "/", "." or "~" (those are paths the user meant as local)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def looks_like_hub_id(path: str) -> bool:
    return _HUB_ID.fullmatch(path) is not None and not os.path.exists(path)


def check_model_dir(path: str, name: str = "model_path") -> None:
    """ValueError naming `name` (the field or flag the path came from) unless `path` is a directory
    holding config.json."""
    if looks_like_hub_id(path):
        local = "/models/" + path.rsplit("/", 1)[1]
        raise ValueError(f"{name} {path!r} is not a local directory: it looks like a Hugging Face Hub id, and "
                         f"weights are never downloaded; fetch them first (huggingface-cli download {path} "
                         f"--local-dir {local}) and give that directory ({name} {local})")
    if not os.path.exists(path):
        raise ValueError(f"{name} {path!r}: no such directory (a checkpoint directory with config.json, "
                         f"*.safetensors and tokenizer.json)")
    if not os.path.isdir(path):
        raise ValueError(f"{name} {path!r} is a file; give the checkpoint directory that holds it")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{name} {path!r} has no config.json: not a checkpoint directory")
