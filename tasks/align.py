"""DVC's entry point of the align stage, `python -m tasks.align [--params P] [--set K=V]...`:
it runs ultrathink/stages/align.py, where what the stage does is written."""

from ultrathink.stage import stage_entry
from ultrathink.stages import align

if __name__ == "__main__":
    stage_entry("align", align.run)
