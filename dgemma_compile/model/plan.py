"""`ForwardPlan`: what each row of one forward does, built outside the model by `build_plan`.

A forward processes one block of T token slots per row (the cache layout of `kv_cache.py`). Each row has a mode:
- ENCODER: a prefill chunk or a commit. Causal; its first `n_new[b]` block tokens are real; they are written to the
  committed slots and advance `cache.lengths[b]` (by the model, after the layers).
- DENOISER: a canvas. Bidirectional over the whole block plus the visible context; every block token is real;
  nothing is committed (its keys/values only pass through the block slots). Its input is the self-conditioned
  embedding, with the previous step's signal where `self_conditioning[b]` (zero otherwise).
- IDLE: no real token, nothing committed; its outputs are meaningless.
- COMMIT_DENOISER (commit fusion, rows of a fused plan): 2C block tokens, the first C a commit (encoder mode,
  `n_new[b]` real, committed) and the last C the next block's start canvas (denoise mode, no self-conditioning),
  which sees the committed context including the tokens committed by this very forward
  (`masks.commit_denoise_mask_mod`). One forward instead of a commit and a block's first denoise step.

The plan holds, per row, the mode and what follows from it (the masks' real-token count, the committed count, the
causal flag, the self-conditioning flag), per block token its logical position and the physical slot its key/value
goes to (`slots`: position -> slot, the identity for the static cache: committed tokens at slot = position, the
others in their own block slot; a paged cache supplies another mapping), and per layer type the RoPE tables and the
attention mask. The model reads only the plan, so one forward serves rows in different phases.

One form: `mode` is an int64 tensor [B] of `IDLE` / `ENCODER` / `DENOISER` codes (forward modes: the row phases
of `phases.py` are another set), and every per-row field is a tensor; a uniform pass (`forwards.py`: every row one
mode) gives every row one code (`every_row`). Inductor's CPU flex template rejects mask tensors computed inside a
compiled graph, so a compiled step builds its plan outside the compiled region or into preallocated buffers
(`PlanBuffers`), whose tensors are then graph inputs. A fused plan
(T = 2C, `canvas=C`) also takes `COMMIT_DENOISER` rows; its DENOISER rows hold their canvas in the first C tokens (C
real, the rest idle: the keys a canvas sees are those of a [B, C] denoise step plus masked ones), its encoder rows
chunks of up to 2C tokens.

Legend: B rows, T block length, S committed slots per row.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

from ..kernels.moe.op import materialize_many
from .config import SLIDING
from .kv_cache import KVCache, commit_slots
from .masks import (block_mask_mod, commit_denoise_mask_mod, dense_block_mask, dense_commit_denoise_mask,
                    dense_mask, make_block_mask, select_mask_mod, block_sparsity, sparsity_of)
from .modes import COMMIT_DENOISER, DENOISER, ENCODER, IDLE


@dataclass
class ForwardPlan:
    """One forward's per-row plan (see the module docstring). Every per-row field is a tensor: a uniform pass is a
    plan whose rows all have one mode code (`every_row`), so the model never dispatches on a field's type.

    Attributes:
        mode: int64 [B], `IDLE` / `ENCODER` / `DENOISER` / `COMMIT_DENOISER` per row.
        encoder_tokens: bool, broadcastable to [B, T] ([B, 1] per row, [B, T] for a fused plan): tokens in encoder
            mode (the layers' encoder scalar).
        denoise_tokens: like `encoder_tokens`, tokens in denoise mode (they take the self-conditioned embedding).
        real: int64 [B], real block tokens per row (the masks' count: n_new for encoder rows, C for denoise rows, 0
            for idle and commit + denoise rows, whose mask reads n_new).
        commit: int64 [B], tokens committed per row (n_new for encoder and commit + denoise rows, 0 otherwise);
            `cache.lengths` grows by it after the forward.
        slots: int64 [B, T], the cache slot each block token's key/value is written to (`kv_cache.commit_slots`:
            the committed slots for committed tokens, the block slots for the others).
        self_conditioning: bool [B], denoise rows whose input carries the previous step's signal.
        positions: int64 [B, T], the block tokens' logical positions (lengths[b] + i; the canvas half of commit
            fusion: lengths[b] + n_new[b] + i - C).
        rope: per layer type, (cos, sin) [B, T, rotary dim] in the model dtype.
        masks: per layer type, a FlexAttention `BlockMask` or a dense bool mask [B, T, S+T].
        kernel_options: per layer type, the FlexAttention kernel options of this forward's queries (`kernel_options`
            of `flex_attention`; empty: the kernel's defaults). Data, not a compiler setting: the compiled generator
            fills it from `CompileOptions.attention_kernel_options`, the eager paths leave it empty.
    """

    mode: torch.Tensor
    encoder_tokens: torch.Tensor
    denoise_tokens: torch.Tensor
    real: torch.Tensor
    commit: torch.Tensor
    slots: torch.Tensor
    self_conditioning: torch.Tensor
    positions: torch.Tensor
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]
    masks: dict[str, BlockMask | torch.Tensor]
    kernel_options: dict[str, dict] = dataclasses.field(default_factory=dict)
    mask_rows: tuple[torch.Tensor, ...] = ()
    """Per-row tensors the masks capture that no other field holds (encoder rows, bool [B]; a fused plan's commit +
    denoise rows too), so that `PlanBuffers` refills them."""
    groups: torch.Tensor | None = None
    """int64 [B, T]: the image group of each block token (-1: text) of a plan whose encoder rows hold a prompt's
    images (`masks.py`'s image-group overlay, `images.py`), or None."""


QUERY_KINDS = ("encoder", "canvas")
"""The query kinds that attention kernel options are chosen by: "encoder" (prefill chunks and unfused commits) and
"canvas" (denoise steps, mixed and commit + denoise forwards, whose queries are a canvas). The caller of
`build_plan` chooses (`CompileOptions.attention_kernels()[kind]`): a plan's kind is not in its tensors."""


def every_row(cache: KVCache, mode: int) -> torch.Tensor:
    """int64 [B] of one mode code (`ENCODER`, `DENOISER`, `COMMIT_DENOISER`) for every row of `cache`: the `mode`
    of a uniform pass (`forwards.py`)."""
    return torch.full((cache.batch_size,), mode, dtype=torch.long, device=cache.lengths.device)


def build_plan(model, cache: KVCache, T: int, *, mode: torch.Tensor, n_new: torch.Tensor | None = None,
               self_conditioning: torch.Tensor | None = None, canvas: int | None = None, check_values: bool = True,
               kernel_options: dict | None = None, block_masks: bool = True, groups: torch.Tensor | None = None,
               dense_masks: bool = False) -> ForwardPlan:
    """The plan of one forward of T block tokens per row over `cache` (its current `lengths`).

    Args:
        model: the `DiffusionGemma` that will run the plan (its config, attention backend, window kind, RoPE).
        cache: the cache the forward reads and writes; T <= cache.block_size.
        mode: int64 [B], each row's `IDLE` / `ENCODER` / `DENOISER` (and `COMMIT_DENOISER` in a fused plan); a
            uniform pass gives every row one code (`every_row`).
        n_new: int64 [B], real tokens of encoder rows (0 <= n_new <= T), or tokens committed by a commit + denoise
            row (0 <= n_new <= C, and lengths + n_new <= S: a precondition, not checked); ignored for other rows;
            required when a row commits. None: zeros.
        self_conditioning: bool [B], denoise rows that receive the previous step's signal (default none).
        canvas: C, the canvas length (default T). T = 2C makes a fused plan (commit fusion): `COMMIT_DENOISER` rows
            commit their first n_new tokens and denoise the next block's canvas in the second half (`masks.
            commit_denoise_mask_mod`); DENOISER rows hold their canvas in the first half (C real tokens, the second
            half idle), encoder rows chunks of up to T tokens.
        check_values: check the mode values and that committing rows have `n_new` (reads the device: a host
            synchronisation; the uniform passes and `PlanBuffers.fill`, which may run compiled, turn it off).
        kernel_options: {layer type: FlexAttention kernel options} of this forward's query kind (`QUERY_KINDS`,
            chosen by the caller). None: none.
        block_masks: False leaves out the FlexAttention block masks (`masks` is then empty for a flex model; what
            `PlanBuffers(sparsity_in_place=True)` rebuilds: everything but its masks, whose sparsity it refills).
        groups: int64 [B, T], the image group of each block token (-1: text): the encoder rows' bidirectional
            image-group overlay in every layer type's mask (`masks.block_mask_mod`); a group must lie whole in this
            block (`images.py` encodes each group in one forward). Not with a fused plan. None: none.
        dense_masks: dense bool masks [B, T, S+T] (`masks.dense_block_mask`, the same visibility as the block
            masks' mask_mods) for a flex model too, so that its attention runs FlexAttention's eager math on them
            (`model.eager_attention`, bitwise) without FlexAttention's vmapped eager path (~9 ms a call at the
            demo's sizes): what an uncompiled step wants. A model with `attention == "dense"` always gets them.
    Returns:
        A `ForwardPlan`. Tensor ops only with `check_values=False` (no host synchronisation), so it can be built
        inside a compiled region.
    Raises:
        ValueError: `mode` not an int64 tensor [B], per-row tensors whose shape is not [B], a non-bool
            `self_conditioning`, a `canvas` other than T or T / 2, `groups` not int64 [B, T] or given with a fused
            plan; with `check_values`, mode values out of range or a committing row without `n_new`.
    """
    B, S, dev = cache.batch_size, cache.max_seq_len, cache.lengths.device
    lengths = cache.lengths
    C = T if canvas is None else canvas
    if C != T and 2 * C != T:
        raise ValueError(f"canvas: a plan's canvas is T or T / 2 (commit fusion), got {canvas} for T = {T}")
    fused = C != T
    if not isinstance(mode, torch.Tensor) or mode.shape != (B,) or mode.dtype != torch.long:
        raise ValueError(f"mode must be an int64 tensor [B={B}], got {getattr(mode, 'dtype', type(mode).__name__)} "
                         f"{tuple(getattr(mode, 'shape', ()))}")
    for name, t in (("n_new", n_new), ("self_conditioning", self_conditioning)):
        if t is not None and t.shape != (B,):
            raise ValueError(f"{name} must be [B={B}], got {tuple(t.shape)}")
    if self_conditioning is not None and self_conditioning.dtype != torch.bool:
        raise ValueError(f"self_conditioning must be bool, got {self_conditioning.dtype}")
    if groups is not None and (fused or not isinstance(groups, torch.Tensor) or groups.dtype != torch.long
                               or groups.shape != (B, T)):
        got = f"{groups.dtype} {tuple(groups.shape)}" if isinstance(groups, torch.Tensor) else type(groups).__name__
        raise ValueError(f"groups: an int64 tensor [B={B}, T={T}] of a plan that is not fused; got {got}"
                         f"{' with canvas = T / 2' if fused else ''}")
    if check_values:
        top = COMMIT_DENOISER if fused else DENOISER
        if bool(((mode < IDLE) | (mode > top)).any()):
            raise ValueError(f"mode: per-row modes are IDLE, ENCODER, DENOISER ({IDLE}, {ENCODER}, {DENOISER}; "
                             f"COMMIT_DENOISER ({COMMIT_DENOISER}) only in a fused plan, T = 2 x canvas), got "
                             f"{mode.tolist()}")
        if n_new is None and bool(((mode == ENCODER) | (mode == COMMIT_DENOISER)).any()):
            raise ValueError("n_new: required for encoder and commit + denoise rows")
    i_T = torch.arange(T, device=dev)
    positions = lengths[:, None] + i_T[None, :]
    encoder_rows, denoise_rows = mode == ENCODER, mode == DENOISER
    n_B = n_new if n_new is not None else torch.zeros(B, dtype=torch.long, device=dev)
    real = torch.where(encoder_rows, n_B, torch.where(denoise_rows, C, 0))
    if fused:  # per token: a commit + denoise row is encoder in its first half, denoise in its second
        fused_rows = mode == COMMIT_DENOISER
        first_half = (i_T < C)[None, :]
        encoder_tokens = encoder_rows[:, None] | (fused_rows[:, None] & first_half)
        denoise_tokens = denoise_rows[:, None] | (fused_rows[:, None] & ~first_half)
        commit = torch.where(encoder_rows | fused_rows, n_B, 0)
        mask_rows: tuple[torch.Tensor, ...] = (encoder_rows, fused_rows)
        # the canvas follows what this forward commits: lengths + n_new + (i - C)
        positions = torch.where(fused_rows[:, None] & ~first_half, positions + n_B[:, None] - C, positions)
    else:
        # tensors of their own, not views of the rows' flags: a compiled step whose weights are tensor subclasses
        # (torchao) refuses mutated graph inputs that alias each other, and `PlanBuffers.fill` rewrites both
        encoder_tokens, denoise_tokens = encoder_rows[:, None].clone(), denoise_rows[:, None].clone()
        mask_rows = (encoder_rows,)
        commit = torch.where(encoder_rows, n_B, 0)
    slots = commit_slots(lengths, commit, T, S)
    if self_conditioning is None:
        self_conditioning = torch.zeros(B, dtype=torch.bool, device=dev)
    self_conditioning = self_conditioning & denoise_rows
    group_kw = {} if groups is None else {"groups_BT": groups}
    rope, masks = {}, {}
    dense = dense_masks or model.attention == "dense"
    for lt in sorted(set(model.config.layer_types)):
        rope[lt] = model.rope_tables(lt, positions)
        window = dict(sliding_window=model.config.sliding_window if lt == SLIDING else None,
                      window_kind=model.window_kind)
        if dense:
            masks[lt] = dense_block_mask(lengths, real, encoder_rows, block_len=T, cache_slots=S, **window,
                                         **group_kw)
            if fused:
                cd = dense_commit_denoise_mask(lengths, n_B, canvas=C, cache_slots=S, **window)
                masks[lt] = torch.where(fused_rows[:, None, None], cd, masks[lt])
        elif block_masks:
            mask_mod = block_mask_mod(lengths, real, encoder_rows, cache_slots=S, **window, **group_kw)
            if fused:
                mask_mod = select_mask_mod(fused_rows, commit_denoise_mask_mod(lengths, n_B, canvas=C, cache_slots=S,
                                                                               **window), mask_mod)
            masks[lt] = make_block_mask(mask_mod, B, T, S, dev)
    return ForwardPlan(mode=mode, encoder_tokens=encoder_tokens, denoise_tokens=denoise_tokens, real=real,
                       commit=commit, slots=slots, self_conditioning=self_conditioning, positions=positions, rope=rope,
                       masks=masks, kernel_options=dict(kernel_options or {}), mask_rows=mask_rows, groups=groups)


class PlanBuffers:
    """A plan held in preallocated tensors, rebuilt in place by `fill` (tensor ops only: a compiled step can fill
    it, and another compiled step read it as graph inputs).

    - `PlanBuffers(model, cache, T)`: the uniform denoise plan that every denoise step of one block reads, filled
      once per block (after the prefill's chunks or the commit that precedes the block) instead of in every step.
    - `PlanBuffers(model, cache, T, mixed=True)`: a mixed plan whose per-row inputs are the buffers `mode`,
      `n_new` and `self_conditioning` ([B]; all rows IDLE until filled): `fill(mode=..., n_new=...,
      self_conditioning=...)` copies the given rows' inputs in, then rebuilds. Its masks read per-row tensors of
      the buffers, which is what Inductor's CPU flex template needs (captured tensors must be graph inputs).
      With `sparsity_in_place` (flex models), its masks' block sparsity is refilled in place by `fill` beside the
      other tensors (`masks.block_sparsity` of each mask's own mask_mod: create_block_mask's partial and full
      blocks, from a few fused tensor ops): no `create_block_mask` per fill (its vmap over B x T x (S + T) took
      ~20 ms a fill eagerly at the demo's B=8), a row visits only the key blocks it sees, and whole visible blocks
      skip the mask_mod (the scaled model's b1 denoise step: every block partial made flex ~1.5x slower than
      the uniform unit's create_block_mask masks). The masks' `q_num_blocks` / `q_indices` (read by the backward
      only) are left as built.

    - `dense_masks=True` (an eager bucket's plans; always for a dense-attention model): dense bool masks refilled
      with the rest (`build_plan(dense_masks=True)`), no block sparsity. A plan of block masks gives a step run
      uncompiled its dense masks through `eager_plan`, and, run uncompiled on CPU, `fill` leaves the buffers as they
      are when they already hold the plan it would build (`_holds`).

    `plan` is a `ForwardPlan` over the buffers: each block mask's sparsity tensors are static (its mask_mod reads
    `cache.lengths` and the plan's own per-row tensors, as `build_plan`'s). `tensors` lists every buffer once, for the
    compiled step's explicit owners (`row_table.Bucket.tensors`).
    """

    def __init__(self, model, cache: KVCache, T: int, *, mixed: bool = False, kernel_options: dict | None = None,
                 sparsity_in_place: bool = False, canvas: int | None = None, dense_masks: bool = False):
        self.model, self.cache, self.T, self.canvas = model, cache, T, canvas
        self.kernel_options = (kernel_options or {}).get("canvas")  # a step's queries are a canvas (`QUERY_KINDS`)
        self.dense_masks = dense_masks or model.attention == "dense"
        """Dense bool masks instead of block masks (`build_plan(dense_masks=True)`): the plan of an eager step."""
        B, dev = cache.batch_size, cache.lengths.device
        self.mixed = mixed
        # the per-row inputs: a mixed plan's `fill` rewrites them (every row IDLE until then); the uniform denoise
        # plan's stay every row DENOISER
        self.mode = torch.full((B,), IDLE if mixed else DENOISER, dtype=torch.long, device=dev)
        self.n_new = torch.zeros(B, dtype=torch.long, device=dev)
        self.self_conditioning = torch.zeros(B, dtype=torch.bool, device=dev)
        self._dense: tuple[dict[str, torch.Tensor], torch.Tensor] | None = None  # `eager_plan`'s masks, their key
        self.plan = self._build()  # fresh tensors: these become the buffers
        self.sparsity_in_place = sparsity_in_place and mixed and not self.dense_masks
        if self.sparsity_in_place:
            self.plan.masks = {lt: _with_full_blocks(m) for lt, m in self.plan.masks.items()}
            self._fill_sparsity()
        self.tensors: list[torch.Tensor] = _plan_tensors(self.plan)
        self._refilled = _plan_tensors(self.plan, masks=not self.sparsity_in_place)  # what `fill` rewrites

    def _build(self, block_masks: bool = True) -> ForwardPlan:
        return build_plan(self.model, self.cache, self.T, mode=self.mode, n_new=self.n_new, check_values=False,
                          self_conditioning=self.self_conditioning, kernel_options=self.kernel_options,
                          block_masks=block_masks, canvas=self.canvas, dense_masks=self.dense_masks)

    def fill(self, mode: torch.Tensor | None = None, n_new: torch.Tensor | None = None,
             self_conditioning: torch.Tensor | None = None) -> None:
        """Rebuild the plan for the cache's current `lengths` (and, mixed, the given per-row inputs: int64 / int64 /
        bool [B], each optional) into the buffers. No host synchronisation and no validation (`build_plan` checks a
        mixed plan's inputs when it is built from them directly).

        Raises:
            ValueError: per-row inputs given to a uniform denoise plan.
        """
        if not self.mixed and (mode is not None or n_new is not None or self_conditioning is not None):
            raise ValueError("fill: per-row inputs (mode, n_new, self_conditioning) need PlanBuffers(..., mixed=True)")
        if self._holds(mode, n_new, self_conditioning):
            return
        for buf, value in ((self.mode, mode), (self.n_new, n_new), (self.self_conditioning, self_conditioning)):
            if value is not None:
                buf.copy_(value)
        new = self._build(block_masks=not self.sparsity_in_place)
        for buf, t in zip(self._refilled, _plan_tensors(new, masks=not self.sparsity_in_place), strict=True):
            buf.copy_(t)
        if self.sparsity_in_place:
            self._fill_sparsity()

    def _holds(self, mode: torch.Tensor | None, n_new: torch.Tensor | None,
               self_conditioning: torch.Tensor | None) -> bool:
        """Whether the buffers already hold the plan `fill` would build (run uncompiled, on CPU, a mixed plan given
        all three per-row inputs): the plan is a function of those inputs and the cache's lengths, and the buffers
        record the ones they were last filled from, whoever filled them (the inputs' own buffers, and the lengths as
        every row's first position). An eager step refills an unchanged plan in most iterations (every denoise step
        of a block after its first two); one comparison instead of rebuilding it. Compiled, never (a static graph
        fills every time); on other devices, never (it would read the device)."""
        if (not self.mixed or mode is None or n_new is None or self_conditioning is None
                or torch.compiler.is_compiling() or self.cache.lengths.device.type != "cpu"):
            return False
        return (torch.equal(mode, self.mode) and torch.equal(n_new, self.n_new)
                and torch.equal(self_conditioning, self.self_conditioning)
                and torch.equal(self.cache.lengths, self.plan.positions[:, 0]))

    def _mask_inputs(self) -> list[torch.Tensor]:
        """The per-row tensors the masks' mask_mods capture, each once."""
        return list({id(t): t for t in (self.cache.lengths, self.plan.real, *self.plan.mask_rows, self.n_new,
                                        self.plan.groups)
                     if isinstance(t, torch.Tensor)}.values())

    def _fill_sparsity(self) -> None:
        """Each mask's block sparsity from its mask_mod over the current buffers (`masks.block_sparsity`), into
        the mask's own tensors.

        Compiled, the per-row tensors the mask_mods read are first rewritten from one opaque copy of themselves
        (`kernels.moe.op.materialize_many`): `fill` has just computed them from the rows' phases, and Inductor would
        otherwise inline that whole computation into the B x T x (S + T) mask evaluation, once per element
        (measured on the demo's B=8 step: 4.1 ms for that loop nest, a step's worth of work). Eagerly the evaluated
        masks are kept, with the values they were evaluated from, as the next eager step's dense masks
        (`eager_plan`)."""
        rows = self._mask_inputs()
        compiling = torch.compiler.is_compiling()
        if compiling:
            for t, fresh in zip(rows, materialize_many(rows), strict=True):
                t.copy_(fresh)
        dense = {}
        for lt, mask in self.plan.masks.items():
            B = mask.kv_indices.shape[0]
            q_len, kv_len = mask.seq_lengths
            if compiling:
                sparsity = block_sparsity(mask.mask_mod, B, q_len, kv_len, mask.BLOCK_SIZE, mask.kv_indices.device)
            else:
                dense[lt] = dense_mask(mask)
                sparsity = sparsity_of(dense[lt], mask.BLOCK_SIZE)
            for buf, t in zip((mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices),
                              sparsity, strict=True):
                buf.copy_(t)
        if not compiling and self.cache.lengths.device.type == "cpu":
            self._dense = (dense, self._mask_key(rows))

    @staticmethod
    def _mask_key(rows: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.reshape(-1) for t in rows])  # (bool rows promote to int64)

    def eager_plan(self) -> ForwardPlan:
        """The plan for a step run uncompiled (`mixed_step.mixed_step`): `plan` with each FlexAttention block mask replaced
        by the dense bool mask it stands for (`masks.dense_mask`), so that attention runs FlexAttention's eager math
        on it (`model.eager_attention`: the same bits) without FlexAttention's vmap over the mask_mod (~9 ms a call
        at the demo's sizes on this CPU).
        The block masks stay as they are: a compiled step reads them next (a held step switched to its compiled
        twin). On CPU the masks the latest eager `fill` evaluated are reused when the values they were evaluated
        from are unchanged (one comparison, instead of evaluating every mask_mod again); else, and on other devices
        (no host synchronisation there), evaluated now. A plan without block masks is returned as it is."""
        if not any(isinstance(m, BlockMask) for m in self.plan.masks.values()):
            return self.plan
        if self._dense is not None and torch.equal(self._dense[1], self._mask_key(self._mask_inputs())):
            masks = self._dense[0]
        else:
            masks = {lt: dense_mask(m) if isinstance(m, BlockMask) else m for lt, m in self.plan.masks.items()}
        return dataclasses.replace(self.plan, masks=masks)


