"""Engine settings: EngineConfig (engine_config.py) and the flags generated from its fields
(flag.py, engine_cli.py); YAML presets in config_file.py; `python -m rollout.config` in __main__.py."""
from rollout.config.engine_config import (ATTENTION_BACKENDS, DEFAULT_MODEL_PATH, DTYPES, MOE_BACKENDS,
                                          EngineConfig)

__all__ = ["ATTENTION_BACKENDS", "DEFAULT_MODEL_PATH", "DTYPES", "MOE_BACKENDS", "EngineConfig"]
