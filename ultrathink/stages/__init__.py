"""The pipeline's stages, one module each, named as in dvc.yaml, each with `run(params)`: what the stage reads and
writes, in terms of the library. `python -m tasks.<name>` (DVC's commands), `ultrathink stage <name>` and the Prefect
flow all run them through ultrathink.stage."""