def _with_full_blocks(mask: BlockMask) -> BlockMask:
    """`mask` with fresh tensors of its own for partial and full blocks, whatever `mask` holds (None full blocks, or
    views): the buffers `PlanBuffers._fill_sparsity` refills in place."""
    B, H, Qb, Kb = mask.kv_indices.shape
    dev = mask.kv_indices.device
    num = lambda: torch.zeros((B, H, Qb), dtype=torch.int32, device=dev)  # noqa: E731
    idx = lambda: torch.arange(Kb, dtype=torch.int32, device=dev).repeat(B, H, Qb, 1)  # noqa: E731
    return BlockMask.from_kv_blocks(num(), idx(), num(), idx(), BLOCK_SIZE=mask.BLOCK_SIZE, mask_mod=mask.mask_mod,
                                    seq_lengths=mask.seq_lengths)


def _plan_tensors(plan: ForwardPlan, masks: bool = True) -> list[torch.Tensor]:
    """Every tensor a plan holds, in a fixed order, each once (a block mask's through its public `as_tuple`)."""
    found: list[torch.Tensor] = []

    def add(t) -> None:
        # identity, not `id(t)`: Dynamo of torch 2.11 (the GPU machine's) cannot trace id() of a tensor made in the graph
        if isinstance(t, torch.Tensor) and not any(t is f for f in found):
            found.append(t)

    for t in (plan.mode, plan.encoder_tokens, plan.denoise_tokens, plan.real, plan.commit, plan.slots,
              plan.self_conditioning, plan.positions, *plan.mask_rows, plan.groups):
        add(t)
    for lt in sorted(plan.rope):
        for t in plan.rope[lt]:
            add(t)
        mask = plan.masks.get(lt) if masks else None
        if mask is None:
            continue
        for t in [mask] if isinstance(mask, torch.Tensor) else mask.as_tuple():
            add(t)
    return found
