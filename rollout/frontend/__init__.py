"""The front end: the Python API (`Rollout`), its engine clients and the per-request state they
feed (tokenization, detokenization, stop strings)."""
