"""`host_memory.retain_freed_memory`: glibc then serves a large block from its heap instead of a mapping of its own,
and keeps it in the process when it is freed (read from glibc's own `malloc_info` report, in a fresh process with
and without the call); and the call says what it did."""

import json
import subprocess
import sys

import pytest

SCRIPT = r"""
import ctypes, json, os, re, sys, tempfile
import torch
said = "default"
if sys.argv[1] == "retain":
    from dgemma_compile.host_memory import retain_freed_memory
    said = retain_freed_memory()
libc = ctypes.CDLL(None)
libc.fopen.restype, libc.fopen.argtypes = ctypes.c_void_p, (ctypes.c_char_p, ctypes.c_char_p)
libc.malloc_info.argtypes, libc.fclose.argtypes = (ctypes.c_int, ctypes.c_void_p), (ctypes.c_void_p,)

def totals():  # glibc's totals over all arenas: blocks in mappings of their own, and the heaps' current size
    fd, path = tempfile.mkstemp()
    os.close(fd)
    f = libc.fopen(path.encode(), b"w")
    libc.malloc_info(0, f)
    libc.fclose(f)
    text = open(path).read()
    os.unlink(path)
    tail = text[text.rindex("</heap>"):]
    mmap = re.search(r'<total type="mmap" count="(\d+)"', tail).group(1)
    heap = re.search(r'<system type="current" size="(\d+)"', tail).group(1)
    return int(mmap), int(heap)

start = totals()
x = torch.empty(10 * 2**20).fill_(1.0)  # 40 MB: above glibc's largest dynamic mmap threshold (32 MB)
live = totals()
del x
print(json.dumps({"said": said, "start": start, "live": live, "freed": totals()}))
"""

MB40 = 40 * 2**20


def _run(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True,
                         timeout=120).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and malloc_info")
def test_large_blocks_come_from_the_heap_and_stay_when_freed():
    retained = _run("retain")
    if retained["said"].startswith("unchanged"):
        pytest.skip(f"this C library: {retained['said']}")
    assert retained["said"].startswith("glibc ") and retained["said"].endswith("freed memory retained")
    default = _run("default")
    # glibc's default: the block is a mapping of its own, unmapped when freed
    assert default["live"][0] == default["start"][0] + 1 and default["freed"][0] == default["start"][0]
    # retained: no new mapping; the heap grows by the block and keeps it after the free
    assert retained["live"][0] == retained["start"][0]
    assert retained["live"][1] >= retained["start"][1] + MB40
    assert retained["freed"][1] == retained["live"][1]
