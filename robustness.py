"""Robustness of any checkpoint of this repo: ImageNet-C, ImageNet-R, CIFAR-10-C, on-the-fly corruptions, PGD / FGSM.

Chen, Hsieh & Gong 2021 (Sec. 4) score robustness as the MEAN ACCURACY over the 19 ImageNet-C corruptions x 5
severities (Hendrycks & Dietterich 2019: 15 benchmark + 4 extra) and as ImageNet-R top-1 (Hendrycks et al. 2021).
Reported here: both, the same model's clean accuracy, each group's mean, and the mCE most tools print (15
corruptions, errors normalised by AlexNet's), which is not the paper's figure.
--benchmark imagenet-c  DATA/<corruption>/<1..5>/<wnid>/*.JPEG; --clean, the ImageNet val folder, gives the classes.
            imagenet-r  DATA/<wnid>/*.jpg, 200 wnids; the logits restricted to them (hendrycks/imagenet-r eval.py).
            cifar10-c   DATA/<corruption>.npy (severity s in rows (s-1)N..sN) + DATA/labels.npy.
            corrupt     the --data set corrupted here by imagecorruptions and cached in the CIFAR-10-C layout:
                        ImageNet-C's constants at the data's size, NOT the published CIFAR-10-C (re-tuned for 32 px).
--attack pgd|fgsm       clean and robust accuracy on the clean set (Madry et al. 2018; pgd.py).
`robustness.py compare A.json B.json --out x.png` draws runs side by side. Under torchrun each image counts once.
Preprocessing is the checkpoint's: CIFAR models their data set's mean/std at 32 px (a run's --img-size upsampled,
its --classes only); ImageNet models data.eval_transform with their recipe's size, crop_pct, interpolation, norm.
"""
import argparse
import csv
import hashlib
import io
import itertools
import math
import os
import pkgutil
import sys
import time
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

import corruptions as cc
import figures
from augment import normalize
from corruptions import CORRUPTIONS, GROUPS, SEVERITIES, load_npy
from data import MEAN, MEANS, STD, Samples, eval_transform, folder_batches, folder_samples, load_cifar
from flags import check_shared_ranges, refuse_loose
from models import imagenet_only, load_model, zero_head
from pgd import fgsm, pgd
from runs import discard_new_dirs, prepare_out, read_json, save_atomic, stored_args
from utils import UserError, epoch_seed, first_set, fmt_time, init_group, leave, setup
BENCHMARK_15 = CORRUPTIONS[:15]  # (Hendrycks & Dietterich 2019, Sec. 3: the 15 of mCE; 4 extra)
# AlexNet's top-1 error per benchmark corruption (mean over the 5 severities), as google-research/augmix
# imagenet.py carries them from hendrycks/robustness, in ITS corruption order, which is BENCHMARK_15's.
ALEXNET_ERR = dict(zip(BENCHMARK_15, [0.886428, 0.894468, 0.922640, 0.819880, 0.826268, 0.785948, 0.798360,
                                      0.866816, 0.826572, 0.819324, 0.564592, 0.853204, 0.646056, 0.717840,
                                      0.606500]))
NOTE = ("on-the-fly corruptions: ImageNet-C's severity constants (imagecorruptions-imaug {v}) applied at "
        '{h}x{w} px, seed {seed}; this is NOT the published {which}')
