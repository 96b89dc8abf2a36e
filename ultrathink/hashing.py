"""The project's one recipe for naming a value by its content: sha256 of its canonical JSON, first 16 hex digits."""

from __future__ import annotations

import hashlib
import json


def json_hash(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]
