"""Train any model of this repo on CIFAR-10/100, with or without SAM, on one device or with torchrun.

    python train_cifar.py                         # ConvMixer-256/8 (k5, p2), CIFAR-10, 25 epochs
    torchrun --nproc_per_node 8 train_cifar.py --model vit_s4_cifar --aug basic --sam --rho 0.05

The defaults are the run in the README of locuslab/convmixer-cifar10 (Trockman & Kolter), which
reports ~92.5% test accuracy after 25 epochs (its log: 92.60%, 2080Ti, ~42.6 s/epoch):
    python train.py --lr-max=0.05 --ra-n=2 --ra-m=12 --wd=0.005 --scale=1.0 --jitter=0 --reprob=0
Its longer run (>94%, same README) is here `--jitter 0.2 --reprob 0.2 --epochs 100`. That
script's own argparse defaults differ from the README run (lr-max 0.01, wd 0.01, scale 0.75,
ra-n 1, ra-m 8, jitter 0.1, reprob 0.25); every help string below names both.

Why it is fast: the reference pipeline decodes and augments with PIL in two loader workers
(~900 img/s per core), so its GPU waits. Here the data set is decoded once into uint8 tensors
that live on the training device (150 MB for CIFAR), and every augmentation runs there on the
whole batch at once, with its own random draw per sample (crop, flip, RandAugment op and sign,
jitter factors and order, erasing box). The inner loop has no host syncs except the logging
every --log-every steps (and the one per step SAM's gradient norm and fp16 loss scaling need).

Distributed: torchrun sets RANK/LOCAL_RANK/WORLD_SIZE; nccl on CUDA, gloo on CPU. The global
batch and the LR are the flags' whatever the world size. Evaluation is exact: each test image is
counted once. Rank 0 prints and saves.

Deviations from the reference script, all deliberate:
  - augmentations are torchvision's tensor (v2) ops re-written batched, not its PIL ops (pixel
    values can differ by rounding, and RandAugment/ColorJitter draw per sample as before);
  - the last partial training batch is dropped (97 steps of 512 per CIFAR epoch, not 98);
  - autocast is bf16 on CUDA by default (the reference: fp16 + GradScaler, here --amp fp16);
  - CIFAR-100 is normalised with its own mean/std.
"""
import argparse
import ast
import json
import math
import os
import pickle
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import convmixer
import mixer
import vit

NUM_CLASSES = {'cifar10': 10, 'cifar100': 100}
# Per-channel mean/std of the training images (CIFAR-10's are the locuslab script's).
MEAN = {'cifar10': (0.4914, 0.4822, 0.4465), 'cifar100': (0.5071, 0.4865, 0.4409)}
STD = {'cifar10': (0.2471, 0.2435, 0.2616), 'cifar100': (0.2673, 0.2564, 0.2762)}
MODEL_FILES = (convmixer, vit, mixer)


