"""The engine process: EngineCore (scheduler, KV pool, prefix cache, capture), its loop and the
control calls it answers."""
