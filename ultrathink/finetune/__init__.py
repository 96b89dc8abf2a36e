"""Supervised fine-tuning after pretraining: chat template, prompt/response pairs, LoRA through PEFT."""