# -----------------------------------------------------------------------------
# Arguments. Defaults = the locuslab/convmixer-cifar10 README run (see the module docstring).
def get_args(argv=None):
    p = argparse.ArgumentParser(
        description='Train a ConvMixer / ViT / MLP-Mixer / ResNet-18 on CIFAR-10/100, optionally '
                    'with SAM. Defaults = the locuslab/convmixer-cifar10 README run (~92.5% in 25 '
                    'epochs).', formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group('data')
    g.add_argument('--data', default='./data', metavar='DIR',
                   help="torchvision's layout (DIR/cifar-10-batches-py or DIR/cifar-100-python, "
                        "downloaded there if absent) or an image folder: DIR/train/<class>/*, "
                        "DIR/test/<class>/*")
    g.add_argument('--dataset', default='cifar10', choices=sorted(NUM_CLASSES),
                   help='10 or 100 classes (the fine labels)')
    g.add_argument('--train-subset', type=int, default=0, metavar='N',
                   help='for quick tests/debugging: train on the first N/classes images of each '
                        'class (deterministic, class-balanced); 0 = all')
    g.add_argument('--test-subset', type=int, default=0, metavar='N',
                   help='for quick tests/debugging: evaluate on a class-balanced N test images; 0 = all')
    g = p.add_argument_group('model')
    g.add_argument('--model', default='convmixer_256_8',
                   help='a config name from convmixer.py, vit.py or mixer.py, or resnet18. ImageNet '
                        'configs are resized for 32 px: ViT/Mixer patch p -> p/4 (16 -> 4: 8x8 '
                        'tokens), ConvMixer patch p -> p/7 (7 -> 1, 14 -> 2: the same patch grid as '
                        'at 224 px); num_classes always comes from --dataset')
    g.add_argument('--model-kw', nargs='+', action='extend', default=[], metavar='KEY=VALUE',
                   help='constructor overrides applied last, e.g. --model-kw dim=128 depth=4 '
                        'kernel_size=5 patch_size=2 (values are Python literals)')
    g = p.add_argument_group('optimisation')
    g.add_argument('--epochs', type=int, default=25, help='training epochs')
    g.add_argument('--batch-size', type=int, default=512,
                   help='global batch size in images, split evenly over the ranks')
    g.add_argument('--lr-max', type=float, default=0.05,
                   help='peak AdamW learning rate of the one-cycle schedule: 0 -> lr-max at 40%% of '
                        'training -> lr-max/20 at 80%% -> 0, set every step (README run 0.05; '
                        'locuslab argparse default 0.01)')
    g.add_argument('--wd', type=float, default=0.005,
                   help='AdamW decoupled weight decay (README run 0.005; locuslab default 0.01)')
    g.add_argument('--label-smoothing', type=float, default=0.0, help='cross-entropy label smoothing')
    g.add_argument('--clip-norm', type=float, default=0.0,
                   help='clip the global gradient L2 norm to this (with SAM: the second gradient); '
                        '0 = off (locuslab --clip-norm clips at 1.0)')
    g.add_argument('--sam', action='store_true',
                   help='Sharpness-Aware Minimization (Foret et al. 2021) around AdamW, via sam.py')
    g.add_argument('--rho', type=float, default=0.05, help='SAM neighbourhood radius rho')
    g.add_argument('--adaptive', action='store_true', help='ASAM (Kwon et al. 2021): eps scaled by |w|')
    g = p.add_argument_group('augmentation (on the training device, per-sample random)')
    g.add_argument('--aug', default='strong', choices=['strong', 'basic'],
                   help="strong: locuslab's RandomResizedCrop(--scale) + flip + RandAugment(--ra-n, "
                        "--ra-m) + ColorJitter(--jitter) + RandomErasing(--reprob); basic: the SAM "
                        "paper's CIFAR setting, 4-px zero-padded random crop + flip only")
    g.add_argument('--scale', type=float, default=1.0,
                   help='RandomResizedCrop minimum area fraction, square crops; 1.0 = no crop '
                        '(README run 1.0; locuslab default 0.75)')
    g.add_argument('--ra-n', type=int, default=2,
                   help='RandAugment ops per image (README run 2; locuslab default 1); 0 = off')
    g.add_argument('--ra-m', type=int, default=12,
                   help='RandAugment magnitude bin, 0-30 (README run 12; locuslab default 8)')
    g.add_argument('--jitter', type=float, default=0.0,
                   help='ColorJitter brightness = contrast = saturation strength '
                        '(README run 0; locuslab default 0.1)')
    g.add_argument('--reprob', type=float, default=0.0,
                   help='RandomErasing probability (README run 0; locuslab default 0.25)')
    g = p.add_argument_group('system')
    g.add_argument('--device', default='auto', choices=['auto', 'cuda', 'cpu'],
                   help='auto = cuda if available (under torchrun: cuda:LOCAL_RANK)')
    g.add_argument('--amp', default='auto', choices=['auto', 'bf16', 'fp16', 'off'],
                   help='autocast dtype; auto = bf16 on CUDA, off on CPU; fp16 adds a GradScaler')
    g.add_argument('--channels-last', action='store_true', help='NHWC memory format (faster convs on GPU)')
    g.add_argument('--compile', action='store_true', help='torch.compile the model')
    g.add_argument('--seed', type=int, default=0, help='seeds init, data order and augmentation')
    g.add_argument('--eval-batch-size', type=int, default=1024, help='images per rank per eval step')
    g.add_argument('--log-every', type=int, default=50, help='progress line every N steps; 0 = per epoch only')
    g = p.add_argument_group('checkpoints')
    g.add_argument('--out', default='runs/cifar', metavar='DIR',
                   help='receives last.pt, metrics.jsonl and args.json, each written atomically every epoch')
    g.add_argument('--resume', default=None, metavar='PATH',
                   help='continue from a last.pt (with --eval-only: the checkpoint to evaluate)')
    g.add_argument('--eval-only', action='store_true',
                   help='evaluate the --resume checkpoint on the test set and exit')
    g.add_argument('--stop-after-epoch', type=int, default=0, metavar='K',
                   help='for testing/preemption: save epoch K and exit; continue with --resume DIR/last.pt')
    args = p.parse_args(argv)

    # Validate now: a user error is a message and exit code 2, never a traceback.
    for name in ('epochs', 'batch_size', 'eval_batch_size'):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    for name in ('train_subset', 'test_subset', 'stop_after_epoch', 'log_every', 'ra_n'):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not 0 <= args.ra_m <= 30:
        p.error(f'--ra-m must be a magnitude bin in 0..30, got {args.ra_m}')
    if not 0 < args.scale <= 1:
        p.error(f'--scale must be in (0, 1], got {args.scale}')
    if not (0 <= args.reprob <= 1 and 0 <= args.jitter and 0 <= args.label_smoothing < 1
            and args.lr_max >= 0 and args.wd >= 0 and args.rho >= 0 and args.clip_norm >= 0):
        p.error('--reprob must be in [0, 1], --label-smoothing in [0, 1), and --jitter, --lr-max, '
                '--wd, --rho, --clip-norm non-negative')
    if args.eval_only and not args.resume:
        p.error('--eval-only needs the checkpoint to evaluate: --resume PATH')
    try:
        args.model_kw_dict = parse_model_kw(args.model_kw)
    except ValueError as e:
        p.error(str(e))
    return args


def parse_model_kw(items):
    """['dim=128', 'act=gelu'] -> {'dim': 128, 'act': 'gelu'} (Python literals, else strings)."""
    out = {}
    for item in items:
        key, sep, value = item.partition('=')
        if not sep or not key.isidentifier():
            raise ValueError(f'--model-kw expects KEY=VALUE, got {item!r}')
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


class UserError(Exception):
    """A mistake in the command line or the files it names: printed without a traceback."""


# -----------------------------------------------------------------------------
# Data: decoded once into uint8 tensors (N, 3, 32, 32) and int64 labels (N,).
IMAGE_EXTENSIONS = ('.jpg', '.jpeg', '.png', '.bmp', '.ppm', '.webp')
TV_FOLDER = {'cifar10': 'cifar-10-batches-py', 'cifar100': 'cifar-100-python'}
TV_FILES = {'cifar10': ([f'data_batch_{i}' for i in range(1, 6)], ['test_batch']),
            'cifar100': (['train'], ['test'])}


def no_data_message(root, dataset, why):
    name = {'cifar10': 'CIFAR-10', 'cifar100': 'CIFAR-100'}[dataset]
    url = {'cifar10': 'https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz',
           'cifar100': 'https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz'}[dataset]
    return (f'no {name} data in {root} ({why}). --data must point at one of:\n'
            f"  1. torchvision's layout: {root}/{TV_FOLDER[dataset]}/ -- downloaded there "
            f'automatically when online, or fetch {url} and extract it into {root}\n'
            f'  2. an image-folder layout: {root}/train/<class>/*.jpg and {root}/test/<class>/*.jpg, '
            f'e.g. tar -xzf ../shared/data/cifar10-jpeg.tar.gz -C /tmp and --data /tmp/cifar10')


def find_layout(root, dataset, download):
    """('folder', dir) or ('torchvision', dir); downloads torchvision's copy if nothing is there."""
    root = Path(root)
    for d in (root, root / dataset):  # --data DIR or its parent
        if (d / 'train').is_dir() and (d / 'test').is_dir():
            return 'folder', d
    if (root / TV_FOLDER[dataset]).is_dir():
        return 'torchvision', root
    if not download:
        raise UserError(no_data_message(root, dataset, 'nothing found; another rank downloads'))
    try:
        import torchvision  # the download (and its md5 check) is torchvision's
        cls = {'cifar10': torchvision.datasets.CIFAR10, 'cifar100': torchvision.datasets.CIFAR100}
        cls[dataset](str(root), train=True, download=True)
    except Exception as e:  # offline: URLError / OSError; a bad archive: RuntimeError
        raise UserError(no_data_message(root, dataset, f'nothing found and the download failed: {e}'))
    return 'torchvision', root


def read_torchvision_split(root, dataset, train):
    """The official python pickles: dicts with 'data' (N, 3072) uint8 and '(fine_)labels'."""
    xs, ys = [], []
    for name in TV_FILES[dataset][0 if train else 1]:
        path = Path(root) / TV_FOLDER[dataset] / name
        try:
            with open(path, 'rb') as f:
                d = pickle.load(f, encoding='latin1')
            xs.append(np.asarray(d['data'], dtype=np.uint8).reshape(-1, 3, 32, 32))
            ys.append(np.asarray(d['labels' if dataset == 'cifar10' else 'fine_labels']))
        except (OSError, pickle.UnpicklingError, EOFError, KeyError, ValueError) as e:
            raise UserError(f'cannot read {path}: {e!r}; delete {path.parent} to re-download')
    return np.concatenate(xs), np.concatenate(ys)


def list_image_folder(split_dir):
    """Sorted class folders (their index = the label) and the sorted image files in each."""
    classes = sorted(d.name for d in Path(split_dir).iterdir() if d.is_dir())
    files, labels = [], []
    for label, c in enumerate(classes):
        fs = sorted(f for f in (Path(split_dir) / c).iterdir() if f.suffix.lower() in IMAGE_EXTENSIONS)
        files += fs
        labels += [label] * len(fs)
    return classes, files, np.asarray(labels, dtype=np.int64)


def decode_images(files):
    """Decode image files into one uint8 (N, 3, 32, 32) array (PIL in a thread pool)."""
    from concurrent.futures import ThreadPoolExecutor
    from PIL import Image

    def decode(path):
        with Image.open(path) as im:
            a = np.asarray(im.convert('RGB'))
        if a.shape != (32, 32, 3):
            raise UserError(f'{path} is {a.shape[1]}x{a.shape[0]} px; CIFAR images are 32x32')
        return a

    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        images = list(pool.map(decode, files, chunksize=256))
    return np.stack(images).transpose(0, 3, 1, 2).copy() if images else np.zeros((0, 3, 32, 32), np.uint8)


def balanced_subset(labels, n, num_classes):
    """Indices of the first n // C (+1 for the first n % C classes) images of each class, in order."""
    labels = np.asarray(labels)
    picked = []
    for c in range(num_classes):
        quota = n // num_classes + (c < n % num_classes)
        idx = np.flatnonzero(labels == c)[:quota]
        if len(idx) < quota:
            raise UserError(f'subset of {n} images needs {quota} of class {c}, the data has {len(idx)}')
        picked.append(idx)
    return np.sort(np.concatenate(picked))


def load_cifar(root, dataset, train, subset=0, download=True):
    """(uint8 images (N, 3, 32, 32), int64 labels (N,)) from either layout; subset > 0 keeps a
    class-balanced deterministic subset (and decodes only that in the image-folder layout)."""
    num_classes = NUM_CLASSES[dataset]
    kind, root = find_layout(root, dataset, download)
    if kind == 'torchvision':
        x, y = read_torchvision_split(root, dataset, train)
        if subset:
            keep = balanced_subset(y, subset, num_classes)
            x, y = x[keep], y[keep]
    else:
        split = root / ('train' if train else 'test')
        classes, files, y = list_image_folder(split)
        if len(classes) != num_classes:
            raise UserError(f'{split} has {len(classes)} class folders, --dataset {dataset} has '
                            f'{num_classes} classes')
        if subset:
            keep = balanced_subset(y, subset, num_classes)
            files, y = [files[i] for i in keep], y[keep]
        if not files:
            raise UserError(f'no images ({", ".join(IMAGE_EXTENSIONS)}) under {split}/<class>/')
        x = decode_images(files)
    if y.min() < 0 or y.max() >= num_classes:
        raise UserError(f'labels in {root} fall outside 0..{num_classes - 1}')
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.uint8)), torch.from_numpy(y.astype(np.int64))


