"""The files of the fine-tune stage's output directory (paths.finetuned_dir) that promote_finetuned reads back."""

STATUS_FILE = "finetune.json"  # what was done (or that fine-tuning is off)
HELDOUT_FILE = "heldout.jsonl"  # the held-out chats: promote_finetuned's yardstick
