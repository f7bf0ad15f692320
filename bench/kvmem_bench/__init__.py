"""Evaluation: long-context benchmark tasks and scoring."""
