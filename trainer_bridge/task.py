"""The embedded task: integer arithmetic with a checkable answer.

A prompt is ``"Q: 37+45= A:"``; the expected response is ``" 82"`` followed by the end-of-sequence
token. Operations: ``a+b`` and ``a-b`` (``0 <= b <= a <= max_operand``) and ``a*b`` with
``b <= max_multiplier``. The question space is split deterministically by a hash of the question:
the held-out (``"eval"``) split never shares a question with the ``"train"`` split, so the held-out
reward measures generalisation, not memorisation.

``arithmetic_reward(response_text, record)`` is a plain Python callable (the signature every reward
function of the training loop has): 1.0 when the response, stripped of whitespace, is exactly the
answer, else 0.0.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Union

__all__ = ["ArithmeticTask", "arithmetic_reward", "write_jsonl", "SPLITS"]

SPLITS = ("train", "eval")
_ANSWER = re.compile(r"^\s*(-?\d+)\s*$")


@dataclass(frozen=True, kw_only=True)
class ArithmeticTask:
    max_operand: int = 99
    max_multiplier: int = 12
    ops: str = "+-*"
    eval_percent: int = 10  # share of the question space held out, in percent

    def __post_init__(self):
        if self.max_operand < 1:
            raise ValueError(f"max_operand must be >= 1, got {self.max_operand}")
        if self.max_multiplier < 0:
            raise ValueError(f"max_multiplier must be >= 0, got {self.max_multiplier}")
        if not self.ops or set(self.ops) - set("+-*"):
            raise ValueError(f"ops must be a non-empty subset of '+-*', got {self.ops!r}")
        if not 0 < self.eval_percent < 100:
            raise ValueError(f"eval_percent must be in (0, 100), got {self.eval_percent}")

    @staticmethod
    def prompt(question: str) -> str:
        return f"Q: {question} A:"

    def split_of(self, question: str) -> str:
        h = int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "little")
        return "eval" if h % 100 < self.eval_percent else "train"

    def _draw(self, rng: random.Random) -> tuple[str, str]:
        op = rng.choice(self.ops)
        a = rng.randint(0, self.max_operand)
        if op == "*":
            b = rng.randint(0, self.max_multiplier)
        else:
            b = rng.randint(0, self.max_operand)
            if op == "-" and b > a:
                a, b = b, a
        ans = {"+": a + b, "-": a - b, "*": a * b}[op]
        return f"{a}{op}{b}=", str(ans)

    def iter_examples(self, seed: int, split: str = "train") -> Iterator[dict]:
        """Endless deterministic stream of ``{"prompt", "answer", "question"}`` records of ``split``."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        rng = random.Random(f"arith-{seed}-{split}")
        while True:
            q, a = self._draw(rng)
            if self.split_of(q) == split:
                yield {"prompt": self.prompt(q), "answer": a, "question": q}

    def examples(self, n: int, seed: int, split: str = "train", unique: bool = False) -> list[dict]:
        """``n`` records of ``split``; ``unique=True`` never repeats a question."""
        out, seen = [], set()
        for ex in self.iter_examples(seed, split):
            if len(out) >= n:
                break
            if unique:
                if ex["question"] in seen:
                    continue
                seen.add(ex["question"])
            out.append(ex)
        return out


def arithmetic_reward(response_text: str, record: Mapping) -> float:
    """1.0 when ``response_text`` is exactly the answer (surrounding whitespace ignored), else 0.0."""
    m = _ANSWER.match(response_text)
    return 1.0 if m is not None and m.group(1) == str(record["answer"]).strip() else 0.0


def write_jsonl(records, path: Union[str, Path]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    return path
