"""Self-supervised contrastive pre-training of a ViT (MoCo v3), with or without SAM, then k-NN and
linear-probe evaluation; the backbone fine-tunes with train_cifar.py --pretrained.

    python train_contrastive.py --data /tmp/cifar10 --model vit_s16 --epochs 300 --batch-size 512
    torchrun --nproc_per_node 8 train_contrastive.py --dataset imagenet --data /imagenet \\
        --model vit_s16 --model-kw heads=12 --batch-size 1024 --sam --rho 0.05      # ViT-S/16, one node

Claim (Chen, Hsieh & Gong 2021, "When Vision Transformers Outperform ResNets...", ICLR 2022): SAM
helps contrastive learning too. A review of the paper gives 350 pre-training epochs, then
fine-tuning, with ImageNet top-1 ViT-S/16 77.0 -> 78.1 and ViT-B/16 77.4 -> 80.0 [unchecked: the
paper's contrastive setting, its framework, epochs and rho could not be read from its text or
code here]. What is followed instead is MoCo v3, the standard for ViTs: Chen, Xie & He 2021, "An
Empirical Study of Training Self-Supervised Vision Transformers" (ICCV), read from
facebookresearch/moco-v3 (main_moco.py, moco/builder.py, moco/loader.py, vits.py, CONFIG.md):
  - two views per image, BYOL's asymmetric augmentations (main_moco.py): crop scale (0.08, 1),
    colour jitter (0.4, 0.4, 0.2, 0.1) with p 0.8, grayscale p 0.2, Gaussian blur sigma (0.1, 2)
    with p 1.0 / 0.1, solarize p 0 / 0.2, flip p 0.5;
  - query encoder f_q = ViT + 3-layer projection MLP (hidden 4096, out 256, BN, last BN without
    affine), a 2-layer predictor; momentum encoder f_k = EMA of f_q, momentum 0.99 -> 1 by a
    half-cycle cosine (--moco-m-cos), BN statistics over the global batch (SyncBatchNorm);
  - loss ctr(q1, k2) + ctr(q2, k1), ctr(q, k) = 2 tau * CE(q k^T / tau, positives), keys
    gathered from all ranks without gradient (concat_all_gather), tau 0.2 for ViTs;
  - AdamW, lr 1.5e-4 * batch / 256, wd 0.1, 40 warmup epochs then cosine, 300 epochs, batch 4096;
    frozen random patch projection (--stop-grad-conv1) and fixed 2-D sin-cos position embedding.
Deviations, all deliberate: views are made on the device, batched (torchvision's tensor ops
re-written per sample; flip applied at the crop, which commutes with every later op); the blur is
torchvision's Gaussian kernel of side 2*round(size/20)+1 (23 at 224 px, BYOL's) with sigma scaled
by size/224 (so at 32 px there is next to none), not PIL's box approximation; ImageNet views are
cut from the central round(size/0.875)-px square the loader decodes; the keys are computed once
per step (both SAM passes use them); a step's random draws are made for the global batch, so the
views do not depend on the world size; checkpoints (and resume) at epoch ends only; our ViT-S has
6 heads (MoCo v3's 12: --model-kw heads=12) and vit.py's JAX initialisation.

SAM (--sam, sam.py) wraps AdamW exactly as in train_cifar.py: both passes see the same two views
and keys; f_k is updated once per step, after the SAM step, from the restored weights.
Evaluation (--eval): knn = weighted k-NN on L2-normalised features (DINO's protocol: k 20,
T 0.07); linear = a linear classifier on frozen, standardised features of the unaugmented
training images (SGD, momentum 0.9, no weight decay, cosine LR, as MoCo v3's main_lincls.py but
on cached features, without augmentation). Both are exact under DDP. The feature is the class
token after the last LayerNorm, the input of the ViT's head. last.pt's 'model' is that backbone
under vit.py's (timm's) keys with a zero head (the ViT's own init), so it loads into
train_cifar.py --pretrained; 'moco' holds both encoders and the predictor for --resume.
"""
import argparse
import ast
import copy
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn as nn
import torch.nn.functional as F

import train_cifar
import vit
from sam import SAM, first_pass, second_pass

# BYOL's augmentations as MoCo v3 uses them (main_moco.py augmentation1 / augmentation2).
AUG = dict(ratio=(3 / 4, 4 / 3), jitter=(0.4, 0.4, 0.2, 0.1), p_jitter=0.8, p_gray=0.2,
           blur_sigma=(0.1, 2.0), p_blur=(1.0, 0.1), p_solarize=(0.0, 0.2), p_flip=0.5)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # MoCo v3's Normalize
ARCH = ('dataset', 'model', 'model_kw', 'img_size', 'proj_hidden', 'proj_dim', 'pos_embed', 'freeze_patch_embed')
ARCH_DEFAULTS = dict(dataset='cifar10', model='vit_s16', model_kw={}, proj_hidden=4096, proj_dim=256,
                     pos_embed='sincos', freeze_patch_embed=True)


class UserError(Exception):
    """A mistake in the command line or the files it names: printed as one line, no traceback."""


