"""Evaluation: episodes, eval, shadow mode, the gate, reports."""
