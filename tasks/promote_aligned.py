"""DVC's entry point of the promote_aligned stage, `python -m tasks.promote_aligned [--params P] [--set K=V]...`:
it runs ultrathink/stages/promote_aligned.py, where what the stage does is written."""

from ultrathink.stage import stage_entry
from ultrathink.stages import promote_aligned

if __name__ == "__main__":
    stage_entry("promote_aligned", promote_aligned.run)
