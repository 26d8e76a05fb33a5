"""The engine process: EngineCore (scheduler, KV pool, prefix cache, capture), its loop and the
commands it answers."""
