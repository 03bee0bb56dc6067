"""Demo assets: a toy task suite (`tasks`) and a small trained DiffusionGemma shipped under `model/` (`DEMO_MODEL`)."""

from pathlib import Path

from . import tasks

DEMO_MODEL = Path(__file__).parent / "model"
"""The built-in demo checkpoint directory: the default model of `dgemma generate`, `dgemma explain` and the tests."""

__all__ = ["DEMO_MODEL", "tasks"]