PLOT_HINT = ' (or pass --no-plot)'
EVAL_PREP = dict(norm='jax', crop_pct=0.875, eval_interp='bilinear', img_size=224)  # train_imagenet's sam recipe


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument('--benchmark', choices=['imagenet-c', 'imagenet-r', 'cifar10-c', 'corrupt'],
                   help='what to evaluate (module docstring); may come with --attack')
    p.add_argument('--data', required=True, metavar='DIR', help='the benchmark, or the clean set to corrupt or attack')
    p.add_argument('--clean', metavar='DIR', help='beside a published benchmark: the ImageNet val folder or CIFAR root')
    p.add_argument('--dataset', choices=['cifar10', 'cifar100', 'imagenet'], help="the model's (default: from last.pt)")
    p.add_argument('--model', help='a model name of train_cifar.py / train_imagenet.py (default: from last.pt)')
    p.add_argument('--model-kw', nargs='*', metavar='K=V', help='constructor overrides (default: from last.pt)')
    p.add_argument('--checkpoint', required=True, metavar='PATH', help='any format the training scripts load')
    # ImageNet models only; default: from our last.pt, else the SAM recipe (timm's SAM ViTs: 0.9, bicubic)
    p.add_argument('--img-size', type=int, help='input px (default: from last.pt, else 224)')
    p.add_argument('--norm', choices=list(MEANS), help='input mean/std; jax = (x - 0.5) / 0.5')
    p.add_argument('--crop-pct', type=float, help='resize to img_size / crop_pct, then centre-crop img_size')
    p.add_argument('--eval-interp', choices=['bilinear', 'bicubic'], help='the resize filter')
    p.add_argument('--corruptions', nargs='+', default=CORRUPTIONS, choices=CORRUPTIONS, metavar='NAME')
    p.add_argument('--severities', nargs='+', type=int, default=list(SEVERITIES), choices=SEVERITIES)
    p.add_argument('--subset', type=int, default=0, help='corrupt / attack: N class-balanced clean images (0 = all)')
    p.add_argument('--seed', type=int, default=0, help="seeds each image's corruption and PGD start")
    p.add_argument('--cache', metavar='DIR', help='corrupt: keeps the corrupted set (OUT/corrupted)')
    p.add_argument('--workers', type=int, default=min(8, os.cpu_count() or 1), help='processes that corrupt / load')
    p.add_argument('--eval-batch-size', type=int, default=256, help='images per forward, per process')
    p.add_argument('--amp', choices=['auto', 'bf16', 'off'], default='auto', help='bf16 autocast (on CUDA)')
    p.add_argument('--attack', choices=['pgd', 'fgsm'], help='also clean and robust accuracy under this attack')
    p.add_argument('--eps', type=float, default=8.0, help='L-inf radius in /255 pixel units')
    p.add_argument('--alpha', type=float, default=2.0, help='PGD step in /255 pixel units')
    p.add_argument('--steps', type=int, default=10, help='PGD steps (the k of PGD-k)')
    p.add_argument('--out', required=True, metavar='DIR', help='receives results.json, results.csv, heatmap.png')
    p.add_argument('--overwrite', action='store_true', help='replace the results already in --out')
    p.add_argument('--no-plot', action='store_true', help='no heatmap.png (no matplotlib needed)')
    args = p.parse_args(argv)
    if not args.benchmark and not args.attack:
        raise UserError('nothing to do: give --benchmark and/or --attack')
    graded = args.benchmark in ('imagenet-c', 'cifar10-c', 'corrupt')  # the benchmarks of (corruption, severity) cells
    refuse_loose(p, argv, [(args.attack, '--attack', ('eps', 'alpha', 'steps')),
                           (args.attack != 'fgsm', '--attack pgd (FGSM is one step of --eps)', ('alpha', 'steps')),
                           (graded, '--benchmark imagenet-c, cifar10-c or corrupt', ('corruptions', 'severities')),
                           (args.benchmark == 'corrupt', '--benchmark corrupt', ('cache',)),
                           (args.benchmark in ('imagenet-c', 'imagenet-r', 'cifar10-c'),
                            '--benchmark imagenet-c, imagenet-r or cifar10-c (beside a published benchmark)',
                            ('clean',)),
                           (args.benchmark == 'corrupt' or args.attack == 'pgd', '--benchmark corrupt or --attack pgd',
                            ('seed',))])
    check_shared_ranges(args, 'img_size', 'crop_pct', 'seed')
    if args.benchmark in ('imagenet-c', 'imagenet-r', 'cifar10-c') and not args.clean:
        raise UserError(f'--benchmark {args.benchmark} needs --clean DIR, the clean test set whose accuracy '
                        'goes beside the corrupted figures')
    if not (0 <= args.eps <= 255 and 0 < args.alpha <= 255 and args.steps >= 1 and args.subset >= 0  # (inf: robust
            and args.workers >= 0 and args.eval_batch_size >= 1):  # above clean; above float32: a traceback in pgd)
        raise UserError(f'need --eps in [0, 255] and --alpha in (0, 255] (/255 pixel units: 255 is the whole range), '
                        f'--steps >= 1, --subset >= 0, --workers >= 0, --eval-batch-size >= 1; got --eps {args.eps:g} '
                        f'--alpha {args.alpha:g}')
    return args


# -----------------------------------------------------------------------------
# The figures, from cells {(corruption, severity): (correct, n)} and clean = (correct, n).
def pct(correct, n):
    return {'correct': correct, 'n': n, 'acc': 100 * correct / n}


def summarize(cells, clean, with_mce=False):
    acc = {}
    for (c, s), (k, n) in cells.items():
        acc.setdefault(c, {})[str(s)] = 100 * k / n
    r = {'clean': pct(*clean), 'acc': acc,
         'counts': {c: {str(s): list(kn) for (c2, s), kn in cells.items() if c2 == c} for c in acc},
         'corruption_mean': {c: float(np.mean(list(per.values()))) for c, per in acc.items()},
         'mean_acc': float(np.mean([100 * k / n for k, n in cells.values()])),  # the paper's: each cell weighs 1
         'groups': {g: float(np.mean([a for c in names if c in acc for a in acc[c].values()]))
                    for g, names in GROUPS.items() if any(c in acc for c in names)}}
    r['gap'] = r['clean']['acc'] - r['mean_acc']
    # mCE (Hendrycks & Dietterich 2019, Sec. 4.1): CE_c = sum_s E_{s,c} / sum_s E^AlexNet_{s,c} = mean_s(err) /
    # ALEXNET_ERR[c] (the table holds AlexNet's mean over s); mCE = 100 x mean over the 15 of CE_c
    complete = all((c, s) in cells for c in BENCHMARK_15 for s in SEVERITIES)
    r['mce'] = (float(np.mean([(100 - r['corruption_mean'][c]) / ALEXNET_ERR[c] for c in BENCHMARK_15]))
                if with_mce and complete else None)
    return r


# -----------------------------------------------------------------------------
# Counting, exact under torchrun: rank r takes a contiguous slice (arrays) or images r, r + W, ...
# (folders); no padding, no duplicates; the counts are all-reduced. Images stay uint8 until
# augment.normalize on the device, so clean, corrupted and attacked images share one preprocessing.
def rank_slice(n, rank, world):
    return n * rank // world, n * (rank + 1) // world


def all_reduce(tensors, world):
    """Per-rank [correct, n] tensors -> the global counts, as (correct, n) tuples of ints."""
    t = torch.stack(tensors)
    if world > 1:
        dist.all_reduce(t)
    return [tuple(row) for row in t.long().tolist()]


