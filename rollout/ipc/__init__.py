"""Messages between the front end (Rollout, rollout-serve) and the engine process, and their transport."""
