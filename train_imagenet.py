"""ImageNet-1k training for ViT, MLP-Mixer, ConvMixer and the ResNet baselines, with DDP, AMP and SAM.
A recipe (RECIPES: sam, convmixer or finetune, sources cited there) fills every flag left unset; with --resume
the run's own flags do.

    torchrun --nproc_per_node 8 train_imagenet.py --data /imagenet --model mixer_b16 --sam --rho 0.05
    torchrun --nproc_per_node 8 train_imagenet.py --resume runs/imagenet/mixer_b16_sam/last.pt
    torchrun --nproc_per_node 8 train_imagenet.py --data /imagenet --recipe finetune --pretrained ViT-B_16.npz
    python train_imagenet.py --data /imagenet --eval-only --checkpoint ViT-B_16.npz --model vit_b16

--batch-size is the GLOBAL batch of one optimizer step: processes x --accum-steps micro-batches.
"""
import argparse
import contextlib
import functools
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchvision import datasets
from torchvision.transforms import v2

from augment import random_erasing
from data import LAYOUT, MEANS, ImageFolder, OneBatch, ResumableSampler, eval_transform
from flags import check_lr_not_all_zero, check_ranges
from loader import collate_bytes, node_workers, on_device, train_transform
from models import build_model, build_on_meta, channels_last, load_state, load_weights, parse_model_kw
from runs import (MACHINE_FLAGS, discard_new_dirs, load_optimizer_state, machine_line, prepare_out, read_checkpoint,
                  save_atomic, written_by)
from gsam import GSAM
from sam import SAM, first_pass, second_pass
from utils import (NO_STEP, UserError, check_finite, epoch_seed, eta, fmt_time, init_group, leave, micro_batch_cap,
                   one_line, score, setup, since_checkpoint, sync_buffers, wrap_ddp)


# -----------------------------------------------------------------------------
# Arguments: default None, then filled from the run being resumed (or evaluated), then from the recipe.
RECIPES = {  # completed below with BASE_RECIPE's values where a recipe sets none
    # Chen, Hsieh & Gong 2021, Sec. 3 and appendix (as reused in the GSAM paper); Inception crop + flip, clipping 1.
    'sam': dict(epochs=300, batch_size=4096, lr=3e-3, wd=0.3, sched='linear', warmup_steps=10_000),
    # locuslab/convmixer README's timm command line (--aa rand-m9-mstd0.5-inc1, batch 64 x 10 GPUs); timm's
    # implicit wd 2e-5 and smoothing 0.1; timm's ConvMixer eval cfg (crop_pct 0.96, bicubic).
    'convmixer': dict(epochs=150, batch_size=640, lr=0.01, opt_eps=1e-3, wd=2e-5, sched='onecycle',
                      warmup_steps=0, label_smoothing=0.1, randaug_n=2, mixup=0.5, cutmix=0.5, reprob=0.25,
                      norm='imagenet', crop_pct=0.96, eval_interp='bicubic'),
    # Dosovitskiy et al. (ICLR 2021) App. B.1.1 (lr from its Table 4 grid); vit_jax configs/common.py (20k steps =
    # 8 epochs); input_pipeline.py: Inception crop, area_range (0.05, 1), + flip. Deviation: vit_jax squashes a
    # test image to 384 x 384; here the shorter side goes to 384, then a centre crop.
    'finetune': dict(epochs=8, batch_size=512, lr=0.03, opt='sgd', wd=0.0, sched='cosine',
                     warmup_steps=500, img_size=384, crop_min=0.05, crop_pct=1.0),
}
BASE_RECIPE = dict(img_size=224, opt='adamw', opt_eps=1e-8, clip_grad=1.0, crop_min=0.08, label_smoothing=0.0,
                   randaug_n=0, mixup=0.0, cutmix=0.0, reprob=0.0, norm='jax', crop_pct=0.875, eval_interp='bilinear')
RECIPES = {name: {**BASE_RECIPE, **recipe} for name, recipe in RECIPES.items()}
DEFAULTS = dict(model='vit_b16', model_kw=[], randaug_m=27, accum_steps=0, max_micro_batch=0, sam=False,
                rho=0.05, adaptive=False, sam_m=0, amp='auto', seed=0, log_every=50, save_every=0, workers=None,
                synthetic=False, decode='cpu', gsam_alpha=None, rho_min=None)  # the same in every recipe (None: SAM)
