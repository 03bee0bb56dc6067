"""The grammar worker process (`python -m dgemma_runtime.http.grammar_worker`): compiles constraints for a server,
bounded in memory, so that a grammar which grows without bound ends with its process, never the server's.

Started by `grammars.Worker` with pipes on stdin / stdout. Frames are an 8-byte big-endian length, then that many
bytes. The first frame from the server is JSON {"info": xgrammar `TokenizerInfo.serialize_json()`, "memory_bytes":
the address space the compiles may add, "threads": xgrammar compile threads}; the worker answers b"ready" once its
limit is set. Then each request is JSON {"kind", "spec"} (a `Constraint`'s fields) and each answer one frame:
b"o" + the compiled grammar's `CompiledGrammar.serialize_json()` (UTF-8), b"e" + the ConstraintError's problem
(`ConfigError.problem`: the request names the field), or
b"m" + a message when the memory limit was hit (the process may also just die there: the server reads EOF).
The worker exits at EOF on stdin, and (Linux) when its parent dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import os
import resource
import struct
import sys

HEADER = struct.Struct(">Q")


def read_frame(f) -> bytes | None:
    """One frame from a binary file, or None at EOF."""
    head = f.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    n, = HEADER.unpack(head)
    body = f.read(n)
    return body if len(body) == n else None


def write_frame(f, data: bytes) -> None:
    f.write(HEADER.pack(len(data)) + data)
    f.flush()


def _die_with_parent() -> None:
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _address_space() -> int:
    """This process's virtual size in bytes (/proc/self/statm)."""
    return int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    _die_with_parent()
    inp = sys.stdin.buffer
    out = os.fdopen(os.dup(1), "wb")  # the protocol's; anything a library prints goes to stderr
    os.dup2(2, 1)
    first = read_frame(inp)
    if first is None:
        return
    setup = json.loads(first)
    import xgrammar as xgr

    from dgemma_compile.model.config import ConfigError
    from dgemma_compile.inputs.constraint import Constraint, compile_constraint

    info = xgr.TokenizerInfo.deserialize_json(setup["info"])
    compiler = xgr.GrammarCompiler(info, max_threads=int(setup["threads"]), cache_enabled=False)
    limit = _address_space() + int(setup["memory_bytes"])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    write_frame(out, b"ready")
    while (frame := read_frame(inp)) is not None:
        ask = json.loads(frame)
        try:
            spec = ask["spec"]
            c = Constraint(ask["kind"], tuple(spec) if ask["kind"] == "choice" else spec)
            answer = b"o" + compile_constraint(compiler, c).serialize_json().encode()
        except MemoryError as e:
            answer = b"m" + str(e).encode()
        except ConfigError as e:  # xgrammar turns a failed allocation into an error naming std::bad_alloc (its
            # message, the library's: no type of its own to read); "e" sends the problem, the request names the field
            answer = (b"m" if "bad_alloc" in str(e) else b"e") + e.problem.encode()
        write_frame(out, answer)


if __name__ == "__main__":
    main()
