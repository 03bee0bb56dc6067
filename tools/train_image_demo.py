#!/usr/bin/env python
"""Train the image demo: the text demo DiffusionGemma taught to read its operands from an image.

Start: the shipped text demo (`dgemma_compile/demo/model`, transformers' `DiffusionGemmaForBlockDiffusion`), its
vocabulary grown by three tokens (`<boi>` 27, `<eoi>` 28, `<image>` 29: small random rows, tied, so their logits
start low) and a new tiny Gemma4 vision tower (hidden 32, 2 layers, patches of 48 px = one grid cell, no pooling) +
multimodal embedder.
Data: `dgemma_compile.demo.image_tasks` (the text suite's train split; ``sort <image>=`` with ``3 1 2`` drawn in a
480 x 336 image, 70 soft tokens, one per grid cell); each train image is drawn fresh (size, offset and ink vary).

Objective per image batch (one task and canvas index per batch, so one prefix length and no padding), summed:
the text trainer's decoder and encoder losses (`train_demo_model.train_losses`' objective: uniform-noise corruption,
self-conditioning on half the rows, encoder next-token loss on the answer), plus ``--aux-weight`` x a feature loss:
each cell's soft token against the scaled embedding of the character drawn there (`embed_tokens(c)`, detached; the
blank cells are free), so the soft tokens stand in for the digit tokens. A share ``--p-text`` of batches are the
text demo's own prompts (its skills kept). The text layers train at ``--text-lr`` (small: nearly frozen), the
embedder at ``--lr``, the tower at ``--tower-lr`` (its random features, standardized at start, already tell the glyphs
apart; trained fast they collapsed).

Checkpoints (model + optimizer + step + RNG states) go to ``RUN_DIR/ckpt.pt`` every ``--ckpt-minutes`` (atomic);
``--resume`` continues one bit for bit in its data order. A periodic eval (transformers' `generate` with
`pixel_values`, on validation prompts ``[500, 500 + eval_n)``) is logged; ``--export DIR`` writes the last
checkpoint as a checkpoint directory both transformers and `dgemma_compile.load` read.

Commands::

    python tools/train_image_demo.py --minutes 60                 # new run in /work/train_runs/image_demo
    python tools/train_image_demo.py --resume --minutes 30        # continue
    python tools/train_image_demo.py --export dgemma_compile/demo/image_model
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

import numpy as np
import torch
import torch.nn.functional as F

from dgemma_compile.demo import DEMO_MODEL
from dgemma_compile.demo import image_tasks as IT
from dgemma_compile.demo import tasks as T
from train_demo_model import CANVAS, Buckets, atomic_save, get_rng_state, hf_cache, set_rng_state, softcapped_logits
from train_demo_model import generation_config as text_generation_config

DEFAULT_RUN_DIR = "/work/train_runs/image_demo"
PATCH, POOL = IT.CELL // 2, 2  # 2 x 2 patches of 24 px per grid cell (soft token)
SPECIAL = ("<boi>", "<eoi>", IT.IMAGE_TOKEN)  # ids 27, 28, 29 after the text demo's 27
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<image>{% endif %}{% endfor %}{% endif %}{% endfor %}"
)


def make_tokenizer():
    """The text demo's character tokenizer plus `<boi>`, `<eoi>`, `<image>` (ids 27, 28, 29)."""
    from build_demo_tokenizer import build_tokenizer

    tok = build_tokenizer()
    n0 = len(tok)
    tok.add_special_tokens({"additional_special_tokens": list(SPECIAL)})
    ids = tok.convert_tokens_to_ids(list(SPECIAL))
    assert ids == [n0, n0 + 1, n0 + 2], ids
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_model(tok, seed: int):
    """The text demo's weights in a config with the grown vocabulary and a new vision tower."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, Gemma4VisionConfig

    base = DiffusionGemmaForBlockDiffusion.from_pretrained(DEMO_MODEL)
    d = base.config.to_dict()
    d["text_config"]["vocab_size"] = len(tok)
    d["boi_token_id"], d["eoi_token_id"], d["image_token_id"] = tok.convert_tokens_to_ids(list(SPECIAL))
    d["vision_config"] = Gemma4VisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        head_dim=16, position_embedding_size=32, patch_size=PATCH, pooling_kernel_size=POOL, standardize=True).to_dict()
    cfg = DiffusionGemmaConfig.from_dict(d)
    torch.manual_seed(seed)
    model = DiffusionGemmaForBlockDiffusion(cfg)
    sd = base.state_dict()
    own = model.state_dict()
    for k, v in sd.items():
        if k not in own or "vision" in k:  # the base's tower is untrained (not in its file): a new one
            continue
        if own[k].shape == v.shape:
            own[k] = v
        else:  # the tied embedding: old rows kept, new rows small
            new = own[k].clone()
            new[: v.shape[0]] = v
            new[v.shape[0]:] = torch.randn_like(new[v.shape[0]:]) * 0.1 * v.std()
            own[k] = new
    model.load_state_dict(own)
    standardize(model, seed)
    return model


@torch.no_grad()
def standardize(model, seed: int, n: int = 64):
    """Set the tower's output standardization (Gemma4's `std_bias` / `std_scale` buffers) to the mean and 1 / std of
    its pooled features over `n` drawn images: raw, a few dims' common offset dwarfs the differences between glyphs
    and the embedder's regression barely moves (measured: the feature loss stalls at the mean-prediction level)."""
    rng = random.Random(f"standardize/{seed}")
    tower = model.model.encoder.vision_tower
    tower.std_bias.zero_()
    tower.std_scale.fill_(1.0)
    pv, pid = zip(*(pixels(IT.render(IT.split_prompt(p)[1], rng)) for _, p, _ in T.make_split("train", n, seed)))
    f = tower(pixel_values=torch.stack(pv), pixel_position_ids=torch.stack(pid)).last_hidden_state.float()
    tower.std_bias.copy_(f.mean(0))
    tower.std_scale.copy_(1.0 / (f.std(0) + 1e-6))


