"""Prompt data for the training loop, read with ``datasets`` from local JSON/JSONL or parquet files.

``load_prompts(files)`` -> ``datasets.Dataset`` (``load_dataset("json" | "parquet", data_files=...)``;
the builder is chosen from the file extension). Every record needs the prompt field (``prompt_key``,
a string) and may carry anything else (e.g. ``answer``), which reaches the reward function.
``PromptStream`` hands out batches of records, reshuffled every epoch with its own seed.
``write_task_files`` writes the embedded arithmetic task's train/held-out splits as JSONL.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Optional, Sequence, Union

from .task import ArithmeticTask, write_jsonl

__all__ = ["load_prompts", "PromptStream", "write_task_files", "DATA_BUILDERS"]

DATA_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def _builder(files: Sequence[str]) -> str:
    kinds = set()
    for f in files:
        suffix = Path(f).suffix.lower()
        if suffix not in DATA_BUILDERS:
            raise ValueError(f"prompt file {f!r}: unsupported extension {suffix!r} "
                             f"(supported: {sorted(DATA_BUILDERS)})")
        if not Path(f).is_file():
            raise ValueError(f"prompt file {f!r} does not exist")
        kinds.add(DATA_BUILDERS[suffix])
    if len(kinds) != 1:
        raise ValueError(f"prompt files mix formats {sorted(kinds)}: give only JSON/JSONL or only parquet")
    return kinds.pop()


def load_prompts(files: Union[str, Sequence[str]], *, prompt_key: str = "prompt", cache_dir: Optional[str] = None):
    """A ``datasets.Dataset`` of the records in ``files`` (one split, in file order)."""
    import datasets

    files = [str(files)] if isinstance(files, (str, Path)) else [str(f) for f in files]
    if not files:
        raise ValueError("no prompt files given")
    ds = datasets.load_dataset(_builder(files), data_files=files, split="train", cache_dir=cache_dir)
    if prompt_key not in ds.column_names:
        raise ValueError(f"prompt files {files} have no {prompt_key!r} field (fields: {ds.column_names})")
    if len(ds) == 0:
        raise ValueError(f"prompt files {files} hold no records")
    return ds


class PromptStream:
    """Endless batches of records from a dataset, reshuffled each epoch (deterministic in ``seed``)."""

    def __init__(self, dataset, *, seed: int = 0, shuffle: bool = True):
        self.records = [dict(r) for r in dataset]
        self.rng = random.Random(f"prompts-{seed}")
        self.shuffle = shuffle
        self.epoch = 0
        self._order: list[int] = []

    def __len__(self) -> int:
        return len(self.records)

    def next_batch(self, n: int) -> list[dict]:
        out = []
        while len(out) < n:
            if not self._order:
                self._order = list(range(len(self.records)))
                if self.shuffle:
                    self.rng.shuffle(self._order)
                self.epoch += 1
            out.append(self.records[self._order.pop()])
        return out


def write_task_files(out_dir: Union[str, Path], *, task: ArithmeticTask = ArithmeticTask(), seed: int = 0,
                     num_train: int = 4096, num_eval: int = 256) -> tuple[Path, Path]:
    """``train.jsonl`` (``num_train`` records of the train split) and ``eval.jsonl`` (``num_eval``
    distinct held-out questions) under ``out_dir``."""
    out_dir = Path(out_dir)
    train = write_jsonl(task.examples(num_train, seed=seed, split="train", unique=True), out_dir / "train.jsonl")
    evals = write_jsonl(task.examples(num_eval, seed=seed + 1, split="eval", unique=True), out_dir / "eval.jsonl")
    return train, evals
