"""`python -m rollout.server` is `rollout-serve`."""
from rollout.server import main

main()
