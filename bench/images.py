"""Time to first block with one image vs a text prompt of the same length (the image-prompt row of issue 27).

A random-weight multimodal checkpoint (transformers' own `DiffusionGemmaForBlockDiffusion` with a Gemma4 vision tower,
image ids inside the vocabulary, image groups bidirectional) at a CPU-friendly size set by the flags; batch 1, the
compiled generator (`dg.build`), one canvas of output, so the time to the first block is the prefill plus one block.
Rows, each the median (min / p90) of `--repeats` interleaved runs after one warm-up each (the compile is reported
apart): `text` (P prompt tokens), `image` (the same P tokens holding one image of N soft tokens: the vision tower,
the image prefix's own forwards, then the step), and the image row's parts measured alone: `vision` (the checks, the
content digest, the tower and embedder: `images.prepare` + `ImagePrompt.features`) and `prefix` (`images.prefill_images`). Numbers of a random model on whatever machine
runs it: ratios within one run are the signal, not absolute times.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

import dgemma_compile as dg
from dgemma_compile.inputs.images import Image, prefill_images, prepare

from .environment import device_name, git_commit


def write_checkpoint(directory: Path, args: argparse.Namespace) -> tuple[Path, int]:
    """The random multimodal checkpoint; returns it and its image token id."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, Gemma4VisionConfig

    torch.manual_seed(0)
    V = 4096
    text = dict(vocab_size=V, hidden_size=args.hidden, intermediate_size=args.hidden * 3 // 4,
                num_hidden_layers=args.layers, layer_types=["sliding_attention"] * (args.layers - 1) + ["full_attention"],
                num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4, global_head_dim=args.hidden // 2,
                num_global_key_value_heads=1, sliding_window=1024, num_experts=16, top_k_experts=4,
                moe_intermediate_size=args.hidden // 4, use_bidirectional_attention="vision")
    vision = Gemma4VisionConfig(hidden_size=args.tower_hidden, intermediate_size=args.tower_hidden * 4,
                                num_hidden_layers=args.tower_layers, num_attention_heads=4, num_key_value_heads=4,
                                head_dim=args.tower_hidden // 4)
    cfg = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=args.canvas,
                               image_token_id=V - 3, boi_token_id=V - 2, eoi_token_id=V - 1)
    DiffusionGemmaForBlockDiffusion(cfg).eval().save_pretrained(str(directory))
    return directory, V - 3


def image_of(side: int) -> Image:
    """side x side patches of random pixels: side^2 / 9 soft tokens."""
    P = side * side
    pos = torch.stack(torch.meshgrid(torch.arange(side), torch.arange(side), indexing="xy"), -1).reshape(P, 2)
    return Image(torch.rand(P, 768), pos)


def spread(xs: list[float]) -> str:
    xs = sorted(xs)
    return f"{statistics.median(xs) * 1e3:.1f} ({xs[0] * 1e3:.1f} / {xs[int(0.9 * (len(xs) - 1))] * 1e3:.1f})"


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(prog="python -m bench.images", description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--canvas", type=int, default=32)
    ap.add_argument("--tower-hidden", type=int, default=128)
    ap.add_argument("--tower-layers", type=int, default=4)
    ap.add_argument("--soft-tokens", type=int, default=70, help="the image's soft tokens N (a square of patches)")
    ap.add_argument("--prompt-len", type=int, default=96, help="prompt tokens P (image placeholders included)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    side = 3 * round(args.soft_tokens ** 0.5)
    N = side * side // 9
    if args.prompt_len < N + 4:
        raise SystemExit(f"--prompt-len must hold the image: at least {N + 4}")
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, IMG = write_checkpoint(Path(tmp), args)
        model = dg.load(ckpt)
    gen = dg.build(model, dg.CompileOptions(batch_buckets=(1,), max_seq_len=256))
    cfg = dg.GenerationConfig(max_new_tokens=args.canvas, max_denoising_steps=16)
    text = [2] + [7 + (i % 50) for i in range(args.prompt_len - 1)]
    head = 8
    with_image = [2] + text[1:head] + [IMG + 1] + [IMG] * N + [IMG + 2]
    with_image += text[len(with_image):args.prompt_len]
    imgs = [[image_of(side)]]
    t0 = time.perf_counter()
    gen.warmup(1, cfg)
    compile_s = time.perf_counter() - t0

    def ttfb(prompt, images=None) -> float:
        start, first = time.perf_counter(), []
        gen.generate([prompt], cfg, seed=0, images=images,
                     on_block=lambda *_: first or first.append(time.perf_counter()))
        return first[0] - start

    def vision() -> float:
        start = time.perf_counter()
        prepare(model, [with_image], imgs)[0].features  # the checks, the digest and the tower (run on first use)
        return time.perf_counter() - start

    item = prepare(model, [with_image], imgs)[0]
    cache = model.new_cache(1, 256)

    def prefix() -> float:
        cache.reset()
        start = time.perf_counter()
        prefill_images(model, cache, 0, with_image, item, chunk=args.canvas, moe_impl=gen.moe_impl)
        return time.perf_counter() - start

    runs = {"text": lambda: ttfb(text), "image": lambda: ttfb(with_image, imgs), "vision": vision, "prefix": prefix}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for fn in runs.values():
        fn()  # warm-up
    with torch.no_grad():
        for _ in range(args.repeats):  # interleaved
            for k, fn in runs.items():
                times[k].append(fn())
    ratio = statistics.median(times["image"]) / statistics.median(times["text"])
    lines = [f"# Time to first block with one image ({N} soft tokens, prompt {args.prompt_len} tokens, batch 1)", "",
             f"{device_name('cpu')}; torch {torch.__version__}; threads {torch.get_num_threads()}; commit "
             f"{git_commit()}; text model hidden {args.hidden} x {args.layers} layers, canvas {args.canvas}; tower "
             f"hidden {args.tower_hidden} x {args.tower_layers} layers; compile {compile_s:.1f} s (apart)", "",
             "| row | ms: median (min / p90) |", "|---|---|"]
    lines += [f"| {k} | {spread(v)} |" for k, v in times.items()]
    lines += ["", f"image / text time to first block: {ratio:.2f}x"]
    report = "\n".join(lines)
    print(report)
    return report


if __name__ == "__main__":
    main()
