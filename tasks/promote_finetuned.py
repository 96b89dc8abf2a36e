"""DVC's entry point of the promote_finetuned stage, `python -m tasks.promote_finetuned [--params P] [--set K=V]...`:
it runs ultrathink/stages/promote_finetuned.py, where what the stage does is written."""

from ultrathink.stage import stage_entry
from ultrathink.stages import promote_finetuned

if __name__ == "__main__":
    stage_entry("promote_finetuned", promote_finetuned.run)
