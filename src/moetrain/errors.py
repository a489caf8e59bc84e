"""Errors shared across components (the config and data ones live with their components)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the allowed values."""


class CheckpointError(ValueError):
    """A checkpoint (moetrain DCP or HF safetensors) is missing, incomplete, damaged or belongs to a different
    model; the message names the file or tensor and the fix. The CLI reports it as bad input (exit 2)."""


class PlanError(ValueError):
    """The plan cannot run on this model and cluster; the message says which value is wrong and what is allowed."""
