"""MLflow tracking and model registry: one run per trained model, champion/challenger aliases.

pyfunc_model.py is deliberately not imported here: MLflow executes it by path when logging and loading.
"""

from ultrathink.registry.promote import champion_uri, promote
from ultrathink.registry.tracking import (
    default_tracking_uri,
    ensure_experiment,
    load_run_id,
    save_run_id,
    start_or_resume_run,
    use_tracking,
)

__all__ = [
    "champion_uri",
    "default_tracking_uri",
    "ensure_experiment",
    "load_run_id",
    "promote",
    "save_run_id",
    "start_or_resume_run",
    "use_tracking",
]
