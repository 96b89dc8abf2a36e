"""Offline and quiet by default: no telemetry, no hub downloads. Imported first by every entry point."""

import logging
import os

QUIET_OFFLINE_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "60",
    "DO_NOT_TRACK": "1",
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    "DVC_NO_ANALYTICS": "1",
    "GX_ANALYTICS_ENABLED": "false",
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "GIT_PYTHON_REFRESH": "quiet",
}


# torchao (imported by PEFT wherever it is installed) says on every import that its optional CUDA kernels for other
# GPU architectures do not load, and registers enums with torch's pytree that torch 2.13 handles natively (a
# deprecation notice about torchao's code): nothing a user can act on. finetune.quantize does not use either.
QUIET_LOGGERS = {"torch.utils._pytree": logging.ERROR, "torchao": logging.ERROR}


def apply() -> None:
    """Set each variable unless the user already chose a value; quiet the loggers above."""
    for key, value in QUIET_OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    for name, level in QUIET_LOGGERS.items():
        logging.getLogger(name).setLevel(level)
