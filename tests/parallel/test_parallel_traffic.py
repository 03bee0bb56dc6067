"""Bytes per step (`y`, docs/parallel.md "Bytes per step"): the collectives a sharded model's
prefill chunk, denoise step and commit issue, counted by `CollectiveCounter` while the eager reference's own steps run,
equal the analytic count of the sharding's design, for both experts splits. One process: torch's fake process group
(`fake` backend: collectives return their input, so values are meaningless but every call and shape is the real
one); the gloo ranks' counts are the bench's (`bench/parallel.py`)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dgemma_compile as dg
from dgemma_compile import parallel
from dgemma_compile.parallel.traffic import Collective, analytic_bytes, measure_steps


@pytest.fixture
def fake_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(world: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def test_measured_collectives_equal_the_analytic_count(fake_group):
    from dgemma_compile.demo import DEMO_MODEL

    def load():  # dense attention: the collectives do not depend on the kernel, and flex compiles for ~3 s per shape
        model = dg.load(DEMO_MODEL)
        model.attention = "dense"
        return model

    plain = measure_steps(load(), batch=2, prompt_len=10, world_size=1)
    assert all(t.calls == 0 for t in plain.values())  # one process: no collective at all
    for world, experts in ((2, "tensor"), (4, "expert")):
        fake_group(world)
        model = parallel.shard(load(), experts=experts)
        cfg, C = model.tensor_parallel.config, model.config.canvas_length
        got = measure_steps(model, batch=2, prompt_len=10, world_size=world)
        for kind, traffic in got.items():
            want = analytic_bytes(cfg, world, kind=kind, batch=2, tokens=C, dtype_bytes=4, experts=experts)
            assert traffic.payload_bytes == sum(want.values()), (world, experts, kind, traffic.by_shape, want)
            L = cfg.num_layers
            # denoise: the sampler's 5 reductions over the vocabulary slices and the self-conditioning product
            assert traffic.calls == 1 + 3 * L + (6 if kind == "denoise" else 0), (kind, traffic.by_shape)
            assert traffic.wire_bytes == pytest.approx(2 * (world - 1) / world * traffic.payload_bytes)
        # no logits gather ([B, C, Vp], the demo's 27 padded to 28): the chunk masses of the inverse CDF instead,
        # one chunk a rank ([B, C, N])
        shapes = got["denoise"].by_shape
        assert not any(shape[-1] == 28 for _, shape, _ in shapes), shapes
        assert shapes[("all_reduce", (2, C, world), "float32")] == 1


def test_wire_bytes_follow_the_ring_algorithm():
    x = dict(shape=(4, 1024), dtype=torch.bfloat16, world_size=4)  # 8 KiB
    assert Collective("all_reduce", **x).wire_bytes == 2 * 3 / 4 * 8192
    assert Collective("all_gather_into_tensor", **x).payload_bytes == 4 * 8192
    assert Collective("all_gather_into_tensor", **x).wire_bytes == 3 / 4 * 4 * 8192
    assert Collective("reduce_scatter_tensor", **x).payload_bytes == 2048
    assert Collective("all_reduce", shape=(8,), dtype=torch.float32, world_size=1).wire_bytes == 0
    with pytest.raises(ValueError, match="kind must be prefill, denoise or commit"):
        analytic_bytes(dg.ModelConfig.__new__(dg.ModelConfig), 2, kind="decode", batch=1, tokens=1, dtype_bytes=2)
