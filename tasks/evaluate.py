"""DVC's entry point of the evaluate stage, `python -m tasks.evaluate [--params P] [--set K=V]...`:
it runs ultrathink/stages/evaluate.py, where what the stage does is written."""

from ultrathink.stage import stage_entry
from ultrathink.stages import evaluate

if __name__ == "__main__":
    stage_entry("evaluate", evaluate.run)
