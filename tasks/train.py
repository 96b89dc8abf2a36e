"""DVC's entry point of the train stage, `python -m tasks.train [--params P] [--set K=V]...`:
it runs ultrathink/stages/train.py, where what the stage does is written."""

from ultrathink.stage import stage_entry
from ultrathink.stages import train

if __name__ == "__main__":
    stage_entry("train", train.run)
