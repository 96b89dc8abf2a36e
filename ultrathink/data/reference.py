"""The Python language reference's topics (CPython 3.11.7's `pydoc_data.topics`, PSF license): the text of the
embedded corpus (data.source: embedded) and of the embedded fine-tuning and preference pairs.

A snapshot in assets/, not the running interpreter's copy: CPython rewrites these texts between patch releases
(3.11.2's differ from 3.11.7's), so a corpus read from the interpreter changed with it, and a fresh clone on another
Python trained on other text while its dvc.lock said nothing had changed. As a file beside this module it is part
of every stage's code (ultrathink.lineage.companion_files): dvc.yaml lists it, and an edit reruns those stages.
Made with `json.dumps(topics, sort_keys=True, ensure_ascii=False, indent=0)`, UTF-8, xz-compressed.
"""

from __future__ import annotations

import json
import lzma
from functools import cache
from pathlib import Path
from types import MappingProxyType

SNAPSHOT = Path(__file__).parent / "assets" / "reference.json.xz"


@cache
def reference_topics() -> MappingProxyType:
    """{topic name: its text}, read once per process; read-only, as every caller shares it."""
    with lzma.open(SNAPSHOT, "rt", encoding="utf-8") as f:
        return MappingProxyType(json.load(f))
