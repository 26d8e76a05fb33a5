"""The engine process: its loop over EngineCore and the commands it answers."""