RUN_KEYS = [k for k in ['data', 'recipe', *DEFAULTS, *RECIPES['sam']] if k not in MACHINE_FLAGS]  # what --resume
# takes from the run (runs.MACHINE_FLAGS: this command line's, or this node's defaults)
EVAL_KEYS = ['data', 'recipe', 'model', 'model_kw', 'img_size', 'norm', 'crop_pct', 'eval_interp']  # --eval-only
PRETRAINED_KEYS = ['model', 'model_kw']  # what --pretrained takes from one of our last.pt files
POSITIVE = ['epochs', 'batch_size', 'lr', 'opt_eps', 'img_size', 'crop_min', 'crop_pct', 'eval_batch_size']
NON_NEGATIVE = ['accum_steps', 'max_micro_batch', 'sam_m', 'workers', 'warmup_steps', 'wd', 'clip_grad', 'rho',
                'label_smoothing', 'randaug_n', 'randaug_m', 'mixup', 'cutmix', 'reprob', 'log_every', 'save_every',
                'max_steps', 'seed']  # (max_micro_batch 0: derived from the GPU, utils.micro_batch_cap)


def flag(p, name, help, **kw):  # p.add_argument, with the default (or each recipe's) appended to the help
    key = name[2:].replace('-', '_')
    if key in DEFAULTS:
        help += f' (default {DEFAULTS[key]})'
    elif key in RECIPES['sam']:
        help += ' [' + ', '.join(f'{r}: {RECIPES[r][key]}' for r in RECIPES) + ']'
    p.add_argument(name, help=help, **kw)


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    a = functools.partial(flag, p)
    a('--recipe', 'sam (default; Chen et al. 2021 Sec. 3 + appendix), convmixer (the locuslab README\'s timm command) '
      'or finetune (Dosovitskiy et al. 2021 App. B.1.1, vit_jax configs/common.py)', choices=list(RECIPES))
    a('--data', 'ImageNet root: train/<wnid>/*.JPEG and val/<wnid>/*.JPEG', metavar='DIR')
    a('--synthetic', 'random images instead of --data: throughput only', action='store_true', default=None)
    a('--img-size', 'training and evaluation resolution (px)', type=int)
    a('--workers', 'data-loader processes per GPU; None: the CPU cores per local process, minus one', type=int)
    a('--decode', 'cpu: PIL decodes and augments in the loader workers; gpu: the workers read bytes, '
      'torchvision.io.decode_jpeg decodes on the device, crop/resize/flip there (for few cores per GPU)',
      choices=['cpu', 'gpu'])
    a('--norm', 'imagenet mean/std (ResNets, ConvMixer) or jax: (x - 0.5) / 0.5 (ViT/Mixer .npz)', choices=list(MEANS))
    a('--crop-min', 'Inception crop: the smallest crop, as a fraction of the image area', type=float)
    a('--crop-pct', 'evaluation: resize to img_size / crop_pct, centre-crop img_size', type=float)
    a('--eval-interp', 'evaluation resize filter', choices=['bilinear', 'bicubic'])
    a('--randaug-n', 'RandAugment ops per image (0 = off)', type=int)
    a('--randaug-m', "RandAugment magnitude 0..30, as train_cifar.py (timm's m9 of 10 = 27)", type=int)
    a('--mixup', 'mixup Beta(alpha, alpha), 0 = off', type=float)
    a('--cutmix', 'cutmix Beta(alpha, alpha), 0 = off; with mixup on too, one of the two per batch', type=float)
    a('--reprob', "random-erasing probability per image (timm's 'pixel' mode)", type=float)
    a('--label-smoothing', 'label smoothing of the cross-entropy', type=float)
    a('--model', 'a config of vit.py, mixer.py, convmixer.py, or resnet50/101/152')
    a('--model-kw', 'constructor overrides, e.g. depth=2 dim=64 (Python literals)', nargs='*', metavar='K=V')
    a('--pretrained', 'fine-tune from these weights: new head, ViT pos_embed resampled', metavar='PATH')
    a('--channels-last', 'NHWC; unset: on for convolutional models on CUDA', action=argparse.BooleanOptionalAction)
    a('--compile', 'torch.compile the model', action='store_true')
    a('--epochs', 'training epochs', type=int)
    a('--batch-size', 'GLOBAL batch of one optimizer step (all processes x --accum-steps)', type=int)
    a('--accum-steps', 'micro-batches per step and process (0: the fewest of at most --max-micro-batch)', type=int)
    a('--max-micro-batch', 'most images per forward pass and process; 0: what fits the GPU for this model at this '
      '--img-size (utils.micro_batch_cap: activations counted on the meta device), 256 on a CPU', type=int)
    a('--lr', 'peak learning rate (for the recipe\'s --batch-size: scale it with the batch, Goyal et al.)', type=float)
    a('--opt', 'adamw (betas 0.9, 0.999) or sgd (momentum 0.9)', choices=['adamw', 'sgd'])
    a('--opt-eps', 'AdamW epsilon', type=float)
    a('--wd', 'weight decay of matrices and kernels only (AdamW: decoupled; SGD: L2)', type=float)
    a('--sched', "warmup then linear/cosine decay to 0; onecycle: locuslab's", choices=['linear', 'cosine', 'onecycle'])
    a('--warmup-steps', 'linear warmup, in optimizer steps (linear, cosine)', type=int)
    a('--clip-grad', 'clip the global gradient norm at this value (0 = off)', type=float)
    a('--sam', 'Sharpness-Aware Minimization (Foret et al. 2020)', action=argparse.BooleanOptionalAction)
    a('--rho', 'SAM radius; Chen et al. tune it per model (their appendix)', type=float)
    a('--adaptive', 'ASAM (Kwon et al. 2021)', action=argparse.BooleanOptionalAction)
    a('--sam-m', 'm-sharpness (Foret et al. Sec. 4.1): images per eps-hat, a divisor of the micro-batch; 0: the '
      "process's whole batch, as the JAX code per device (the paper: 4096 images on 64 TPU chips, m = 64)", type=int)
    a('--gsam-alpha', 'GSAM (Zhuang et al. 2022; gsam.GSAM): step along g_p - A g_perp; unset: SAM', type=float)
    a('--rho-min', 'GSAM: rho goes with the LR from this (LR 0) to --rho (the peak LR); unset: --rho', type=float)
    a('--amp', 'autocast: auto = bf16 where the GPU has it, else off; fp16 adds a GradScaler',
      choices=['auto', 'bf16', 'fp16', 'off'])
    a('--seed', 'seed of the initial weights, data order and augmentation', type=int)
    a('--out', "run folder (default: the --resume file's folder, else runs/imagenet/<model>[_sam])", metavar='DIR')
    a('--overwrite', 'let a new run replace the run already in --out', action='store_true')
    a('--save-every', 'also save last.pt every N optimizer steps; 0 = at epoch ends only', type=int)
    a('--resume', 'continue the run that wrote this last.pt (mid-epoch if saved there)', metavar='PATH')
    a('--eval-only', 'evaluate --checkpoint on val and exit', action='store_true')
    a('--checkpoint', 'for --eval-only: our last.pt, a timm/torchvision state_dict, .npz or .pth.tar', metavar='PATH')
    a('--eval-batch-size', 'evaluation batch per process (default 256)', type=int, default=256)
    a('--max-steps', 'stop after this many optimizer steps in all (0 = off)', type=int, default=0)
    a('--log-every', 'a progress line every N optimizer steps; 0 = per epoch', type=int)
    args = p.parse_args(argv)
    if args.eval_only != bool(args.checkpoint) or (args.eval_only and args.resume):
        raise UserError('--eval-only evaluates --checkpoint PATH (not --resume); --checkpoint is for --eval-only')
    if (args.resume or args.eval_only) and (args.overwrite or args.pretrained):
        raise UserError('--resume and --eval-only load their own weights; --overwrite or --pretrained would start a '
                        'new run')
    for name in ('resume', 'checkpoint', 'pretrained'):
        if getattr(args, name) and not os.path.isfile(getattr(args, name)):
            raise UserError(f'--{name}: no such file: {getattr(args, name)}')
    source = args.resume or args.checkpoint or args.pretrained
    which = '--resume' if args.resume else '--checkpoint' if args.checkpoint else '--pretrained'
    author = written_by(ckpt := read_checkpoint(source, which) if source and not source.endswith('.npz') else None)
    if args.resume and author != 'train_imagenet.py':
        raise UserError(f'--resume {args.resume} is not a last.pt of train_imagenet.py (to evaluate weights use '
                        '--eval-only --checkpoint)')
    if args.eval_only and author not in (None, 'train_imagenet.py'):  # its flags are of another recipe and data
        raise UserError(f'--checkpoint {args.checkpoint} is a last.pt of {author}: evaluate it with {author} '
                        '--eval-only')
    keys = RUN_KEYS if args.resume else EVAL_KEYS if args.eval_only else PRETRAINED_KEYS
    run = {k: v for k, v in (ckpt['args'] if author else {}).items() if k in keys}
    loose = [f'--{k.replace("_", "-")}' for k in ('rho', 'adaptive', 'sam_m', 'gsam_alpha', 'rho_min')
             if getattr(args, k) is not None]
    recipe = args.recipe or run.get('recipe') or 'sam'
    for key, value in {**DEFAULTS, **RECIPES[recipe], **run, 'recipe': recipe}.items():  # later ones win
        setattr(args, key, value if getattr(args, key) is None else getattr(args, key))
    args.workers = node_workers() if args.workers is None else args.workers  # (of this node: loader.node_workers)
    check_ranges(args, POSITIVE, NON_NEGATIVE, {}, stored_in=source if author else None)  # (bounds: utils)
    check_ranges(args, [], [k for k in ('gsam_alpha', 'rho_min') if vars(args)[k] is not None], {'rho_min': args.rho},
                 stored_in=source, stored=[k for k in run if f'--{k.replace("_", "-")}' not in loose])  # (R03/J13)
    if loose and not args.sam:
        raise UserError(f'{", ".join(loose)} only act with --sam: add --sam, or leave them out')
    if not (args.data or args.synthetic) or (args.synthetic and args.eval_only):  # (FakeData: made-up labels)
        raise UserError('--eval-only needs --data DIR: --synthetic has no validation set' if args.synthetic else
                        f'give --data DIR ({LAYOUT}), or --synthetic')
    build_on_meta(args)  # every impossible model shape now, before anything slow (models.py)
    return args


