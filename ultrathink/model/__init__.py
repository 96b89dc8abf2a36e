"""The UltraThink decoder and its generation loop. Knows nothing of files beyond its own weights directory."""

from ultrathink.model.model import KVCache, UltraThink

__all__ = ["KVCache", "UltraThink"]
