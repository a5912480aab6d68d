"""Train any model of this repo on CIFAR-10/100, with or without SAM, on one device or under torchrun.

    python train_cifar.py --out runs/convmixer       # ConvMixer-256/8 (k5, p2), CIFAR-10, 25 epochs
    torchrun --nproc_per_node 8 train_cifar.py --model vit_s4_cifar --aug basic --sam --out runs/vit
    python train_cifar.py --resume runs/vit/last.pt  # continue; unset flags default to the run's
    python train_cifar.py --recipe finetune --pretrained ViT-B_16.npz --model vit_b16 --img-size 224

Defaults: the README run of locuslab/convmixer-cifar10 (~92.5% in 25 epochs), but the last partial batch of an
epoch is dropped (on 5,000 images at batch 128, locuslab's extra 8-image step costs it ~1.8 points; README),
augmentation is torchvision's tensor ops batched on the device (augment.py), autocast is bf16 on a GPU that has it,
CIFAR-100 has its own mean/std. The data lives on the device as uint8. Each epoch's random draws are seeded
from (--seed, epoch, rank): --resume at an epoch boundary continues bit-identically.
"""
import argparse
from argparse import ArgumentDefaultsHelpFormatter, Namespace
import math
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from augment import make_augment
from data import MEAN, NUM_CLASSES, STD, evaluate, load_cifar, resize
from flags import check_lr_not_all_zero, check_ranges, given
from models import build_model, build_on_meta, channels_last, load_weights, parse_model_kw, zero_head
from pgd import pgd
from runs import (MACHINE_FLAGS, discard_new_dirs, prepare_out, read_checkpoint, restore, save_atomic, stored_args,
                  written_by)
from gsam import GSAM
from sam import SAM, first_pass, second_pass
from utils import (NO_STEP, UserError, check_finite, epoch_seed, eta, fmt_time, init_group, leave, rank_zero_first,
                   setup, since_checkpoint, sync_buffers, wrap_ddp)