# -----------------------------------------------------------------------------
# Data: decoding, crop, flip and RandAugment per image in the loader workers (data.train_transform; --decode gpu:
# on the device); mixup/cutmix on the batch on the GPU.
def seed_epoch(seed, epoch, rank, start):
    """This process's RNG (mixup, erasing, dropout) from (seed, epoch, rank, first step): a resume at an epoch
    boundary draws what the uninterrupted run drew. (Crops, flips, RandAugment: per image, ResumableSampler.)"""
    torch.manual_seed(epoch_seed(seed, epoch, rank, start))


# -----------------------------------------------------------------------------
# One optimizer step, with gradient accumulation and optionally SAM; the LR schedule.
def accumulate(model, micro, scaler, label_smoothing, amp_dtype, share=1.0):
    """Backward of each micro-batch's loss x share / k: the sum is the gradient of the whole batch's mean loss
    (exactly so without BatchNorm) x share. Under DDP only the last backward all-reduces. -> the mean loss."""
    no_sync, total = getattr(model, 'no_sync', None), 0.0  # no_sync: DDP (also through torch.compile)
    for j, (x, y) in enumerate(micro):  # y: class indices, or mixup/cutmix soft targets (B, classes)
        with no_sync() if no_sync is not None and j < len(micro) - 1 else contextlib.nullcontext():
            with torch.autocast(x.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
                logits = model(x)  # under autocast bf16/fp16: the loss in fp32 (a float64 model keeps float64)
                loss = F.cross_entropy(logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits, y,
                                       label_smoothing=label_smoothing) / len(micro)
            scaler.scale(loss * share if share != 1.0 else loss).backward()
        total += loss.detach()
    return total


def train_step(model, optimizer, scaler, micro, *, sam, clip_grad, label_smoothing=0.0, amp_dtype=None,
               sam_m=None, window=None):
    """One optimizer step on a batch split into micro-batches [(x, y), ...]; returns the (first pass's) mean loss.
    SAM (Foret et al. Alg. 1): the first pass accumulates g with no all-reduce (m-sharpness: each replica its own
    eps-hat, as the official JAX code), perturbs once, and the second pass accumulates g_SAM, which is clipped.
    sam_m below the process's batch: m-sharpness in groups of sam_m images (each dividing a micro-batch), each
    group its own eps-hat from its own first pass; the groups' g_SAM averaged, all-reduced once (sam.py).
    GSAM: each replica (group) decomposes its own g_p, so no all-reduce until gsam_gradient (gsam.GSAM). window: a (2,)
    tensor on the device, += (the loss, the surrogate gap f_p - f of SAM/GSAM), read only at the log row."""
    gsam, loss_p = isinstance(optimizer, GSAM), 0.0
    groups = [(xg, yg) for x, y in micro for xg, yg in zip(x.split(sam_m), y.split(sam_m))] if sam and sam_m else []
    if len(groups) > 1 and sam_m < sum(len(x) for x, _ in micro):
        loss = 0.0
        for j, group in enumerate(groups):
            with first_pass(model):  # a clean gradient of this group alone
                loss += accumulate(model, [group], scaler, label_smoothing, amp_dtype) / len(groups)
            optimizer.first_step(zero_grad=True)  # w <- w + eps_hat_j; .grad <- the groups' g_SAM so far
            with second_pass(model, sync=j == len(groups) - 1 and not gsam):  # DDP: one all-reduce (GSAM: below)
                loss_p += accumulate(model, [group], scaler, label_smoothing, amp_dtype, share=1 / len(groups)) \
                    / len(groups)
            if j < len(groups) - 1:
                optimizer.next_group()  # w restored exactly; the g_SAM sum set aside
    elif sam:
        with first_pass(model):
            loss = accumulate(model, micro, scaler, label_smoothing, amp_dtype)
        optimizer.first_step(zero_grad=True)  # climb to w + eps_hat
        with second_pass(model, sync=not gsam):  # BatchNorm running stats come from the first pass only
            loss_p = accumulate(model, micro, scaler, label_smoothing, amp_dtype)  # g_SAM, averaged over replicas
    else:
        loss = accumulate(model, micro, scaler, label_smoothing, amp_dtype)
    if gsam:
        optimizer.gsam_gradient(all_reduce=dist.is_initialized())  # g_p - alpha g_perp, mean over groups, replicas
    if window is not None:
        window += torch.stack([loss, loss_p - loss if sam else torch.zeros_like(loss)])
    if clip_grad > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
    scaler.step(optimizer)  # SAM: back to w, then the base step with g_SAM
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss


def lr_at(step, peak, sched, warmup, epochs, steps_per_epoch):  # the LR of optimizer step `step` (0-based)
    if sched == 'onecycle':  # locuslab's, as train_cifar.py runs it (t in epochs)
        t = (step + 1) / steps_per_epoch  # in epochs; integer breakpoints, as train_cifar.py
        return float(np.interp(t, [0, epochs * 2 // 5, epochs * 4 // 5, epochs], [0, peak, peak / 20, 0]))
    if step < warmup:  # linear (SAM paper), cosine (ViT fine-tuning): linear warmup, then decay to 0
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, epochs * steps_per_epoch - warmup)  # 0 -> 1 over the decay
    return peak * (1 - t if sched == 'linear' else 0.5 * (1 + math.cos(math.pi * t)))


# -----------------------------------------------------------------------------
# Output, data, optimizer, resume: the sections of main() that are long. Every file is written atomically
# (utils.save_atomic): a failed write ends the run and keeps the old file.
def save_run(out, model, optimizer, scaler, step, steps_per_epoch, history, info):
    """last.pt first: if it cannot be written, nothing of the run has changed. info: vars(args) and more."""
    save_atomic(Path(out, 'last.pt'), dict(model=model.state_dict(), optimizer=optimizer.state_dict(),
                scaler=scaler.state_dict(), epoch=step // steps_per_epoch, step=step, steps_per_epoch=steps_per_epoch,
                history=history, args=info))
    save_atomic(Path(out, 'metrics.jsonl'), history)
    save_atomic(Path(out, 'args.json'), info)


def make_data(args, proc, micro=0, fmt=torch.preserve_format):
    """(val_loader, num_classes, train loader of micro-batches, its sampler, mixup/cutmix or None); the train parts
    are None with --eval-only. Rank r evaluates images r, r + W, ...: exact, no padding. Workers persist across
    epochs and evaluations (each image's draws come from its own seed, not from the worker's RNG)."""
    val_tf = eval_transform(args.img_size, args.crop_pct, args.eval_interp, args.norm, to_float=False)
    if args.synthetic:  # ImageNet's counts; the training batch is made on the device (OneBatch), val by FakeData
        train_set = range(1_281_167)
        val_set = datasets.FakeData(50_000, (3, args.img_size, args.img_size), 1000, val_tf)
    else:
        val_set = ImageFolder(args.data, 'val', val_tf, args.img_size, args.decode)
        train_tf = train_transform(args, MEANS[args.norm][0])
        train_set = None if args.eval_only else ImageFolder(args.data, 'train', train_tf, args.img_size,
                                                            args.decode)
        if train_set is not None and train_set.classes != val_set.classes:
            raise UserError(f'--data {args.data}: the class folders of train ({len(train_set.classes)}) and val '
                            f'({len(val_set.classes)}) differ in number or names; {LAYOUT}')
    num_classes = 1000 if args.synthetic else len(val_set.classes)
    loader_kw = dict(num_workers=args.workers, pin_memory=proc.device.type == 'cuda',
                     persistent_workers=args.workers > 0,
                     collate_fn=collate_bytes if args.decode == 'gpu' and not args.synthetic else None)
    val_loader = torch.utils.data.DataLoader(val_set, batch_size=args.eval_batch_size,
                                             sampler=range(proc.rank, len(val_set), proc.world), **loader_kw)
    if args.eval_only:
        return val_loader, num_classes, None, None, None
    sampler = ResumableSampler(len(train_set), proc.world, proc.rank, args.seed, args.batch_size // proc.world)
    if sampler.steps == 0:
        raise UserError(f'--batch-size {args.batch_size} is larger than the training set ({len(train_set)} images)')
    train_loader = OneBatch(micro, args.img_size, num_classes, proc.device) if args.synthetic else \
        torch.utils.data.DataLoader(train_set, batch_size=micro, sampler=sampler, **loader_kw)  # uint8 micro-batches
    if args.synthetic:  # in the model's layout once (fmt: channels_last for a ConvMixer on a GPU), not every step
        train_loader.batch = (train_loader.batch[0].to(memory_format=fmt), train_loader.batch[1])
    mix = [v2.MixUp(alpha=args.mixup, num_classes=num_classes)] if args.mixup > 0 else []
    mix += [v2.CutMix(alpha=args.cutmix, num_classes=num_classes)] if args.cutmix > 0 else []
    mix = v2.RandomChoice(mix) if mix else None  # on the batch: one of them, p 0.5 each (timm)
    return val_loader, num_classes, train_loader, sampler, mix


def split_batch(args, world):
    """-> (images per process and step, micro-batches k, m-sharpness group m). The global batch never changes:
    k is --accum-steps, or the fewest micro-batches of at most --max-micro-batch images; m divides a micro-batch."""
    args.max_micro_batch = args.max_micro_batch or micro_batch_cap(  # from this GPU, model, image size (stored)
        lambda: build_model(args.model, 1000, args.img_size, parse_model_kw(args.model_kw)), args.img_size,
        half=args.amp != 'off')
    per_step, cap = args.batch_size // world, args.max_micro_batch
    k = args.accum_steps or next(k for k in range(1, per_step + 2) if per_step % k == 0 and per_step // k <= cap)
    if args.batch_size % (world * k):
        raise UserError(f'--batch-size {args.batch_size} (global) must divide by processes ({world}) x --accum-steps '
                        f'({k})')
    if per_step // k > cap:
        raise UserError(f'--accum-steps {k} makes micro-batches of {per_step // k} images, more than --max-micro-batch '
                        f'{cap}; pass --accum-steps 0 (derived) or a larger --max-micro-batch')
    m = args.sam_m or per_step
    if args.sam and m != per_step and (per_step // k) % m:
        raise UserError(f'--sam-m {m} must divide the micro-batch of {per_step // k} images (--batch-size '
                        f'{args.batch_size} / {world} processes / {k} micro-batches) or be {per_step}, the process\'s '
                        f'batch; pass a divisor of {per_step // k}')
    return per_step, k, m


def make_optimizer(args, model, steps):
    """AdamW or SGD, SAM-wrapped with --sam; weight decay only on matrices and conv kernels, as timm."""
    groups = [dict(params=[], weight_decay=args.wd), dict(params=[], weight_decay=0.0)]
    for name, p in model.named_parameters():
        groups[p.ndim < 2 or name in ('pos_embed', 'cls_token')]['params'].append(p)
    base, base_kw = (torch.optim.AdamW, dict(betas=(0.9, 0.999), eps=args.opt_eps)) if args.opt == 'adamw' else \
        (torch.optim.SGD, dict(momentum=0.9))
    if args.sam and (args.gsam_alpha is not None or args.rho_min is not None):  # GSAM; rho_t: lowest .. highest LR
        lr = lambda s: lr_at(s, args.lr, args.sched, args.warmup_steps, args.epochs, steps)  # noqa: E731
        top, s = lr(0), 1  # highest: where the rise ends (--lr unless inside the warm-up); lowest: the end or step 0
        while s < args.epochs * steps and (nxt := lr(s)) >= top:
            top, s = nxt, s + 1
        return GSAM(groups, base, rho=args.rho, rho_min=args.rho_min, alpha=args.gsam_alpha or 0.0, lr_max=top,
                    lr_min=min(lr(0), lr(args.epochs * steps)), adaptive=args.adaptive, lr=args.lr, **base_kw)
    return (SAM(groups, base, rho=args.rho, adaptive=args.adaptive, lr=args.lr, **base_kw) if args.sam
            else base(groups, lr=args.lr, **base_kw))


def gsam_header(args, optimizer):  # GSAM's settings, and the LR range rho_t follows (rho_min unset: --rho)
    return (f', GSAM alpha {args.gsam_alpha or 0} rho_min {args.rho if args.rho_min is None else args.rho_min} at LR '
            f'{optimizer.lr_min:g} .. rho {args.rho} at LR {optimizer.lr_max:g}') if isinstance(optimizer, GSAM) else ''


def resume(args, model, optimizer, scaler, steps, log):
    """--resume: weights, optimizer, GradScaler, step, history (the loop re-seeds the RNGs). -> (step, history)"""
    ckpt = read_checkpoint(args.resume, '--resume')
    old = ckpt['args']
    if ckpt['steps_per_epoch'] != steps or old['batch_size'] != args.batch_size:
        raise UserError(f'--resume {args.resume}: that run has --batch-size {old["batch_size"]} and '
                        f'{ckpt["steps_per_epoch"]} steps per epoch, this one {args.batch_size} and {steps}; a '
                        'resumed run keeps its global batch and training set')
    load_state(model, ckpt['model'], f'--resume {args.resume} does not fit this run', old)  # (models.py)
    try:
        load_optimizer_state(optimizer, ckpt['optimizer'])  # this command line's rho, wd, eps, ...
    except (RuntimeError, ValueError, KeyError) as e:
        raise UserError(f'--resume {args.resume} does not fit this run: {one_line(e)}') from None
    if ckpt['scaler']:  # {} when the run had no enabled GradScaler (not fp16)
        scaler.load_state_dict(ckpt['scaler'])
    step = ckpt['step']
    changed = [f'--{k.replace("_", "-")} {old.get(k)} -> {getattr(args, k)}' for k in RUN_KEYS
               if old.get(k) != getattr(args, k)]  # only flags given on this command line can differ
    log(f'resumed {args.resume} at epoch {step // steps + 1}, step {step} ({step % steps} of {steps} in this '
        f'epoch); changed: {", ".join(changed) or "nothing"}')
    machine_line(args, old, log)
    return step, ckpt['history']


# -----------------------------------------------------------------------------
def main(argv=None):
    # --- setup: arguments, processes, device, output folder --------------------------------------------
    args, t_start = get_args(argv), time.time()
    proc = setup(args.amp)  # rank, device (cuda:LOCAL_RANK when there is a GPU), autocast
    world, rank, distributed, master, device, log = proc.world, proc.rank, proc.ddp, proc.master, proc.device, proc.log
    fmt = torch.channels_last if channels_last(args.channels_last, args.model, device) else torch.preserve_format
    if not args.eval_only:
        per_step, k, m = split_batch(args, world)
        build_on_meta(args, group=min(per_step // k, m), world=world)  # BatchNorm: 2 or more values per channel
        args.out = args.out or (os.path.dirname(os.path.abspath(args.resume)) if args.resume else
                                os.path.join('runs', 'imagenet', args.model + '_sam' * args.sam))
        prepare_out(args, lock=master)  # (one lock: rank 0's)
    init_group(proc)
    val_loader, num_classes, train_loader, sampler, mix = make_data(args, proc, 0 if args.eval_only else per_step // k,
                                                                    fmt)
    mean, std = (torch.tensor(v, device=device).view(1, 3, 1, 1) for v in MEANS[args.norm])
    # --- model: trained through DDP; evaluated bare (no collectives: ranks may run unequal eval batches) --------
    torch.manual_seed(args.seed)  # the same initial weights on every rank and world size
    model = build_model(args.model, num_classes, args.img_size, parse_model_kw(args.model_kw))
    if args.checkpoint or args.pretrained:  # (--resume loads its own weights below)
        load_weights(model, args.checkpoint or args.pretrained, finetune=bool(args.pretrained))
    model.to(device, memory_format=fmt)
    eval_model = torch.compile(model) if args.compile else model
    log(f'{args.model}: {sum(p.numel() for p in model.parameters()):,} parameters, {num_classes} classes, '
        f'{args.img_size} px, norm {args.norm}, {world} process(es) on {device.type}, amp {proc.amp}')
    if args.eval_only:
        res = score(eval_model, on_device(val_loader, mean, std, fmt), proc.autocast, distributed)
        log(f'eval {args.checkpoint} | test loss {res["loss"]:.4f} acc {res["top1"]:.2f}% top-5 {res["top5"]:.2f}% '
            f'({res["correct"]:,}/{res["n"]:,})\n{json.dumps(res)}')
        return leave(distributed) or res
    # DDP without its broadcast of rank 0's buffers before each forward (utils.wrap_ddp: sync_buffers before each
    # evaluation and checkpoint instead). Compiled, DDP overlaps its buckets with backward
    train_model = wrap_ddp(model, proc)
    train_model, steps = torch.compile(train_model) if args.compile else train_model, sampler.steps
    optimizer = make_optimizer(args, model, steps)
    scaler = torch.amp.GradScaler(device.type, enabled=proc.amp == 'fp16')
    step, history = resume(args, model, optimizer, scaler, steps, log) if args.resume else (0, [])
    total, stop = args.epochs * steps, min(args.epochs * steps, args.max_steps or math.inf)
    check_lr_not_all_zero((lr_at(s, args.lr, args.sched, args.warmup_steps, args.epochs, steps) for s in
                           range(step, total)), args, steps, step, f'--sched {args.sched}',
                          'raise --epochs, lower --batch-size, or pass --sched linear')  # (S01: onecycle, 1 step)
    last, saved = os.path.join(args.out, 'last.pt'), (args.resume, step) if args.resume else (None, 0)
    info = dict(vars(args), world_size=world, micro_batch=per_step // k, steps_per_epoch=steps, total_steps=total)
    log(f'global batch {args.batch_size} = {world} x {k} x {per_step // k}, peak lr {args.lr:.3g}, {steps} '
        f'steps/epoch, SAM {f"rho {args.rho}" if args.sam else "off"}{gsam_header(args, optimizer)}, out {args.out}')
    # --- loop: an epoch (or the rest of a resumed one); at its end evaluate and checkpoint -------------------
    first_bad = torch.full((), NO_STEP, device=device)  # the first step with a non-finite loss, kept on the device
    evals, t_loop, step0 = [r for r in history if r['kind'] == 'eval'], time.time(), step
    try:
        for epoch in range(step // steps, math.ceil(stop / steps)):  # counted from 0 here, from 1 in the logs
            start = step % steps  # > 0: the rest of an epoch saved mid-way
            seed_epoch(args.seed, epoch, rank, start)
            sampler.set_epoch(epoch)
            sampler.start = start
            t_epoch = t_window = time.time()
            window, n_window, epoch_loss = torch.zeros(2, device=device), 0, 0.0  # loss sum, gap sum; steps
            train_model.train()
            batches = train_loader if args.synthetic else on_device(train_loader, mean, std, fmt)
            for micro in itertools.islice(zip(*[iter(batches)] * k), min(stop - step, steps - start)):  # k at a time
                # per micro-batch, as timm with accumulation: erasing per image, then mixup/cutmix (y -> (b, classes))
                micro = [(random_erasing(x, args.reprob, noise=True) if args.reprob else x, y) for x, y in micro]
                micro = [mix(x, y) if mix is not None else (x, y) for x, y in micro]
                lr = lr_at(step, args.lr, args.sched, args.warmup_steps, args.epochs, steps)
                for group in optimizer.param_groups:
                    group['lr'] = lr
                loss = train_step(train_model, optimizer, scaler, micro, sam=args.sam, clip_grad=args.clip_grad,
                                  label_smoothing=args.label_smoothing, amp_dtype=proc.amp_dtype, sam_m=m,
                                  window=window)  # (+= the loss and, SAM/GSAM, the surrogate gap, on the device)
                step, n_window = step + 1, n_window + 1
                first_bad = torch.where(loss.isfinite(), first_bad, first_bad.clamp(max=step))
                if (args.log_every and step % args.log_every == 0) or step % steps == 0:  # a train row
                    check_finite(first_bad, steps, saved, 'step', distributed)
                    if distributed:
                        dist.all_reduce(window)
                    (loss_sum, gap_sum), n = window.tolist(), world * n_window  # gap: SAM/GSAM's f_p - f
                    history.append(row := dict(kind='train', epoch=epoch + 1, step=step, lr=lr, loss=loss_sum / n,
                                               **({'surrogate_gap': gap_sum / n} if args.sam else {}),
                                               img_per_s=args.batch_size * n_window / (time.time() - t_window),
                                               elapsed_s=time.time() - t_start))
                    epoch_loss += row['loss'] * n_window
                    if step % steps:  # (at the epoch's end the epoch line and save_run follow)
                        log(f'ep {epoch + 1}/{args.epochs} step {step - epoch * steps}/{steps} | loss '
                            f'{row["loss"]:.4f} | lr {lr:.2e} | {row["img_per_s"]:,.0f} img/s | eta '
                            f'{eta(t_loop, step - step0, total - step)}')
                        if master and (saved[0] or not args.overwrite):  # --overwrite: the old run stays whole
                            save_atomic(Path(args.out, 'metrics.jsonl'), history)  # until this one's first save
                    window, n_window, t_window = torch.zeros(2, device=device), 0, time.time()
                if args.save_every and step % args.save_every == 0 and step % steps:  # mid-epoch checkpoint
                    check_finite(first_bad, steps, saved, 'step', distributed)
                    sync_buffers(model, distributed)  # rank 0's BatchNorm statistics, as saved, on every rank
                    if master:
                        save_run(args.out, model, optimizer, scaler, step, steps, history, info)
                    saved = (last, step)
            if step % steps:  # --max-steps ended the run mid-epoch
                break
            sync_buffers(model, distributed)  # BatchNorm statistics: evaluate rank 0's, the ones the checkpoint holds
            res = score(eval_model, on_device(val_loader, mean, std, fmt), proc.autocast, distributed)
            if not math.isfinite(res['loss']):
                raise UserError(f'training diverged: the weights after epoch {epoch + 1} (step {step}) give a '
                                f'non-finite test loss; {since_checkpoint(saved, "step")}')
            evals.append(dict(kind='eval', epoch=epoch + 1, step=step, **res, elapsed_s=time.time() - t_start))
            history.append(evals[-1])
            if master:
                save_run(args.out, model, optimizer, scaler, step, steps, history, info)
            saved = (last, step)
            log(f'ep {epoch + 1}/{args.epochs} | train loss {epoch_loss / (steps - start):.4f} | test loss '
                f'{res["loss"]:.4f} acc {res["top1"]:.2f}% top-5 {res["top5"]:.2f}% | {time.time() - t_epoch:.1f} s | '
                f'eta {eta(t_loop, step - step0, total - step)}')
    except KeyboardInterrupt:
        log(f'train_imagenet.py: interrupted in epoch {step // steps + 1}; {since_checkpoint(saved, "step")}',
            file=sys.stderr)
        sys.exit(130)

    if step < total:
        log(f'stopped after --max-steps {args.max_steps}; {since_checkpoint(saved, "step")}')
    else:
        log(f'done | {args.model} on imagenet | epoch {args.epochs}/{args.epochs} | test acc {evals[-1]["top1"]:.2f}% '
            f'(best {max(r["top1"] for r in evals):.2f}%) | {fmt_time(time.time() - t_start)} wall | {last}')
    leave(distributed)
    return evals[-1] if evals else None


if __name__ == '__main__':
    try:
        main()
    except UserError as e:
        sys.exit(discard_new_dirs() or f'train_imagenet.py: error: {e}')  # (and no empty --out left behind)
    except KeyboardInterrupt:  # main() handles it once training has started
        print(discard_new_dirs() or 'train_imagenet.py: interrupted before training started; nothing was saved',
              file=sys.stderr)
        sys.exit(130)
