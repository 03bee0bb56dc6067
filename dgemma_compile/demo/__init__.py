"""Demo assets: a toy task suite (`tasks`) and a small trained DiffusionGemma shipped under `model/`."""

from . import tasks

__all__ = ["tasks"]