def pixels(im) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values [70, 3 * 48^2], image_position_ids [70, 2]) of a 480 x 336 image: what transformers'
    Gemma4ImageProcessorPil gives at 70 soft tokens with patches of 48 px and no pooling (checked against it at
    start-up, `check_pixels`)."""
    a = np.asarray(im, dtype=np.float32) / 255.0
    H, W = a.shape[:2]
    pv = a.reshape(H // PATCH, PATCH, W // PATCH, PATCH, 3).transpose(0, 2, 1, 3, 4).reshape(-1, 3 * PATCH * PATCH)
    ys, xs = np.meshgrid(np.arange(H // PATCH), np.arange(W // PATCH), indexing="ij")
    pid = np.stack([xs.reshape(-1), ys.reshape(-1)], -1)
    return torch.from_numpy(pv), torch.from_numpy(pid).long()


def check_pixels(im):
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    enc = Gemma4ImageProcessorPil(patch_size=PATCH, pooling_kernel_size=POOL, max_soft_tokens=IT.SOFT_TOKENS)(
        images=[im], return_tensors="pt")
    pv, pid = pixels(im)
    assert torch.equal(enc["pixel_values"][0], pv) and torch.equal(enc["image_position_ids"][0], pid)


class ImageData:
    """Image batches: (task, canvas index) buckets over the text train split, images drawn on the fly."""

    def __init__(self, tok, n_train: int, seed: int):
        v = tok.get_vocab()
        self.char = {c: v[c] for c in T.ALPHABET}
        self.bos, self.eos, self.pad = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
        self.boi, self.eoi, self.img = tok.convert_tokens_to_ids(list(SPECIAL))
        self.by_key: dict[tuple[str, int], list[int]] = {}
        self.rows = T.make_split("train", n_train, seed)
        for i, (task, _p, a) in enumerate(self.rows):
            for k in range(len(a) // CANVAS + 1):
                self.by_key.setdefault((task, k), []).append(i)
        self.keys = sorted(self.by_key)
        self.weights = [len(self.by_key[k]) for k in self.keys]

    def prefix(self, prompt: str) -> tuple[list[int], int]:
        """Token ids of an image prompt (``sort <image>=``) and where its image tokens start."""
        head, tail = prompt.split(IT.IMAGE_TOKEN)
        ids = [self.bos] + [self.char[c] for c in head]
        start = len(ids) + 1
        ids += [self.boi] + [self.img] * IT.SOFT_TOKENS + [self.eoi] + [self.char[c] for c in tail]
        return ids, start

    def batch(self, rng: random.Random, n: int):
        (key,) = rng.choices(self.keys, weights=self.weights)
        task, k = key
        enc, canv, ans_start, pvs, pids, cells = [], [], [], [], [], []
        pool = self.by_key[key]
        for _ in range(n):
            _t, prompt, ans = self.rows[pool[rng.randrange(len(pool))]]
            img_prompt, shown = IT.split_prompt(prompt)
            ids, start = self.prefix(img_prompt)
            a = [self.char[c] for c in ans]
            ans_start.append(len(ids))
            enc.append(ids + a[: k * CANVAS])
            canv.append((a + [self.eos] + [self.pad] * (2 * CANVAS))[k * CANVAS:(k + 1) * CANVAS])
            pv, pid = pixels(IT.render(shown, rng))
            pvs.append(pv)
            pids.append(pid)
            c = [-1] * (IT.SOFT_TOKENS - len(shown)) + [self.char[ch] if ch != " " else -1 for ch in shown]
            cells.append(c)
        return (torch.tensor(enc), torch.tensor(canv), torch.tensor(ans_start), torch.stack(pvs), torch.stack(pids),
                torch.tensor(cells))


def losses(model, enc_ids, canvas, ans_start, gen, args, pv=None, pid=None, cells=None):
    """(total, decoder CE, encoder CE, decoder accuracy, feature loss, drawn cells classified right) of one
    batch."""
    from transformers import DynamicCache

    B, L = enc_ids.shape
    V = model.config.text_config.vocab_size
    encoder = model.model.encoder
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    aux = torch.zeros(())
    cell_acc = torch.full((), float("nan"))
    kw = {}
    if pv is not None:
        feats = encoder.get_image_features(pv, pid, return_dict=True)
        soft = feats.pooler_output.view(B, IT.SOFT_TOKENS, -1)
        emb = encoder.get_input_embeddings()
        target = emb.weight.detach()[cells.clamp(min=0)] * emb.scalar_embed_scale
        m = (cells >= 0).float()[..., None]
        mse = (((soft - target) ** 2) * m).sum() / (m.sum() * target.shape[-1]) / target.pow(2).mean()
        # and a classification of each drawn cell against the (unit) embedding rows: the direction of its character
        rows = F.normalize(emb.weight.detach(), dim=-1)
        keep = cells >= 0
        ce = F.cross_entropy(soft[keep] @ rows.T, cells[keep])
        aux = mse + ce
        cell_acc = ((soft[keep] @ rows.T).argmax(-1) == cells[keep]).float().mean()
        kw["mm_encoder_outputs"] = {"image": feats}
    h = encoder(input_ids=enc_ids, **hf_cache(cache), **kw).last_hidden_state
    logits = softcapped_logits(model, h[:, :-1])
    pos = torch.arange(1, L)[None, :]
    w = (pos >= ans_start[:, None]).float()
    ce = F.cross_entropy(logits.reshape(-1, V), enc_ids[:, 1:].reshape(-1), reduction="none").view(B, L - 1)
    enc_loss = (ce * w).sum() / w.sum().clamp(min=1)

    t = 1.0 - torch.rand(B, generator=gen) ** 2
    t = torch.where(torch.rand(B, generator=gen) < 0.1, torch.ones_like(t), t)
    noisy = torch.where(torch.rand(B, CANVAS, generator=gen) < t[:, None],
                        torch.randint(0, V, (B, CANVAS), generator=gen), canvas)
    sc_mask = torch.rand(B, generator=gen) < 0.5
    sc = None
    if sc_mask.any():
        with torch.no_grad():
            h0 = model.model.decoder(decoder_input_ids=noisy, **hf_cache(cache)).last_hidden_state
            temp = 0.4 + 0.4 * torch.rand(B, 1, 1, generator=gen)
            sc = softcapped_logits(model, h0) / temp
    hd = model.model.decoder(decoder_input_ids=noisy, **hf_cache(cache), self_conditioning_logits=sc,
                             self_conditioning_mask=sc_mask if sc is not None else None).last_hidden_state
    dl = softcapped_logits(model, hd)
    dec_loss = F.cross_entropy(dl.reshape(-1, V), canvas.reshape(-1))
    acc = (dl.argmax(-1) == canvas).float().mean()
    total = dec_loss + 0.5 * enc_loss + args.aux_weight * aux
    return total, dec_loss.detach(), enc_loss.detach(), acc.detach(), aux.detach(), cell_acc.detach()


def lr_scale(step: int, args) -> float:
    if step < args.warmup:
        return (step + 1) / args.warmup
    frac = min(1.0, (step - args.warmup) / max(1, args.total_steps - args.warmup))
    return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac))


def quick_eval(model, data: ImageData, n: int, seed: int, log):
    """Exact match of transformers' `generate` (batch 1, pixel_values) on validation prompts [500, 500 + n)."""
    model.eval()
    ok, per = 0, {}
    t0 = time.time()
    gcfg = text_generation_config()
    with torch.no_grad():
        for ex, im in IT.make_split("heldout", n, seed, offset=T.VALIDATION_OFFSET):
            ids, _ = data.prefix(ex.prompt)
            pv, pid = pixels(im)
            out = model.generate(torch.tensor([ids]), pixel_values=pv[None], image_position_ids=pid[None],
                                 generation_config=gcfg)
            seq = (out.sequences if hasattr(out, "sequences") else out)[0, len(ids):].tolist()
            if data.eos in seq:
                seq = seq[: seq.index(data.eos)]
            inv = {v: k for k, v in data.char.items()}
            text = "".join(inv.get(t, "?") for t in seq if t != data.pad)
            good = T.check(ex.text_prompt, text)
            ok += good
            per.setdefault(ex.task, []).append(good)
    model.train()
    table = " ".join(f"{t}={100 * sum(v) / len(v):.0f}%" for t, v in sorted(per.items()))
    log(f"EVAL exact={100 * ok / n:.1f}% [{table}] ({time.time() - t0:.0f}s)")
    return ok / n


