"""DVC's entry point of the finetune stage, `python -m tasks.finetune [--params P] [--set K=V]...`:
it runs ultrathink/stages/finetune.py, where what the stage does is written."""

from ultrathink.stage import stage_entry
from ultrathink.stages import finetune

if __name__ == "__main__":
    stage_entry("finetune", finetune.run)
