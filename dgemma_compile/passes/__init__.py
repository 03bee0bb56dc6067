"""Our Inductor graph passes: one file per pass, one ordered pipeline (`pipeline.PASSES`).

- `sample_step_fusion.py`: the vocabulary-wide region of the denoise step -> `dgemma::sample_step`.
- `pipeline.py`: the registry, the Inductor hooks (`inductor_config`), cache-safe uuids, match counting.
- `records.py`: match counts kept beside Inductor's cache for compiles it serves.

The compile backend (`compile/units.py`) installs the pipeline around each unit's Inductor compile, minus the passes
named in `CompileOptions.disabled_passes`.
"""

from .pipeline import PASS_NAMES, PASSES, PassPipeline, cache_key, check_names, inductor_config, recording

__all__ = ["PASS_NAMES", "PASSES", "PassPipeline", "cache_key", "check_names", "inductor_config", "recording"]
