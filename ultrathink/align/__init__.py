"""Preference alignment after fine-tuning: Direct Preference Optimization on (prompt, chosen, rejected) pairs."""
