"""scripts/soak.py's verdict: window means, so a sample landing high or low in a process's RSS band
does not read as growth, while growth of the level does."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak_script", ROOT / "scripts" / "soak.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["soak_script"] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop("soak_script", None)


def _rows(rss_of_step, steps=500, every=10, role="engine"):
    out = []
    for step in [1, *range(every, steps + 1, every)]:
        out.append({"step": step, "label": f"{role}0.0", "role": role, "pid": 7, "rss_mb": rss_of_step(step),
                    "open_files": 13})
    return out


def test_a_band_without_a_trend_is_within(soak):
    # NOTE: alternate low and high samples, the low one at step 100 and the high one at the end:
    # +8% point to point, 0% in the level
    rows = _rows(lambda s: 611.0 if (s // 10) % 2 == 0 else 660.0, steps=490)
    text, ok = soak.table(rows, base_step=100, max_growth_pct=5.0, window=50)
    assert ok, text
    assert "+8.0%" in text


def test_growth_of_the_level_is_over(soak):
    rows = _rows(lambda s: 600.0 + 0.2 * s + (25.0 if (s // 10) % 2 else 0.0))   # +80 MB over 400 steps
    text, ok = soak.table(rows, base_step=100, max_growth_pct=5.0, window=50)
    assert not ok, text


def test_the_window_must_hold_a_step(soak):
    with pytest.raises(ValueError, match="window"):
        soak.table(_rows(lambda s: 1.0), base_step=100, max_growth_pct=5.0, window=0)