# Defaults of the flags left unset. finetune: the ViT paper's CIFAR fine-tuning (Dosovitskiy et al. 2021, App. B.1.1;
# vit_jax configs/common.py, train.py, input_pipeline.py): SGD momentum 0.9, batch 512, 10,000 steps (~100 epochs),
# warm-up then cosine, Inception crop (square here) + flip, inputs (x - 0.5) / 0.5 as the released weights expect.
RECIPES = {'locuslab': {}, 'finetune': dict(epochs=100, lr=0.03, wd=0.0, clip_grad=1.0, scale=0.05, randaug_n=0)}
WARMUP = 0.05  # finetune: the warm-up's share of all steps (500 of 10,000)
RUN_KEYS = ('model', 'optimizer', 'scaler', 'epoch', 'step', 'history', 'args')  # what last.pt holds
NOT_INHERITED = ('resume', 'checkpoint', 'eval_only', 'out', 'overwrite', 'pretrained', *MACHINE_FLAGS)  # (runs.py)
AUG_FLAGS = ('aug', 'scale', 'randaug_n', 'randaug_m', 'jitter', 'reprob', 'seed')  # augment.make_augment's


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.partition('\n')[0], formatter_class=ArgumentDefaultsHelpFormatter)
    p.add_argument('--recipe', default='locuslab', choices=sorted(RECIPES), help='locuslab (AdamW, one cycle: '
                   f'as shown) or finetune (ViT paper App. B.1.1: SGD, warm-up + cosine, {RECIPES["finetune"]})')
    g = p.add_argument_group('data')
    g.add_argument('--data', default='./data', metavar='DIR', help="torchvision's CIFAR or DIR/{train,test}/<class>/*")
    g.add_argument('--dataset', default='cifar10', choices=sorted(NUM_CLASSES), help='CIFAR-100: fine labels')
    g.add_argument('--train-subset', type=int, default=0, metavar='N', help='N class-balanced images; 0 = all')
    g.add_argument('--test-subset', type=int, default=0, metavar='N', help='N class-balanced images; 0 = all')
    g.add_argument('--img-size', type=int, default=32, metavar='PX', help='bilinear upsampling after augmentation')
    g.add_argument('--classes', type=int, nargs='+', metavar='C', help='only these classes (train and test), '
                   'relabelled 0..k-1 in this order: transfer splits; with --pretrained the head is new')
    g = p.add_argument_group('model')
    g.add_argument('--model', default='convmixer_256_8', help='a config of convmixer.py, vit.py, mixer.py; resnet18/20')
    g.add_argument('--model-kw', nargs='+', action='extend', default=[], metavar='KEY=VALUE',
                   help='constructor overrides (Python literals), e.g. dim=128 depth=4; classes come from --dataset')
    g.add_argument('--pretrained', metavar='PATH', help='fine-tune from weights (as --checkpoint; our last.pt: its '
                   '--model, --model-kw are the defaults): a head of other classes is replaced by zeros, a ViT '
                   'pos_embed resampled (ViT paper Sec. 3.2)')
    g = p.add_argument_group('optimisation ("locuslab": that script\'s own argparse default)')
    g.add_argument('--epochs', type=int, default=25)
    g.add_argument('--batch-size', type=int, default=512, help='global batch: images per optimizer step')
    g.add_argument('--lr', type=float, default=0.05, help="peak LR; locuslab's one cycle: 0 -> lr at epoch E*2//5 "
                   '-> lr/20 at E*4//5 -> 0 at E, set every step (its --lr-max; locuslab 0.01)')
    g.add_argument('--wd', type=float, default=0.005, help='decoupled weight decay (locuslab 0.01)')
    g.add_argument('--label-smoothing', type=float, default=0.0)
    g.add_argument('--clip-grad', type=float, default=0.0, help='global grad-norm clip (SAM: of g_SAM); 0 = off')
    g.add_argument('--sam', action='store_true', help='Sharpness-Aware Minimization (Foret et al. 2021)')
    g.add_argument('--rho', type=float, default=0.05, help='SAM neighbourhood radius')
    g.add_argument('--adaptive', action='store_true', help='ASAM (Kwon et al. 2021): eps-hat scaled by |w|')
    g.add_argument('--sam-m', type=int, default=0, metavar='M', help='m-sharpness (Foret et al. Sec. 4.1): one eps-hat '
                   "per group of M images of a process's batch; 0: the whole of it, as the JAX code per device")
    g.add_argument('--gsam-alpha', type=float, metavar='A', help='GSAM (Zhuang et al. 2022, gsam.GSAM): update '
                   'g_p - A g_perp; unset (and no --rho-min): plain SAM; 0 with --rho-min = --rho: SAM bit for bit')
    g.add_argument('--rho-min', type=float, metavar='R', help='GSAM: rho follows the LR schedule from R (at its end, '
                   'LR 0) to --rho (at its peak); unset: --rho, constant')
    g.add_argument('--adv', choices=['pgd'], help='train on PGD examples (Madry et al. 2018, pgd.py)')
    g.add_argument('--adv-eps', type=float, default=8.0, help='L-inf radius, in pixel levels /255')
    g.add_argument('--adv-alpha', type=float, default=2.0, help='PGD step size, in pixel levels /255')
    g.add_argument('--adv-steps', type=int, default=7, help='PGD steps (Madry et al.: 7 on CIFAR)')
    g = p.add_argument_group('augmentation (augment.py: on the device, drawn per image)')
    g.add_argument('--aug', default='strong', choices=['strong', 'basic'], help="strong: locuslab's crop, flip, "
                   "RandAugment, jitter, erasing; basic: the SAM paper's 4-px pad-and-crop + flip")
    g.add_argument('--scale', type=float, default=1.0, help='RandomResizedCrop min area (locuslab 0.75)')
    g.add_argument('--randaug-n', type=int, default=2, help='RandAugment ops per image (locuslab 1)')
    g.add_argument('--randaug-m', type=int, default=12, help='RandAugment magnitude 0..30 (locuslab 8)')
    g.add_argument('--jitter', type=float, default=0.0, help='ColorJitter strength (locuslab 0.1)')
    g.add_argument('--reprob', type=float, default=0.0, help='RandomErasing probability (locuslab 0.25)')
    g = p.add_argument_group('system')
    g.add_argument('--amp', default='auto', choices=['auto', 'bf16', 'fp16', 'off'],
                   help='auto: bf16 where the GPU has it, else off')
    g.add_argument('--channels-last', action=argparse.BooleanOptionalAction,
                   help='NHWC memory format; unset: on for the convolutional models on CUDA (models.channels_last)')
    g.add_argument('--compile', action='store_true', help='torch.compile the model')
    g.add_argument('--seed', type=int, default=0, help='seeds the init, the data order and the augmentation')
    g.add_argument('--eval-batch-size', type=int, default=1024, help='images per rank per eval step')
    g.add_argument('--log-every', type=int, default=50, help='a progress line every N steps; 0 = per epoch')
    g = p.add_argument_group('run folder and checkpoints')
    g.add_argument('--out', metavar='DIR', help="default runs/cifar, or the --resume file's folder")
    g.add_argument('--overwrite', action='store_true', help='replace the run already in --out')
    g.add_argument('--resume', metavar='PATH', help='continue this last.pt; unset flags default to its run')
    g.add_argument('--eval-only', action='store_true', help='evaluate --checkpoint on the test set and exit')
    g.add_argument('--checkpoint', metavar='PATH', help='for --eval-only: our last.pt (its model, model-kw, dataset, '
                   'img-size, recipe are the defaults), a timm or locuslab file, or an official .npz')
    p.set_defaults(**RECIPES[p.parse_known_args(argv)[0].recipe])  # (a resumed run's own values win below)
    args = p.parse_args(argv)
    # One of our runs: what it stored is the default of every flag not given (argparse fills only unset ones).
    run = args.resume or (args.checkpoint if args.eval_only and not str(args.checkpoint).endswith('.npz') else None)
    ckpt = read_checkpoint(run, '--resume' if args.resume else '--checkpoint') if run else None
    if written_by(ckpt) not in (None, 'train_cifar.py'):  # its args would set the wrong recipe, data, statistics
        raise UserError(f'{run} is a last.pt of {written_by(ckpt)}: ' + (
            f'evaluate it with {written_by(ckpt)} --eval-only' if written_by(ckpt) == 'train_imagenet.py' else
            f'fine-tune its backbone first (train_cifar.py --pretrained {run})' if args.eval_only else
            f'continue it with {written_by(ckpt)} --resume, or fine-tune from it with --pretrained'))
    if written_by(ckpt) == 'train_cifar.py':
        keep = [k for k in vars(args) if k not in NOT_INHERITED] if args.resume else \
            ['data', 'model', 'model_kw', 'dataset', 'img_size', 'recipe', 'classes']
        args = p.parse_args(argv, namespace=Namespace(**{k: ckpt['args'][k] for k in keep if k in ckpt['args']}))
        args.saved_args = ckpt['args']
    elif args.resume:
        raise UserError(f'--resume {run} is not a train_cifar.py checkpoint (it lacks some of {RUN_KEYS})')
    elif args.pretrained and not str(args.pretrained).endswith('.npz') and (pre := stored_args(
            args.pretrained, '--pretrained')) and (args.model == pre['model'] or not given(p, argv, 'model')):
        # one of our last.pt files (any script's): its --model and --model-kw are the defaults (--model-kw given win)
        args = p.parse_args(argv, namespace=Namespace(model=pre['model'], model_kw=list(pre.get('model_kw') or [])))
    args.out = args.out or (str(Path(args.resume).parent) if args.resume else 'runs/cifar')
    check_ranges(args, ['epochs', 'batch_size', 'eval_batch_size', 'img_size', 'adv_steps', 'scale'],
                 ['sam_m', 'train_subset', 'test_subset', 'log_every', 'randaug_n', 'randaug_m', 'seed', 'lr', 'wd',
                  'rho', 'clip_grad', 'jitter', 'label_smoothing', 'reprob', 'adv_eps', 'adv_alpha'],
                 {}, stored_in=run if written_by(ckpt) else None)  # (the shared bounds: flags.SHARED_AT_MOST)
    gsam = [k for k in ('gsam_alpha', 'rho_min') if getattr(args, k) is not None]  # (unset: plain SAM)
    check_ranges(args, [], gsam, dict(rho_min=args.rho), stored_in=run, stored=[  # rho_min <= rho: rho_t <= --rho
        k for k in gsam if written_by(ckpt) and f'--{k.replace("_", "-")}' not in given(p, argv, *gsam)])  # (R03)
    if args.eval_only != bool(args.checkpoint) or (args.eval_only and args.resume):
        raise UserError('--eval-only evaluates --checkpoint PATH (not --resume); --checkpoint is for --eval-only')
    if args.pretrained and (args.resume or args.eval_only):
        raise UserError('--pretrained starts a new run from weights; --resume and --eval-only load their own')
    if args.resume and args.overwrite:
        raise UserError('--resume continues a run; --overwrite would start a new one in its folder')
    for on, flags in (('sam', ('rho', 'adaptive', 'sam_m', 'gsam_alpha', 'rho_min')),
                      ('adv', ('adv_eps', 'adv_alpha', 'adv_steps'))):
        if not getattr(args, on) and (loose := given(p, argv, *flags)):
            raise UserError(f'{", ".join(loose)} only act with --{on}: add --{on}, or leave them out')
    if args.classes and not (len(set(args.classes)) == len(args.classes) >= 2 and
                             all(0 <= c < NUM_CLASSES[args.dataset] for c in args.classes)):
        raise UserError(f'--classes needs 2 or more distinct labels of {args.dataset} (0..'
                        f'{NUM_CLASSES[args.dataset] - 1}), got {args.classes}')
    return args


