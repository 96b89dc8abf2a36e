"""UltraThink: pretrain your own LLM as a reproducible MLOps pipeline."""

from ultrathink import env as _env

_env.apply()

__version__ = "0.1.0"
