"""The two workloads, built identically for every system from a JSON-serialisable `WorkloadSpec`.

- `fixed` (vLLM-style): every block runs exactly `steps` denoise steps (confidence stop disabled) and eos is ignored,
  so every system produces exactly `output_len` tokens from the same `prompt_len`-token prompts. Ours:
  `GenerationConfig(stop_early=False, eos_token_ids=())`. transformers: `stability_threshold=steps` (its stop needs
  the argmax canvas equal to each of the previous `stability_threshold` ones, and its history starts as -1, so it
  cannot fire before step `steps` + 1: exactly `steps` steps) and `eos_token_id=[]`.
- `adaptive`: the checkpoint's own generation config (its max_new_tokens, max_denoising_steps, confidence stop and
  eos). On the demo model the prompts are real held-out task prompts (`demo.tasks.make_split("heldout", n, seed)`),
  so answers can be checked; elsewhere random prompts of `prompt_len` tokens.
Request i uses seed `seed + i` (ours: the request's stream seed; transformers: `torch.manual_seed`).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

from dgemma_compile.model.config import GenerationConfig, ModelConfig

KINDS = ("fixed", "adaptive")


@dataclass(frozen=True)
class WorkloadSpec:
    kind: str = "fixed"
    prompt_len: int = 256
    output_len: int = 512
    steps: int = 16
    batch: int = 1
    n_prompts: int = 8  # adaptive only
    seed: int = 0
    repeats: int = 3  # timed repeats of the whole workload, after one untimed warm-up run

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"workload must be one of {KINDS}, got {self.kind!r}")
        for name in ("prompt_len", "output_len", "steps", "batch", "n_prompts", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.kind == "adaptive" and self.batch != 1:
            raise ValueError("the adaptive workload runs batch 1 (prompts of different lengths)")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Request:
    """One generate call: B prompts (token ids) run as one batch, their seeds, and the task prompts (for checking
    answers) when known."""

    prompts: list[list[int]]
    seeds: list[int]
    texts: list[str] | None = None


@dataclass
class Workload:
    spec: WorkloadSpec
    requests: list[Request]
    config: GenerationConfig  # ours
    hf_kwargs: dict = field(default_factory=dict)  # transformers `generate` kwargs
    ignore_eos: bool = False

    @property
    def max_new_tokens(self) -> int:
        return self.config.max_new_tokens

    @property
    def max_prompt_len(self) -> int:
        return max(len(p) for r in self.requests for p in r.prompts)

    def describe(self) -> str:
        s, c = self.spec, self.config
        if s.kind == "fixed":
            return (f"fixed: batch {s.batch}, prompt {s.prompt_len} tokens, output {s.output_len} tokens, "
                    f"{s.steps} denoise steps per block (confidence stop off, eos ignored), seed {s.seed}, "
                    f"{s.repeats} timed repeats after 1 warm-up")
        return (f"adaptive: {len(self.requests)} prompts at batch 1 (checkpoint generation config: max_new_tokens "
                f"{c.max_new_tokens}, max_denoising_steps {c.max_denoising_steps}, stability {c.stability_threshold}, "
                f"confidence {c.confidence_threshold}, entropy_bound {c.entropy_bound}), seeds {s.seed}.., "
                f"{s.repeats} timed repeats after 1 warm-up")


def random_prompt(rng: random.Random, length: int, cfg: ModelConfig) -> list[int]:
    """bos followed by ids drawn from [3, V) minus the eos ids (no special tokens inside the prompt)."""
    banned = set(cfg.eos_token_ids) | {cfg.pad_token_id, cfg.bos_token_id}
    out = [cfg.bos_token_id]
    while len(out) < length:
        t = rng.randrange(0, cfg.vocab_size)
        if t not in banned:
            out.append(t)
    return out


def build(spec: WorkloadSpec, model_cfg: ModelConfig, gen_cfg: GenerationConfig, *, tokenizer=None,
          demo_tasks: bool = False) -> Workload:
    """The workload for a model with `model_cfg` and checkpoint generation config `gen_cfg`.

    Raises:
        ValueError: fixed output_len not a multiple of the canvas (transformers generates whole canvases, so the
            systems would produce different token counts).
    """
    rng = random.Random(f"dgemma-bench/{spec.kind}/{spec.seed}")
    C = model_cfg.canvas_length
    if spec.kind == "fixed":
        if spec.output_len % C:
            raise ValueError(f"output_len {spec.output_len} must be a multiple of the canvas length {C}")
        prompts = [random_prompt(rng, spec.prompt_len, model_cfg) for _ in range(spec.batch)]
        seeds = [spec.seed + i for i in range(spec.batch)]
        cfg = gen_cfg.replace(max_new_tokens=spec.output_len, max_denoising_steps=spec.steps, stop_early=False,
                              eos_token_ids=()).resolved(model_cfg)
        hf = dict(max_new_tokens=spec.output_len, max_denoising_steps=spec.steps, stability_threshold=spec.steps,
                  eos_token_id=[])
        return Workload(spec=spec, requests=[Request(prompts=prompts, seeds=seeds)], config=cfg, hf_kwargs=hf,
                        ignore_eos=True)
    requests = []
    if demo_tasks and tokenizer is not None:
        from dgemma_compile.demo.tasks import make_split

        for i, (_, text, _) in enumerate(make_split("heldout", spec.n_prompts, spec.seed)):
            ids = [int(t) for t in tokenizer(text)["input_ids"]]
            requests.append(Request(prompts=[ids], seeds=[spec.seed + i], texts=[text]))
    else:
        for i in range(spec.n_prompts):
            requests.append(Request(prompts=[random_prompt(rng, spec.prompt_len, model_cfg)], seeds=[spec.seed + i]))
    return Workload(spec=spec, requests=requests, config=gen_cfg.resolved(model_cfg), hf_kwargs={}, ignore_eos=False)
