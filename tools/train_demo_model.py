#!/usr/bin/env python
"""Train the small demo DiffusionGemma (transformers' own ``DiffusionGemmaForBlockDiffusion``).

Data: ``dgemma_compile.demo.tasks`` (train split), character tokenizer from
``tools/build_demo_tokenizer.py``. Canvases are aligned to the end of the prompt exactly as in
``generate``: the prompt ``[bos] + chars`` is encoded; canvas k covers answer positions
``[k*C, (k+1)*C)`` of ``answer + [eos] + [pad]*``. A training example is (example, k): the encoder
sees ``[bos] + prompt + answer[:k*C]`` and the decoder target is canvas k.

Objective (summed):

* decoder / denoiser (weight 1): the clean canvas k is corrupted by replacing every token, with
  probability t, by a token drawn uniformly over the whole vocabulary (t per row: t = 1 with
  probability ``--p-full-noise``, otherwise t = 1 - u**2, u ~ U(0,1), i.e. weighted toward high
  noise since generation starts from pure noise). Cross-entropy of the softcapped decoder logits
  against the clean canvas at all C positions (eos and trailing pads included: the model must be
  confident there too for adaptive stopping). Self-conditioning: a first decoder pass without
  gradient on the same noisy canvas gives logits; they are scaled by 1/T with T ~ U(t_min, t_max)
  (generate feeds the temperature-processed logits of the previous step) and passed as
  ``self_conditioning_logits`` to the second, trained pass, for a random half of the rows
  (``self_conditioning_mask``); the other rows get the zero signal of the first denoising step.
* encoder (weight ``--enc-weight``): next-token prediction on the clean prefix, with
  ``lm_head`` + final softcap applied to ``encoder_last_hidden_state``; loss on the targets that
  are answer tokens (including the first answer token, predicted at the ``=``).

Batching: every batch has ONE prefix length (buckets by encoder length), so no padding, masks or
explicit positions are needed and every row sees exactly what it sees in batch-1 generation
(the reference derives positions from the cache length and uses the DynamicCache sliding layers,
which keep the last W-1 keys).

Checkpoints (model + optimizer + step + RNG states) go to ``RUN_DIR/ckpt.pt`` every
``--ckpt-minutes``; ``RUN_DIR/best.pt`` keeps the weights with the best periodic eval.

Commands::

    python tools/train_demo_model.py --minutes 140               # new run in /work/train_runs/demo
    python tools/train_demo_model.py --resume --minutes 120       # continue the last checkpoint
    python tools/train_demo_model.py --export dgemma_compile/demo/model [--from best|last]

The shipped model (26,870 steps, about 3.6 hours of one core): a run with ``--total-steps 24000`` (its other
flags the defaults) resumed several times, with the ``add`` format of the time: unpadded until step 21,427, operands
zero-padded until 24,370 (``dgemma_compile/demo/tasks.py`` at commits 9e20e72 and ff29834), then
``--resume --restart-at 24370 --lr 5e-4 --total-steps 2500 --max-steps 26870`` on today's fixed-width format. Those
earlier formats exist only in git history, so an exact re-run checks out those revisions for its first two phases;
a fresh run on today's format is ``--total-steps 24000 --minutes 200`` (not run as such).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import torch
import torch.nn.functional as F

from dgemma_compile.demo import tasks as T

DEFAULT_RUN_DIR = "/work/train_runs/demo"
CANVAS = 16
# learning-rate schedule defaults (lr_at); on --resume a run keeps its own values unless a flag is given
SCHEDULE = {"lr": 2e-3, "min_lr_frac": 0.05, "warmup": 300, "total_steps": 20000, "restart_at": 0}

# Generation settings shipped with the model (tuned for this model; see eval_demo_model.py).
GENERATION_CONFIG = {
    "max_new_tokens": 32,  # two canvases: every answer (+ eos) fits
    "max_denoising_steps": 16,
    "t_min": 0.4,
    "t_max": 0.8,
    "stability_threshold": 1,
    "confidence_threshold": 0.01,
    "sampler_config": {"entropy_bound": 0.5, "_cls_name": "EntropyBoundSamplerConfig"},
    "eos_token_id": 1,
    "pad_token_id": 0,
    "bos_token_id": 2,
}


# ----------------------------------------------------------------------------------------------
# model


def make_config(vocab_size: int, size: str = "base"):
    from transformers import DiffusionGemmaConfig, DiffusionGemmaTextConfig, Gemma4VisionConfig

    sizes = {
        # hidden, layers, dense MLP, experts, expert size
        "base": dict(hidden_size=128, num_hidden_layers=4, intermediate_size=256, num_experts=8, moe_intermediate_size=128),
        "small": dict(hidden_size=96, num_hidden_layers=4, intermediate_size=192, num_experts=4, moe_intermediate_size=96),
        "deep": dict(hidden_size=128, num_hidden_layers=6, intermediate_size=256, num_experts=8, moe_intermediate_size=128),
    }[size]
    n_layers = sizes["num_hidden_layers"]
    # alternate sliding / full, last layer full
    layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    layer_types[-1] = "full_attention"
    text = DiffusionGemmaTextConfig(
        vocab_size=vocab_size,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        global_head_dim=64,
        num_global_key_value_heads=1,
        top_k_experts=2,
        sliding_window=16,
        layer_types=layer_types,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        tie_word_embeddings=True,
        **sizes,
    )
    vision = Gemma4VisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        position_embedding_size=16,
    )
    cfg = DiffusionGemmaConfig(
        text_config=text,
        vision_config=vision,
        canvas_length=CANVAS,
        # no image tokens in this vocabulary; keep the ids out of range of the text vocab
        boi_token_id=vocab_size + 1,
        eoi_token_id=vocab_size + 2,
        image_token_id=vocab_size + 3,
        tie_word_embeddings=True,
    )
    return cfg


def hf_cache(cache) -> dict:
    """transformers' keyword for a DiffusionGemma cache: `cache` (5.2x; `past_key_values` deprecated there) or
    `past_key_values` (before the rename: 5.17, the GPU image's)."""
    import inspect

    from transformers.models.diffusion_gemma.modeling_diffusion_gemma import DiffusionGemmaEncoderModel

    new = "cache" in inspect.signature(DiffusionGemmaEncoderModel.forward).parameters
    return {"cache" if new else "past_key_values": cache}


def softcapped_logits(model, hidden):
    cap = model.config.text_config.final_logit_softcapping
    logits = model.lm_head(hidden).float()
    return torch.tanh(logits / cap) * cap


def count_params(model):
    seen, text, total = set(), 0, 0
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        if "vision" not in name:
            text += p.numel()
    return text, total


# ----------------------------------------------------------------------------------------------
# data


class Buckets:
    """Training items (example, canvas index) grouped by encoder input length."""

    def __init__(self, tokenizer, n_train: int, seed: int):
        self.eos, self.pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        vocab = tokenizer.get_vocab()
        self.char_id = {ch: vocab[ch] for ch in T.ALPHABET}
        self.bos = tokenizer.bos_token_id
        split = T.make_split("train", n_train, seed)
        self.prompts, self.answers, self.tasks = [], [], []
        by_len: dict[int, list[tuple[int, int]]] = {}
        for i, (task, prompt, ans) in enumerate(split):
            p = [self.bos] + [self.char_id[c] for c in prompt]
            a = [self.char_id[c] for c in ans]
            self.prompts.append(p)
            self.answers.append(a)
            self.tasks.append(task)
            n_canvases = len(a) // CANVAS + 1  # the canvas holding the eos is the last one
            for k in range(n_canvases):
                by_len.setdefault(len(p) + k * CANVAS, []).append((i, k))
        self.lengths = sorted(by_len)
        self.items = [by_len[L] for L in self.lengths]
        self.weights = [len(x) for x in self.items]

    def batch(self, rng: random.Random, batch_size: int):
        (j,) = rng.choices(range(len(self.lengths)), weights=self.weights)
        bucket = self.items[j]
        picks = [bucket[rng.randrange(len(bucket))] for _ in range(batch_size)]
        enc, canv, ans_start = [], [], []
        for i, k in picks:
            p, a = self.prompts[i], self.answers[i]
            enc.append(p + a[: k * CANVAS])
            full = a + [self.eos] + [self.pad] * (2 * CANVAS)
            canv.append(full[k * CANVAS : (k + 1) * CANVAS])
            ans_start.append(len(p))
        return (
            torch.tensor(enc, dtype=torch.long),
            torch.tensor(canv, dtype=torch.long),
            torch.tensor(ans_start, dtype=torch.long),
        )


# ----------------------------------------------------------------------------------------------
# training step


def train_losses(model, enc_ids, canvas, ans_start, gen: torch.Generator, args):
    """Return (total, decoder CE, encoder CE, decoder token accuracy)."""
    from transformers import DynamicCache

    B, L = enc_ids.shape
    V = model.config.text_config.vocab_size
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    enc = model.model.encoder(input_ids=enc_ids, **hf_cache(cache))
    enc_h = enc.last_hidden_state

    # encoder: next-token prediction on answer targets
    enc_logits = softcapped_logits(model, enc_h[:, :-1])
    targets = enc_ids[:, 1:]
    pos = torch.arange(1, L)[None, :]
    w = (pos >= ans_start[:, None]).float()
    if w.sum() > 0:
        ce = F.cross_entropy(enc_logits.reshape(-1, V), targets.reshape(-1), reduction="none").view(B, L - 1)
        enc_loss = (ce * w).sum() / w.sum()
    else:
        enc_loss = enc_logits.sum() * 0.0

    # decoder: uniform-noise corruption
    u = torch.rand(B, generator=gen)
    t = 1.0 - u**2
    t = torch.where(torch.rand(B, generator=gen) < args.p_full_noise, torch.ones_like(t), t)
    replace = torch.rand(B, CANVAS, generator=gen) < t[:, None]
    noise = torch.randint(0, V, (B, CANVAS), generator=gen)
    noisy = torch.where(replace, noise, canvas)

    sc_mask = torch.rand(B, generator=gen) < args.p_self_cond
    sc_logits = None
    if sc_mask.any():
        with torch.no_grad():
            h0 = model.model.decoder(decoder_input_ids=noisy, **hf_cache(cache)).last_hidden_state
            temp = args.t_min + (args.t_max - args.t_min) * torch.rand(B, 1, 1, generator=gen)
            sc_logits = softcapped_logits(model, h0) / temp
    h = model.model.decoder(
        decoder_input_ids=noisy,
        **hf_cache(cache),
        self_conditioning_logits=sc_logits,
        self_conditioning_mask=sc_mask if sc_logits is not None else None,
    ).last_hidden_state
    logits = softcapped_logits(model, h)
    dec_loss = F.cross_entropy(logits.reshape(-1, V), canvas.reshape(-1))
    acc = (logits.argmax(-1) == canvas).float().mean()
    total = dec_loss + args.enc_weight * enc_loss
    return total, dec_loss.detach(), enc_loss.detach(), acc.detach()


def validation_split(n: int, seed: int, train_n: int):
    """The held-out prompts the periodic eval scores (and `best.pt` is chosen on): ``[500, 500 + n)``."""
    return T.make_split("heldout", n, seed, train_n=train_n, offset=T.VALIDATION_OFFSET)


def lr_at(step: int, args) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_frac * lr`` at ``total_steps``, then constant; with
    ``--restart-at S`` the schedule (warm-up included) starts over at global step S (steps counted from S)."""
    step -= args.restart_at
    if step < 0:
        raise ValueError(f"step {step + args.restart_at} is before restart_at={args.restart_at}")
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = min(1.0, (step - args.warmup) / max(1, args.total_steps - args.warmup))
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * frac)))


# ----------------------------------------------------------------------------------------------
# export / eval


def generation_config():
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

    return DiffusionGemmaGenerationConfig(**json.loads(json.dumps(GENERATION_CONFIG)))


def export(model, tokenizer, out_dir: str, drop_vision: bool = True):
    """Write config.json, generation_config.json, model.safetensors (text weights) and tokenizer."""
    from safetensors.torch import load_file, save_file

    os.makedirs(out_dir, exist_ok=True)
    model.generation_config = generation_config()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if drop_vision:
        path = os.path.join(out_dir, "model.safetensors")
        sd = load_file(path)
        keep = {k: v.contiguous() for k, v in sd.items() if ".vision_tower." not in k and ".embed_vision." not in k}
        save_file(keep, path, metadata={"format": "pt"})
    for name in os.listdir(out_dir):
        os.chmod(os.path.join(out_dir, name), 0o644)


def run_eval(model, tokenizer, examples, log):
    from eval_demo_model import evaluate

    was_training = model.training
    model.eval()
    gen_cfg = generation_config()
    with torch.no_grad():
        m = evaluate(model, tokenizer, examples, gen_cfg)
    if was_training:
        model.train()
    per = " ".join(f"{t}={100 * v:.0f}%" for t, v in sorted(m["exact"].items()))
    log(
        f"EVAL exact={100 * m['overall']:.1f}% [{per}] steps/block={m['steps_per_block']:.2f} "
        f"tok/fwd={m['tokens_per_forward']:.2f} early={100 * m['early_stop_share']:.0f}% ({m['seconds']:.0f}s)"
    )
    for p, c, ok in m["samples"][:4]:
        log(f"   {'ok ' if ok else 'BAD'} {p!r} -> {c!r}")
    return m


# ----------------------------------------------------------------------------------------------
# main


def get_rng_state(py_rng, gen):
    return {"py": py_rng.getstate(), "torch": torch.get_rng_state(), "gen": gen.get_state()}


def set_rng_state(state, py_rng, gen):
    py_rng.setstate(state["py"])
    torch.set_rng_state(state["torch"])
    gen.set_state(state["gen"])


def atomic_save(obj, path):
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", default=DEFAULT_RUN_DIR)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--export", metavar="DIR", help="export a checkpoint of RUN_DIR to DIR and exit")
    ap.add_argument("--from", dest="from_", default="best", choices=["best", "last"])
    ap.add_argument("--keep-vision", action="store_true", help="export: keep the (tiny, untrained) vision tower")
    ap.add_argument("--minutes", type=float, default=140.0, help="wall-clock budget of this invocation")
    ap.add_argument("--max-steps", type=int, default=None, help="stop after this global step")
    ap.add_argument("--size", default="base")
    ap.add_argument("--batch-size", type=int, default=64)
    # schedule flags default to None: on --resume, the ones given explicitly replace the run's (see SCHEDULE)
    ap.add_argument("--lr", type=float, default=None, help=f"peak learning rate (default {SCHEDULE['lr']})")
    ap.add_argument("--min-lr-frac", type=float, default=None, help=f"default {SCHEDULE['min_lr_frac']}")
    ap.add_argument("--warmup", type=int, default=None, help=f"warm-up steps (default {SCHEDULE['warmup']})")
    ap.add_argument("--total-steps", type=int, default=None,
                    help=f"where the cosine ends: a global step, or with --restart-at S the schedule's length after S "
                         f"(default {SCHEDULE['total_steps']})")
    ap.add_argument("--restart-at", type=int, default=None,
                    help="start the schedule (warm-up included) over at this global step, to fine-tune a resumed run; "
                         "must not be ahead of the checkpoint's step")
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--enc-weight", type=float, default=0.5)
    ap.add_argument("--p-full-noise", type=float, default=0.1)
    ap.add_argument("--p-self-cond", type=float, default=0.5)
    ap.add_argument("--t-min", type=float, default=0.4)
    ap.add_argument("--t-max", type=float, default=0.8)
    ap.add_argument("--n-train", type=int, default=T.DEFAULT_TRAIN_N)
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--eval-minutes", type=float, default=12.0)
    ap.add_argument("--eval-n", type=int, default=48)
    ap.add_argument("--ckpt-minutes", type=float, default=4.0)
    ap.add_argument("--experts", default="eager", help="transformers experts implementation")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer, DiffusionGemmaForBlockDiffusion
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    os.makedirs(args.run_dir, exist_ok=True)
    ckpt_path = os.path.join(args.run_dir, "ckpt.pt")
    best_path = os.path.join(args.run_dir, "best.pt")
    tok_dir = os.path.join(args.run_dir, "tokenizer")

    log_f = open(os.path.join(args.run_dir, "train.log"), "a", buffering=1)

    def log(msg):
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        log_f.write(line + "\n")

    if args.export:
        ck = torch.load(best_path if args.from_ == "best" and os.path.exists(best_path) else ckpt_path, weights_only=False)
        tokenizer = AutoTokenizer.from_pretrained(tok_dir)
        from transformers import DiffusionGemmaConfig

        cfg = DiffusionGemmaConfig.from_dict(ck["config"])
        model = DiffusionGemmaForBlockDiffusion(cfg)
        model.load_state_dict(ck["model"])
        export(model, tokenizer, args.export, drop_vision=not args.keep_vision)
        print(f"exported step {ck['step']} ({'best' if 'eval' in ck else 'last'}) to {args.export}")
        if "eval" in ck:
            print(json.dumps({k: v for k, v in ck["eval"].items() if k != "samples"}))
        return

    resume = None
    if args.resume:
        resume = torch.load(ckpt_path, weights_only=False)
        # keep the run's hyperparameters; the budget / logging flags of this invocation win, and so
        # does an explicitly given --total-steps / --lr (a new schedule for the continuation)
        own = {"minutes", "max_steps", "eval_minutes", "eval_n", "ckpt_minutes", "threads", "log_every", "run_dir", "resume", "experts"}
        own |= {k for k in SCHEDULE if getattr(args, k) is not None}
        merged = vars(args).copy()
        merged.update({k: v for k, v in resume["args"].items() if k not in own})
        args = argparse.Namespace(**merged)
    for k, v in SCHEDULE.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    start_step = resume["step"] if resume is not None else 0
    if args.restart_at > start_step:
        ap.error(f"--restart-at {args.restart_at} is ahead of the starting step {start_step}: the learning rate would "
                 "be computed for negative steps")

    if not os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
        from build_demo_tokenizer import save_tokenizer

        save_tokenizer(tok_dir)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir)

    torch.manual_seed(args.seed)
    py_rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    if resume is not None:
        from transformers import DiffusionGemmaConfig

        cfg = DiffusionGemmaConfig.from_dict(resume["config"])
    else:
        cfg = make_config(len(tokenizer), args.size)
    cfg._experts_implementation = args.experts
    model = DiffusionGemmaForBlockDiffusion(cfg)
    model.train()
    decay, no_decay = [], []
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen or "vision" in name:
            continue
        seen.add(id(p))
        (decay if p.ndim >= 2 and "embed" not in name else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.98),
    )
    step = 0
    best = -1.0
    if resume is not None:
        model.load_state_dict(resume["model"])
        opt.load_state_dict(resume["opt"])
        step = resume["step"]
        best = resume.get("best", -1.0)
        set_rng_state(resume["rng"], py_rng, gen)
        log(f"resumed from step {step} (best eval {best})")
    text_p, total_p = count_params(model)
    log(f"args: {json.dumps(vars(args))}")
    log(f"params: text {text_p / 1e6:.2f}M, total incl. vision {total_p / 1e6:.2f}M; vocab {len(tokenizer)}")

    t_data = time.time()
    data = Buckets(tokenizer, args.n_train, args.data_seed)
    # checkpoint selection on the validation part of the held-out stream, never on the test prompts [0, 500) of the
    # README's table (eval_demo_model.py --offset 500 measures the same prompts when --n-train is the default)
    heldout = validation_split(args.eval_n, args.data_seed, args.n_train)
    log(f"data: {args.n_train} train examples, {len(data.lengths)} length buckets ({time.time() - t_data:.1f}s)")

    def save_ckpt():
        atomic_save(
            {
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "step": step,
                "best": best,
                "rng": get_rng_state(py_rng, gen),
                "args": vars(args),
                "config": cfg.to_dict(),
            },
            ckpt_path,
        )

    t_start = time.time()
    deadline = t_start + args.minutes * 60
    last_ckpt = last_eval = time.time()
    win = {"loss": 0.0, "dec": 0.0, "enc": 0.0, "acc": 0.0, "n": 0, "rows": 0, "t": time.time()}
    while time.time() < deadline and (args.max_steps is None or step < args.max_steps):
        lr = lr_at(step, args)
        for g in opt.param_groups:
            g["lr"] = lr
        enc_ids, canvas, ans_start = data.batch(py_rng, args.batch_size)
        total, dec, enc, acc = train_losses(model, enc_ids, canvas, ans_start, gen, args)
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        win["loss"] += total.item()
        win["dec"] += dec.item()
        win["enc"] += enc.item()
        win["acc"] += acc.item()
        win["n"] += 1
        win["rows"] += enc_ids.shape[0]
        if step % args.log_every == 0:
            dt = time.time() - win["t"]
            n = win["n"]
            log(
                f"step {step} loss {win['loss'] / n:.4f} dec {win['dec'] / n:.4f} enc {win['enc'] / n:.4f} "
                f"acc {win['acc'] / n:.3f} lr {lr:.2e} {win['rows'] / dt:.0f} rows/s {dt / n:.3f}s/step"
            )
            win = {"loss": 0.0, "dec": 0.0, "enc": 0.0, "acc": 0.0, "n": 0, "rows": 0, "t": time.time()}
        if time.time() - last_ckpt > args.ckpt_minutes * 60:
            save_ckpt()
            last_ckpt = time.time()
        if args.eval_minutes > 0 and time.time() - last_eval > args.eval_minutes * 60:
            m = run_eval(model, tokenizer, heldout, log)
            score = m["overall"] + 0.01 * min(m["tokens_per_forward"], 4)  # tie-break by speed
            if score > best:
                best = score
                atomic_save(
                    {"model": model.state_dict(), "step": step, "config": cfg.to_dict(), "eval": m}, best_path
                )
                log(f"new best at step {step}")
            save_ckpt()
            last_ckpt = last_eval = time.time()
            win["t"] = time.time()
    save_ckpt()
    log(f"stopped at step {step} after {(time.time() - t_start) / 60:.1f} min; checkpoint {ckpt_path}")


if __name__ == "__main__":
    main()
