"""The HTTP server (`rollout-serve`): SGLang's /generate and control routes, OpenAI /v1/*.

`app.py` builds the FastAPI app and runs uvicorn; the routes are grouped by area in the other
modules. `main` is imported lazily so that `rollout.server.args` does not pull in FastAPI."""
from __future__ import annotations

from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> None:
    from rollout.server.app import main as run  # noqa: PLC0415

    run(argv)
