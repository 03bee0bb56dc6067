"""The compiler side of dgemma_compile, split by concern:

- `options.py`: `CompileOptions` (every knob, with its reason) and `applied()`;
- `units.py`: `CompiledUnit` (one compiled step over static buffers, CUDA-graph capture) and `UnitFactory`;
- `generator.py`: `CompiledGenerator` (drives the one step over a `row_table.RowTable`) and `build(model)`;
- `explain.py`: `torch._dynamo.explain` reports per unit (`UnitReport`).
"""

from .explain import UnitReport, explain
from .generator import CompiledGenerator, build
from .options import CompileOptions, applied
from .units import CompiledUnit, CudaGraphs, ModelChangedError, ModelFingerprint, UnitFactory

__all__ = ["CompileOptions", "CompiledGenerator", "CompiledUnit", "CudaGraphs", "ModelChangedError",
           "ModelFingerprint", "UnitFactory", "UnitReport", "applied", "build", "explain"]
