"""DVC's entry point of the promote stage, `python -m tasks.promote [--params P] [--set K=V]...`:
it runs ultrathink/stages/promote.py, where what the stage does is written."""

from ultrathink.stage import stage_entry
from ultrathink.stages import promote

if __name__ == "__main__":
    stage_entry("promote", promote.run)