def export(model, tok, out_dir: str):
    """config.json, generation_config.json, model.safetensors (vision included), tokenizer, preprocessor."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    os.makedirs(out_dir, exist_ok=True)
    model.generation_config = text_generation_config()
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    Gemma4ImageProcessorPil(patch_size=PATCH, pooling_kernel_size=POOL, max_soft_tokens=IT.SOFT_TOKENS).save_pretrained(
        out_dir)
    for name in os.listdir(out_dir):
        os.chmod(os.path.join(out_dir, name), 0o644)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", default=DEFAULT_RUN_DIR)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--export", metavar="DIR")
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--total-steps", type=int, default=4000, help="where the cosine schedule ends")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-2, help="the multimodal embedder")
    ap.add_argument("--tower-lr", type=float, default=5e-4,
                    help="the vision tower (small: at the embedder's rate its features collapsed to the mean, measured)")
    ap.add_argument("--text-lr", type=float, default=None,
                    help="text layers and embeddings (nearly frozen; default 2e-4); given with --resume it replaces the "
                         "run's from the resumed step on")
    ap.add_argument("--aux-weight", type=float, default=1.0)
    ap.add_argument("--p-text", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--ckpt-minutes", type=float, default=3.0)
    ap.add_argument("--eval-minutes", type=float, default=10.0)
    ap.add_argument("--eval-n", type=int, default=32)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    os.makedirs(args.run_dir, exist_ok=True)
    ckpt_path = os.path.join(args.run_dir, "ckpt.pt")
    log_f = open(os.path.join(args.run_dir, "train.log"), "a", buffering=1)

    def log(msg):
        line = f"[{time.strftime('%H:%M:%S')}] {msg}"
        print(line, flush=True)
        log_f.write(line + "\n")

    tok = make_tokenizer()
    resume = torch.load(ckpt_path, weights_only=False) if (args.resume or args.export) else None
    if resume is not None:
        keep = {"minutes", "max_steps", "run_dir", "resume", "export", "eval_minutes", "eval_n", "log_every"}
        keep |= {"text_lr"} if args.text_lr is not None else set()
        args = argparse.Namespace(**{**vars(args), **{k: v for k, v in resume["args"].items() if k not in keep}})
        model = DiffusionGemmaForBlockDiffusion(DiffusionGemmaConfig.from_dict(resume["config"]))
        model.load_state_dict(resume["model"])
    else:
        model = make_model(tok, args.seed)
    if args.text_lr is None:
        args.text_lr = 2e-4
    if args.export:
        export(model, tok, args.export)
        print(f"exported step {resume['step']} to {args.export}")
        return
    model.train()
    embedder = [p for n, p in model.named_parameters() if "embed_vision" in n]
    tower = [p for n, p in model.named_parameters() if "vision_tower" in n]
    vis = embedder + tower
    text = [p for n, p in model.named_parameters() if "vision" not in n]
    opt = torch.optim.AdamW([{"params": embedder, "lr": args.lr, "base": args.lr},
                             {"params": tower, "lr": args.tower_lr, "base": args.tower_lr},
                             {"params": text, "lr": args.text_lr, "base": args.text_lr}],
                            betas=(0.9, 0.98), weight_decay=0.01)
    py_rng, gen = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
    step = 0
    if resume is not None:
        opt.load_state_dict(resume["opt"])
        opt.param_groups[2]["base"] = args.text_lr
        step = resume["step"]
        set_rng_state(resume["rng"], py_rng, gen)
        log(f"resumed at step {step}")
    log(f"args: {json.dumps(vars(args))}")
    log(f"params: vision {sum(p.numel() for p in vis) / 1e3:.1f}K, text {sum(p.numel() for p in text) / 1e6:.2f}M")
    data = ImageData(tok, T.DEFAULT_TRAIN_N, 0)
    text_data = Buckets(tok, T.DEFAULT_TRAIN_N, 0)
    check_pixels(IT.render("3 1 2", random.Random(0)))

    def save():
        atomic_save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step,
                     "rng": get_rng_state(py_rng, gen), "args": vars(args), "config": model.config.to_dict()},
                    ckpt_path)

    deadline = time.time() + args.minutes * 60
    last_ckpt = last_eval = time.time()
    win = {"loss": 0.0, "dec": 0.0, "enc": 0.0, "acc": 0.0, "aux": 0.0, "cell": 0.0, "ni": 0, "n": 0, "t": time.time()}
    while time.time() < deadline and (args.max_steps is None or step < args.max_steps):
        s = lr_scale(step, args)
        for g in opt.param_groups:
            g["lr"] = g["base"] * s
        if py_rng.random() < args.p_text:
            enc_ids, canvas, ans_start = text_data.batch(py_rng, args.batch_size)
            out = losses(model, enc_ids, canvas, ans_start, gen, args)
        else:
            enc_ids, canvas, ans_start, pv, pid, cells = data.batch(py_rng, args.batch_size)
            out = losses(model, enc_ids, canvas, ans_start, gen, args, pv, pid, cells)
        total, dec, enc, acc, aux, cacc = out
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        for k, v in zip(("loss", "dec", "enc", "acc", "aux"), (total.detach(), dec, enc, acc, aux)):
            win[k] += float(v)
        win["n"] += 1
        if not math.isnan(float(cacc)):
            win["cell"] += float(cacc)
            win["ni"] += 1
        if step % args.log_every == 0:
            n = win["n"]
            log(f"step {step} loss {win['loss'] / n:.4f} dec {win['dec'] / n:.4f} enc {win['enc'] / n:.4f} "
                f"acc {win['acc'] / n:.3f} aux {win['aux'] / n:.4f} cells {win['cell'] / max(1, win['ni']):.3f} lr x{s:.2f} {(time.time() - win['t']) / n:.2f}s/step")
            win = {k: 0.0 for k in win} | {"t": time.time()}
        if time.time() - last_ckpt > args.ckpt_minutes * 60:
            save()
            last_ckpt = time.time()
        if args.eval_minutes > 0 and time.time() - last_eval > args.eval_minutes * 60:
            quick_eval(model, data, args.eval_n, 0, log)
            save()
            last_ckpt = last_eval = time.time()
            win["t"] = time.time()
    save()
    log(f"stopped at step {step}; checkpoint {ckpt_path}")


if __name__ == "__main__":
    main()