# -----------------------------------------------------------------------------
# Arguments. Defaults = MoCo v3's ViT recipe (CONFIG.md); those marked * come from a checkpoint
# being resumed or evaluated when not given.
def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group('data')
    g.add_argument('--data', default='./data', metavar='DIR',
                   help='CIFAR: either layout train_cifar.py reads; imagenet: DIR/train/<class>/*, DIR/val/<class>/*')
    g.add_argument('--dataset', choices=['cifar10', 'cifar100', 'imagenet'], help='* default cifar10')
    g.add_argument('--train-subset', type=int, default=0, metavar='N',
                   help='CIFAR: a class-balanced subset of N training images (0 = all)')
    g.add_argument('--test-subset', type=int, default=0, metavar='N', help='CIFAR: the same for the test set')
    g.add_argument('--img-size', type=int, help='* view size in px; default 32 for CIFAR, 224 for imagenet')
    g.add_argument('--workers', type=int, default=8, help='imagenet: data-loader processes per rank')
    g.add_argument('--crop-min', type=float, default=0.08, help='RandomResizedCrop minimum area fraction')
    g = p.add_argument_group('model (MoCo v3, Sec. 3 and vits.py)')
    g.add_argument('--model', help=f'* a ViT config of vit.py (default vit_s16); for CIFAR at 32 px with '
                                   f'patch p/4, the rule of train_cifar.py: {", ".join(vit.configs)}')
    g.add_argument('--model-kw', nargs='+', metavar='KEY=VALUE',
                   help='* ViT constructor overrides, e.g. dim=192 depth=6 heads=3 (Python literals)')
    g.add_argument('--proj-hidden', type=int, help='* hidden width of the projector and predictor MLPs (4096)')
    g.add_argument('--proj-dim', type=int, help='* output width of both MLPs, the contrastive space (256)')
    g.add_argument('--pos-embed', choices=['sincos', 'learned'], help='* sincos: fixed 2-D sin-cos (MoCo v3)')
    g.add_argument('--freeze-patch-embed', action=argparse.BooleanOptionalAction,
                   help='* keep the random patch projection frozen (MoCo v3 Sec. 4.2 trick, --stop-grad-conv1); '
                        'default on')
    g.add_argument('--tau', type=float, default=0.2, help='softmax temperature of the InfoNCE loss (ViT: 0.2)')
    g.add_argument('--moco-m', type=float, default=0.99, help='base EMA momentum, raised to 1 by a half cosine')
    g = p.add_argument_group('optimisation')
    g.add_argument('--epochs', type=int, default=300, help='pre-training epochs')
    g.add_argument('--batch-size', type=int, default=4096, help='GLOBAL batch of one step, split over the ranks')
    g.add_argument('--lr', type=float, help='peak AdamW LR; default 1.5e-4 * batch-size / 256 (MoCo v3 linear scaling)')
    g.add_argument('--wd', type=float, default=0.1, help='AdamW decoupled weight decay (on all parameters, as MoCo v3)')
    g.add_argument('--warmup-epochs', type=float, default=40, help='linear LR warmup, then half-cycle cosine to 0')
    g.add_argument('--clip-grad', type=float, default=0.0, help='global gradient-norm clip (0 = off)')
    g.add_argument('--sam', action='store_true', help='SAM (Foret et al. 2021) around AdamW, via sam.py')
    g.add_argument('--rho', type=float, default=0.05, help="SAM radius rho (SAM's default; the paper's is unchecked)")
    g.add_argument('--adaptive', action='store_true', help='ASAM (Kwon et al. 2021)')
    g = p.add_argument_group('evaluation')
    g.add_argument('--eval', nargs='+', choices=['knn', 'linear'], default=['knn', 'linear'],
                   help='protocols run on frozen features after each --eval-every epochs and at the end')
    g.add_argument('--eval-every', type=int, default=10, help='epochs between evaluations (0 = at the end only)')
    g.add_argument('--knn-k', type=int, default=20, help='k-NN neighbours (DINO: 20)')
    g.add_argument('--knn-t', type=float, default=0.07, help='k-NN vote temperature: weight exp(cos / T)')
    g.add_argument('--linear-epochs', type=int, default=100, help='linear-probe epochs over the cached features')
    g.add_argument('--linear-lr', type=float, default=0.1, help='linear-probe SGD peak LR (batch 256)')
    g.add_argument('--eval-batch-size', type=int, default=256, help='images per rank per feature batch')
    g = p.add_argument_group('system')
    g.add_argument('--device', default='auto', choices=['auto', 'cuda', 'cpu'],
                   help='auto = cuda:LOCAL_RANK if available')
    g.add_argument('--amp', default='auto', choices=['auto', 'bf16', 'fp16', 'off'],
                   help='autocast; auto = bf16 on CUDA, off on CPU; fp16 adds a GradScaler')
    g.add_argument('--seed', type=int, default=0, help='seeds init, data order and views')
    g.add_argument('--log-every', type=int, default=50, help='progress line and train row every N steps (0 = epochs)')
    g = p.add_argument_group('checkpoints')
    g.add_argument('--out', metavar='DIR', help='last.pt, metrics.jsonl, args.json (default: the --resume '
                                                "file's folder, else runs/contrastive)")
    g.add_argument('--overwrite', action='store_true', help='replace a run already in --out')
    g.add_argument('--resume', metavar='PATH', help='continue a run of this script from its last.pt')
    g.add_argument('--eval-only', action='store_true',
                   help='evaluate --checkpoint (without it: the randomly initialised network) and exit')
    g.add_argument('--checkpoint', metavar='PATH', help='for --eval-only: our last.pt, a timm state_dict or a JAX .npz')
    g.add_argument('--stop-after-epoch', type=int, default=0, metavar='K',
                   help='save epoch K and exit (tests, preemption)')
    args = p.parse_args(argv)
    for name in ('epochs', 'batch_size', 'eval_batch_size', 'knn_k', 'linear_epochs', 'img_size', 'proj_hidden',
                 'proj_dim'):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    for name in ('train_subset', 'test_subset', 'log_every', 'eval_every', 'stop_after_epoch', 'workers',
                 'warmup_epochs', 'wd', 'clip_grad', 'rho'):
        if getattr(args, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not (0 < args.crop_min <= 1 and 0 <= args.moco_m <= 1 and args.tau > 0 and args.knn_t > 0):
        raise UserError('--crop-min must be in (0, 1], --moco-m in [0, 1], --tau and --knn-t positive')
    if args.warmup_epochs > args.epochs:
        raise UserError(f'--warmup-epochs {args.warmup_epochs} exceeds --epochs {args.epochs}')
    if args.checkpoint and not args.eval_only:
        raise UserError('--checkpoint is for --eval-only; to continue a run use --resume PATH')
    if args.eval_only and args.resume:
        raise UserError('--eval-only evaluates --checkpoint PATH, not --resume')
    if args.model_kw is not None:
        args.model_kw = parse_model_kw(args.model_kw)
    return args


def parse_model_kw(items):
    out = {}
    for item in items:
        key, sep, value = item.partition('=')
        if not sep or not key.isidentifier():
            raise UserError(f'--model-kw expects KEY=VALUE, got {item!r}')
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def resolve_arch(args, stored):
    """Architecture and data flags: given, else the checkpoint's (if ours), else the defaults."""
    for k in ARCH:
        dataset = args.dataset or (stored or ARCH_DEFAULTS)['dataset']
        have = stored[k] if stored else ARCH_DEFAULTS.get(k, 224 if dataset == 'imagenet' else 32)
        if getattr(args, k) is None:
            setattr(args, k, have)
        elif stored and getattr(args, k) != have:
            raise UserError(f"--{k.replace('_', '-')} {getattr(args, k)} differs from the checkpoint's {have}; "
                            f'leave it out to use the checkpoint\'s')
    if args.lr is None:
        args.lr = 1.5e-4 * args.batch_size / 256  # MoCo v3: base lr 1.5e-4 per 256 images


# -----------------------------------------------------------------------------
# Views, on the device and batched. Pixels stay float32 holding integers 0..255 between ops,
# rounded as torchvision's uint8 tensor ops round, so each op equals its
# torchvision.transforms.v2.functional counterpart (tests/test_contrastive.py). Every op gets
# per-sample parameters; a sample that did not draw an op keeps its pixels by torch.where, so
# nothing needs the list of samples that drew it: no boolean indexing, no host sync.
def grayscale(x):  # (B, 3, H, W) -> (B, 1, H, W): ITU-R 601-2 luma, truncated as for uint8
    r, g, b = x.unbind(1)
    return r.mul(0.2989).add_(g, alpha=0.587).add_(b, alpha=0.114).floor_().unsqueeze(1)


def blend(x, other, f):  # torchvision's _blend: f*x + (1-f)*other, clamped, truncated; f (B, 1, 1, 1)
    return torch.addcmul(x * f, other, 1 - f).clamp_(0, 255).floor_()  # addcmul: add_(alpha=)'s rounding


def adjust_brightness(x, f):
    return x.mul(f).clamp_(0, 255).floor_()


def adjust_contrast(x, f):
    return blend(x, grayscale(x).mean(dim=(1, 2, 3), keepdim=True), f)


def adjust_saturation(x, f):
    return blend(x, grayscale(x), f)


def adjust_hue(x, f):
    """torchvision's adjust_hue per sample (f: (B, 1, 1) in [-0.5, 0.5]): RGB -> HSV (PIL's
    formulas), h <- (h + f) mod 1, HSV -> RGB, back to integers as to_dtype(uint8) does."""
    x = x * (1.0 / 255)
    r, g, _ = x.unbind(1)
    maxc, minc = x.amax(1), x.amin(1)
    eqc = maxc == minc  # grey pixels: h = s = 0 (the divisors below are replaced by 1)
    ones = torch.ones_like(maxc)
    s = (maxc - minc) / torch.where(eqc, ones, maxc)
    rc, gc, bc = ((maxc.unsqueeze(1) - x) / torch.where(eqc, ones, maxc - minc).unsqueeze(1)).unbind(1)
    hr = (bc - gc) * (maxc == r)
    hg = (rc + 2.0 - bc) * ((maxc == g) & (maxc != r))
    hb = (gc + 4.0 - rc) * ((maxc != g) & (maxc != r))
    h = ((hr + hg + hb) * (1.0 / 6.0) + 1.0).fmod(1.0)
    h = (h + f).remainder(1.0)
    # HSV -> RGB: sector i = floor(6h) picks each channel from (v, p, q, t)
    h6 = h * 6
    i = h6.floor()
    frac, i = h6 - i, i.int().remainder(6)
    v, p, q, t = maxc, (1.0 - s) * maxc, (1.0 - s * frac) * maxc, (s * frac + (1.0 - s)) * maxc
    p, q, t = p.clamp(0, 1), q.clamp(0, 1), t.clamp(0, 1)
    red = torch.where(i == 0, v, torch.where(i == 1, q, torch.where(i <= 3, p, torch.where(i == 4, t, v))))
    green = torch.where(i == 0, t, torch.where(i <= 2, v, torch.where(i == 3, q, p)))
    blue = torch.where(i <= 1, p, torch.where(i == 2, t, torch.where(i <= 4, v, q)))
    return torch.stack([red, green, blue], 1).mul_(255 + 1.0 - 1e-3).floor_()


def color_jitter(x, factors, order):
    """ColorJitter (torchvision): brightness, contrast, saturation, hue with factors (B, 4) (hue's as
    an offset), applied in a per-sample random order (B, 4), a permutation of 0..3 per row."""
    B = len(x)
    for slot in range(4):
        for k, fn in enumerate((adjust_brightness, adjust_contrast, adjust_saturation)):
            x = torch.where((order[:, slot] == k).view(B, 1, 1, 1), fn(x, factors[:, k].view(B, 1, 1, 1)), x)
        x = torch.where((order[:, slot] == 3).view(B, 1, 1, 1), adjust_hue(x, factors[:, 3].view(B, 1, 1)), x)
    return x


def gaussian_blur(x, sigma, kernel_size):
    """torchvision's gaussian_blur per sample (sigma: (B,)): a kernel_size^2 Gaussian, reflect
    padding, one grouped conv for the batch, rounded as for uint8."""
    B, C, H, W = x.shape
    lim = (kernel_size - 1) / (2 * math.sqrt(2))
    k1 = torch.softmax(-(torch.linspace(-lim, lim, kernel_size, device=x.device) / sigma[:, None]).pow(2), 1)
    k2 = (k1[:, :, None] * k1[:, None, :]).repeat_interleave(C, 0)[:, None]  # (B*C, 1, k, k)
    pad = [kernel_size // 2] * 4
    out = F.conv2d(F.pad(x.reshape(1, B * C, H, W), pad, mode='reflect'), k2, groups=B * C)
    return out.view(B, C, H, W).round_()


def resized_crop_flip(x, top, left, height, width, size, flip):
    """Per-sample boxes (B,) float64 pixel counts, resized bilinearly to size x size as torchvision's
    resized_crop (interpolate, align_corners=False, edges clamped to the box; antialias changes
    nothing when enlarging), mirrored where flip (B,). One grid_sample for the batch."""
    B, _, H, W = x.shape
    u = torch.arange(size, dtype=torch.float64, device=x.device)
    # output pixel u reads the box at (u + 0.5) * side / size - 0.5, clamped to [0, side - 1]
    ox = ((u + 0.5) * width[:, None] / size - 0.5).clamp(min=0).minimum(width[:, None] - 1)  # (B, size)
    oy = ((u + 0.5) * height[:, None] / size - 0.5).clamp(min=0).minimum(height[:, None] - 1)
    gx, gy = left[:, None] + ox, top[:, None] + oy
    gx = torch.where(flip[:, None], gx.flip(1), gx)
    grid = torch.stack([((2 * gx + 1) / W - 1)[:, None, :].expand(B, size, size),  # normalised coordinates
                        ((2 * gy + 1) / H - 1)[:, :, None].expand(B, size, size)], -1)
    return F.grid_sample(x, grid.to(x.dtype), mode='bilinear', padding_mode='border', align_corners=False).round_()


def uniform(gen, B, lo, hi, *shape, dtype=torch.float32):
    """U(0, 1) draws for the whole global batch of B, of which this rank keeps rows lo..hi-1: the
    views of an image do not depend on the world size."""
    return torch.rand(B, *shape, generator=gen, device=gen.device, dtype=dtype)[lo:hi]


def moco_view(x_u8, gen, B, lo, hi, view, size, crop_min, mean, std):
    """One MoCo v3 view (view 0 or 1: its blur and solarize probabilities) of each image of x_u8
    (b, 3, H, W) uint8 on the device -> (b, 3, size, size) normalised float32."""
    x = x_u8.float()
    b, _, H, W = x.shape
    # RandomResizedCrop(size, scale=(crop_min, 1), ratio=(3/4, 4/3)), torchvision's draw: the
    # first of 10 (area, log-ratio) tries that fits; else the whole (square) image
    area = H * W * (crop_min + (1 - crop_min) * uniform(gen, B, lo, hi, 10, dtype=torch.float64))
    lr = [math.log(r) for r in AUG['ratio']]
    ratio = torch.exp(lr[0] + (lr[1] - lr[0]) * uniform(gen, B, lo, hi, 10, dtype=torch.float64))
    w, h = torch.sqrt(area * ratio).round(), torch.sqrt(area / ratio).round()
    fits = (w >= 1) & (w <= W) & (h >= 1) & (h <= H)
    first = fits.int().argmax(1, keepdim=True)
    any_fit = fits.any(1)
    w = torch.where(any_fit, w.gather(1, first)[:, 0], float(W))
    h = torch.where(any_fit, h.gather(1, first)[:, 0], float(H))
    top = (uniform(gen, B, lo, hi, dtype=torch.float64) * (H - h + 1)).floor()
    left = (uniform(gen, B, lo, hi, dtype=torch.float64) * (W - w + 1)).floor()
    x = resized_crop_flip(x, top, left, h, w, size, uniform(gen, B, lo, hi) < AUG['p_flip'])
    # RandomApply(ColorJitter(0.4, 0.4, 0.2, 0.1), p=0.8): factors U(1-j, 1+j), hue offset U(-j, j)
    u = uniform(gen, B, lo, hi, 4)  # (no torch.tensor(..., device) here: a blocking copy on CUDA)
    factors = torch.stack([(1.0 if i < 3 else 0.0) + j * (2 * u[:, i] - 1) for i, j in enumerate(AUG['jitter'])], 1)
    order = uniform(gen, B, lo, hi, 4).argsort(1)
    on = (uniform(gen, B, lo, hi) < AUG['p_jitter']).view(b, 1, 1, 1)
    x = torch.where(on, color_jitter(x, factors, order), x)
    on = (uniform(gen, B, lo, hi) < AUG['p_gray']).view(b, 1, 1, 1)  # RandomGrayscale(p=0.2)
    x = torch.where(on, grayscale(x).expand_as(x), x)
    # GaussianBlur with p 1.0 (view 0) / 0.1 (view 1), sigma U(0.1, 2.0) px at 224 px, scaled with
    # the view: at 32 px sigma <= 0.29 px, next to no blur (CIFAR runs of SimCLR leave blur out)
    s0, s1 = (s * size / 224 for s in AUG['blur_sigma'])
    sigma = s0 + (s1 - s0) * uniform(gen, B, lo, hi)
    on = (uniform(gen, B, lo, hi) < AUG['p_blur'][view]).view(b, 1, 1, 1)
    x = torch.where(on, gaussian_blur(x, sigma, 2 * round(size / 20) + 1), x)
    on = (uniform(gen, B, lo, hi) < AUG['p_solarize'][view]).view(b, 1, 1, 1)  # PIL solarize: threshold 128
    x = torch.where(on & (x >= 128), 255 - x, x)
    return normalize(x, mean, std)


def normalize(x, mean, std):  # 0..255 -> ToTensor + Normalize; mean/std (1, 3, 1, 1), built once
    return (x.float() / 255 - mean) / std


# -----------------------------------------------------------------------------
# Model: MoCo v3 (Chen, Xie & He 2021, Sec. 3 and Alg. 1) around vit.py's VisionTransformer.
def sincos_pos_embed(grid, dim, prefix):
    """vits.py build_2d_sincos_position_embedding: [sin, cos](row * w), [sin, cos](col * w) with
    w = 1 / 10000^(i / (dim/4)); zeros for the class token. (1, prefix + h*w, dim)."""
    rows, cols = torch.meshgrid(torch.arange(grid[0], dtype=torch.float32),
                                torch.arange(grid[1], dtype=torch.float32), indexing='ij')
    omega = 1.0 / 10000.0 ** (torch.arange(dim // 4, dtype=torch.float32) / (dim // 4))
    a, b = rows.flatten()[:, None] * omega, cols.flatten()[:, None] * omega
    pe = torch.cat([a.sin(), a.cos(), b.sin(), b.cos()], 1)
    return torch.cat([torch.zeros(prefix, dim), pe])[None]


def build_backbone(args):
    """The ViT without a head (num_classes=0: forward gives the head's input, the feature), built by
    train_cifar.build_model: the same geometry at 32 px (patch p/4) as the fine-tuning model."""
    if args.model not in vit.configs:
        raise UserError(f"unknown ViT config {args.model!r}; valid names: {', '.join(vit.configs)}")
    try:
        model = train_cifar.build_model(args.model, 0, args.model_kw, args.img_size)
    except train_cifar.UserError as e:
        raise UserError(str(e))
    dim = model.pos_embed.shape[-1]
    if args.pos_embed == 'sincos':
        if dim % 4:
            raise UserError(f'--pos-embed sincos needs a width divisible by 4, got dim={dim}')
        model.pos_embed.data.copy_(sincos_pos_embed(model.grid, dim, model.num_prefix_tokens))
        model.pos_embed.requires_grad_(False)
    if args.freeze_patch_embed:  # Sec. 4.2: a fixed random patch projection stabilises training
        model.patch_embed.requires_grad_(False)
    return model


class GlobalBatchNorm1d(nn.BatchNorm1d):
    """BatchNorm1d with statistics over the GLOBAL batch, as MoCo v3 gets by SyncBatchNorm (which
    runs on CUDA only): the batch is gathered with the autograd-aware all_gather (works on gloo
    too), normalised whole, and this rank's rows are kept; gradients flow back to every rank."""

    def forward(self, x):  # (b, C) -> (b, C)
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        r = dist.get_rank()
        return super().forward(torch.cat(dist_nn.all_gather(x)))[r * len(x):(r + 1) * len(x)]


def mlp(num_layers, in_dim, hidden, out_dim, last_bn=True):
    """moco/builder.py _build_mlp: Linear (no bias) -> BN -> ReLU, ..., last Linear -> BN without affine."""
    layers = []
    for i in range(num_layers):
        d1, d2 = in_dim if i == 0 else hidden, out_dim if i == num_layers - 1 else hidden
        layers.append(nn.Linear(d1, d2, bias=False))
        if i < num_layers - 1:
            layers += [GlobalBatchNorm1d(d2), nn.ReLU(inplace=True)]
        elif last_bn:  # SimCLR's design, gamma removed
            layers.append(GlobalBatchNorm1d(d2, affine=False))
    return nn.Sequential(*layers)


def concat_all_gather(t):
    """Every rank's keys in rank order (builder.py concat_all_gather): no gradient, keys are targets."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return t
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.cat(out)


def contrastive_loss(q, k, tau):
    """ctr(q, k) of MoCo v3 Alg. 1 / eq. (1), InfoNCE: -log exp(q.k+/tau) / sum_k- exp(q.k/tau) over
    the keys of the whole global batch (the positive of query i on rank r is key N*r + i),
    times 2*tau as builder.py does."""
    q, k = F.normalize(q.float(), dim=1), F.normalize(k.float(), dim=1)
    k = concat_all_gather(k)  # (W*N, C)
    logits = q @ k.T / tau  # (N, W*N)
    rank = dist.get_rank() if dist.is_initialized() else 0
    labels = torch.arange(len(q), device=q.device) + len(q) * rank
    return F.cross_entropy(logits, labels) * (2 * tau)


class MoCo(nn.Module):
    """f_q = backbone + projector, a predictor on top; f_k = EMA of f_q (no predictor)."""

    def __init__(self, backbone, proj_dim, proj_hidden, tau):
        super().__init__()
        width = backbone.pos_embed.shape[-1]
        self.base_encoder = nn.Sequential(backbone, mlp(3, width, proj_hidden, proj_dim))  # 3 layers for ViT
        self.predictor = mlp(2, proj_dim, proj_hidden, proj_dim)
        self.momentum_encoder = copy.deepcopy(self.base_encoder).requires_grad_(False)  # theta_k = theta_q at init
        self.tau = tau

    def forward(self, x1, x2, k1, k2):  # views (b, 3, S, S) and their keys f_k(x) (b, proj_dim)
        q1, q2 = self.predictor(self.base_encoder(x1)), self.predictor(self.base_encoder(x2))
        return contrastive_loss(q1, k2, self.tau) + contrastive_loss(q2, k1, self.tau)  # symmetrised

    @torch.no_grad()
    def update_momentum_encoder(self, m):  # theta_k <- m theta_k + (1 - m) theta_q (MoCo eq. (2))
        for pq, pk in zip(self.base_encoder.parameters(), self.momentum_encoder.parameters()):
            pk.copy_(pk * m + pq * (1 - m))


def lr_at(t, args):  # main_moco.py adjust_learning_rate; t in epochs (fractional)
    if t < args.warmup_epochs:
        return args.lr * t / args.warmup_epochs
    return args.lr * 0.5 * (1 + math.cos(math.pi * (t - args.warmup_epochs) / (args.epochs - args.warmup_epochs)))


def momentum_at(t, args):  # main_moco.py adjust_moco_momentum: moco_m at t = 0 -> 1 at the end
    return 1 - 0.5 * (1 + math.cos(math.pi * t / args.epochs)) * (1 - args.moco_m)


# -----------------------------------------------------------------------------
# Data. CIFAR: train_cifar.load_cifar, decoded once, on the device as uint8. imagenet: torchvision
# ImageFolder + DataLoader as in train_imagenet.py, decoded to uint8 squares; views on the device.
def load_data(args, device):
    if args.dataset != 'imagenet':
        try:
            train = train_cifar.load_cifar(args.data, args.dataset, True, args.train_subset)
            test = train_cifar.load_cifar(args.data, args.dataset, False, args.test_subset)
        except train_cifar.UserError as e:
            raise UserError(str(e))
        norm = (train_cifar.MEAN[args.dataset], train_cifar.STD[args.dataset])
        return dict(train=train[0].to(device), train_y=train[1].to(device), train_eval=train[0].to(device),
                    test=test[0].to(device), test_y=test[1].to(device), classes=train_cifar.NUM_CLASSES[args.dataset],
                    norm=norm)
    from torchvision import datasets
    from torchvision.transforms import v2
    side = round(args.img_size / 0.875)  # 256 for 224: train_imagenet's evaluation resize
    sets = {}
    for split in ('train', 'val'):
        try:
            sets[split] = datasets.ImageFolder(os.path.join(args.data, split))
        except (FileNotFoundError, RuntimeError) as e:
            raise UserError(f'--data {args.data}: {e}; expected DIR/train/<class>/*.JPEG and DIR/val/<class>/*.JPEG')
    if sets['train'].classes != sets['val'].classes:
        raise UserError(f'--data {args.data}: train and val have different class folders')
    train_eval, test = copy.copy(sets['train']), sets['val']
    sets['train'].transform = v2.Compose([v2.Resize(side), v2.CenterCrop(side), v2.PILToTensor()])
    train_eval.transform = test.transform = v2.Compose([v2.Resize(side), v2.CenterCrop(args.img_size),
                                                        v2.PILToTensor()])
    return dict(train=sets['train'], train_y=torch.tensor(sets['train'].targets, device=device),
                train_eval=train_eval, test=test, test_y=torch.tensor(test.targets, device=device),
                classes=len(test.classes), norm=(IMAGENET_MEAN, IMAGENET_STD))


# -----------------------------------------------------------------------------
# Evaluation on frozen features, exact under DDP: rank r embeds images [n*r/W, n*(r+1)/W) (no
# padding, no duplicates); the training features are gathered whole onto every rank.
@torch.no_grad()
def features(backbone, images, lo, hi, args, device, autocast, mean, std):
    backbone.eval()
    if isinstance(images, torch.Tensor):
        batches = (images[s:min(s + args.eval_batch_size, hi)] for s in range(lo, hi, args.eval_batch_size))
    else:
        batches = (x for x, _ in torch.utils.data.DataLoader(images, args.eval_batch_size, sampler=range(lo, hi),
                                                             num_workers=args.workers))
    out = [torch.zeros(0, backbone.pos_embed.shape[-1], device=device)]
    for x in batches:
        with autocast:
            out.append(backbone(normalize(x.to(device, non_blocking=True), mean, std)).float())
    backbone.train()
    return torch.cat(out)


def gather_rows(t, n, world):
    """The row blocks [n*r//W, n*(r+1)//W) of all ranks, in order (padded for all_gather, then trimmed)."""
    if world == 1:
        return t
    sizes = [n * (r + 1) // world - n * r // world for r in range(world)]
    buf = [t.new_empty(max(sizes), *t.shape[1:]) for _ in sizes]
    dist.all_gather(buf, torch.cat([t, t.new_zeros(max(sizes) - len(t), *t.shape[1:])]))
    return torch.cat([b[:s] for b, s in zip(buf, sizes)])


def knn_scores(train_f, train_y, test_f, classes, k, T):
    """Weighted k-NN (Wu et al. 2018; DINO eval_knn.py): the k most cosine-similar training
    features vote for their labels with weight exp(cos / T). (n_test, classes) vote shares."""
    train_f, test_f = F.normalize(train_f, dim=1), F.normalize(test_f, dim=1)
    chunk = max(1, 2 ** 25 // max(len(train_f), 1))  # similarity blocks of <= 128 MB
    out = []
    for s in range(0, len(test_f), chunk):
        sim, idx = (test_f[s:s + chunk] @ train_f.T).topk(min(k, len(train_f)), dim=1)
        votes = torch.zeros(len(sim), classes, device=sim.device).scatter_add_(1, train_y[idx], (sim / T).exp())
        out.append(votes / votes.sum(1, keepdim=True))
    return torch.cat(out) if out else torch.zeros(0, classes, device=test_f.device)


def linear_probe(train_f, train_y, classes, args):
    """A linear classifier on frozen features, standardised with the training mean/std (the
    affine-free BatchNorm of the MAE linear probe). MoCo v3 main_lincls.py: init N(0, 0.01),
    SGD momentum 0.9, no weight decay, cosine LR; here batch 256 over cached, unaugmented features.
    Deterministic given the seed. Returns (classifier, mu, sd)."""
    mu, sd = train_f.mean(0), train_f.std(0) + 1e-6
    g = torch.Generator(train_f.device).manual_seed(args.seed)
    clf = nn.Linear(train_f.shape[1], classes).to(train_f.device)
    nn.init.normal_(clf.weight, std=0.01, generator=g)
    nn.init.zeros_(clf.bias)
    opt = torch.optim.SGD(clf.parameters(), lr=args.linear_lr, momentum=0.9, weight_decay=0.0)
    n, bs = len(train_f), 256
    steps, step = args.linear_epochs * math.ceil(n / bs), 0
    with torch.enable_grad():
        for _ in range(args.linear_epochs):
            perm = torch.randperm(n, generator=g, device=train_f.device)
            for s in range(0, n, bs):
                for group in opt.param_groups:
                    group['lr'] = args.linear_lr * 0.5 * (1 + math.cos(math.pi * step / steps))
                idx = perm[s:s + bs]
                loss = F.cross_entropy(clf((train_f[idx] - mu) / sd), train_y[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                step += 1
    return clf, mu, sd


def evaluate(backbone, data, args, device, autocast, rank, world, epoch, step, t_start):
    """One eval row per protocol: top-1/5 (%), loss (cross-entropy; k-NN: -log of the true class's
    vote share, floored at 1e-6), correct and n counted over the whole test set, once each."""
    mean, std = (torch.tensor(v, device=device).view(1, 3, 1, 1) for v in data['norm'])
    n_tr, n_te = len(data['train_y']), len(data['test_y'])
    train_f = gather_rows(features(backbone, data['train_eval'], n_tr * rank // world, n_tr * (rank + 1) // world,
                                   args, device, autocast, mean, std), n_tr, world)
    lo, hi = n_te * rank // world, n_te * (rank + 1) // world
    test_f, test_y = features(backbone, data['test'], lo, hi, args, device, autocast, mean, std), data['test_y'][lo:hi]
    rows = []
    for protocol in args.eval:
        if protocol == 'knn':
            probs = knn_scores(train_f, data['train_y'], test_f, data['classes'], args.knn_k, args.knn_t)
            loss = -probs.gather(1, test_y[:, None]).clamp_min(1e-6).log()
        else:
            clf, mu, sd = linear_probe(train_f, data['train_y'], data['classes'], args)
            if world > 1:  # every rank trained the same probe; rank 0's copy makes that exact
                for t in clf.parameters():
                    dist.broadcast(t.data, 0)
            probs = clf((test_f - mu) / sd)  # logits
            loss = F.cross_entropy(probs, test_y, reduction='none')
        top5 = probs.topk(min(5, data['classes']), dim=1).indices
        stats = torch.stack([loss.sum().double(), (top5[:, 0] == test_y).sum().double(),
                             (top5 == test_y[:, None]).any(1).sum().double(),
                             torch.tensor(float(len(test_y)), dtype=torch.float64, device=device)])
        if world > 1:
            dist.all_reduce(stats)
        loss_sum, c1, c5, n = stats.tolist()
        rows.append(dict(kind='eval', protocol=protocol, epoch=epoch, step=step, loss=loss_sum / n,
                         top1=100 * c1 / n, top5=100 * c5 / n, correct=int(c1), n=int(n),
                         elapsed_s=time.time() - t_start))
    return rows


# -----------------------------------------------------------------------------
# Checkpoints: every file written atomically; one loader for weights.
RUN_FILES = ('last.pt', 'metrics.jsonl', 'args.json')


def save_atomic(path, obj):
    """Write PATH.tmp, then os.replace: a reader never sees half a file, a failed write keeps the old one."""
    tmp = Path(f'{path}.tmp')
    try:
        if path.suffix == '.jsonl':  # a list of rows, one JSON object per line, never NaN
            tmp.write_text(''.join(json.dumps(row, allow_nan=False) + '\n' for row in obj))
        elif path.suffix == '.json':
            tmp.write_text(json.dumps(obj, indent=2))
        else:
            torch.save(obj, tmp)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # disk full: OSError, or torch.save's RuntimeError
        tmp.unlink(missing_ok=True)
        why = e.strerror if isinstance(e, OSError) and e.strerror else ' '.join(str(e).split())
        raise UserError(f'could not write {path} ({why}); the previous {path.name} and last.pt are intact')


def read_checkpoint(path, flag):
    if not os.path.isfile(path):
        raise UserError(f'{flag} file not found: {path}')
    try:
        if str(path).endswith('.npz'):
            return {'model': vit.load_npz(path)}
        with torch.serialization.safe_globals([argparse.Namespace]):  # timm's train checkpoints hold one
            return torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:  # torch.load raises many types (UnpicklingError, RuntimeError, EOFError, ...)
        raise UserError(f'{flag} file {path} is not a readable checkpoint ({type(e).__name__}: '
                        f'{" ".join(str(e).split())[:200]})')


def load_weights(model, path, finetune=False):
    """--checkpoint for the backbone: our last.pt ('model'), a timm checkpoint ('state_dict') or a bare
    state_dict, or an official JAX .npz. DDP/compile prefixes are stripped and the classifier head
    dropped (the backbone has none); the rest loads strictly. finetune=True resamples pos_embed."""
    ckpt = read_checkpoint(path, '--checkpoint')
    sd = ckpt.get('model', ckpt.get('state_dict', ckpt)) if isinstance(ckpt, dict) else None
    if not isinstance(sd, dict):
        raise UserError(f'--checkpoint file {path} holds no state_dict')
    sd = dict(sd)
    for prefix in ('module.', '_orig_mod.'):
        nn.modules.utils.consume_prefix_in_state_dict_if_present(sd, prefix)
    sd = {k: v for k, v in sd.items() if not k.startswith('head.')}
    if finetune and 'pos_embed' in sd:
        sd['pos_embed'] = vit.resample_pos_embed(sd['pos_embed'], model.grid, model.num_prefix_tokens)
    try:
        model.load_state_dict(sd)
    except RuntimeError as e:
        raise UserError(f'--checkpoint {path} does not fit this --model: {" ".join(str(e).split())}')


def check_out(out, args, master):
    """Refuse an --out that holds another run, is a file, or is not writable: before any write."""
    if out.exists() and not out.is_dir():
        raise UserError(f'--out {out} is a file; pick a folder')
    held = [f for f in RUN_FILES if (out / f).exists()]
    resuming = args.resume is not None and Path(args.resume).resolve().parent == out.resolve()
    if held and not resuming and not args.overwrite:
        raise UserError(f'--out {out} already holds a run ({", ".join(held)}); use --resume {out / "last.pt"}, '
                        f'or pick another --out, or pass --overwrite')
    if master:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(f'--out {out} cannot be created ({e.strerror})')
        if not os.access(out, os.W_OK):
            raise UserError(f'--out {out} is not writable')


def epoch_seed(*key):
    """A 32-bit seed that depends on every item of key, e.g. (seed, epoch, rank), without collisions."""
    return int(np.random.SeedSequence([int(k) for k in key]).generate_state(1)[0])


fmt_time = train_cifar.fmt_time  # H:MM:SS from 1 h, else M:SS


# -----------------------------------------------------------------------------
def main(argv=None):
    args = get_args(argv)
    t_start = time.time()

    # --- distributed setup, the torchrun way ---------------------------------------------------
    rank, world = int(os.environ.get('RANK', 0)), int(os.environ.get('WORLD_SIZE', 1))
    local_rank, master = int(os.environ.get('LOCAL_RANK', 0)), int(os.environ.get('RANK', 0)) == 0
    if args.device == 'cuda' and not torch.cuda.is_available():
        raise UserError('--device cuda, but CUDA is not available')
    use_cuda = args.device == 'cuda' or (args.device == 'auto' and torch.cuda.is_available())
    device = torch.device('cuda', local_rank) if use_cuda else torch.device('cpu')
    if use_cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if args.batch_size % world:
        raise UserError(f'--batch-size {args.batch_size} (global) does not divide by the world size {world}')
    B, b = args.batch_size, args.batch_size // world  # global, per rank
    amp = args.amp if args.amp != 'auto' else ('bf16' if use_cuda else 'off')
    autocast = torch.autocast(device.type, dtype={'bf16': torch.bfloat16, 'fp16': torch.float16}.get(amp),
                              enabled=amp != 'off')
    log = print if master else (lambda *a, **k: None)  # only rank 0 prints

    # --- checkpoints read, output folder checked: before any write or process group -------------
    ckpt = read_checkpoint(args.resume, '--resume') if args.resume else None
    if ckpt is not None and not (isinstance(ckpt, dict) and {'moco', 'optimizer', 'epoch', 'args'} <= ckpt.keys()):
        raise UserError(f'--resume file {args.resume} is not a train_contrastive.py checkpoint (no moco, optimizer)')
    stored = ckpt['args'] if ckpt else None
    if args.checkpoint:  # --eval-only of our own checkpoint: its architecture, unless given
        peek = read_checkpoint(args.checkpoint, '--checkpoint')
        stored = peek['args'] if isinstance(peek, dict) and 'moco' in peek else None
    resolve_arch(args, stored)
    out = Path(args.out or (Path(args.resume).parent if args.resume else 'runs/contrastive'))
    if not args.eval_only:
        check_out(out, args, master)

    # --- model (the same initial weights on every rank) ----------------------------------------
    torch.manual_seed(args.seed)
    moco = MoCo(build_backbone(args), args.proj_dim, args.proj_hidden, args.tau)
    if ckpt is not None:
        try:
            moco.load_state_dict(ckpt['moco'])
        except RuntimeError as e:
            raise UserError(f'--resume file {args.resume} does not fit: {" ".join(str(e).split())}')
    moco.to(device)
    backbone = moco.base_encoder[0]  # the query encoder's ViT: what is evaluated and exported
    ddp = world > 1
    if ddp:
        dist.init_process_group('nccl' if use_cuda else 'gloo')

    # --- data ------------------------------------------------------------------------------------
    if ddp and not master:
        dist.barrier()  # rank 0 reads (and, for CIFAR, may download) first
    data = load_data(args, device)
    if ddp and master:
        dist.barrier()
    mean, std = (torch.tensor(v, device=device).view(1, 3, 1, 1) for v in data['norm'])

    if args.eval_only:
        if args.checkpoint:
            load_weights(backbone, args.checkpoint)
        rows = evaluate(backbone, data, args, device, autocast, rank, world, 0, 0, t_start)
        log(f'eval | {args.checkpoint or f"random init, seed {args.seed}"} | {args.model} on {args.dataset} | '
            + ' | '.join(f'{r["protocol"]} acc {r["top1"]:.2f}% ({r["correct"]}/{r["n"]}) loss {r["loss"]:.4f}'
                         for r in rows) + f' | world {world}', flush=True)
        if ddp:
            dist.barrier()
            dist.destroy_process_group()
        return

    n_train = len(data['train_y'])
    steps = n_train // B  # the last partial batch is dropped; the order changes every epoch
    if steps == 0:
        raise UserError(f'the training set has {n_train} images, fewer than --batch-size {B}')

    # --- optimizer, AMP, DDP ----------------------------------------------------------------------
    params = [p for p in moco.parameters() if p.requires_grad]  # f_q and the predictor; not f_k, not frozen ones
    if args.sam:
        opt = SAM(params, torch.optim.AdamW, rho=args.rho, adaptive=args.adaptive, lr=args.lr, weight_decay=args.wd)
    else:
        opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.wd)
    scaler = torch.amp.GradScaler(device.type, enabled=amp == 'fp16')  # bf16/fp32 need no loss scaling
    model = nn.parallel.DistributedDataParallel(moco, device_ids=[local_rank] if use_cuda else None) if ddp else moco

    start_epoch, step, history = 0, 0, []
    if ckpt is not None:
        try:
            opt.load_state_dict(ckpt['optimizer'])
            scaler.load_state_dict(ckpt['scaler'])
        except (ValueError, KeyError, RuntimeError) as e:
            raise UserError(f'--resume file {args.resume}: the optimizer state does not fit (saved '
                            f'with{"out" if args.sam else ""} --sam?): {e}')
        start_epoch, step, history = ckpt['epoch'], ckpt['step'], ckpt['history']
        changed = {k: (v, getattr(args, k)) for k, v in stored.items() if k not in ('resume', 'out', 'overwrite')
                   and getattr(args, k, None) != v}
        log(f'resumed {args.resume} at epoch {start_epoch}, step {step}'
            + (f'; flags changed since (saved, now): {changed}' if changed else ''))
    resolved = dict(vars(args), world_size=world, per_rank_batch=b, amp=amp, device=str(device), n_train=n_train,
                    n_test=len(data['test_y']), steps_per_epoch=steps, num_classes=data['classes'],
                    torch=str(torch.__version__))
    if master:
        save_atomic(out / 'args.json', resolved)
        n_bb = sum(p.numel() for p in backbone.parameters())
        print(f'{args.model} {args.model_kw or ""} ({n_bb:,} backbone params, {sum(p.numel() for p in params):,} '
              f'trained) MoCo v3 on {args.dataset}: {n_train:,} train / {len(data["test_y"]):,} test images | '
              f'{args.epochs} epochs x {steps} steps of {B} ({world} x {b}) | AdamW lr {args.lr:.3g} wd {args.wd} '
              f'warmup {args.warmup_epochs} | tau {args.tau} m {args.moco_m} -> 1'
              + (f' | SAM rho {args.rho}{" adaptive" if args.adaptive else ""}' if args.sam else '')
              + f' | amp {amp} | {device} | out {out}', flush=True)

    # --- training loop ------------------------------------------------------------------------------
    gen = torch.Generator(device)
    total, run_t0, run_steps = args.epochs * steps, time.time(), 0
    never = 2 ** 62
    bad = torch.full((), never, dtype=torch.long, device=device)  # the first step whose loss was not finite
    for epoch in range(start_epoch, args.epochs):
        # Every draw of this epoch derives from (seed, epoch): resume at an epoch boundary is exact.
        # Data order and views are the same on every rank (rank r takes its slice of each global
        # batch); anything else (dropout, off by default) differs per rank.
        torch.manual_seed(epoch_seed(args.seed, epoch, rank))
        gen.manual_seed(epoch_seed(args.seed, epoch))
        perm = torch.randperm(n_train, generator=torch.Generator().manual_seed(epoch_seed(args.seed, epoch)))
        loader = None
        if args.dataset == 'imagenet':
            batches = [perm[i * B + rank * b:i * B + (rank + 1) * b].tolist() for i in range(steps)]
            loader = iter(torch.utils.data.DataLoader(data['train'], batch_sampler=batches,
                                                      num_workers=args.workers, pin_memory=use_cuda))
        perm = perm.to(device)
        moco.train()
        epoch_loss, row_loss = (torch.zeros((), dtype=torch.float64, device=device) for _ in range(2))
        t0 = last_t = time.time()
        last_i = 0
        for i in range(steps):
            lr = lr_at(epoch + i / steps, args)
            for group in opt.param_groups:
                group['lr'] = lr
            if loader:
                x = next(loader)[0].to(device, non_blocking=True)
            else:  # rank r's slice of global batch i
                x = data['train'][perm[i * B + rank * b:i * B + (rank + 1) * b]]
            x1 = moco_view(x, gen, B, rank * b, (rank + 1) * b, 0, args.img_size, args.crop_min, mean, std)
            x2 = moco_view(x, gen, B, rank * b, (rank + 1) * b, 1, args.img_size, args.crop_min, mean, std)
            with torch.no_grad(), autocast:  # keys: targets from f_k, once per step (both SAM passes)
                k1, k2 = moco.momentum_encoder(x1), moco.momentum_encoder(x2)

            if args.sam:  # Foret et al. Alg. 1 via sam.py, as train_cifar.py; eps-hat per rank (m-sharpness)
                with first_pass(model):
                    with autocast:
                        loss = model(x1, x2, k1, k2)
                    scaler.scale(loss).backward()
                opt.first_step(zero_grad=True)  # w <- w + eps-hat
                with second_pass(model):  # the same views and keys at w + eps-hat
                    with autocast:
                        loss_sam = model(x1, x2, k1, k2)
                    scaler.scale(loss_sam).backward()
            else:
                with autocast:
                    loss = model(x1, x2, k1, k2)
                scaler.scale(loss).backward()
            if args.clip_grad > 0:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(params, args.clip_grad)
            scaler.step(opt)  # with SAM: w restored exactly, then the AdamW step with g_SAM
            scaler.update()
            opt.zero_grad(set_to_none=True)
            # f_k follows the updated (restored, then stepped) f_q, once per step. MoCo v3 updates at the
            # start of the next step with that step's m: the same sequence of updates.
            moco.update_momentum_encoder(momentum_at(epoch + (i + 1) / steps, args))
            step += 1
            run_steps += 1
            loss = loss.detach().double()
            bad = torch.where((bad == never) & ~torch.isfinite(loss), step, bad)  # no host sync
            epoch_loss += loss
            row_loss += loss

            # --- a train row every --log-every steps and at the end of the epoch ---------------------
            if i + 1 == steps or (args.log_every and (i + 1) % args.log_every == 0):
                if ddp:
                    dist.all_reduce(row_loss)
                    dist.all_reduce(bad, op=dist.ReduceOp.MIN)
                if bad.item() != never:
                    s = bad.item()
                    raise UserError(f'the loss became non-finite at epoch {(s - 1) // steps + 1}, step {s}: '
                                    f'diverged. ' + (f'{out / "last.pt"} (epoch {epoch}) is kept as the last good '
                                    f'checkpoint' if (out / 'last.pt').exists() else 'no checkpoint was written')
                                    + '; try a lower --lr or --clip-grad 1')
                now = time.time()
                history.append(dict(kind='train', epoch=epoch + 1, step=step, lr=lr,
                                    loss=row_loss.item() / world / (i + 1 - last_i),
                                    img_per_s=(i + 1 - last_i) * B / (now - last_t), elapsed_s=now - t_start))
                if master and i + 1 < steps:
                    h = history[-1]
                    print(f'ep {epoch + 1}/{args.epochs} step {i + 1}/{steps} | loss {h["loss"]:.4f} | lr {lr:.2e} | '
                          f'{h["img_per_s"]:,.0f} img/s | eta {fmt_time((now - run_t0) / run_steps * (total - step))}',
                          flush=True)
                if master:
                    save_atomic(out / 'metrics.jsonl', history)
                row_loss.zero_()
                last_t, last_i = now, i + 1

        # --- end of epoch: exact evaluation on frozen features, checkpoint ---------------------------
        if ddp:
            dist.all_reduce(epoch_loss)
        train_s = time.time() - t0
        due = epoch + 1 == args.epochs or (args.eval_every and (epoch + 1) % args.eval_every == 0)
        evals = evaluate(backbone, data, args, device, autocast, rank, world, epoch + 1, step, t_start) if due else []
        history += evals
        eta = (time.time() - run_t0) / run_steps * (total - step)
        if master:
            print(f'ep {epoch + 1}/{args.epochs} | train loss {epoch_loss.item() / world / steps:.4f} | '
                  + ''.join(f'{r["protocol"]} acc {r["top1"]:.2f}% | ' for r in evals)
                  + f'{train_s:.1f} s | eta {fmt_time(eta)}', flush=True)
            save_atomic(out / 'metrics.jsonl', history)
            num_classes, width = data['classes'], backbone.pos_embed.shape[-1]
            save_atomic(out / 'last.pt', {
                # the backbone under vit.py's (timm's) keys, with the zero head vit.py itself starts from:
                # train_cifar.py --pretrained (or plain load_state_dict) takes it as it is
                'model': {**backbone.state_dict(), 'head.weight': torch.zeros(num_classes, width),
                          'head.bias': torch.zeros(num_classes)},
                'moco': moco.state_dict(), 'optimizer': opt.state_dict(), 'scaler': scaler.state_dict(),
                'epoch': epoch + 1, 'step': step, 'history': history, 'args': vars(args), 'resolved': resolved})
        if args.stop_after_epoch and epoch + 1 == args.stop_after_epoch and epoch + 1 < args.epochs:
            if master:
                print(f'stopped after epoch {epoch + 1} (--stop-after-epoch); continue with --resume {out / "last.pt"}',
                      flush=True)
            break
    else:  # --- one-line summary, only for a run that reached --epochs ------------------------------
        if master:
            parts = []
            for protocol in args.eval:
                accs = [r['top1'] for r in history if r['kind'] == 'eval' and r['protocol'] == protocol]
                if accs:
                    parts.append(f'{protocol} acc {accs[-1]:.2f}% (best {max(accs):.2f}%)')
            print(f'done | {args.model} on {args.dataset} | epoch {args.epochs}/{args.epochs} | ' + ' | '.join(parts)
                  + f' | {fmt_time(time.time() - t_start)} wall | {out / "last.pt"}', flush=True)
    if ddp:
        dist.barrier()  # rank 0 may still be saving; leave together
        dist.destroy_process_group()


def interrupted_message():
    try:
        args = get_args()
        last = Path(args.out or (Path(args.resume).parent if args.resume else 'runs/contrastive')) / 'last.pt'
    except UserError:
        return 'train_contrastive.py: interrupted'
    if last.exists():
        return f'train_contrastive.py: interrupted; the last checkpoint is {last}: continue with --resume {last}'
    return 'train_contrastive.py: interrupted before the first checkpoint was written'


if __name__ == '__main__':
    try:
        main()
    except UserError as e:
        sys.exit(f'train_contrastive.py: error: {e}')
    except KeyboardInterrupt:
        print(interrupted_message(), file=sys.stderr)
        sys.exit(130)
