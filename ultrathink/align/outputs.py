"""The files of the align stage's output directory (paths.aligned_dir) that promote_aligned reads back."""

STATUS_FILE = "align.json"  # what was done (or that alignment is off)
HELDOUT_FILE = "heldout.jsonl"  # the held-out preference pairs: promote_aligned's yardstick
