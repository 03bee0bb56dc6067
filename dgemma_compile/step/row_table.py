"""`RowTable`: B rows and every buffer the step reads or writes, and its buckets (one per batch size).

Two words, two things (the design card's): the *row table* is the B rows and their buffers: the KV cache (static, or
paged over a shared pool: `kv_cache.PagedKVCache`), `mixed_step.DenoiseState`, `mixed_step.StepInputs` and
`rows.RowState`; a *bucket* is one batch size b over it with its step: `RowTable.view(b)` is the `Bucket` of the first b
rows, over views of the same buffers (so rows keep their state whatever size runs them), with a `plan.PlanBuffers`
of its own and its step unit (compiled, and on CUDA captured as one CUDA graph). The table's `sizes` are its buckets'
batch sizes. A driver admits requests into the lowest free row and runs, each iteration, the smallest size that holds
every live row (`size_for`), as vLLM's persistent batch does: a lone request runs at batch 1 in a table of 8 rows.

A bucket's step is `mixed_step.mixed_step` over its rows, behind one interface (`Unit`): an `EagerUnit` by default,
or whatever `unit` makes of it (the compiled generator passes `UnitFactory.unit`, which compiles one unit per size,
captured as one CUDA graph on CUDA: a `compile.units.CompiledUnit`); `unit` gets the step's name, function and every
tensor it reads (`Bucket.tensors`), given explicitly. A driver asks a bucket's `unit` (ready, calls, held, source,
`check_owners`) and the table (`warm`, `views`, `made`), nothing else. Run uncompiled
(no unit, or a unit holding its step eagerly: `CompiledGenerator.defer`), the step runs in inference mode and its
attention on dense masks (`plan.PlanBuffers.eager_plan`); a table without a unit keeps dense masks in its plans
from the start (`PlanBuffers(dense_masks=True)`: no block sparsity to refill).

Host-side changes to rows (`admit`, `retire`) write the shared buffers; a driver then refreshes the plan of the
size it runs next (`Bucket.refresh`), which the step itself keeps filled between iterations of one size. After a
step the host reads what each row did from the step's report (`Bucket.report`: `rows.Report`), once.

Legend: B rows, b a batch size (<= B), C canvas, S committed slots.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..model.backbone import DiffusionGemma
from ..model.config import ConfigError, GenerationConfig
from ..model.kv_cache import KVCache, PagedKVCache, paged_cache
from ..model.plan import PlanBuffers
from .frames import frame_rows
from .mixed_step import DenoiseState, StepInputs, mixed_step, refresh_plan
from .phases import FREE
from .rows import RowReport, RowState

log = logging.getLogger("dgemma_compile")


class Unit(Protocol):
    """A view's step as the drivers see it: `EagerUnit`, or `compile.units.CompiledUnit`."""

    name: str
    calls: int
    """Calls run by the unit itself (compiled or eager; not those of a held unit)."""
    held: bool
    """It runs its function eagerly until released (`CompiledGenerator.defer`)."""
    source: str | None
    """Where the step came from: "compiled", "loaded" (the compile cache), None (eager, or not yet run)."""

    @property
    def ready(self) -> bool:
        """Runs without compiling first (compiled, loaded, or eager)."""

    def __call__(self) -> None: ...

    def prepare(self) -> None:
        """Compile (and on CUDA capture) now, with a call whose effect does not matter; eager: nothing."""

    def check_owners(self) -> None:
        """Before a driver runs it: a unit calling a compiled graph directly checks that its tensors are the same
        objects (`CompiledUnit.check_owners`); eager: nothing."""


class EagerUnit:
    """The `Unit` of an eager bucket: the step function itself, counted."""

    held = False
    source = None
    ready = True

    def __init__(self, name: str, fn: Callable[[], None]):
        self.name, self.fn, self.calls = name, fn, 0

    def __call__(self) -> None:
        self.calls += 1
        self.fn()

    def prepare(self) -> None:
        pass

    def check_owners(self) -> None:
        pass


UnitMaker = Callable[[str, Callable[[], None], list[torch.Tensor]], Unit]
"""unit(name, fn, tensors) -> a `Unit` running fn (compiled); `tensors`: every tensor fn reads."""


