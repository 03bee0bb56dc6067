"""Autoregressive baseline on the same weights: the encoder used as a causal LM, greedy, one token per forward.

Compiled exactly the way `dgemma_compile.build` compiles its units: each step is a `CompiledUnit` made by the
library's public `compile.UnitFactory` (a zero-argument function over static buffers,
`torch.compile(fullgraph=True, dynamic=False)` under `CompileOptions`, with the token, lengths and counts in tensors
so no position recompiles; on CUDA a graph captured after two warm calls, a failed capture logged); the factory
counts the compiles and their seconds.

Two units over one static cache (`block_size` = canvas length), each an encoder forward (`model.forward_plan`) over
a plan held in buffers (`plan.PlanBuffers`, every row `ENCODER`: the per-row tensors its masks capture are graph
inputs, which Inductor's CPU flex template needs), as our step's plan is:
- `prefill`: the forward over ids [B, C] with n_new real tokens per row (its plan filled on the host before each
  chunk), then the greedy token at each row's last real prompt position (`model.logits` + argmax); prompts longer
  than C run in C-token chunks. It ends by filling the step's plan for the new lengths.
- `step`: the forward over tok [B, 1] (a one-token causal pass reading S+1 slots; the larger block_size only leaves
  unused block slots, it adds no reads), `model.logits`, argmax into `tok`; then it fills its own plan for the next
  token, inside the unit (as `mixed_step.mixed_step` refreshes its plan).
The cache holds block_size = C rather than 1 so that the prompt is encoded in C-token compiled chunks like ours,
instead of one forward per prompt token; decode forwards are unaffected.
"""

from __future__ import annotations

import time

import torch

from dgemma_compile.compile import CompileOptions, UnitFactory
from dgemma_compile.kernels.moe.op import resolve_moe_impl
from dgemma_compile.model.modes import ENCODER
from dgemma_compile.model.plan import PlanBuffers, every_row


class ARBaseline:
    """Greedy AR generation with compiled prefill-chunk and one-token step units for batch `batch`."""

    def __init__(self, model, batch: int, max_seq_len: int, options: CompileOptions | None = None,
                 compiled: bool = True):
        """`compiled=False`: the same two functions run eagerly (no Inductor; e.g. for its accuracy alone,
        bench/parallelism.py)."""
        self.model = model
        self.options = options or CompileOptions(batch_buckets=(batch,), max_seq_len=max_seq_len)
        dev = model.device
        C = model.config.canvas_length
        self.cache = model.new_cache(batch, max_seq_len, block_size=C)
        long = dict(dtype=torch.long, device=dev)
        self.ids = torch.zeros(batch, C, **long)
        self.n_new = torch.zeros(batch, **long)
        self.tok = torch.zeros(batch, 1, **long)
        self.ones = torch.ones(batch, **long)
        self.rows = torch.arange(batch, device=dev)
        self.encoder = every_row(self.cache, ENCODER)
        plans = dict(mixed=True, sparsity_in_place=compiled, dense_masks=not compiled)
        self.prefill_plan = PlanBuffers(model, self.cache, C, **plans)
        self.step_plan = PlanBuffers(model, self.cache, 1, **plans)
        self.units = UnitFactory(self.options, dev)
        cfg = model.config  # the experts as our compiled generator runs them
        self.moe_impl = resolve_moe_impl(self.options.moe_impl, dtype=model.dtype, num_experts=cfg.num_experts,
                                         top_k=cfg.top_k_experts, compiled=True, quant=model.expert_quant)
        # every tensor the units read (direct calls, as ours-compiled's units)
        owners = (model, self.cache, self, *(t for p in (self.prefill_plan, self.step_plan)
                                            for t in (p.mode, p.n_new, p.self_conditioning, *p.tensors)))
        if compiled:
            self.prefill_unit = self.units.unit("ar_prefill_chunk", self._prefill, owners)
            self.step = self.units.unit("ar_step", self._step, owners)
        else:
            self.prefill_unit, self.step = self._prefill, self._step

    @property
    def compile_seconds(self) -> float:
        """Seconds spent in Inductor for both units (Dynamo tracing excluded)."""
        return self.units.compile_seconds

    @property
    def compiles(self) -> int:
        """Inductor compiles of both units (two unless something recompiled)."""
        return sum(self.units.compiles.values())

    def _forward(self, ids: torch.Tensor, plan: PlanBuffers) -> torch.Tensor:
        # run uncompiled, attention reads the plan's dense masks (`PlanBuffers.eager_plan`), as an eager step does
        fplan = plan.plan if torch.compiler.is_compiling() else plan.eager_plan()
        return self.model.forward_plan(ids, self.cache, fplan, moe_impl=self.moe_impl)

    def _prefill(self) -> None:
        hidden = self._forward(self.ids, self.prefill_plan)
        last = hidden[self.rows, (self.n_new - 1).clamp(min=0)]
        tok = self.model.logits(last).argmax(-1)
        self.tok.copy_(torch.where(self.n_new > 0, tok, self.tok[:, 0])[:, None])
        self.step_plan.fill(self.encoder, self.ones)

    def _step(self) -> None:
        hidden = self._forward(self.tok, self.step_plan)
        self.tok.copy_(self.model.logits(hidden[:, -1]).argmax(-1)[:, None])
        self.step_plan.fill(self.encoder, self.ones)

    def prefill(self, prompts: list[list[int]]) -> None:
        """Reset the cache and encode right-padded prompts chunk by chunk; leaves the first greedy token in `tok`."""
        dev, C = self.ids.device, self.ids.shape[1]
        self.cache.reset()
        lengths = torch.tensor([len(p) for p in prompts], device=dev)
        for start in range(0, int(lengths.max()), C):
            self.ids.zero_()
            for r, p in enumerate(prompts):
                chunk = p[start:start + C]
                if chunk:
                    self.ids[r, :len(chunk)] = torch.tensor(chunk, device=dev)
            self.n_new.copy_((lengths - start).clamp(0, C))
            self.prefill_plan.fill(self.encoder, self.n_new)  # on the host: a chunk's plan, before its unit
            self.prefill_unit()

    @torch.no_grad()
    def warmup(self, prompt_len: int) -> float:
        """Compile both units (and reach the CUDA-graph capture) on a dummy prompt; returns seconds."""
        start = time.perf_counter()
        for _ in range(3):
            self.prefill([[self.model.config.bos_token_id] * prompt_len] * self.ids.shape[0])
            for _ in range(3):
                self.step()
        if self.ids.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, eos_ids: tuple[int, ...] = (),
                 timed=lambda f: f, on_token=None) -> list[list[int]]:
        """Greedy continuation of `prompts` (batch = the constructor's); stops a row at eos when `eos_ids` are given
        (all rows done -> stop). `timed` wraps each decode forward; `on_token(i)` is called after token i (1-based)."""
        self.prefill(prompts)
        out = torch.zeros(len(prompts), max_new_tokens, dtype=torch.long, device=self.tok.device)
        eos = torch.tensor(eos_ids, dtype=torch.long, device=self.tok.device) if eos_ids else None
        step = timed(self.step)
        for i in range(max_new_tokens):
            if i > 0:
                step()
            out[:, i] = self.tok[:, 0]
            if on_token is not None:
                on_token(i + 1)
            if eos is not None and bool(torch.isin(out[:, :i + 1], eos).any(dim=1).all()):
                out = out[:, :i + 1]
                break
        seqs = []
        for row in out.tolist():
            if eos is not None:
                hit = [j for j, t in enumerate(row) if t in eos_ids]
                row = row[:hit[0] + 1] if hit else row
            seqs.append(row)
        return seqs
