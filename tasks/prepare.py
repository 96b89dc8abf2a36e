"""DVC's entry point of the prepare stage, `python -m tasks.prepare [--params P] [--set K=V]...`:
it runs ultrathink/stages/prepare.py, where what the stage does is written."""

from ultrathink.stage import stage_entry
from ultrathink.stages import prepare

if __name__ == "__main__":
    stage_entry("prepare", prepare.run)