@dataclass
class Bucket:
    """A bucket: the step over the first `rows` rows of a row table, with views of its buffers and a plan of its own.

    unit: the step (`mixed_step.mixed_step` over these views) behind the `Unit` interface (compiled where the table was
    given a `unit` maker); step: what a driver calls to run it (the unit, unless a test or bench wraps it);
    refresh: `mixed_step.refresh_plan` for these rows, eager (after a host change, or when this size runs next);
    report: the step's per-row report (`rows.RowReport` per row), one host read."""

    rows: int
    name: str
    cache: KVCache | PagedKVCache
    state: DenoiseState
    inputs: StepInputs
    row_state: RowState
    plan: PlanBuffers
    unit: Unit
    step: Callable[[], None]

    def refresh(self) -> None:
        refresh_plan(self.row_state, self.state, self.plan)

    def report(self) -> list[RowReport]:
        """What each of the `rows` rows did in the latest step (`rows.Report`), read from the device at once."""
        return [RowReport.of(r) for r in self.row_state.report.tolist()]

    def tensors(self) -> list[torch.Tensor]:
        """Every buffer tensor the step reads or writes (the model's parameters aside), each once."""
        c = self.cache
        out = [*c.keys, *c.values, c.lengths] + ([c.page_table] if isinstance(c, PagedKVCache) else [])
        for obj in (self.state, self.inputs, self.row_state):
            out += [t for t in vars(obj).values() if isinstance(t, torch.Tensor)]
        pb = self.plan  # the plan's per-row inputs and its tensors
        out += [pb.mode, pb.n_new, pb.self_conditioning] + pb.tensors
        seen: set[int] = set()
        return [t for t in out if not (id(t) in seen or seen.add(id(t)))]


