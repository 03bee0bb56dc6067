"""Shared set-up of the Triton kernel tests (tests/test_triton_*.py): Triton's interpreter on a machine without CUDA.

Importing this module sets TRITON_INTERPRET=1 when no CUDA device is present. Triton reads it when a kernel is
*defined* (`@triton.jit` returns an interpreted function), so a test module imports this first and imports kernel
modules inside its tests, never at its top. Tensors then live on the CPU (`DEVICE`). On a CUDA machine the variable is
left alone and the tests run the compiled kernels on the GPU. `interpreted_triton_language` covers Triton's own
library functions, which were decorated when triton was first imported.
"""

import contextlib
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@contextlib.contextmanager
def interpreted_triton_language():
    """On the CPU, while a test module runs (its autouse fixture): Triton's own @jit library functions (tl.sum,
    tl.max, tl.cumsum, tl.sigmoid, ...) interpreted as well.

    Triton 3.7.1 decides interpreted-or-compiled once per function, when `@triton.jit` decorates it, from
    `triton.knobs.runtime.interpret` (env TRITON_INTERPRET). Its library functions are decorated when triton is first
    imported, and in a full run that happens while earlier test modules are collected (Inductor imports triton),
    before a test module imported this one; a compiled-mode JITFunction then refuses to be called from an
    interpreted kernel ("Cannot call @triton.jit'd outside of the scope of a kernel"). So each such binding in
    triton.language, .standard, .math and .core is swapped for an InterpretedFunction of the same Python function
    while the module runs, and restored after. A no-op when triton was first imported with the variable set.
    """
    if DEVICE != "cpu":
        yield
        return
    import triton
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    modules = (triton.language, triton.language.standard, triton.language.math, triton.language.core)
    swapped, saved = {}, []
    for module in modules:
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                if id(value) not in swapped:
                    swapped[id(value)] = InterpretedFunction(value.fn)
                saved.append((module, name, value))
                setattr(module, name, swapped[id(value)])
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
