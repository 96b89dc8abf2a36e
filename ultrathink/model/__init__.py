"""The UltraThink decoder and its generation loop. Knows nothing of files beyond its own weights directory."""

from ultrathink.device import settle_cpu_math
from ultrathink.model.model import KVCache, UltraThink
# The shipped routing variants (model.moe, model.dre) register their classes for their config sections when
# imported (routing.implements): imported here, they are there wherever a model is built.
from ultrathink.model import dre, moe  # noqa: E402,F401  (after model: they build on its blocks)

# Before any model's rotary tables or any training step: the same bits in every process (device.settle_cpu_math).
settle_cpu_math()

__all__ = ["KVCache", "UltraThink"]
