"""params.yaml's schema and how it is read, by concern: schema.py (the sections: every knob, defined once),
budget.py (train.budget's grammar), loading.py (the file and overrides, checked, and the schema for the CLI) and
fingerprint.py (which knobs name a checkpoint, the params hashes). The names most code needs are here."""

from ultrathink.config.budget import Budget
from ultrathink.config.loading import ParamsError, apply_overrides, default_params_yaml, load_params, schema_rows
from ultrathink.config.schema import (MANUAL_SHAPE, AlignConfig, ConstitutionConfig, DataConfig, DeepSpeedConfig, DREConfig,
                                      EvaluateConfig, FinetuneConfig, LaunchConfig, LoggingConfig, LoraSettings,
                                      MixtureSource, ModelConfig, MoEConfig, MoEGroups, Params, PathsConfig,
                                      PrepareConfig, RegistryConfig, Section, TokenizerConfig, TrainConfig,
                                      ValidateConfig, VariantConfig)

__all__ = ["MANUAL_SHAPE", "AlignConfig", "Budget", "ConstitutionConfig", "DREConfig", "DataConfig", "DeepSpeedConfig",
           "EvaluateConfig", "FinetuneConfig", "LaunchConfig", "LoggingConfig", "LoraSettings", "MixtureSource",
           "ModelConfig", "MoEConfig", "MoEGroups", "Params", "ParamsError", "PathsConfig", "PrepareConfig", "RegistryConfig",
           "Section", "TokenizerConfig", "TrainConfig", "ValidateConfig", "VariantConfig", "apply_overrides",
           "default_params_yaml", "load_params", "schema_rows"]
