"""The HTTP server (`rollout-serve`): SGLang's /generate and control routes, OpenAI /v1/*.

`startup.py` parses the flags, binds the port and checks the model directory; `app.py` builds the
FastAPI app and runs uvicorn; the routes are grouped by area in the other modules. `main` is imported
lazily so that `rollout.server.args` does not pull in FastAPI or torch."""
from __future__ import annotations

import os
import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> None:
    try:
        from rollout.server.startup import main as run  # noqa: PLC0415
    except KeyboardInterrupt:
        print("rollout-serve: interrupted before the server was up", file=sys.stderr, flush=True)
        os._exit(130)   # NOTE: as rollout.server.startup.interrupted
    run(argv)
