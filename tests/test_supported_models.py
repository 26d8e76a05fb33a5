"""README's "Supported models" table says what the code does: one row per architecture the
registry serves, the exact-trainer column from the trainer's own list, the quantized weight
formats from each architecture's class, and every preset's architecture served."""
from __future__ import annotations

import re
from pathlib import Path

from rollout.models.registry import model_class, supported_architectures
from trainer_bridge.exact_model import EXACT_ARCHITECTURES

ROOT = Path(__file__).resolve().parent.parent


def readme_rows() -> dict[str, dict[str, str]]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Supported models", 1)[1].split("\n## ", 1)[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for ln in lines[2:]:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        row = dict(zip(header, cells))
        rows[re.sub(r"`", "", cells[0])] = row
    return rows


def test_table_lists_every_served_architecture():
    assert set(readme_rows()) == set(supported_architectures())


def test_exact_trainer_column_matches_the_trainer():
    for arch, row in readme_rows().items():
        assert (row["Exact trainer"] == "yes") == (arch in EXACT_ARCHITECTURES), arch


def test_weight_formats_column_matches_the_classes():
    for arch, row in readme_rows().items():
        formats = model_class(arch).quantized_formats
        for name in ("mxfp4", "fp8"):
            assert (name.upper() in row["Weight formats"]) == (name in formats), (arch, row["Weight formats"])
