"""The front end: the Python API's engine clients and the per-request state they feed."""