def array_batches(images, labels, lo, hi, batch_size, device=None):
    """Rows lo..hi of (N, H, W, 3) uint8 images (the CIFAR-10-C layout, memmaps too) -> (x (B, 3, H, W), y, index).
    device: rows lo..hi moved there first, in one copy (a CIFAR-10-C cell of a rank: 30 MB / world), not per batch."""
    if device is not None:
        images, labels, lo, hi = (torch.from_numpy(np.array(images[lo:hi])).to(device),
                                  torch.from_numpy(np.asarray(labels[lo:hi]).copy()).to(device), 0, hi - lo)
    for s in range(lo, hi, batch_size):
        e = min(s + batch_size, hi)
        x, y = (images[s:e], labels[s:e]) if device is not None else (torch.from_numpy(np.array(images[s:e])),
                                                                      torch.from_numpy(np.asarray(labels[s:e]).copy()))
        yield x.permute(0, 3, 1, 2), y, torch.arange(s, e)


@torch.no_grad()
def predict(model, x_u8, mean, std, amp=False, mask=None):
    """Top-1 class; with mask (ImageNet-R), the argmax over those classes only, as an index of all."""
    with torch.autocast(x_u8.device.type, torch.bfloat16, enabled=amp):
        logits = model(normalize(x_u8, mean, std)).float()
    return logits.argmax(1) if mask is None else mask[logits[:, mask].argmax(1)]


def count(model, batches, mean, std, amp=False, mask=None):
    """[correct, n] on this process, a float64 tensor on the model's device (for all_reduce). No host sync: n is a
    Python number (no host-to-device copy), the copies in are non_blocking (asynchronous where the loader pins)."""
    model.eval()
    k = torch.zeros(2, dtype=torch.float64, device=mean.device)
    for x, y, _ in batches:
        y = y.to(mean.device, non_blocking=True)
        k[0] += (predict(model, x.to(mean.device, non_blocking=True), mean, std, amp, mask) == y).sum()
        k[1] += len(y)
    return k


# -----------------------------------------------------------------------------
# On-the-fly corruptions (corruptions.py makes them and keeps them in a memmap cache), scored here.
def corruption_accuracy(model, images_u8, labels, mean, std, corruptions=CORRUPTIONS, severities=SEVERITIES,
                        seed=0, cache_dir=None, batch_size=256, *, workers=0, rank=0, world=1, amp=False,
                        progress=False):
    """Accuracy (%) of `model` on uint8 images (N, 3, H, W) of >= 32 px corrupted on the fly, and clean (mean, std:
    the normalisation on [0, 1]); or images_u8 a Dataset of (uint8 (3, H, W), label (-1: undecodable), index), e.g.
    data.Samples, and labels None: each image decoded once (kept for the corruptions in a file of this process's,
    in TMPDIR). cache_dir: the corrupted set kept there (CIFAR-10-C layout, 5 severities; a folder it made, or new or
    empty) for the next call; None: in memory. workers: loader processes that decode and corrupt. Under torchrun
    call it on every rank: each decodes, corrupts and writes only its slice of rows into the cache's memmaps (no
    images cross processes but the bytes of pages two ranks share). progress: a line a corruption. -> summarize()"""
    version = cc.package()
    tensors = isinstance(images_u8, torch.Tensor)
    if tensors and (len(labels) != len(images_u8) or images_u8.ndim != 4):
        raise UserError(f'need uint8 images (N, 3, H, W) and N labels; got {tuple(images_u8.shape)} and {len(labels)}')
    clean = torch.utils.data.TensorDataset(images_u8, torch.as_tensor(labels), torch.arange(len(labels))) \
        if tensors else images_u8
    if not len(clean):  # no accuracy of nothing
        raise UserError('no images to corrupt')
    device = next(model.parameters()).device
    mean, std = (torch.tensor(v, dtype=torch.float32, device=device).view(1, 3, 1, 1) for v in (mean, std))
    n, (lo, hi) = len(clean), rank_slice(len(clean), rank, world)
    shape = image_shape(clean[0][0]) if tensors or lo == hi else None  # (a folder's: from its first decoded batch)
    m, made, files, keep = hi - lo, SEVERITIES if cache_dir else severities, {}, None  # a cached file holds all five
    seen, clean_k = [], torch.zeros(2, dtype=torch.float64, device=device)
    try:
        for x, y, j in cc.loader(torch.utils.data.Subset(clean, range(lo, hi)), 0 if tensors else workers,
                                 batch_size=batch_size):  # this rank's clean images (ImageNet: decoded in the workers)
            if not tensors and keep is None:  # decoded once: kept for the corruptions
                shape = image_shape(x[0])
                kept = np.load(keep := cc.keep_file(m, shape), mmap_mode='r+')
            seen += [(hashlib.sha256(a.numpy().tobytes()).digest(), int(b)) for a, b in zip(x, y)]  # the cache's
            clean_k += count(model, [(x, y, j)], mean, std, amp)  # identity of the set: each image's sha256, label
            if keep:
                kept[int(j[0]) - lo:int(j[-1]) + 1 - lo] = x.permute(0, 2, 3, 1).numpy()
        if keep:
            kept.flush()  # (read back by path in the loader's workers)
        cached, files = cache_verdict(clean, seen, n, shape, seed, version, cache_dir, corruptions, rank, world)
        k = make_and_count(model, images_u8[lo:hi] if tensors else keep, seen, corruptions, severities, made, seed,
                           cache_dir, cached, files, batch_size, workers, n, lo, hi, rank, world, mean, std, amp,
                           progress)
    finally:  # Ctrl-C, a crash: no half-filled file is left (the corruptions finished stay)
        for path in [*files.values(), keep] if rank == 0 else [keep]:
            if path and os.path.exists(path):
                os.remove(path)
    cells = list(itertools.product(corruptions, severities))
    counts = all_reduce([k[cell] for cell in cells] + [clean_k], world)
    r = summarize(dict(zip(cells, counts)), counts[-1])
    which = 'CIFAR-10-C' if shape[0] == 32 else 'ImageNet-C (corrupted at 224 px, saved as JPEG)'
    r['note'] = NOTE.format(v=version, h=shape[0], w=shape[1], seed=seed, which=which)
    return r


