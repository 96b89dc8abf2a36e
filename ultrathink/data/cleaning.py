"""Cleaning after the validation gate: the gate judges the source as it is; cleaning makes the training corpus."""

from __future__ import annotations

import pandas as pd


def drop_exact_duplicates(corpus: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """Keep the first occurrence of each text. Repeated documents teach memorisation and inflate validation scores
    when a copy lands on each side of the split."""
    kept = corpus.drop_duplicates(subset="text", keep="first").reset_index(drop=True)
    return kept, len(corpus) - len(kept)