class RowTable:
    """B rows, every buffer the step reads or writes, and a bucket per batch size (see the module docstring).

    Args:
        model: the model the step runs.
        sizes: the batch sizes a step may run over, increasing; B = sizes[-1].
        max_seq_len: S, committed slots per row; max_denoising_steps: the temperature table's width.
        config: the structural config (stability history, stop_early, eos ids); default the model's.
        fuse_commit: commit fusion (a cache of 2C block slots; rows of 2C tokens in the step).
        moe_impl: the routed experts' implementation of the step (`kernels.moe.op.resolve_moe_impl`).
        page_size, kv_pages: a `kv_cache.PagedKVCache` of `kv_pages` pages of `page_size` slots (default: the
            static cache's memory); None: a static cache.
        kernel_options: FlexAttention kernel options of the plans (`plan.build_plan`; the compiled generator's).
        unit: makes each size's step (`UnitMaker`); None: eager (plans with dense masks).
        max_logprobs: K, the most likely ids whose log-probabilities each step keeps per position (`mixed_step.logprobs`;
            0: only the committed tokens'; None: no logprobs, none computed); part of the compiled step's shapes.
        tag: the name of the bucket's steps, "step[B{b}_{tag}]" (default from the structural config).
        skip_idle_vocabulary: a forward in which no row samples (prefill chunks and unfused commits only) skips the
            vocabulary region (`mixed_step.mixed_step`; the compiled generator's `CompileOptions.skip_idle_vocabulary`).
    Raises:
        ConfigError: `sizes` not increasing positive integers.
        ValueError: `kv_cache.new_paged_cache`'s (max_seq_len not a multiple of page_size, a non-positive size).
    """

    def __init__(self, model: DiffusionGemma, sizes: Sequence[int], *, max_seq_len: int, max_denoising_steps: int,
                 config: GenerationConfig | None = None, fuse_commit: bool = False, moe_impl: str = "dense",
                 page_size: int | None = None, kv_pages: int | None = None, kernel_options: dict | None = None,
                 unit: UnitMaker | None = None, tag: str | None = None, max_logprobs: int | None = None,
                 skip_idle_vocabulary: bool = False):
        sizes = tuple(sizes)
        if not sizes or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in sizes) or \
                list(sizes) != sorted(set(sizes)):
            raise ConfigError("sizes", f"must be increasing positive integers, got {sizes!r}")
        self.model, self.sizes, self.rows = model, sizes, sizes[-1]
        cfg = (config or model.generation_config).resolved(model.config)
        self.config = cfg
        C = model.config.canvas_length
        B, block = self.rows, 2 * C if fuse_commit else C
        self.fuse_commit = fuse_commit
        """Commits run fused with the next block's first denoise step: every row of the forward is [2C] tokens."""
        self.tokens_per_row = block
        self.cache = (model.new_cache(B, max_seq_len, block_size=block) if page_size is None else
                      paged_cache(model, B, max_seq_len, block_size=block, page_size=page_size, kv_pages=kv_pages))
        if max_logprobs is not None and (not isinstance(max_logprobs, int) or isinstance(max_logprobs, bool)
                                         or not 0 <= max_logprobs <= 64):
            raise ConfigError("max_logprobs", f"must be None or an integer in [0, 64], got {max_logprobs!r}")
        self.max_logprobs = max_logprobs
        self.state = DenoiseState.allocate(model, B, cfg.stability_threshold if cfg.stop_early else 0, max_logprobs)
        self.inputs = StepInputs.allocate(model, B, C, max_denoising_steps)
        self.row_state = RowState.allocate(B, self.cache.max_seq_len, cfg.eos_token_ids, model.device, C)
        self.moe_impl, self.kernel_options, self.unit = moe_impl, kernel_options, unit
        self.skip_idle_vocabulary = skip_idle_vocabulary
        depth = cfg.stability_threshold if cfg.stop_early else 0
        self.tag = tag or f"P{depth}_{'stop' if cfg.stop_early else 'fixed'}" + (
            f"_pages{self.cache.page_size}x{self.cache.num_pages}" if page_size is not None else "")
        self._views: dict[int, Bucket] = {}
        self._written = self.rows  # rows [0, _written) may hold keys and values since the cache was last zeroed
        self.state.finished.fill_(True)  # every row frozen until a request begins a block in it

    @property
    def paged(self) -> bool:
        return isinstance(self.cache, PagedKVCache)

    @property
    def max_seq_len(self) -> int:
        return self.cache.max_seq_len

    def views(self) -> list[Bucket]:
        """The views made so far (sizes that ran or were warmed)."""
        return [self._views[b] for b in sorted(self._views)]

    def made(self, size: int) -> Bucket | None:
        """The view of `size` rows if it has been made (by `view`: a size that ran or was warmed), else None; makes
        nothing (the engine's bucket table reads whether a size has compiled without compiling it)."""
        return self._views.get(size)

    def step_name(self, size: int) -> str:
        """The name of the step over `size` rows, "step[B{size}_{tag}]": its compile unit's name in logs, explain
        reports and observer spans."""
        return f"step[B{size}_{self.tag}]"

    def view(self, size: int) -> Bucket:
        """The step over the first `size` rows (made on first use; with a `unit` maker, compiled on its first call).
        Raises ConfigError for a size not in `sizes`."""
        if size not in self.sizes:
            raise ConfigError("size", f"{size} is not one of this bucket's batch sizes {self.sizes}")
        self._written = max(self._written, size)  # a step over these rows writes their block slots
        if size not in self._views:
            full = size == self.rows
            cache = self.cache if full else self.cache.view(size)
            state = self.state if full else self.state.view(size)
            inputs = self.inputs if full else self.inputs.view(size)
            rows = self.row_state if full else self.row_state.view(size)
            T = self.tokens_per_row
            plan = PlanBuffers(self.model, cache, T, mixed=True, kernel_options=self.kernel_options,
                               sparsity_in_place=True, canvas=self.model.config.canvas_length,
                               dense_masks=self.unit is None)
            model, kw = self.model, dict(stop_early=self.config.stop_early, moe_impl=self.moe_impl,
                                         skip_idle_vocabulary=self.skip_idle_vocabulary)

            def step() -> None:
                if torch.compiler.is_compiling():
                    mixed_step(model, cache, state, inputs, rows, plan, **kw)
                    return
                # run uncompiled (an eager bucket, or a compiled one's step held while it compiles): in inference mode,
                # whose ops skip autograd's bookkeeping (~18% of a small op's cost on this CPU); the step only writes
                # the buffers in place, so no inference tensor outlives it
                with torch.inference_mode():
                    mixed_step(model, cache, state, inputs, rows, plan, **kw)

            name = self.step_name(size)
            view = Bucket(rows=size, name=name, cache=cache, state=state, inputs=inputs, row_state=rows,
                              plan=plan, unit=EagerUnit(name, step), step=step)
            if self.unit is not None:
                view.unit = self.unit(name, step, view.tensors())
            view.step = view.unit
            self._views[size] = view
        return self._views[size]

    def warm(self, size: int) -> bool:
        """Whether the step of `size` rows runs without compiling first: made and ready (`Unit.ready`), or any size of
        an eager bucket."""
        view = self._views.get(size)
        return self.unit is None or (view is not None and view.unit.ready)

    def size_for(self, live: int, warm: Callable[[int], bool] | None = None) -> int:
        """The batch size to run when rows [0, live) hold every live row: the smallest size >= live that is `warm`
        (compiled already), else the smallest size >= live (which then compiles). Raises ConfigError past B."""
        fits = [b for b in self.sizes if b >= max(live, 1)]
        if not fits:
            raise ConfigError("rows", f"{live} live rows, more than this bucket's {self.rows}")
        if warm is not None:
            ready = [b for b in fits if warm(b)]
            if ready:
                return ready[0]
        return fits[0]

    # ----- host writes: admission and retirement ------------------------------------------------------------------
    def admit(self, row: int, prompt: list[int], cfg: GenerationConfig, seed: int, *, prefilled: int | None = None
              ) -> None:
        """Put a request into FREE row `row` (phase PREFILL): its per-request inputs (`StepInputs.set_row`, block 0),
        its row state, and its cache row emptied -- or, with `prefilled` (a paged cache whose row the caller mapped,
        or a static row the caller wrote, e.g. an image prefix by `images.prefill_images`; `cache.lengths[row]` =
        prefilled), kept. `cfg` is resolved and validated. Raises ValueError as
        `StepInputs.set_row` / `RowState.admit`."""
        self._written = max(self._written, row + 1)
        self.inputs.set_row(row, cfg, seed)
        self.inputs.block[row] = 0
        if prefilled is None:
            self.cache.reset_row(row)
        self.row_state.admit(row, prompt, cfg.max_new_tokens, prefilled=prefilled or 0, ignore_eos=cfg.ignore_eos,
                             canvas=self.model.config.canvas_length)
        self.state.has_sc[row] = False

    def constrain(self, row: int, bitmask_W: torch.Tensor, commit_len: int | None = None) -> None:
        """A constrained row (`constraint.py`), host writes between steps: its next block's first position allows
        the ids of `bitmask_W` (int32 [W]); `commit_len`: the tokens of its finished block that its commit writes
        (the kept prefix; None: unchanged). The driver then refreshes the plan (the commit's length is in it)."""
        self.inputs.constrain(row, bitmask_W)
        if commit_len is not None:
            self.row_state.commit_len[row] = commit_len

    def pin(self, row: int, block: tuple[list[int], list[bool], list[bool]]) -> None:
        """A row with a canvas (`canvas.py`), a host write between steps: the (ids, seeded, pinned) of the block it
        begins next (`canvas.Canvas.block_slice`; `StepInputs.pin`). Nothing recompiles, no plan changes."""
        self.inputs.pin(row, *block)

    def retire(self, row: int) -> None:
        """Free row `row` (FREE, frozen) where the host, not the device, ended its request."""
        self._written = max(self._written, row + 1)  # a failed admission may have written it (an image prefix)
        self.row_state.phase[row] = FREE
        self.state.finished[row] = True

    def clear(self) -> None:
        """Every row FREE, every committed token forgotten (the cache zeroed). A static cache zeroes only the rows
        that may have been written since it was last zeroed: those of every size viewed (`view`: a step writes its
        rows' block slots) and every row admitted or retired; a generate call at batch 1 zeroes one row of B, not all
        of them (~0.5 ms of a demo request at B = 8 on a 2-core CPU). A paged cache is zeroed whole."""
        self.row_state.phase.fill_(FREE)
        self.state.finished.fill_(True)
        if self.paged:
            self.cache.reset()
        else:
            self.cache.reset(rows=self._written)
        self._written = 0

    def read_blocks(self, rows: list[int]) -> list[list[int]]:
        """Per row of `rows` whose block finished in the latest step: its argmax canvas as C ids -- one host read
        (whether the device ended the request and the block's decoder passes are in the step's report)."""
        if not rows:
            return []
        idx = torch.tensor(rows, device=self.state.argmax.device)
        return self.state.argmax[idx].tolist()

    def read_frames(self, rows: list[int]) -> list[tuple[list[int], list[bool], float]]:
        """Per row of `rows` (each stepped in the latest step): (its argmax canvas, C ids; which positions the step
        accepted, C bools; the step's mean entropy) -- `mixed_step.DenoiseState.accepted` / `entropy`, what a live canvas
        frame shows (`frames.py`); one host read for all of them (float64: token ids are exact)."""
        if not rows:
            return []
        st = self.state
        idx = torch.tensor(rows, device=st.argmax.device)
        both = torch.cat([st.argmax[idx].double(), st.accepted[idx].double(), st.entropy[idx].double()[:, None]], 1)
        return frame_rows(both.tolist(), st.argmax.shape[1])

    def read_logprobs(self, rows: list[int], k: int) -> list[list[tuple[float, list[tuple[int, float]]]]]:
        """Per row of `rows` (their block finished in the latest step): per canvas position, (log p of its argmax
        token, the k <= `max_logprobs` most likely (id, log p)) -- `mixed_step.logprobs` of that step; one host read.
        Raises ConfigError for k above `max_logprobs`."""
        if self.max_logprobs is None or k > self.max_logprobs:
            raise ConfigError("top_logprobs", f"{k} is more than this bucket keeps (max_logprobs={self.max_logprobs})")
        if not rows:
            return []
        idx = torch.tensor(rows, device=self.state.steps.device)
        st = self.state
        token, ids = st.logprob[idx].tolist(), st.top_ids[idx, :, :k].tolist()
        top = st.top_logprobs[idx, :, :k].tolist()
        return [[(t, list(zip(i, p))) for t, i, p in zip(*row)] for row in zip(token, ids, top)]
