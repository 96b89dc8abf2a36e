"""The UltraThink decoder and its generation loop. Knows nothing of files beyond its own weights directory."""

from ultrathink.model.model import KVCache, UltraThink
# The shipped routing variants (model.moe, model.dre): a config names its implementation by string, so they are
# imported here to be part of the code of every stage that builds a model (lineage.module_closure).
from ultrathink.model import dre, moe  # noqa: E402,F401  (after model: they build on its blocks)

__all__ = ["KVCache", "UltraThink"]
