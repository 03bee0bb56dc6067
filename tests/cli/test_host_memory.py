"""`host_memory.retain_freed_memory`: glibc then serves a block of up to 32 MB from its heap instead of a mapping of
its own and keeps it in the process when it is freed, while a larger block keeps its mapping (read from glibc's own
`malloc_info` report, in a fresh process with and without the call); and the call says what it did."""

import json
import subprocess
import sys

import pytest

SCRIPT = r"""
import ctypes, json, os, re, sys, tempfile
import torch
said = "default"
if sys.argv[1] == "retain":
    from dgemma_compile.cli.host_memory import retain_freed_memory
    said = retain_freed_memory()
libc = ctypes.CDLL(None)
libc.fopen.restype, libc.fopen.argtypes = ctypes.c_void_p, (ctypes.c_char_p, ctypes.c_char_p)
libc.malloc_info.argtypes, libc.fclose.argtypes = (ctypes.c_int, ctypes.c_void_p), (ctypes.c_void_p,)

class MallInfo2(ctypes.Structure):  # glibc >= 2.33
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                 "uordblks", "fordblks", "keepcost")]

libc.mallinfo2.restype = MallInfo2

def totals():  # glibc's totals over all arenas: blocks in mappings of their own, the heaps' current size and the
    # free bytes inside them (mallinfo2's fordblks, the top chunk's included)
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
    return int(mmap), int(heap), int(libc.mallinfo2().fordblks)

blocks = {}
for mb in (24, 40):  # below glibc's largest mmap threshold (32 MB) and above it
    start = totals()
    x = torch.empty(mb * 2**18).fill_(1.0)
    live = totals()
    del x
    blocks[mb] = {"start": start, "live": live, "freed": totals()}
print(json.dumps({"said": said, **blocks}))
"""


def _run(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, check=True,
                         timeout=120).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and malloc_info")
def test_blocks_up_to_32_mb_come_from_the_heap_and_stay_when_freed():
    retained = _run("retain")
    if retained["said"].startswith("unchanged"):  # not glibc: nothing to check here
        pytest.skip(f"this C library: {retained['said']}")
    assert retained["said"].startswith("glibc ") and retained["said"].endswith("freed memory retained"), retained
    default = _run("default")
    for run in (default, retained):  # above 32 MB, with or without: a mapping of its own, unmapped when freed
        big = run["40"]
        assert big["live"][0] == big["start"][0] + 1 and big["freed"][0] == big["start"][0], run
    # a 24 MB block: glibc's default maps it (its mmap threshold starts at 128 KB, and the import freed no larger
    # mapped block to raise it); retained, no mapping of its own: the heap grows by it and keeps it after the free
    assert default["24"]["live"][0] == default["24"]["start"][0] + 1, default
    mid = retained["24"]
    assert mid["live"][0] == mid["start"][0]
    # the block comes from the heap: what the heap grew by plus the free space it already held covers all of it
    assert mid["live"][1] > mid["start"][1]
    assert mid["live"][1] - mid["start"][1] + mid["start"][2] >= 24 * 2**20, mid
    assert mid["freed"][1] == mid["live"][1]
