"""DVC's entry point of the validate stage, `python -m tasks.validate [--params P] [--set K=V]...`:
it runs ultrathink/stages/validate.py, where what the stage does is written."""

from ultrathink.stage import stage_entry
from ultrathink.stages import validate

if __name__ == "__main__":
    stage_entry("validate", validate.run)