# -----------------------------------------------------------------------------
# Augmentation on the training device. Images stay float32 holding integer values 0..255 between
# ops, rounded/truncated as torchvision does on uint8 tensors, so each op equals its
# torchvision.transforms.v2.functional counterpart (tests/test_train_cifar.py checks that). Every
# op takes per-sample parameters, and a sample that did not draw an op gets that op's identity
# parameters (factor 1, 8 bits, threshold 256, the identity matrix), which leave it bit-exact. So
# on the GPU no op needs the list of samples that drew it: no boolean indexing, no host sync. (On
# the CPU, where a sync is free, apply_ra_ops runs each RandAugment op on its own subset instead.)

def blend(x, other, f, one_minus_f):
    """torchvision's _blend: f*x + (1-f)*other, clamped, truncated to an integer as uint8 does.
    (1 - f) comes in separately, computed in float64 like torchvision's Python scalar. After the
    clamp to [0, 255] truncation is floor: floor_ is vectorised on CPU, trunc_ is not (~20x slower)."""
    return torch.addcmul(x * f, other, one_minus_f).clamp_(0, 255).floor_()  # the same rounding as add_(alpha=)


def grayscale(x):  # (B, 3, H, W) -> (B, 1, H, W), ITU-R 601-2 luma, floored as for uint8
    r, g, b = x.unbind(1)
    return r.mul(0.2989).add_(g, alpha=0.587).add_(b, alpha=0.114).floor_().unsqueeze(1)  # torchvision's order


def adjust_brightness(x, f, one_minus_f):
    return (x * f).clamp_(0, 255).floor_()  # blend with black


def adjust_saturation(x, f, one_minus_f):
    return blend(x, grayscale(x), f, one_minus_f)


def adjust_contrast(x, f, one_minus_f):
    return blend(x, grayscale(x).mean(dim=(1, 2, 3), keepdim=True), f, one_minus_f)


def adjust_sharpness(x, f, one_minus_f):
    """Blend with PIL's SMOOTH filter (3x3: centre 5/13, the rest 1/13); border pixels stay."""
    c = x[:, :, 1:-1, 1:-1]
    rows = x[:, :, :, :-2] + x[:, :, :, 1:-1] + x[:, :, :, 2:]  # 3x3 box sum as shifted sums (faster
    box = rows[:, :, :-2] + rows[:, :, 1:-1] + rows[:, :, 2:]   # than conv2d on CPU); integers: exact
    blurred = ((box + 4 * c) / 13).round_()  # (8 neighbours + 5 * centre) / 13
    out = x.clone()
    out[:, :, 1:-1, 1:-1] = torch.addcmul(c, blurred - c, one_minus_f)
    return out.clamp_(0, 255).floor_()


def posterize(x, bits):  # bits: (B, 1, 1, 1) floats in 0..8; 8 = identity
    step = torch.exp2(8 - bits)
    return (x / step).floor_() * step


def solarize(x, threshold):  # threshold: (B, 1, 1, 1); 256 = identity
    return torch.where(x >= threshold, 255 - x, x)


def autocontrast(x):
    """Stretch each channel to 0..255 (a constant channel is left alone)."""
    lo, hi = x.amin(dim=(2, 3), keepdim=True), x.amax(dim=(2, 3), keepdim=True)
    flat = hi == lo
    inv_scale = torch.where(flat, 1.0, (hi - lo) * (1.0 / 255))
    return ((x - torch.where(flat, 0.0, lo)) / inv_scale).clamp_(0, 255).floor_()


