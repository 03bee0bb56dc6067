"""Demo assets: a toy task suite (`tasks`), its image version (`image_tasks`), a small trained DiffusionGemma shipped
under `model/` (`DEMO_MODEL`) and its image-reading version under `image_model/` (`IMAGE_DEMO_MODEL`)."""

from pathlib import Path

from . import tasks

DEMO_MODEL = Path(__file__).parent / "model"
"""The built-in demo checkpoint directory: the default model of `dgemma generate`, `dgemma explain` and the tests."""

IMAGE_DEMO_MODEL = Path(__file__).parent / "image_model"
"""The image demo checkpoint directory: the demo model with a tiny vision tower, reading the demo tasks' operands from
an image (`image_tasks`; docs/demo.md)."""

__all__ = ["DEMO_MODEL", "IMAGE_DEMO_MODEL", "tasks"]
