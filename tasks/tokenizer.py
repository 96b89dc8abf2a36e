"""DVC's entry point of the tokenizer stage, `python -m tasks.tokenizer [--params P] [--set K=V]...`:
it runs ultrathink/stages/tokenizer.py, where what the stage does is written."""

from ultrathink.stage import stage_entry
from ultrathink.stages import tokenizer

if __name__ == "__main__":
    stage_entry("tokenizer", tokenizer.run)