def equalize(x):
    """PIL's histogram equalisation per channel, batched: lut[i] = (cdf[i-1] + step//2) // step."""
    B, C, H, W = x.shape
    # one histogram of B*C*256 bins: channel i's pixel value v counts in bin 256*i + v
    bins = (x.reshape(B * C, H * W).int() + torch.arange(0, B * C * 256, 256, dtype=torch.int32,
                                                          device=x.device)[:, None]).view(-1)
    ones = torch.ones((), dtype=torch.int32, device=x.device).expand(bins.shape)
    hist = torch.zeros(B * C * 256, dtype=torch.int32, device=x.device).index_add_(0, bins, ones)
    hist = hist.view(B * C, 256)  # (torch.bincount would be faster on CPU but syncs the host on CUDA)
    cdf = hist.cumsum(1)
    last = cdf.argmax(1, keepdim=True)  # the last non-empty bin: the first to reach the total
    step = ((H * W - hist.gather(1, last)) // 255).double()  # (B*C, 1): PIL's step
    # lut[i] = (cdf[i-1] + step // 2) // step, in float64 (exact for these integers; int64 division
    # is not vectorised on CPU)
    lut = (cdf - hist).double().add_((step / 2).floor_()).div_(step.clamp(min=1)).floor_().clamp_(0, 255)
    lut = torch.where(step > 0, lut, torch.arange(256, dtype=lut.dtype, device=x.device))  # step 0: identity
    return lut.to(x.dtype).view(-1).index_select(0, bins).view(B, C, H, W)


def affine_grid_sample(x, matrix, mode='nearest'):
    """Sample x through per-sample inverse affine maps (B, 2, 3) that take output pixel centres to
    input coordinates, both centred on the image middle (torchvision's convention); zero fill."""
    B, C, H, W = x.shape
    xs = torch.arange(W, dtype=x.dtype, device=x.device) - (W - 1) / 2
    ys = torch.arange(H, dtype=x.dtype, device=x.device) - (H - 1) / 2
    px, py = xs.expand(H, W).reshape(-1), ys[:, None].expand(H, W).reshape(-1)  # (H*W,) pixel centres
    # (No torch.tensor(..., device=cuda) in here or anywhere in the step: that copy syncs the host.)
    theta = torch.stack([matrix[:, 0] / (W / 2), matrix[:, 1] / (H / 2)], 1).unsqueeze(-1)  # (B, 2, 3, 1), scaled like torchvision
    # torchvision's grid is [x, y, 1] @ theta; the same products and sums in the same order, laid
    # out planar (B, 2, H*W) and viewed as (B, H, W, 2): bit-identical, ~4x faster on CPU than bmm.
    grid = px * theta[:, :, 0] + py * theta[:, :, 1] + theta[:, :, 2]  # normalised input coordinates
    grid = grid.view(B, 2, H, W).permute(0, 2, 3, 1)
    return F.grid_sample(x, grid, mode=mode, padding_mode='zeros', align_corners=False).round_()


# RandAugment (Cubuk et al. 2020) as in torchvision: 14 ops, each drawn uniformly, at one magnitude
# bin m of 31; signed ops flip their sign with probability 1/2.
RA_OPS = ('Identity', 'ShearX', 'ShearY', 'TranslateX', 'TranslateY', 'Rotate', 'Brightness', 'Color',
          'Contrast', 'Sharpness', 'Posterize', 'Solarize', 'AutoContrast', 'Equalize')
RA_SIGNED = ('ShearX', 'ShearY', 'TranslateX', 'TranslateY', 'Rotate', 'Brightness', 'Color', 'Contrast',
             'Sharpness')


def ra_magnitudes(m, size=32, num_bins=31):
    """Each op's unsigned magnitude at bin m, computed like torchvision's table (in float32)."""
    lin = lambda hi: torch.linspace(0.0, hi, num_bins)[m].item()
    return {'Identity': 0.0, 'ShearX': lin(0.3), 'ShearY': lin(0.3),
            'TranslateX': float(int(lin(150.0 / 331.0 * size))), 'TranslateY': float(int(lin(150.0 / 331.0 * size))),
            'Rotate': lin(30.0), 'Brightness': lin(0.9), 'Color': lin(0.9), 'Contrast': lin(0.9),
            'Sharpness': lin(0.9),
            'Posterize': float((8 - (torch.arange(num_bins) / ((num_bins - 1) / 4))).round().int()[m]),
            'Solarize': 255.0 * torch.linspace(1.0, 0.0, num_bins)[m].item(),
            'AutoContrast': 0.0, 'Equalize': 0.0}


RA_IDENTITY = {'Posterize': 8.0, 'Solarize': 256.0}  # the parameter that leaves an image as it is
RA_GEOMETRIC = ('ShearX', 'ShearY', 'TranslateX', 'TranslateY', 'Rotate')


def geometric_matrix(shear_x, shear_y, translate_x, translate_y, angle, H, W):
    """Per-sample inverse affine maps (B, 2, 3) for torchvision's RandAugment geometry; all-zero
    arguments give the identity. Each sample should have at most one non-zero argument.

    ShearX about the top-left pixel (centre [0, 0]): x_in = x + s * (y + H/2); ShearY likewise;
    Translate: x_in = x - t; Rotate by `angle` degrees about the image centre.
    """
    a = torch.deg2rad(angle)
    cos, sin = torch.cos(a), torch.sin(a)
    return torch.stack([torch.stack([cos, shear_x - sin, shear_x * H / 2 - translate_x], -1),
                        torch.stack([shear_y + sin, cos, shear_y * W / 2 - translate_y], -1)], 1)


def ra_op(x, name, magnitude):
    """RandAugment op `name` on every sample of x (B, 3, H, W), with per-sample signed magnitudes
    (B,) float64: the op's factor - 1, shear, pixels, degrees, bits or threshold."""
    B, _, H, W = x.shape
    if name == 'Identity':
        return x
    if name in RA_GEOMETRIC:
        args = [magnitude if name == n else torch.zeros_like(magnitude) for n in RA_GEOMETRIC]
        return affine_grid_sample(x, geometric_matrix(*args, H, W).to(x.dtype), mode='nearest')
    if name in ('Brightness', 'Color', 'Contrast', 'Sharpness'):  # factor 1 + magnitude
        fn = {'Brightness': adjust_brightness, 'Color': adjust_saturation, 'Contrast': adjust_contrast,
              'Sharpness': adjust_sharpness}[name]
        return fn(x, (1.0 + magnitude).to(x.dtype).view(B, 1, 1, 1), (-magnitude).to(x.dtype).view(B, 1, 1, 1))
    if name == 'Posterize':
        return posterize(x, magnitude.to(x.dtype).view(B, 1, 1, 1))
    if name == 'Solarize':
        return solarize(x, magnitude.to(x.dtype).view(B, 1, 1, 1))
    return {'AutoContrast': autocontrast, 'Equalize': equalize}[name](x)


def apply_ra_ops(x, op, magnitude, sync_free=None):
    """Apply to each sample b the RandAugment op RA_OPS[op[b]] with signed magnitude[b] (float64).

    x: (B, 3, H, W) float, integer-valued. Two equal ways (the tests check they agree bit for bit):
    sync_free (default on CUDA) runs every op on the whole batch, giving the samples that did not
    draw it the op's identity parameters, and folds the five geometric ops into one grid_sample:
    no host sync, ~14x the arithmetic, which a GPU does not notice. Otherwise (default on CPU,
    where a sync costs nothing) each op runs on the subset of samples that drew it, and the
    result is written into x in place (a fresh batch-sized tensor costs more than the ops here).
    """
    if sync_free is None:
        sync_free = x.device.type != 'cpu'
    B, _, H, W = x.shape
    if not sync_free:
        for k, name in enumerate(RA_OPS):
            idx = (op == k).nonzero()[:, 0]
            if name != 'Identity' and len(idx):  # index_select/index_copy_: ~3x faster than x[idx]
                x.index_copy_(0, idx, ra_op(x.index_select(0, idx), name, magnitude.index_select(0, idx)))
        return x
    only = {name: torch.where(op == k, magnitude, RA_IDENTITY.get(name, 0.0)) for k, name in enumerate(RA_OPS)}
    x = affine_grid_sample(x, geometric_matrix(*[only[n] for n in RA_GEOMETRIC], H, W).to(x.dtype), mode='nearest')
    for name in ('Brightness', 'Color', 'Contrast', 'Sharpness', 'Posterize', 'Solarize'):
        x = ra_op(x, name, only[name])
    for name in ('AutoContrast', 'Equalize'):
        x = torch.where((op == RA_OPS.index(name)).view(B, 1, 1, 1), ra_op(x, name, None), x)
    return x


def resized_crop_flip(x, top, left, side, flip):
    """Square crops (top, left, side: (B,) float64 pixel counts) resized bilinearly back to H x W,
    as torchvision's resized_crop (interpolate, align_corners=False, edges clamped to the crop),
    then mirrored where flip (B,) is True. One grid_sample for the batch."""
    B, _, H, W = x.shape
    u = torch.arange(W, dtype=torch.float64, device=x.device)
    # output pixel u reads the crop at (u + 0.5) * side / W - 0.5, clamped to [0, side - 1]
    offset = ((u + 0.5) * side[:, None] / W - 0.5).clamp(min=0).minimum(side[:, None] - 1)  # (B, W)
    gx, gy = left[:, None] + offset, top[:, None] + offset
    gx = torch.where(flip[:, None], gx.flip(1), gx)
    grid = torch.stack([(2 * gx[:, None, :].expand(B, H, W) + 1) / W - 1,  # normalised, align_corners=False
                        (2 * gy[:, :, None].expand(B, H, W) + 1) / H - 1], -1)
    return F.grid_sample(x, grid.to(x.dtype), mode='bilinear', padding_mode='border',
                         align_corners=False).round_()


def pad_crop_flip(x_u8, dy, dx, flip, pad=4):
    """Zero-pad by `pad` px, take the 32x32 window at (dy, dx) ((B,) ints in 0..2*pad), mirror where
    flip: exact integer shifts on uint8, by one gather."""
    B, _, H, W = x_u8.shape
    padded = F.pad(x_u8, (pad, pad, pad, pad))
    rows = dy[:, None] + torch.arange(H, device=x_u8.device)  # (B, H)
    cols = dx[:, None] + torch.arange(W, device=x_u8.device)  # (B, W)
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    b = torch.arange(B, device=x_u8.device)[:, None, None]
    return padded[b, :, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2)  # (B, H, W, 3) -> (B, 3, H, W)


def flip_samples_(x, flip, sync_free=None):
    """Mirror the samples b of x (B, C, H, W) where flip[b] is True. As in apply_ra_ops, sync_free
    (default on CUDA) uses one where(); otherwise the subset is flipped in x in place (~2x faster)."""
    if sync_free is None:
        sync_free = x.device.type != 'cpu'
    if sync_free:
        return torch.where(flip.view(-1, 1, 1, 1), x.flip(3), x)
    idx = flip.nonzero()[:, 0]
    return x.index_copy_(0, idx, x.index_select(0, idx).flip(3))


def make_augment(args, device):
    """Returns augment(x_uint8 (B, 3, 32, 32) on device) -> normalised float32 (B, 3, 32, 32).

    Every random draw is per sample, from augment.generator (a torch.Generator on `device`).
    strong (locuslab): RandomResizedCrop(32, scale=(--scale, 1), ratio=(1, 1)) -> flip ->
        RandAugment(--ra-n, --ra-m) -> ColorJitter(--jitter x3, random order per sample) ->
        Normalize -> RandomErasing(--reprob, value 0).
    basic (SAM paper, Foret et al. 2021 CIFAR setting): 4-px zero padding + random 32x32 crop -> flip
        -> Normalize.
    """
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(args.seed)
    mags = ra_magnitudes(args.ra_m)
    ra_mag = torch.tensor([mags[n] for n in RA_OPS], dtype=torch.float64, device=device)
    ra_signed = torch.tensor([n in RA_SIGNED for n in RA_OPS], device=device)

    def rand(*shape, dtype=torch.float32):
        return torch.rand(*shape, generator=gen, device=device, dtype=dtype)

    def random_resized_crop_flip(x):  # torchvision's draw with ratio (1, 1): always fits at once
        B, _, H, W = x.shape
        area = (args.scale + (1 - args.scale) * rand(B, dtype=torch.float64)) * H * W  # U(scale, 1) * H*W
        side = torch.sqrt(area).round().clamp_(1, min(H, W))
        top = (rand(B, dtype=torch.float64) * (H - side + 1)).floor()
        left = (rand(B, dtype=torch.float64) * (W - side + 1)).floor()
        return resized_crop_flip(x, top, left, side, rand(B) < 0.5)

    def color_jitter(x):
        B, j = x.shape[0], args.jitter
        v = ((2 * rand(B, 3, dtype=torch.float64) - 1) * j).clamp(min=-1.0)  # factors 1 + v ~ U(1-j, 1+j), >= 0
        order = rand(B, 3).argsort(1)  # per-sample order of (brightness, contrast, saturation)
        for slot in range(3):
            for k, fn in enumerate((adjust_brightness, adjust_contrast, adjust_saturation)):
                vk = torch.where(order[:, slot] == k, v[:, k], 0.0)  # 0: identity for the others
                x = fn(x, (1.0 + vk).float().view(B, 1, 1, 1), (-vk).float().view(B, 1, 1, 1))
        return x

    def random_erasing(x):  # torchvision's RandomErasing(p, scale=(0.02, 0.33), ratio=(0.3, 3.3), value=0)
        B, _, H, W = x.shape
        area = (0.02 + 0.31 * rand(B, 10, dtype=torch.float64)) * H * W  # 10 attempts: the first that fits
        ratio = torch.exp(math.log(0.3) + (math.log(3.3) - math.log(0.3)) * rand(B, 10, dtype=torch.float64))
        h, w = torch.sqrt(area * ratio).round(), torch.sqrt(area / ratio).round()
        fits = (h < H) & (w < W)
        first = fits.int().argmax(1, keepdim=True)
        h, w = h.gather(1, first)[:, :, None], w.gather(1, first)[:, :, None]  # (B, 1, 1)
        top = (rand(B, 1, 1, dtype=torch.float64) * (H - h + 1)).floor()
        left = (rand(B, 1, 1, dtype=torch.float64) * (W - w + 1)).floor()
        on = ((rand(B, 1) < args.reprob) & fits.any(1, keepdim=True))[:, :, None]
        rows = torch.arange(H, dtype=torch.float64, device=device)[None, :, None]
        cols = torch.arange(W, dtype=torch.float64, device=device)[None, None, :]
        box = (rows >= top) & (rows < top + h) & (cols >= left) & (cols < left + w) & on  # (B, H, W)
        return x.masked_fill(box[:, None], 0.0)

    def augment(x_u8):
        B = x_u8.shape[0]
        if args.aug == 'basic':
            dy, dx = (torch.randint(0, 9, (2, B), generator=gen, device=device))
            x = pad_crop_flip(x_u8, dy, dx, rand(B) < 0.5).float()
        else:
            if args.scale < 1:
                x = random_resized_crop_flip(x_u8.float())
            else:  # every crop would be the whole image: flip only
                x = flip_samples_(x_u8.float(), rand(B) < 0.5)
            for _ in range(args.ra_n):
                op = torch.randint(0, len(RA_OPS), (B,), generator=gen, device=device)
                sign = torch.where(ra_signed[op] & (rand(B) < 0.5), -1.0, 1.0).double()
                x = apply_ra_ops(x, op, ra_mag[op] * sign)
            if args.jitter > 0:
                x = color_jitter(x)
        x = normalize(x, args.dataset)
        if args.aug == 'strong' and args.reprob > 0:
            x = random_erasing(x)
        return x

    augment.generator = gen
    return augment


def normalize(x, dataset):
    """(B, 3, H, W) values 0..255 (uint8 or float) -> float32, ToTensor + Normalize per channel.
    A float32 x is normalised in place (augment passes its own buffer)."""
    mean = torch.tensor(MEAN[dataset], dtype=torch.float32, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(STD[dataset], dtype=torch.float32, device=x.device).view(1, 3, 1, 1)
    # in place (x.float() is x itself for float32); bit-identical to the per-channel form, ~20x faster on CPU
    return x.float().mul_(1.0 / 255).sub_(mean).div_(std)


# -----------------------------------------------------------------------------
# Model: every config of convmixer.py, vit.py, mixer.py, plus a torchvision ResNet-18 baseline.
def model_names():
    return [n for m in MODEL_FILES for n in m.configs] + ['resnet18']


def build_model(name, num_classes, model_kw=None):
    """ImageNet configs are adapted to 32 px (the rule is in --model's help); overrides last."""
    model_kw = dict(model_kw or {})
    if name == 'resnet18':
        import torchvision
        try:
            model = torchvision.models.resnet18(num_classes=num_classes, **model_kw)
        except TypeError as e:
            raise UserError(f'--model-kw does not fit resnet18: {e}')
        # CIFAR stem (He et al. 2016, Sec. 4.2): a 3x3 stride-1 conv and no max-pool keep 32x32
        model.conv1 = nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(model.conv1.weight, mode='fan_out', nonlinearity='relu')  # as torchvision
        model.maxpool = nn.Identity()
        return model
    for module in MODEL_FILES:
        if name in module.configs:
            cfg, over = module.configs[name], {'num_classes': num_classes}
            if module is convmixer and cfg['patch_size'] >= 7:  # ImageNet ConvMixer: 224/7 = 32
                over['patch_size'] = cfg['patch_size'] // 7
            if module is not convmixer and cfg.get('img_size', 224) != 32:  # ImageNet ViT / Mixer
                over.update(img_size=32, patch_size=max(1, cfg['patch_size'] // 4))
            try:
                return module.create(name, **{**over, **model_kw})
            except TypeError as e:
                raise UserError(f'--model-kw does not fit {name}: {e}')
    raise UserError(f"unknown model {name!r}; valid names: {', '.join(model_names())}")


# -----------------------------------------------------------------------------
# Learning-rate schedule: locuslab's piecewise-linear one cycle, t in epochs (fractional).
def lr_at(t, epochs, lr_max):
    return float(np.interp(t, [0, epochs * 2 / 5, epochs * 4 / 5, epochs], [0, lr_max, lr_max / 20, 0]))


# -----------------------------------------------------------------------------
# Checkpoints and RNG.
def save_atomic(path, obj):
    """Write to path + '.tmp', then os.replace: a reader never sees a half-written file."""
    tmp = f'{path}.tmp'
    if str(path).endswith('.jsonl'):  # a list of dicts, one JSON line each
        with open(tmp, 'w') as f:
            f.writelines(json.dumps(line) + '\n' for line in obj)
    elif str(path).endswith('.json'):
        with open(tmp, 'w') as f:
            json.dump(obj, f, indent=2)
    else:
        torch.save(obj, tmp)
    os.replace(tmp, path)


def rng_state(augment_generator):
    """Every RNG the run draws from. (The loop reseeds them all from (seed, epoch, rank) at each
    epoch start, which is what makes resume exact; restoring them matters for nothing else.)"""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {'python': random.getstate(),
            'numpy': (kind, keys.tolist(), pos, has_gauss, gauss),
            'torch': torch.get_rng_state(),
            'cuda': torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            'augment': augment_generator.get_state()}


def set_rng_state(state, augment_generator):
    random.setstate(state['python'])
    kind, keys, pos, has_gauss, gauss = state['numpy']
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state['torch'])
    if state['cuda'] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state['cuda'])
    augment_generator.set_state(state['augment'])


def epoch_seed(*key):
    """A 32-bit seed that depends on every item of key (seed, epoch, rank), without collisions."""
    return int(np.random.SeedSequence([int(k) for k in key]).generate_state(1)[0])


def read_checkpoint(path):
    if not os.path.isfile(path):
        raise UserError(f'--resume file not found: {path}')
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:
        first_line = (str(e).strip().splitlines() or [''])[0].split('. ')[0]
        raise UserError(f'--resume file {path} is not a readable checkpoint ({type(e).__name__}: {first_line})')
    if not isinstance(ckpt, dict) or 'model' not in ckpt:
        raise UserError(f'--resume file {path} is not a train_cifar.py checkpoint (no "model" entry)')
    return ckpt


def load_model_state(model, state, path, name):
    """Load strictly; on a mismatch name the first differing key (and both shapes)."""
    state = {k.removeprefix('module.').removeprefix('_orig_mod.'): v for k, v in state.items()}
    own = model.state_dict()
    problems = [f'{k}: missing from the checkpoint' if k not in state else
                f'{k}: checkpoint {tuple(state[k].shape)}, model {tuple(own[k].shape)}'
                for k in own if k not in state or state[k].shape != own[k].shape]
    problems += [f'{k}: in the checkpoint, not in the model' for k in state if k not in own]
    if problems:
        raise UserError(f'{path} does not fit this --model {name} ({len(problems)} mismatched '
                        f'keys; first: {problems[0]}). Pass the --model / --model-kw / --dataset it was '
                        f'trained with.')
    model.load_state_dict(state)


def fmt_time(s):
    s = int(round(s))
    return f'{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}' if s >= 3600 else f'{s // 60}:{s % 60:02d}'


# -----------------------------------------------------------------------------
# Evaluation: exact under DDP. Rank r takes images [r*N/W, (r+1)*N/W) (no padding, no duplicates);
# the sums of loss, correct and count are all-reduced.
@torch.no_grad()
def evaluate(model, x_u8, y, dataset, batch_size, rank, world, autocast, channels_last):
    model.eval()
    n = len(y)
    lo, hi = n * rank // world, n * (rank + 1) // world
    stats = torch.zeros(3, dtype=torch.float64, device=x_u8.device)  # loss sum, correct, count
    for s in range(lo, hi, batch_size):
        xb, yb = normalize(x_u8[s:min(s + batch_size, hi)], dataset), y[s:min(s + batch_size, hi)]
        if channels_last:
            xb = xb.contiguous(memory_format=torch.channels_last)
        with autocast:
            out = model(xb)
        stats[0] += F.cross_entropy(out.float(), yb, reduction='sum').double()
        stats[1] += (out.argmax(1) == yb).sum()
        stats[2] += len(yb)
    if world > 1:
        dist.all_reduce(stats)
    loss, correct, count = stats.tolist()
    return loss / max(count, 1), int(correct), int(count)


# -----------------------------------------------------------------------------
def main(argv=None):
    args = get_args(argv)
    t_start = time.time()

    # --- distributed setup, the torchrun way ---------------------------------
    rank, world = int(os.environ.get('RANK', 0)), int(os.environ.get('WORLD_SIZE', 1))
    local_rank = int(os.environ.get('LOCAL_RANK', 0))
    master = rank == 0
    if args.device == 'cuda' and not torch.cuda.is_available():
        raise UserError('--device cuda, but CUDA is not available')
    use_cuda = args.device == 'cuda' or (args.device == 'auto' and torch.cuda.is_available())
    device = torch.device('cuda', local_rank) if use_cuda else torch.device('cpu')
    if use_cuda:
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if args.batch_size % world:
        raise UserError(f'--batch-size {args.batch_size} (global) does not divide by the world size {world}')
    batch = args.batch_size // world  # per rank
    amp = args.amp if args.amp != 'auto' else ('bf16' if use_cuda else 'off')
    autocast = torch.autocast(device.type, dtype={'bf16': torch.bfloat16, 'fp16': torch.float16}.get(amp),
                              enabled=amp != 'off')
    log = print if master else (lambda *a, **k: None)

    # --- model (built before the data is read, so a bad name fails at once) --
    num_classes = NUM_CLASSES[args.dataset]
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    raw = build_model(args.model, num_classes, args.model_kw_dict)
    ckpt = read_checkpoint(args.resume) if args.resume else None
    if ckpt is not None:
        load_model_state(raw, ckpt['model'], args.resume, args.model)
    raw.to(device)
    if args.channels_last:
        raw.to(memory_format=torch.channels_last)

    ddp = world > 1
    if ddp:
        dist.init_process_group('nccl' if use_cuda else 'gloo')

    # --- data: decoded once, whole, onto the device as uint8 ----------------
    if ddp and master:  # rank 0 downloads (if needed) before the others look
        find_layout(args.data, args.dataset, download=True)
    if ddp:
        dist.barrier()
    test_x, test_y = load_cifar(args.data, args.dataset, train=False, subset=args.test_subset, download=master)
    test_x, test_y = test_x.to(device), test_y.to(device)
    eval_model = torch.compile(raw) if args.compile else raw  # plain module: ranks eval different counts

    if args.eval_only:
        loss, correct, count = evaluate(eval_model, test_x, test_y, args.dataset, args.eval_batch_size,
                                        rank, world, autocast, args.channels_last)
        log(f'eval | {args.resume} | {args.model} on {args.dataset} | test loss {loss:.4f} '
            f'acc {100 * correct / count:.2f}% ({correct}/{count}) | world {world}', flush=True)
        if ddp:
            dist.barrier()  # leave together: a gloo rank torn down while its peer still runs may abort
            dist.destroy_process_group()
        return

    train_x, train_y = load_cifar(args.data, args.dataset, train=True, subset=args.train_subset, download=master)
    n_train = len(train_y)
    if n_train < args.batch_size:
        raise UserError(f'the training set has {n_train} images, fewer than --batch-size {args.batch_size}')
    train_x, train_y = train_x.to(device), train_y.to(device)
    steps_per_epoch = n_train // args.batch_size  # the last partial batch is dropped; order changes every epoch
    augment = make_augment(args, device)

    # --- optimizer, loss, AMP, wrappers ----------------------------------------
    if args.sam:
        from sam import SAM, first_pass, second_pass
        opt = SAM(raw.parameters(), torch.optim.AdamW, rho=args.rho, adaptive=args.adaptive,
                  lr=args.lr_max, weight_decay=args.wd)
    else:
        opt = torch.optim.AdamW(raw.parameters(), lr=args.lr_max, weight_decay=args.wd)
    scaler = torch.amp.GradScaler(device.type, enabled=amp == 'fp16')  # bf16/fp32 need no loss scaling
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    model = nn.parallel.DistributedDataParallel(raw, device_ids=[local_rank] if use_cuda else None) if ddp else raw
    fwd = torch.compile(model) if args.compile else model

    # --- resume -----------------------------------------------------------------
    start_epoch, step, history = 0, 0, []
    if ckpt is not None:
        missing = [k for k in ('optimizer', 'scaler', 'epoch', 'step', 'rng') if k not in ckpt]
        if missing:
            raise UserError(f'--resume file {args.resume} lacks {missing}: not a training checkpoint')
        try:
            opt.load_state_dict(ckpt['optimizer'])
            scaler.load_state_dict(ckpt['scaler'])
        except (ValueError, KeyError, RuntimeError) as e:
            raise UserError(f'--resume file {args.resume}: optimizer state does not fit '
                            f'(was it saved with{"out" if args.sam else ""} --sam?): {e}')
        set_rng_state(ckpt['rng'], augment.generator)
        start_epoch, step, history = ckpt['epoch'], ckpt['step'], ckpt.get('history', [])
        changed = {k: (v, getattr(args, k, None)) for k, v in ckpt.get('args', {}).items()
                   if k not in ('resume', 'out', 'stop_after_epoch', 'log_every', 'eval_only')
                   and getattr(args, k, None) != v}
        log(f'resumed {args.resume} at epoch {start_epoch}, step {step}'
            + (f'; flags changed since (saved, now): {changed}' if changed else ''))

    out_dir = Path(args.out)
    cli_args = {k: v for k, v in vars(args).items() if k != 'model_kw_dict'}
    resolved = dict(cli_args)
    resolved.update(model_kw=args.model_kw_dict, amp=amp, device=str(device), world_size=world,
                    per_rank_batch=batch, num_classes=num_classes, n_train=n_train, n_test=len(test_y),
                    steps_per_epoch=steps_per_epoch, torch=str(torch.__version__))
    n_params = sum(p.numel() for p in raw.parameters())
    if master:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_atomic(out_dir / 'args.json', resolved)
    kw = ' ' + ' '.join(f'{k}={v}' for k, v in args.model_kw_dict.items()) if args.model_kw_dict else ''
    log(f'{args.model}{kw} ({n_params:,} params) on {args.dataset}: {n_train:,} train / {len(test_y):,} test '
        f'images | {args.epochs} epochs x {steps_per_epoch} steps of {args.batch_size} '
        f'({world} x {batch}) | AdamW lr-max {args.lr_max} wd {args.wd}'
        + (f' | SAM rho {args.rho}{" adaptive" if args.adaptive else ""}' if args.sam else '')
        + f' | aug {args.aug} | amp {amp} | {device} | out {out_dir}', flush=True)

    # --- training loop ------------------------------------------------------------
    total_steps = args.epochs * steps_per_epoch
    run_t0, run_steps, best = None, 0, max([h['test_acc'] for h in history], default=0.0)
    for epoch in range(start_epoch, args.epochs):
        # Every random draw of this epoch derives from (seed, epoch[, rank]): exact resume at any
        # epoch boundary, and different augmentations (and dropout masks) on different ranks.
        s = epoch_seed(args.seed, epoch, rank)
        random.seed(s); np.random.seed(s); torch.manual_seed(s); augment.generator.manual_seed(s)
        # The data order is shared by all ranks (like DistributedSampler.set_epoch): rank r takes its
        # slice [r*batch, (r+1)*batch) of every global batch.
        perm = torch.randperm(n_train, generator=torch.Generator().manual_seed(epoch_seed(args.seed, epoch)))
        perm = perm.to(device, non_blocking=True)
        model.train()
        stats = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count (this rank)
        t0 = time.time()
        run_t0 = run_t0 or t0
        last_log_t, last_log_i = t0, 0
        for i in range(steps_per_epoch):
            lr = lr_at(epoch + (i + 1) / steps_per_epoch, args.epochs, args.lr_max)
            for group in opt.param_groups:
                group['lr'] = lr
            idx = perm[i * args.batch_size + rank * batch:i * args.batch_size + (rank + 1) * batch]
            x, y = augment(train_x[idx]), train_y[idx]
            if args.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)

            if args.sam:  # Foret et al. Alg. 1 via sam.py: eps-hat from this rank's own batch (m-sharpness)
                with first_pass(model):
                    with autocast:
                        out = fwd(x)
                        loss = criterion(out, y)
                    scaler.scale(loss).backward()
                opt.first_step(zero_grad=True)  # w <- w + eps-hat
                with second_pass(model):  # BatchNorm running stats come from the clean pass only
                    with autocast:
                        loss_sam = criterion(fwd(x), y)
                    scaler.scale(loss_sam).backward()  # g_SAM, all-reduced under DDP
            else:
                with autocast:
                    out = fwd(x)
                    loss = criterion(out, y)
                scaler.scale(loss).backward()
            if args.clip_norm > 0:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(raw.parameters(), args.clip_norm)
            scaler.step(opt)  # with SAM: w restored from its saved copy, then the AdamW step with g_SAM
            scaler.update()
            opt.zero_grad(set_to_none=True)
            step += 1
            run_steps += 1
            stats[0] += loss.detach().double() * len(y)
            stats[1] += (out.detach().argmax(1) == y).sum()
            stats[2] += len(y)

            if master and args.log_every and (i + 1) % args.log_every == 0 and i + 1 < steps_per_epoch:
                running_loss = stats[0].item() / stats[2].item()  # the only host sync, every N steps
                now = time.time()
                ips = (i + 1 - last_log_i) * args.batch_size / (now - last_log_t)
                eta = (now - run_t0) / run_steps * (total_steps - step)
                print(f'ep {epoch + 1}/{args.epochs} step {i + 1}/{steps_per_epoch} loss {running_loss:.4f} '
                      f'lr {lr:.2e} {ips:,.0f} img/s eta {fmt_time(eta)}', flush=True)
                last_log_t, last_log_i = now, i + 1

        # --- end of epoch: train stats, exact eval, checkpoint --------------------
        if ddp:
            dist.all_reduce(stats)
        train_loss, train_correct, train_count = stats.tolist()
        if use_cuda:
            torch.cuda.synchronize()
        train_s = time.time() - t0
        if ddp:  # evaluate (and save) exactly rank 0's BatchNorm statistics on every rank
            for buf in raw.buffers():
                dist.broadcast(buf, 0)
        test_loss, test_correct, test_count = evaluate(eval_model, test_x, test_y, args.dataset,
                                                       args.eval_batch_size, rank, world, autocast,
                                                       args.channels_last)
        epoch_s = time.time() - t0
        test_acc = test_correct / test_count
        best = max(best, test_acc)
        history.append(dict(epoch=epoch + 1, step=step, train_loss=train_loss / train_count,
                            train_acc=train_correct / train_count, test_loss=test_loss, test_acc=test_acc,
                            test_correct=test_correct, test_total=test_count, lr=lr,
                            img_per_s=train_count / train_s, train_s=train_s, epoch_s=epoch_s,
                            elapsed_s=time.time() - t_start))
        h = history[-1]
        eta = (time.time() - run_t0) / run_steps * (total_steps - step)
        log(f'ep {epoch + 1}/{args.epochs} | train loss {h["train_loss"]:.4f} acc {100 * h["train_acc"]:.2f}% | '
            f'test loss {test_loss:.4f} acc {100 * test_acc:.2f}% | lr {lr:.2e} | {h["img_per_s"]:,.0f} img/s | '
            f'{epoch_s:.1f} s | eta {fmt_time(eta)}', flush=True)
        if master:
            save_atomic(out_dir / 'metrics.jsonl', history)
            save_atomic(out_dir / 'last.pt', {'model': raw.state_dict(), 'optimizer': opt.state_dict(),
                         'scheduler': {'kind': 'piecewise-linear one-cycle (locuslab)', 'epochs': args.epochs,
                                       'lr_max': args.lr_max, 'steps_per_epoch': steps_per_epoch, 'step': step,
                                       'lr': lr},
                         'scaler': scaler.state_dict(), 'rng': rng_state(augment.generator),
                         'epoch': epoch + 1, 'step': step, 'args': cli_args, 'resolved': resolved,
                         'history': history})
        if args.stop_after_epoch and epoch + 1 == args.stop_after_epoch and epoch + 1 < args.epochs:
            log(f'stopped after epoch {epoch + 1} (--stop-after-epoch); continue with: '
                f'--resume {out_dir / "last.pt"}', flush=True)
            break

    # --- one-line summary -----------------------------------------------------------
    if history:
        h = history[-1]
        log(f'done | {args.model} on {args.dataset} | epoch {h["epoch"]}/{args.epochs} | '
            f'test acc {100 * h["test_acc"]:.2f}% (best {100 * best:.2f}%) | train acc {100 * h["train_acc"]:.2f}% | '
            f'{sum(x["img_per_s"] for x in history) / len(history):,.0f} img/s | '
            f'{fmt_time(time.time() - t_start)} wall | {out_dir / "last.pt"}', flush=True)
    if ddp:
        dist.barrier()  # rank 0 may still be saving; leave together (gloo aborts on a one-sided teardown)
        dist.destroy_process_group()


if __name__ == '__main__':
    try:
        main()
    except UserError as e:
        print(f'train_cifar.py: error: {e}', file=sys.stderr)
        sys.exit(1)