def lr_at(t, epochs, lr, recipe='locuslab'):
    """The LR at t epochs: locuslab's one cycle (integer breakpoints); finetune: vit_jax's warm-up x cosine."""
    if recipe == 'finetune':
        warm = WARMUP * epochs
        return lr * min(1.0, t / warm) * 0.5 * (1 + math.cos(math.pi * min(max((t - warm) / (epochs - warm), 0), 1)))
    return float(np.interp(t, [0, epochs * 2 // 5, epochs * 4 // 5, epochs], [0, lr, lr / 20, 0]))



def make_model(args):
    """The model (models.py, with the CIFAR adaptation at 32 px) and the weights of --checkpoint, --resume or
    --pretrained (fine-tuning: a new zero head for other classes)."""
    num_classes = len(args.classes) if args.classes else NUM_CLASSES[args.dataset]
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = build_model(args.model, num_classes, args.img_size, parse_model_kw(args.model_kw), cifar=True)
    if weights := args.checkpoint or args.resume or args.pretrained:  # (--checkpoint: --eval-only)
        load_weights(model, weights, finetune=bool(args.pretrained), new_head=bool(args.classes))
    if args.eval_only and zero_head(model):  # every image would get the same logits: "accuracy" = one class's share
        raise UserError(f'{weights} has an all-zero classifier (a backbone, e.g. a MoCo run\'s): fine-tune it first '
                        f'(train_cifar.py --pretrained {weights})')
    return model


def load_data(args, proc):
    """The CIFAR images on the device as uint8: (train_x, train_y) (None with --eval-only), (test_x, test_y).
    Under torchrun rank 0 reads (and downloads, if needed) first."""
    with rank_zero_first(proc):
        read = lambda train, n: [t.to(proc.device) for t in load_cifar(  # (every class in a subset: data.py)
            args.data, args.dataset, train, n, args.classes, '--classes', f'--{"train" if train else "test"}-subset')]
        test = read(False, args.test_subset)
        train = (None, None) if args.eval_only else read(True, args.train_subset)
    if not args.eval_only and len(train[1]) < args.batch_size:
        raise UserError(f'the training set has {len(train[1])} images, fewer than --batch-size {args.batch_size}')
    return (*train, *test)


def train_step(model, fwd, opt, scaler, criterion, x, y, m, args, autocast):
    """One optimizer step on this process's batch (x, y) -> (the clean passes' mean loss, their logits, the surrogate
    gap f_p - f of SAM/GSAM or None), detached, on the device.
    SAM (Foret et al. Alg. 1, sam.py) with m-sharpness (Sec. 4.1): each group of m images gets its own eps-hat from
    its own first pass (no all-reduce: DDP's no_sync); the SAM gradients of the groups are averaged, all-reduced
    once; BatchNorm statistics come from the first passes. m = the whole batch (the default) is one group.
    GSAM (gsam.GSAM): each group's (each replica's) g_p is decomposed against its own g, so the second passes run
    under no_sync too and gsam_gradient() averages the result over the replicas in one all-reduce (big_vision's
    pmean after gsam_gradient)."""
    groups = list(zip(x.split(m), y.split(m))) if args.sam else [(x, y)]
    gsam = isinstance(opt, GSAM)
    losses, outs, losses_p = [], [], []
    for j, (xg, yg) in enumerate(groups):
        with first_pass(model) if args.sam else nullcontext():
            with autocast:
                out = fwd(xg)
                loss = criterion(out, yg)
            scaler.scale(loss).backward()
        losses.append(loss.detach())
        outs.append(out.detach())
        if args.sam:
            opt.first_step(zero_grad=True)  # w <- w + eps-hat_j; .grad <- the SAM gradient of the groups before
            with second_pass(model, sync=j == len(groups) - 1 and not gsam):  # DDP: one all-reduce, on the last
                with autocast:                                                # backward (GSAM: in gsam_gradient)
                    loss_sam = criterion(fwd(xg), yg) / len(groups)
                scaler.scale(loss_sam).backward()  # g_SAM, averaged over the groups (and replicas)
            losses_p.append(loss_sam.detach())
            if j < len(groups) - 1:
                opt.next_group()  # w restored exactly; the SAM gradient so far set aside
    if gsam:
        opt.gsam_gradient(all_reduce=dist.is_initialized())  # g_p - alpha g_perp, mean over groups and replicas
    if args.clip_grad > 0:
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
    scaler.step(opt)  # SAM: w restored from its copy, then the base step with g_SAM
    scaler.update()
    opt.zero_grad(set_to_none=True)
    loss = torch.stack(losses).mean()
    return loss, torch.cat(outs), torch.stack(losses_p).sum() - loss if args.sam else None


def make_optimizer(args, model, steps):
    """locuslab: AdamW; finetune: SGD with momentum 0.9 (vit_jax); SAM-wrapped with --sam. Decay on every parameter,
    as locuslab's AdamW. GSAM's rho_t goes from --rho-min at the schedule's lowest LR (its end, 0) to --rho at its
    highest, over the LRs the loop sets: --lr, except at --epochs 1 or 2, where locuslab's cycle peaks lower (C26)."""
    base, kw = (torch.optim.SGD, dict(momentum=0.9)) if args.recipe == 'finetune' else (torch.optim.AdamW, {})
    kw.update(lr=args.lr, weight_decay=args.wd)
    if args.sam and (args.gsam_alpha is not None or args.rho_min is not None):
        lrs = [lr_at(e + (i + 1) / steps, args.epochs, args.lr, args.recipe) for e in range(args.epochs)
               for i in range(steps)]  # (as the loop computes them)
        lr_range = dict(lr_max=max(lrs), lr_min=min(lrs))
        return GSAM(model.parameters(), base, rho=args.rho, rho_min=args.rho_min, alpha=args.gsam_alpha or 0.0,
                    adaptive=args.adaptive, **lr_range, **kw)
    return SAM(model.parameters(), base, rho=args.rho, adaptive=args.adaptive, **kw) if args.sam else \
        base(model.parameters(), **kw)


def train_row(epoch, step, lr, sums, images, t_row, t_start, sam=False):
    """A metrics.jsonl row of the steps since the last one: sums = (loss sum, correct, images, gap sum) on the device;
    SAM/GSAM rows add the surrogate gap h = f_p - f (Zhuang et al. 2022, eq. 2), the mean over the steps."""
    loss_sum, correct, count, gap_sum = sums.tolist()
    return {'kind': 'train', 'epoch': epoch + 1, 'step': step, 'lr': lr, 'loss': loss_sum / count, 'acc': 100 * correct
            / count, **({'surrogate_gap': gap_sum / count} if sam else {}), 'img_per_s': images / (time.time() - t_row),
            'elapsed_s': time.time() - t_start}


def eval_models(args, raw, n_test, rank, world):
    """(the model the attack and evaluation run, what evaluate() calls). Not DDP: the ranks see different counts.
    --compile: static (dynamic=False), since an eval batch unlike the training batch would else make dynamo recompile
    the forward for any batch size (automatic dynamic shapes); StaticEval pads this rank's tail batch."""
    if not args.compile:
        return raw, raw
    eval_model = torch.compile(raw, dynamic=False)
    mine = n_test * (rank + 1) // world - n_test * rank // world  # this rank's test images (evaluate's)
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    return eval_model, StaticEval(eval_model, min(args.eval_batch_size, mine), fmt)


class StaticEval(nn.Module):
    """--compile's evaluation: a batch smaller than `size` (the tail of the test set, of a rank's slice) is padded with
    zeros to it and its padding's logits dropped, so that one static graph serves every eval batch, not a second,
    dynamic one compiled for the tail (eval mode: an image's logits depend on it alone; tests/test_compile.py)."""

    def __init__(self, compiled, size, memory_format):
        super().__init__()
        self.compiled, self.size, self.memory_format = compiled, size, memory_format

    def forward(self, x):
        if len(x) == self.size:
            return self.compiled(x)
        full = x.new_zeros(self.size, *x.shape[1:]).contiguous(memory_format=self.memory_format)
        full[:len(x)] = x
        return self.compiled(full)[:len(x)]


def main(argv=None):
    args, t_start = get_args(argv), time.time()
    proc = setup(args.amp)  # rank, device, autocast; cuda:LOCAL_RANK when there is a GPU
    rank, world, device, autocast, log = proc.rank, proc.world, proc.device, proc.autocast, proc.log
    args.channels_last = channels_last(args.channels_last, args.model, device)  # (stored resolved)
    if not args.eval_only and args.batch_size % world:
        raise UserError(f'--batch-size {args.batch_size} (global) does not divide by the world size {world}')
    batch = args.batch_size // world
    m = args.sam_m or batch  # m-sharpness: images per eps-hat (sam.py)
    if args.sam and not args.eval_only and batch % m:  # (--eval-only trains nothing: training flags are unused)
        fit = max(d for d in range(1, m) if batch % d == 0)
        raise UserError(f'--sam-m {m} does not divide the {batch} images of a process (--batch-size {args.batch_size} '
                        f'/ {world}); pass a divisor of {batch}, such as {fit}')
    raw = make_model(args)  # the model first: a bad name fails at once
    if not args.eval_only:  # BatchNorm: 2 or more values per channel in every training forward pass
        build_on_meta(args, cifar=True, group=m if args.sam else batch, world=world)
    ckpt = read_checkpoint(args.resume, '--resume') if args.resume else None  # optimizer, scaler, history
    out_dir = prepare_out(args) if proc.master and not args.eval_only else Path(args.out)
    raw.to(device, memory_format=torch.channels_last if args.channels_last else torch.preserve_format)
    init_group(proc)
    train_x, train_y, test_x, test_y = load_data(args, proc)
    norm = ((0.5,) * 3,) * 2 if args.recipe == 'finetune' else (MEAN[args.dataset], STD[args.dataset])  # (x-m)/s
    mean, std = (torch.tensor(v, device=device).view(1, 3, 1, 1) for v in norm)
    eval_model, scorer = eval_models(args, raw, len(test_y), rank, world)  # (--compile: static shapes)
    test = (test_x, test_y, mean, std, args.eval_batch_size, rank, world, autocast, args.channels_last, args.img_size)
    if args.eval_only:
        r = evaluate(scorer, *test)
        log(f'eval | {args.checkpoint} | {args.model} on {args.dataset} | test loss {r["loss"]:.4f} acc '
            f'{r["top1"]:.2f}% ({r["correct"]}/{r["n"]}) top-5 {r["top5"]:.2f}% | world {world}')
        return leave(proc.ddp)
    steps = len(train_y) // args.batch_size  # the last partial batch is dropped (module docstring)
    augment = make_augment(**{k: getattr(args, k) for k in AUG_FLAGS}, mean=norm[0], std=norm[1], device=device)
    opt, scaler = make_optimizer(args, raw, steps), torch.amp.GradScaler(device.type, enabled=proc.amp == 'fp16')
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    model = wrap_ddp(raw, proc)
    fwd = torch.compile(model) if args.compile else model
    start_epoch, step, history = restore(ckpt, opt, scaler, args, NOT_INHERITED, log) if ckpt else (0, 0, [])
    check_lr_not_all_zero((lr_at(e + (i + 1) / steps, args.epochs, args.lr, args.recipe)  # the loop's LRs (S01)
                           for e in range(start_epoch, args.epochs) for i in range(steps)), args, steps, start_epoch,
                          "locuslab's one-cycle" if args.recipe == 'locuslab' else "vit_jax's warm-up x cosine",
                          'raise --epochs or --train-subset, or lower --batch-size')
    run_args = {k: v for k, v in vars(args).items() if k != 'saved_args'}
    log(f'{args.model} {" ".join(args.model_kw)} ({sum(p.numel() for p in raw.parameters()):,} params) on '
        f'{args.dataset}: {len(train_y):,} train / {len(test_y):,} test at {args.img_size} px | {args.epochs} epochs '
        f'x {steps} steps of {args.batch_size} ({world} x {batch})'
        f' | {type(getattr(opt, "base_optimizer", opt)).__name__} lr {args.lr} wd {args.wd}'
        f'{f" | SAM rho {args.rho} m {m}" * args.sam}'
        + (f' | GSAM alpha {args.gsam_alpha or 0} rho_min {args.rho if args.rho_min is None else args.rho_min} at LR '
           f'{opt.lr_min:g} .. rho {args.rho} at LR {opt.lr_max:g}' if isinstance(opt, GSAM) else '') +
        f'{f" | PGD-{args.adv_steps} eps {args.adv_eps:g}/255" * bool(args.adv)}'
        f' | aug {args.aug} | amp {proc.amp} | {device}')
    last, epoch, saved = out_dir / 'last.pt', start_epoch, (args.resume, start_epoch)  # saved: the last good one
    first_bad = torch.full((), NO_STEP, device=device)  # first non-finite loss: kept on the device, no sync
    t_loop, step0 = time.time(), step  # (a resume may change the steps per epoch)
    try:
        for epoch in range(start_epoch, args.epochs):
            # (seed, epoch, rank): each rank its own augmentation and dropout; one data order, rank r takes its slice
            torch.manual_seed(epoch_seed(args.seed, epoch, rank))
            augment.generator.manual_seed(epoch_seed(args.seed, epoch, rank))
            perm = torch.randperm(len(train_y), generator=torch.Generator().manual_seed(epoch_seed(args.seed, epoch)))
            perm, t_epoch, t_row, row_start = perm.to(device), time.time(), time.time(), 0
            sums = torch.zeros(2, 4, dtype=torch.float64, device=device)  # (since the last row, epoch) x
            model.train()                                                  # (loss sum, correct, images, gap sum)
            for i in range(steps):
                lr = lr_at(epoch + (i + 1) / steps, args.epochs, args.lr, args.recipe)
                for group in opt.param_groups:
                    group['lr'] = lr
                idx = perm[i * args.batch_size + rank * batch:i * args.batch_size + (rank + 1) * batch]
                x, y = resize(augment(train_x[idx]), args.img_size), train_y[idx]
                if args.adv:  # PGD on [0, 1] pixels (normalised inside), made at w in eval mode: no BatchNorm update
                    # (under DDP with this rank's running statistics, which follow its own images: utils.wrap_ddp)
                    with autocast:
                        x = (pgd(eval_model, x * std + mean, y, args.adv_eps / 255, args.adv_alpha / 255,
                                 args.adv_steps, normalize=lambda v: (v - mean) / std) - mean) / std
                x = x.contiguous(memory_format=torch.channels_last) if args.channels_last else x
                loss, out, gap = train_step(model, fwd, opt, scaler, criterion, x, y, m, args, autocast)
                step += 1
                loss = loss.double()  # (fp16 overflow is in the gradients, and GradScaler skips it)
                first_bad = torch.where(loss.isfinite(), first_bad, first_bad.clamp(max=step))
                sums[:, :2] += torch.stack([loss * len(y), (out.argmax(1) == y).sum()])
                sums[:, 2] += len(y)
                if gap is not None:  # (per image, as the loss: the row divides by the images)
                    sums[:, 3] += gap.double() * len(y)
                if args.log_every and (i + 1) % args.log_every == 0 and i + 1 < steps:
                    if proc.master:  # (rank 0's images: no collective mid-epoch; reading first_bad is the host sync)
                        check_finite(first_bad, steps, saved)
                        history.append(train_row(epoch, step, lr, sums[0], (i + 1 - row_start) * args.batch_size,
                                                 t_row, t_start, args.sam))
                        if saved[0] or not args.overwrite:  # --overwrite: the old run stays whole until epoch 1 ends
                            save_atomic(out_dir / 'metrics.jsonl', history)
                        log(f'ep {epoch + 1}/{args.epochs} step {i + 1}/{steps} | loss {history[-1]["loss"]:.4f} | '
                            f'lr {lr:.2e} | {history[-1]["img_per_s"]:,.0f} img/s | '
                            f'eta {eta(t_loop, step - step0, (args.epochs - epoch) * steps - i - 1)}')
                    sums[0], t_row, row_start = 0, time.time(), i + 1  # on every rank: the next row's window
            if proc.ddp:  # the epoch's sums
                dist.all_reduce(sums)
            sync_buffers(raw, proc.ddp)  # rank 0's BatchNorm statistics on every rank: evaluated and saved
            check_finite(first_bad, steps, saved, distributed=proc.ddp)
            history.append(train_row(epoch, step, lr, sums[0], (steps - row_start) * args.batch_size, t_row, t_start,
                                     args.sam))
            r = evaluate(scorer, *test)
            history.append({'kind': 'eval', 'epoch': epoch + 1, 'step': step, **r, 'elapsed_s': time.time() - t_start})
            loss_sum, correct, count, _ = sums[1].tolist()
            log(f'ep {epoch + 1}/{args.epochs} | train loss {loss_sum / count:.4f} acc {100 * correct / count:.2f}% | '
                f'test loss {r["loss"]:.4f} acc {r["top1"]:.2f}% | {time.time() - t_epoch:.1f} s | '
                f'eta {eta(t_loop, step - step0, (args.epochs - epoch - 1) * steps)}')
            if proc.master:  # last.pt first: it holds the history the other two are rebuilt from
                save_atomic(last, {'model': raw.state_dict(), 'optimizer': opt.state_dict(), 'history': history,
                                   'scaler': scaler.state_dict(), 'epoch': epoch + 1, 'step': step, 'args': run_args})
            saved = (last, epoch + 1)  # now, not after the other two: a Ctrl-C while they are written names it
            if proc.master:
                save_atomic(out_dir / 'metrics.jsonl', history)
                save_atomic(out_dir / 'args.json', run_args)
    except KeyboardInterrupt:
        log(f'train_cifar.py: interrupted in epoch {epoch + 1}; {since_checkpoint(saved)}', file=sys.stderr)
        sys.exit(130)
    best = max(r['top1'] for r in history if r['kind'] == 'eval')
    log(f'done | {args.model} on {args.dataset} | epoch {args.epochs}/{args.epochs} | test acc {r["top1"]:.2f}% '
        f'(best {best:.2f}%) | {fmt_time(time.time() - t_start)} wall | {last}')
    leave(proc.ddp)


if __name__ == '__main__':
    try:
        main()
    except UserError as e:
        sys.exit(discard_new_dirs() or f'train_cifar.py: error: {e}')  # (and no empty --out left behind)
    except KeyboardInterrupt:
        print(discard_new_dirs() or 'train_cifar.py: interrupted before training started; nothing was saved',
              file=sys.stderr)
        sys.exit(130)