def image_shape(image):  # (3, H, W) uint8 of >= 32 px -> (H, W, 3): the package's and C layout
    if image.dtype != torch.uint8 or image.ndim != 3 or min(image.shape[1:]) < 32:
        raise UserError(f'need uint8 images (3, H, W) of at least 32 px; got {image.dtype} {tuple(image.shape)}')
    return (*image.shape[1:], 3)


def cache_verdict(clean, seen, n, shape, seed, version, cache_dir, corruptions, rank, world):
    """Rank 0 gets every rank's digests and labels (bytes, not images), names an undecodable file or, alone (another
    rank could see a half-made folder), opens or makes the cache; every rank gets the verdict. -> (cached, files)"""
    everyone, cached, files, error = [seen] * world, set(), {}, None
    if world > 1:
        dist.gather_object(seen, everyone if rank == 0 else None, dst=0)
    if rank == 0:
        digests, y_all = zip(*[d for part in everyone for d in part])
        y_all = np.asarray(y_all, np.int64)
        if (y_all < 0).any():  # (data.Samples' mark; folder_batches says the same)
            error = f'cannot decode {clean.samples[int(np.argmax(y_all < 0))][0]} (corrupt or truncated); replace or ' \
                    'delete it'
        elif cache_dir:
            meta = {'made_by': cc.CACHE_MARK, 'seed': seed, 'n': n, 'image_shape': list(shape), 'package': version,
                    'sha256': hashlib.sha256(b''.join(digests) + y_all.tobytes()).hexdigest(),
                    'sha256_of': 'the per-image sha256 digests, then the int64 labels'}
            try:
                cached, files = cc.use_cache(cache_dir, meta, y_all, corruptions)
            except UserError as e:
                error = str(e)
    if world > 1:
        dist.broadcast_object_list(box := [error, cached, files])
        error, cached, files = box
    if error:
        raise UserError(error)
    return cached, files


