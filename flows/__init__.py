"""Prefect flows over the DVC pipeline: they run the stages, they do not re-implement them."""