def make_and_count(model, rows, seen, corruptions, severities, made, seed, cache_dir, cached, files, batch_size,
                   workers, n, lo, hi, rank, world, mean, std, amp, progress):
    """{(corruption, severity): [correct, n] on this rank}: cached corruptions read back (this rank's rows lo..hi),
    the others made from `rows` (this rank's images, decoded once), scored, and written into the files rank 0 made."""
    y_rank, m, t0 = torch.tensor([b for _, b in seen], dtype=torch.int64), hi - lo, time.time()
    make = [c for c in corruptions if c not in cached]  # one loader for them all: its workers start once
    chunks = [range(i * m + j, i * m + min(j + batch_size, m))  # batches of one corruption each
              for i in range(len(make)) for j in range(0, m, batch_size)]
    # one batch in flight per worker: a batch takes a worker seconds to corrupt, and holds S x B images (pinned)
    batches = iter(cc.loader(cc.Corrupted(rows, m, make, made, seed, lo), workers, batch_sampler=chunks,
                             **dict(prefetch_factor=1) if workers else {}) if chunks else [])
    k = {cell: torch.zeros(2, dtype=torch.float64, device=mean.device)
         for cell in itertools.product(corruptions, severities)}
    for i, c in enumerate(corruptions):
        if c in cached:
            for s in severities:
                k[c, s] = count(model, array_batches(cc.rows(cache_dir, c, s, n, lo, hi), y_rank, 0, m, batch_size),
                                mean, std, amp)
            continue
        fill = cc.Filler(files[c], n, lo, hi, rank, world) if cache_dir else None
        for _ in range(len(chunks) // len(make)):
            x, j = next(batches)  # x (B, S, H, W, 3) uint8: image j[b] at severity made[s] in x[b, s]
            for t, s in enumerate(made if fill else ()):
                fill.write(s, int(j[0]), x[:, t].numpy())
            x, y = x.to(mean.device, non_blocking=True), y_rank[j - lo]
            for s in severities:
                k[c, s] += count(model, [(x[:, made.index(s)].permute(0, 3, 1, 2), y, j)], mean, std, amp)
        if fill:
            fill.finish()  # every rank's rows are in: rank 0 renames the file whole
            if rank == 0:
                os.replace(files[c], os.path.join(cache_dir, f'{c}.npy'))
        if progress:
            print(f'corrupted {c} ({i + 1}/{len(corruptions)}): {m:,} images x {len(made)} severities '
                  f'| {fmt_time(time.time() - t0)} elapsed', file=sys.stderr, flush=True)
    return k


# -----------------------------------------------------------------------------
# Published benchmarks.
def read_cifar10c(root, corruptions, num_classes):
    """{corruption: (5N, H, W, 3) uint8 memmap}, labels (5N,): the layout RobustBench's load_corruptions_cifar reads."""
    if not os.path.isdir(root):
        raise UserError(f'--data {root}: no such folder (CIFAR-10-C: DIR/<corruption>.npy and DIR/labels.npy)')
    found = sorted(f for f in os.listdir(root) if f.endswith('.npy'))
    for name in [f'{c}.npy' for c in corruptions] + ['labels.npy']:
        if name not in found:
            raise UserError(f'{os.path.join(root, name)} not found; {root} has: {", ".join(found) or "no .npy files"}')
    labels = load_npy(os.path.join(root, 'labels.npy'), 'fetch it again')
    arrays = {c: load_npy(os.path.join(root, f'{c}.npy'), 'fetch it again') for c in corruptions}
    for c, a in arrays.items():
        if a.dtype != np.uint8 or a.ndim != 4 or a.shape[-1] != 3 or len(a) % len(SEVERITIES) or not len(a):
            raise UserError(f'{root}/{c}.npy is {a.dtype} {a.shape}; expected uint8 (5 x N, H, W, 3)')
        if len(a) != len(labels):
            raise UserError(f'{root}/labels.npy has {len(labels)} labels but {c}.npy has {len(a)} images')
    if labels.min() < 0 or labels.max() >= num_classes:
        raise UserError(f"{root}/labels.npy holds labels outside 0..{num_classes - 1}, the model's classes")
    return arrays, labels


def imagenet_c_samples(root, corruption, severity, class_to_idx):
    """[(path, class index)] of root/<corruption>/<severity>/<wnid>/*: each wnid gets the clean set's index,
    whichever wnids this folder holds (torchvision's make_dataset with the clean class_to_idx)."""
    path = os.path.join(root, corruption, str(severity))
    if not os.path.isdir(path):
        where = os.path.dirname(path) if os.path.isdir(os.path.dirname(path)) else root
        raise UserError(f'{path} not found; {where} has: {", ".join(sorted(os.listdir(where))) or "nothing"} '
                        '(layout: DATA/<corruption>/<1..5>/<wnid>/*.JPEG)')
    unknown = sorted(set(os.listdir(path)) - set(class_to_idx))
    if unknown:
        raise UserError(f'{path}/{unknown[0]} is not a class folder of --clean ({len(unknown)} such folders)')
    samples = make_dataset(path, class_to_idx, extensions=IMG_EXTENSIONS, allow_empty=True)
    if not samples:
        raise UserError(f'{path}/<wnid>/ holds no images ({", ".join(IMG_EXTENSIONS)})')
    return samples


def imagenet_r_mask(classes):
    """The indices among the model's 1000 classes of ImageNet-R's 200 wnids: timm's package data
    (timm/data/_info/imagenet_r_synsets.txt, the imagenet_r_wnids of hendrycks/imagenet-r eval.py)."""
    try:
        data = pkgutil.get_data('timm.data', '_info/imagenet_r_synsets.txt')  # None: timm without that file
    except ImportError:
        data = None
    if data is None:
        raise UserError('ImageNet-R takes its list of 200 wnids from the timm package: pip install timm')
    r_wnids = data.decode().split()
    if len(classes) != 1000 or set(r_wnids) - set(classes):
        raise UserError(f'ImageNet-R needs 1000-class logits (an ImageNet-1k model and its val folder as --clean); '
                        f'got {len(classes)} classes, {len(set(r_wnids) - set(classes))} of the 200 wnids missing')
    return torch.tensor(sorted(classes.index(w) for w in r_wnids))


# -----------------------------------------------------------------------------
def uniform_start(seed, idx, shape):
    """U[0, 1) of shape (len(idx), *shape) on idx's device in one draw, counter-based: element j of image i is
    mix32(mix32(j) ^ mix32(idx[i] ^ epoch_seed(seed))) >> 8, times 2^-24 (exact in float32). So a start depends on
    (seed, index) alone, not on batch, workers, world size or device; no generator per image, no copy from the host."""
    def mix32(x):  # Chris Wellons' lowbias32 on 32-bit values in int64: x * c mod 2^32 in 16-bit halves, no overflow
        for shift, c in ((16, 0x7feb352d), (15, 0x846ca68b)):
            x = x ^ (x >> shift)
            x = (x * (c & 0xFFFF) + ((x * (c >> 16)) & 0xFFFF) * 65536) & 0xFFFFFFFF
        return x ^ (x >> 16)
    key = mix32(idx.long() ^ epoch_seed(seed))[:, None]
    j = mix32(torch.arange(math.prod(shape), device=idx.device))[None]
    return ((mix32(j ^ key) >> 8).float() * 2.0 ** -24).view(len(idx), *shape)


def attack_counts(model, batches, mean, std, kind, eps, alpha, steps, seed, amp=False):
    """batches of (uint8 x, labels, indices) -> [clean correct, robust correct, n] on this process; amp: every forward
    (the attack's too) under the bf16 autocast of the clean evaluation, so that both see one model.
    Each image's PGD random start U(-eps, eps) is uniform_start's, keyed by (seed, index). No host sync."""
    pixels = lambda v: normalize(v * 255, mean, std)  # noqa: E731  attacked on [0, 1] pixels: eps is /255
    k = torch.zeros(3, dtype=torch.float64, device=mean.device)
    for x_u8, y, idx in batches:
        x_u8, y = (t.to(mean.device, non_blocking=True) for t in (x_u8, y))
        x = x_u8.float() / 255
        with torch.autocast(x.device.type, torch.bfloat16, enabled=amp):  # (pgd sums the loss: no bf16 underflow)
            if kind == 'fgsm':
                x_adv = fgsm(model, x, y, eps, normalize=pixels)
            else:
                start = (uniform_start(seed, idx.to(mean.device, non_blocking=True), x.shape[1:]) * 2 - 1) * eps
                x_adv = pgd(model, x, y, eps, alpha, steps, random_start=start, normalize=pixels)
        with torch.no_grad(), torch.autocast(x.device.type, torch.bfloat16, enabled=amp):
            k[:2] += torch.stack([(predict(model, x_u8, mean, std, amp) == y).sum(),
                                  (model(pixels(x_adv)).float().argmax(1) == y).sum()])
            k[2] += len(y)
    return k


def preprocessing(args, stored, dataset):
    """What the model expects: CIFAR its data set's mean/std at 32 px; ImageNet the flags, else what our last.pt
    stored, else the SAM recipe's (timm's SAM ViTs: crop 0.9, bicubic: pass them)."""
    if dataset != 'imagenet':
        return dict(img_size=32, mean=MEAN[dataset], std=STD[dataset])
    prep = {k: first_set(getattr(args, k), stored.get(k), EVAL_PREP[k]) for k in EVAL_PREP}
    prep['mean'], prep['std'] = MEANS[prep['norm']]
    return prep


def uint8_transform(prep):
    """data.eval_transform's resize, centre crop and PILToTensor (uint8); its ToDtype + Normalize run on the
    device instead (augment.normalize, the same arithmetic), so that attacks and corruptions see pixels."""
    return eval_transform(prep['img_size'], prep['crop_pct'], prep['eval_interp'], prep['norm'], to_float=False)


# -----------------------------------------------------------------------------
# Output: a console table, results.json, results.csv, heatmap.png; `compare` draws bars of two or more.
def table(r):
    out = [f'{r["benchmark"]} on {r["dataset"]} | {r["model"]} | {r["checkpoint"]} | clean {r["clean"]["acc"]:.2f}% '
           f'of {r["clean"]["n"]:,} images']
    if 'acc' in r:
        sev = list(next(iter(r['acc'].values())))
        out.append(f'{"corruption":<18}' + ''.join(f'{"s" + s:>7}' for s in sev) + '   mean')
        out += [f'{c:<18}' + ''.join(f'{per[s]:7.2f}' for s in sev) + f'{r["corruption_mean"][c]:7.2f}'
                for c, per in r['acc'].items()]
        out.append('groups: ' + ' | '.join(f'{g} {a:.2f}' for g, a in r['groups'].items()))
        out.append(f'mean corruption accuracy {r["mean_acc"]:.2f}% ({len(sev) * len(r["acc"])} cells) | clean '
                   f'{r["clean"]["acc"]:.2f}% | gap {r["gap"]:.2f} points'
                   + ('' if r['mce'] is None else f' | mCE {r["mce"]:.2f} (15 corruptions, AlexNet = 100)'))
    if 'imagenet_r' in r:
        out.append(f'ImageNet-R {r["imagenet_r"]["acc"]:.2f}% of {r["imagenet_r"]["n"]:,} (200-class logits) | '
                   f'clean val, same 200 classes {r["clean_200"]["acc"]:.2f}% | gap {r["gap"]:.2f} points')
    if 'attack' in r:
        a = r['attack']
        out.append(f'{a["name"]} | clean {a["clean_acc"]:.2f}% | robust {a["robust_acc"]:.2f}% of {a["n"]:,} images')
    return '\n'.join(out + ([f'note: {r["note"]}'] if 'note' in r else []))


def csv_text(r):
    f, group = io.StringIO(), {c: g for g, names in GROUPS.items() for c in names}
    rows = [['benchmark', 'corruption', 'group', 'severity', 'correct', 'n', 'acc']]
    rows += [[r['benchmark'], key, '', '', r[key]['correct'], r[key]['n'], r[key]['acc']]
             for key in ('clean', 'imagenet_r', 'clean_200') if key in r]
    rows += [[r['benchmark'], c, group[c], s, k, n, r['acc'][c][s]]
             for c, per in r.get('counts', {}).items() for s, (k, n) in per.items()]
    if 'attack' in r:
        rows.append([r['attack']['name'], 'robust', '', '', r['attack']['robust_correct'], r['attack']['n'],
                     r['attack']['robust_acc']])
    csv.writer(f, lineterminator='\n').writerows(rows)
    return f.getvalue()


def read_results(path):
    """A results.json of a --benchmark run with corruption cells (what compare draws), or a UserError naming it."""
    r = read_json(path, 'give results.json files of robustness.py')
    try:
        sev, num = [list(per) for per in r['acc'].values()], (int, float)
        ok = sev and sev[0] and all(s == sev[0] for s in sev) and set(r['corruption_mean']) == set(r['acc']) and all(
            isinstance(v, num) for v in [r['mean_acc'], r['clean']['acc'], *r['corruption_mean'].values(),
                                         *(a for per in r['acc'].values() for a in per.values())])
        ok = ok and all(isinstance(r[k], str) for k in ('benchmark', 'model', 'checkpoint'))
    except (TypeError, KeyError, AttributeError):  # not an object, a key missing, a value of another type
        ok = False
    if not ok:
        raise UserError(f'{path} holds no corruption figures of robustness.py (an undamaged results.json of '
                        '--benchmark imagenet-c, cifar10-c or corrupt)')
    return r


def compare(argv):
    """robustness.py compare A.json B.json ... --out chart.png: bars per corruption, the mean and clean."""
    p = argparse.ArgumentParser(prog='robustness.py compare', description=compare.__doc__)
    p.add_argument('results', nargs='+', help='results.json of two or more robustness.py --benchmark runs')
    p.add_argument('--labels', nargs='+', help='a legend entry per file (default: model and checkpoint)')
    p.add_argument('--out', required=True, help='the PNG to write')
    args = p.parse_args(argv)
    if len(args.results) < 2 or (args.labels and len(args.labels) != len(args.results)):
        raise UserError('compare needs two or more results.json files (and as many --labels, if any)')
    runs = [read_results(path) for path in args.results]
    kinds = [f'{r["benchmark"]} run at severities {",".join(next(iter(r["acc"].values())))}' for r in runs]
    if bad := [i for i, kind in enumerate(kinds) if kind != kinds[0]]:  # one chart, one title: like with like
        raise UserError(f'{args.results[bad[0]]} is a {kinds[bad[0]]}, {args.results[0]} a {kinds[0]}: compare runs '
                        'of one benchmark and severity set')
    if bad := [i for i, r in enumerate(runs) if set(r['acc']) != set(runs[0]['acc'])]:  # each mean over its own set
        raise UserError(f'{args.results[bad[0]]} covers the corruptions {", ".join(runs[bad[0]]["acc"])}, '
                        f'{args.results[0]} {", ".join(runs[0]["acc"])}: their means are over other cells; compare '
                        'runs over one corruption set')
    labels = args.labels or [f'{r["model"]} ({r["checkpoint"]})' for r in runs]
    figures.corruption_bars(runs, labels, runs[0]['benchmark'], args.out, PLOT_HINT)
    print(f'wrote {args.out}')


# -----------------------------------------------------------------------------
def main(argv=None):
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    if argv[:1] == ['compare']:
        return compare(argv[1:])
    args = get_args(argv)
    try:
        return run(args, *prepare(args))
    except BaseException:  # a refusal, Ctrl-C, a crash: an --out made by this run and still empty goes again
        discard_new_dirs()
        raise


def prepare(args):
    """The checks before anything slow or written, then a real write into --out. -> (stored, dataset, clean, ...)"""
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UserError(f'--out {args.out} is a file, not a folder')
    if os.path.exists(os.path.join(args.out, 'results.json')) and not args.overwrite:
        raise UserError(f'--out {args.out} already holds results.json; pick another --out or pass --overwrite')
    if args.benchmark and not args.no_plot:
        figures.pyplot(PLOT_HINT)
    if args.benchmark == 'corrupt':
        cc.package()
        cc.open_cache(args.cache or os.path.join(args.out, 'corrupted'))  # (again with the images, on rank 0)
    if not os.path.isfile(args.checkpoint):
        raise UserError(f'--checkpoint {args.checkpoint}: no such file')
    stored = stored_args(args.checkpoint, '--checkpoint') or {}  # our last.pt (any script), else {}
    dataset = (args.dataset or stored.get('dataset') or ('imagenet' if 'recipe' in stored else None)
               or {'cifar10-c': 'cifar10', 'imagenet-c': 'imagenet', 'imagenet-r': 'imagenet'}.get(args.benchmark))
    if dataset is None:  # a bare state_dict, timm's or the .npz: its classes and preprocessing are unknown
        raise UserError(f'{args.checkpoint} does not say which data set its model was trained on (not a last.pt of '
                        'ours): pass --dataset cifar10, cifar100 or imagenet')
    if args.benchmark in ('imagenet-c', 'imagenet-r') and dataset != 'imagenet':
        raise UserError(f'--benchmark {args.benchmark} needs an ImageNet model; {args.checkpoint} is a {dataset} one')
    if args.benchmark == 'cifar10-c' and dataset != 'cifar10':
        raise UserError(f'CIFAR-10-C has the 10 classes of cifar10; {args.checkpoint} is a {dataset} model')
    imagenet_only(dataset, args.checkpoint, stored, **{k: getattr(args, k) for k in EVAL_PREP})
    clean_root = args.clean if args.benchmark in ('imagenet-c', 'imagenet-r', 'cifar10-c') else args.data
    classes, samples = folder_samples(clean_root, args.subset) if dataset == 'imagenet' else (None, None)  # (sorted)
    if samples == []:  # class folders without images: no figure of nothing
        raise UserError(f'{clean_root} holds no images ({", ".join(IMG_EXTENSIONS)}) in its class folders')
    # a real write now, not after hours of evaluation; rank 0 holds OUT/.lock as the training scripts do (runs.py):
    # a second run into --out is refused while this one runs (what results.json holds is checked above)
    prepare_out(SimpleNamespace(out=args.out, overwrite=True, resume=None), lock=os.environ.get('RANK', '0') == '0')
    return stored, dataset, clean_root, classes, samples


def run(args, stored, dataset, clean_root, classes, samples):
    t_start, mask = time.time(), imagenet_r_mask(classes) if args.benchmark == 'imagenet-r' else None
    # --- distributed setup, the torchrun way; the model and the clean set ---
    proc = setup(args.amp)  # rank, device (cuda:LOCAL_RANK when there is a GPU)
    rank, world, device, amp, batch = proc.rank, proc.world, proc.device, proc.amp == 'bf16', args.eval_batch_size
    init_group(proc)
    prep = preprocessing(args, stored, dataset)
    cifar = dataset != 'imagenet'  # CIFAR: the run's own --img-size and --classes, from our last.pt
    model, info = load_model(args.checkpoint, args.model, args.model_kw, dataset, img_size=None if cifar else
                             prep['img_size'], num_classes=None if cifar else len(classes))
    if cifar and info['img_size'] != 32:  # train_cifar.py --img-size upsampled each 32-px batch: so does the model
        model = torch.nn.Sequential(torch.nn.Upsample(info['img_size'], mode='bilinear'), model).eval()
    if args.benchmark == 'cifar10-c' and (some := info['stored'].get('classes')):
        raise UserError(f'CIFAR-10-C holds all 10 classes; {args.checkpoint} knows only --classes {some}')
    if zero_head(model):  # every image would get one class: chance reported as the model's accuracy
        raise UserError(f'{args.checkpoint}: its classifier head is all zeros (a train_contrastive.py backbone?); '
                        f'fine-tune it first: train_cifar.py --pretrained {args.checkpoint}')
    model, name, kw = model.to(device), info['name'], info['model_kw']
    if dataset == 'imagenet':
        transform = uint8_transform(prep)
    else:
        x_clean, y_clean = load_cifar(clean_root, dataset, False, args.subset, info['stored'].get('classes'))
        clean_hwc = x_clean.permute(0, 2, 3, 1).numpy()
    mean, std = (torch.tensor(prep[k], dtype=torch.float32, device=device).view(1, 3, 1, 1) for k in ('mean', 'std'))
    r = {'benchmark': args.benchmark or 'attack', 'model': name, 'model_kw': kw, 'checkpoint': args.checkpoint,
         'dataset': dataset, 'data': args.data, 'clean_set': clean_root, 'preprocessing': prep, 'seed': args.seed,
         'world_size': world, 'amp': amp, 'device': str(device)}
    cells = [(c, s) for c in args.corruptions for s in args.severities]
    if args.benchmark == 'cifar10-c':
        arrays, labels = read_cifar10c(args.data, args.corruptions, 10)
        n = len(labels) // len(SEVERITIES)
        lo, hi = rank_slice(n, rank, world)
        k = [count(model, array_batches(arrays[c], labels, (s - 1) * n + lo, (s - 1) * n + hi, batch, device), mean,
                   std, amp) for c, s in cells]
        k = all_reduce(k + [count(model, array_batches(clean_hwc, y_clean, *rank_slice(len(y_clean), rank, world),
                                                       batch, device), mean, std, amp)], world)
        r.update(summarize(dict(zip(cells, k)), k[-1]))
    elif args.benchmark in ('imagenet-c', 'imagenet-r'):
        if args.benchmark == 'imagenet-c':
            class_to_idx = {w: i for i, w in enumerate(classes)}
            groups = {cell: (imagenet_c_samples(args.data, *cell, class_to_idx), None) for cell in cells}
        else:
            r_classes, r_samples = folder_samples(args.data)
            in_r = {classes[i] for i in mask.tolist()}
            for w in set(r_classes) - in_r:
                raise UserError(f"{args.data}/{w} is not one of ImageNet-R's 200 wnids")
            mask = mask.to(device)
            # beside ImageNet-R, its paper's clean figure: the val images of the same 200 classes, masked alike
            groups = {'imagenet_r': ([(p, classes.index(r_classes[y])) for p, y in r_samples], mask),
                      'clean_200': ([s for s in samples if classes[s[1]] in in_r], mask)}
            if not (groups['imagenet_r'][0] and groups['clean_200'][0]):  # no figure of nothing
                raise UserError(f"no images of ImageNet-R's 200 classes in {args.data} or in --clean {clean_root}")
        groups['clean'] = (samples, None)
        k = all_reduce([count(model, folder_batches(g, transform, batch, args.workers, rank, world), mean, std, amp, m)
                        for g, m in groups.values()], world)
        k = dict(zip(groups, k))
        if args.benchmark == 'imagenet-c':
            r.update(summarize({cell: k[cell] for cell in cells}, k['clean'], with_mce=True))
        else:
            r.update(imagenet_r=pct(*k['imagenet_r']), clean_200=pct(*k['clean_200']), clean=pct(*k['clean']))
            r['gap'] = r['clean_200']['acc'] - r['imagenet_r']['acc']
    elif args.benchmark == 'corrupt':
        if dataset == 'imagenet':  # decoded in the loader's workers, each rank its slice: uint8 at the eval size
            x_clean, y_clean = Samples(samples, transform), None
        r.update(corruption_accuracy(model, x_clean, y_clean, prep['mean'], prep['std'], args.corruptions,
                                     args.severities, args.seed, args.cache or os.path.join(args.out, 'corrupted'),
                                     batch, workers=args.workers, rank=rank, world=world, amp=amp, progress=rank == 0))
    if args.attack:  # on the clean set
        batches = (folder_batches(samples, transform, batch, args.workers, rank, world) if dataset == 'imagenet' else
                   array_batches(clean_hwc, y_clean, *rank_slice(len(y_clean), rank, world), batch, device))
        k = all_reduce([attack_counts(model, batches, mean, std, args.attack, args.eps / 255, args.alpha / 255,
                                      args.steps, args.seed, amp)], world)[0]
        steps, alpha = (args.steps, args.alpha) if args.attack == 'pgd' else (1, args.eps)
        r['attack'] = dict(name=f'PGD-{steps} eps {args.eps:g}/255 alpha {alpha:g}/255' if args.attack == 'pgd'
                           else f'FGSM eps {args.eps:g}/255', kind=args.attack, eps=args.eps, alpha=alpha, steps=steps,
                           robust_correct=k[1], n=k[2], robust_acc=100 * k[1] / k[2])
        # one clean accuracy per model: the benchmark's where it ran (the same images under the same autocast)
        clean = r.setdefault('clean', pct(k[0], k[2]))
        r['attack'].update(clean_correct=clean['correct'], clean_acc=clean['acc'])
    r['wall_s'] = time.time() - t_start
    if rank == 0:
        print(table(r))
        save_atomic(os.path.join(args.out, 'results.json'), r)
        save_atomic(os.path.join(args.out, 'results.csv'), lambda f: f.write(csv_text(r).encode()))
        if 'acc' in r and not args.no_plot:
            figures.heatmap(r, os.path.join(args.out, 'heatmap.png'), PLOT_HINT)
        print(f'done | {name} | {r["benchmark"]} | {fmt_time(r["wall_s"])} wall | {args.out}')
    leave(world > 1)  # (a barrier first: rank 0 may still be writing)
    return r


if __name__ == '__main__':
    try:
        main()
    except UserError as e:
        sys.exit(f'robustness.py: error: {e}')
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's status for SIGINT; the cache keeps what it finished
        sys.exit(print('robustness.py: interrupted', file=sys.stderr) or 130)
