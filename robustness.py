"""Robustness of any checkpoint of this repo: ImageNet-C, ImageNet-R, CIFAR-10-C, on-the-fly corruptions, PGD / FGSM.

Chen, Hsieh & Gong 2021 (Sec. 4) score robustness as the MEAN ACCURACY over the 19 ImageNet-C
corruptions x 5 severities (Hendrycks & Dietterich 2019: 15 benchmark corruptions + 4 extra ones)
and as ImageNet-R top-1 (Hendrycks et al. 2021). This file reports both, with the clean accuracy of
the same model and preprocessing beside them, each group's mean, and the mCE most tools print (15
corruptions, errors normalised by AlexNet's), which is not the paper's figure.

    python robustness.py --benchmark imagenet-c --data DIR/imagenet-c --clean DIR/imagenet/val \
        --model vit_b16 --checkpoint ViT-B_16-sam.npz --crop-pct 0.9 --eval-interp bicubic --out runs/c
    python robustness.py --benchmark imagenet-r --data DIR/imagenet-r --clean DIR/imagenet/val ...
    python robustness.py --benchmark cifar10-c --data DIR/CIFAR-10-C --clean DIR/cifar10 \
        --checkpoint runs/vit/last.pt --out runs/vit_c10c
    python robustness.py --benchmark corrupt --data DIR/cifar10 --subset 1000 --cache c10-1000 \
        --checkpoint runs/vit/last.pt --attack pgd --eps 8 --alpha 2 --steps 10 --out runs/vit_rob
    python robustness.py compare runs/vit/results.json runs/vit_sam/results.json --out sam.png
    torchrun --nproc_per_node 8 robustness.py ...     # the same numbers: each image counted once

--benchmark:
  imagenet-c  DATA/<corruption>/<1..5>/<wnid>/*.JPEG, the published layout. --clean is the ImageNet
              val folder (DIR/<wnid>/*.JPEG); its sorted wnids are the model's class indices.
  imagenet-r  DATA/<wnid>/*.jpg, the benchmark's 200 wnids. The 1000 logits are restricted to those
              200 before the argmax, as hendrycks/imagenet-r eval.py does (net(x)[:, mask]); the clean
              figure beside it is the val images of the same 200 classes, scored the same way.
  cifar10-c   DATA/<corruption>.npy (5 x N images: severity s in rows (s-1)N..sN) + DATA/labels.npy.
  corrupt     the --data set (CIFAR-10/100, or --subset N images of an ImageNet folder) corrupted here by
              the imagecorruptions package (the benchmark's own code), cached in the CIFAR-10-C layout.
              These are ImageNet-C's severity constants applied at the data's size (32 px for CIFAR),
              NOT the published CIFAR-10-C, whose constants Hendrycks & Dietterich re-tuned for 32 px.
              Each image is seeded from (--seed, corruption, severity, its index): the same set
              whatever the batch size, world size, worker count or order.
--attack pgd|fgsm adds clean and robust accuracy on the clean set (Madry et al. 2018; pgd.py), eps
and alpha in /255 pixel units, each image's random start seeded from (--seed, its index).

Preprocessing is the checkpoint's own: CIFAR models see 32 px with their data set's mean/std;
ImageNet models get train_imagenet.eval_transform's resize + centre crop with their recipe's
img_size, crop_pct, interpolation and norm (our last.pt stores them; the flags override them).
"""
import argparse
import concurrent.futures
import csv
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import multiprocessing
import os
import pkgutil
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
from torchvision.datasets.folder import IMG_EXTENSIONS, default_loader, find_classes, make_dataset
from torchvision.transforms import v2

import train_cifar
import train_imagenet
from augment import normalize
from pgd import fgsm, pgd

# -----------------------------------------------------------------------------
# The benchmark's constants (Hendrycks & Dietterich 2019, Sec. 3 and Fig. 1).
GROUPS = {'noise': ['gaussian_noise', 'shot_noise', 'impulse_noise'],
          'blur': ['defocus_blur', 'glass_blur', 'motion_blur', 'zoom_blur'],
          'weather': ['snow', 'frost', 'fog', 'brightness'],
          'digital': ['contrast', 'elastic_transform', 'pixelate', 'jpeg_compression'],
          'extra': ['speckle_noise', 'gaussian_blur', 'spatter', 'saturate']}
CORRUPTIONS = [c for names in GROUPS.values() for c in names]  # also imagecorruptions' order
BENCHMARK_15 = CORRUPTIONS[:15]
SEVERITIES = (1, 2, 3, 4, 5)
# AlexNet's top-1 error per benchmark corruption (mean over the 5 severities), as google-research/
# augmix imagenet.py carries them from hendrycks/robustness, paired with its CORRUPTIONS list, which
# is BENCHMARK_15's order (some copies reorder one list and not the other).
ALEXNET_ERR = dict(zip(BENCHMARK_15, [0.886428, 0.894468, 0.922640, 0.819880, 0.826268, 0.785948, 0.798360,
                                      0.866816, 0.826572, 0.819324, 0.564592, 0.853204, 0.646056, 0.717840,
                                      0.606500]))
NOTE = ('on-the-fly corruptions: ImageNet-C\'s severity constants (imagecorruptions-imaug {v}) applied at '
        '{h}x{w} px, seed {seed}; this is NOT the published {which}')
EXTRAS = 'pip install -r requirements-extras.txt'


class UserError(Exception):
    """A mistake in the command line or the data: one line on stderr, exit status 1."""


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument('--benchmark', choices=['imagenet-c', 'imagenet-r', 'cifar10-c', 'corrupt'],
                   help='what to evaluate (module docstring); may come with --attack')
    p.add_argument('--data', required=True, metavar='DIR', help='the benchmark (imagenet-c, imagenet-r, '
                   'cifar10-c), or the clean set to corrupt or attack (a CIFAR root as train_cifar.py takes '
                   'it, or an ImageNet folder DIR/<wnid>/*.JPEG)')
    p.add_argument('--clean', metavar='DIR', help='the clean set beside a published benchmark: the ImageNet '
                   'val folder, or the CIFAR-10 root')
    p.add_argument('--dataset', choices=['cifar10', 'cifar100', 'imagenet'],
                   help='what the model was trained on (default: from our last.pt, else the benchmark\'s)')
    p.add_argument('--model', help='a model name of train_cifar.py / train_imagenet.py (default: from our last.pt)')
    p.add_argument('--model-kw', nargs='*', metavar='K=V', help='constructor overrides (default: from our last.pt)')
    p.add_argument('--checkpoint', required=True, metavar='PATH', help='weights in any format the training '
                   'scripts load: our last.pt, timm, an official .npz, locuslab')
    p.add_argument('--img-size', type=int, help='ImageNet models: input px (default: from last.pt, else 224)')
    p.add_argument('--norm', choices=list(train_imagenet.MEANS), help='ImageNet models: input mean/std; '
                   'jax = (x - 0.5) / 0.5, as timm\'s SAM ViTs (default: from last.pt / the recipe)')
    p.add_argument('--crop-pct', type=float, help='ImageNet models: resize to img_size / crop_pct, centre-crop '
                   '(default: from last.pt / the recipe; timm\'s SAM ViTs: 0.9)')
    p.add_argument('--eval-interp', choices=['bilinear', 'bicubic'], help='ImageNet models: resize filter '
                   '(default: from last.pt / the recipe; timm\'s SAM ViTs: bicubic)')
    p.add_argument('--corruptions', nargs='+', default=CORRUPTIONS, choices=CORRUPTIONS, metavar='NAME',
                   help='default: all 19')
    p.add_argument('--severities', nargs='+', type=int, default=list(SEVERITIES), choices=SEVERITIES)
    p.add_argument('--subset', type=int, default=0, help='corrupt / attack: N class-balanced clean images (0 = all)')
    p.add_argument('--seed', type=int, default=0, help="seeds each image's corruption and PGD start")
    p.add_argument('--cache', metavar='DIR', help='corrupt: the corrupted set, CIFAR-10-C layout; a second run '
                   'only evaluates (default OUT/corrupted; pass one DIR to share it between checkpoints)')
    p.add_argument('--workers', type=int, default=min(8, os.cpu_count() or 1),
                   help='processes that corrupt images / load ImageNet images (0 = this process)')
    p.add_argument('--eval-batch-size', type=int, default=256, help='images per forward, per process')
    p.add_argument('--amp', choices=['auto', 'bf16', 'off'], default='auto',
                   help='bf16 autocast for the benchmark forwards (auto: on CUDA); the attack always runs fp32')
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
    if args.benchmark in ('imagenet-c', 'imagenet-r', 'cifar10-c') and not args.clean:
        raise UserError(f'--benchmark {args.benchmark} needs --clean DIR, the clean test set whose accuracy '
                        'goes beside the corrupted figures')
    if not (args.eps >= 0 and args.alpha > 0 and args.steps >= 1 and args.subset >= 0 and args.workers >= 0
            and args.eval_batch_size >= 1):
        raise UserError('need --eps >= 0, --alpha > 0, --steps >= 1, --subset >= 0, --workers >= 0, '
                        '--eval-batch-size >= 1')
    return args


# -----------------------------------------------------------------------------
# The figures, from counts {corruption: {severity: (correct, n)}} and clean = (correct, n).
def pct(correct, n):
    return {'correct': correct, 'n': n, 'acc': 100 * correct / n}


def summarize(counts, clean, with_mce=False):
    acc = {c: {s: 100 * k / n for s, (k, n) in per.items()} for c, per in counts.items()}
    cells = [a for per in acc.values() for a in per.values()]
    r = {'clean': pct(*clean),
         'counts': {c: {str(s): list(kn) for s, kn in per.items()} for c, per in counts.items()},
         'acc': {c: {str(s): a for s, a in per.items()} for c, per in acc.items()},
         'corruption_mean': {c: float(np.mean(list(per.values()))) for c, per in acc.items()},
         'mean_acc': float(np.mean(cells)),  # the paper's figure: each (corruption, severity) weighs the same
         'groups': {g: float(np.mean([a for c in names if c in acc for a in acc[c].values()]))
                    for g, names in GROUPS.items() if any(c in acc for c in names)}}
    r['gap'] = r['clean']['acc'] - r['mean_acc']
    # mCE (Hendrycks & Dietterich 2019, Sec. 4.1): CE_c = sum_s E_{s,c} / sum_s E^AlexNet_{s,c}; with
    # AlexNet's mean over s in the table, CE_c = mean_s(err) / ALEXNET_ERR[c]; mCE = 100 x mean of CE_c
    complete = all(c in acc and set(acc[c]) == set(SEVERITIES) for c in BENCHMARK_15)
    r['mce'] = (float(np.mean([(100 - r['corruption_mean'][c]) / ALEXNET_ERR[c] for c in BENCHMARK_15]))
                if with_mce and complete else None)
    return r


# -----------------------------------------------------------------------------
# Counting. Images travel as uint8 and are normalised on the device (augment.normalize), so clean,
# corrupted and attacked images share one preprocessing, and PGD can attack pixels.
def rank_slice(n, rank, world):
    """Rank r's contiguous share [lo, hi) of n images: no padding, no duplicates."""
    return n * rank // world, n * (rank + 1) // world


def all_reduce(t, world):
    if world > 1:
        dist.all_reduce(t)
    return t


def barrier(world):
    if world > 1:
        dist.barrier()


def count_array(model, images, labels, mean, std, batch_size, amp):
    """Correct predictions on images (N, H, W, 3) uint8 (the CIFAR-10-C layout), all on this process."""
    x = torch.from_numpy(np.array(images)).to(mean.device).permute(0, 3, 1, 2)  # a copy: memmaps are read-only
    y = torch.as_tensor(np.asarray(labels), dtype=torch.int64, device=mean.device)
    autocast = torch.autocast(mean.device.type, torch.bfloat16, enabled=amp)
    return train_cifar.evaluate(model, x, y, mean, std, batch_size, autocast=autocast)['correct']


@torch.no_grad()
def predict(model, x_u8, mean, std, amp=False, mask=None):
    """Top-1 class; with mask (ImageNet-R), the argmax over those classes only, as an index of all."""
    with torch.autocast(x_u8.device.type, torch.bfloat16, enabled=amp):
        logits = model(normalize(x_u8, mean, std)).float()
    return logits.argmax(1) if mask is None else mask[logits[:, mask].argmax(1)]


# -----------------------------------------------------------------------------
# On-the-fly corruption with the benchmark's own code, through the imagecorruptions-imaug fork (the
# original 1.1.2 no longer imports on current setuptools). It draws from numpy's global RNG, so each
# image is seeded from its own key: no RNG stream is shared between images.
def image_seed(*key):
    return int(np.random.SeedSequence([int(k) for k in key]).generate_state(1)[0])


def corrupt_chunk(task):
    """(images (B, H, W, 3) uint8, index of the first, corruption, severity, seed) -> corrupted copy."""
    from imagecorruptions import corrupt
    images, start, corruption, severity, seed = task
    out = np.empty_like(images)
    for i, image in enumerate(images):
        s = image_seed(seed, CORRUPTIONS.index(corruption), severity, start + i)
        np.random.seed(s)
        # glass_blur and impulse_noise ignore the global RNG (a fresh default_rng) unless handed a seed
        kw = {}
        out[i] = corrupt(image, severity=severity, corruption_name=corruption, **kw)
    return out


def corruption_package():
    """The package's version, or a UserError saying how to install it (also tqdm, for the progress bar)."""
    if importlib.util.find_spec('imagecorruptions') is None or importlib.util.find_spec('tqdm') is None:
        raise UserError(f'on-the-fly corruption needs the imagecorruptions-imaug and tqdm packages; {EXTRAS}')
    return importlib.metadata.version('imagecorruptions-imaug')


def open_cache(cache_dir, images, labels, seed, version, rank, world):
    """Make cache_dir (meta.json, labels.npy), or check that it holds this set: other images or another
    seed are refused. Returns the corruptions whose .npy is complete."""
    meta = {'seed': seed, 'n': len(labels), 'image_shape': list(images.shape[1:]), 'package': version,
            'sha256': hashlib.sha256(images.tobytes() + labels.tobytes()).hexdigest(),
            'layout': 'CIFAR-10-C: <corruption>.npy holds severities 1..5 x n images in order; labels.npy'}
    path = os.path.join(cache_dir, 'meta.json')
    if os.path.isfile(path):
        with open(path) as f:
            old = json.load(f)
        if any(old.get(k) != meta[k] for k in ('seed', 'n', 'image_shape', 'sha256')):
            raise UserError(f'--cache {cache_dir} holds a corrupted set of other images or another seed (seed '
                            f'{old.get("seed")}, {old.get("n")} images); pick another --cache')
    elif rank == 0:
        try:
            os.makedirs(cache_dir, exist_ok=True)
        except OSError as e:
            raise UserError(f'--cache {cache_dir}: {e.strerror or e}')
        atomic(os.path.join(cache_dir, 'labels.npy'), lambda f: np.save(f, np.tile(labels, len(SEVERITIES))))
        atomic(path, lambda f: f.write(json.dumps(meta, indent=1).encode()))
    barrier(world)  # meta.json is there for every rank
    return {c for c in CORRUPTIONS if os.path.isfile(os.path.join(cache_dir, f'{c}.npy'))}


def corruption_accuracy(model, images_u8, labels, mean, std, corruptions=CORRUPTIONS, severities=SEVERITIES,
                        seed=0, cache_dir=None, batch_size=256, *, workers=0, rank=0, world=1, amp=False,
                        progress=False):
    """Accuracy (%) of `model` on uint8 images (N, 3, H, W), H, W >= 32, corrupted on the fly, and clean.

    mean, std: the model's per-channel input normalisation on [0, 1] pixels (3 numbers each).
    cache_dir: keep the corrupted set there (CIFAR-10-C layout, all 5 severities) so that the next
    call only evaluates; None: in memory. workers: processes that corrupt. Under torch.distributed
    pass rank and world: each rank corrupts and evaluates its contiguous slice, the counts are
    all-reduced, and the ranks write the cache together (a file system they share).
    Returns summarize()'s dict (clean, counts, acc, corruption_mean, mean_acc, groups, gap) + note."""
    version = corruption_package()
    from tqdm import tqdm
    if len(labels) != len(images_u8) or images_u8.dtype != torch.uint8 or images_u8.ndim != 4 \
            or min(images_u8.shape[2:]) < 32:
        raise UserError(f'need uint8 images (N, 3, H, W) of at least 32 px and N labels; got {images_u8.dtype} '
                        f'{tuple(images_u8.shape)} and {len(labels)} labels')
    device = next(model.parameters()).device
    mean, std = (torch.tensor(v, dtype=torch.float32, device=device).view(1, 3, 1, 1) for v in (mean, std))
    images = images_u8.permute(0, 2, 3, 1).contiguous().numpy()  # (N, H, W, 3): the package's and C layout
    labels = np.asarray(labels, np.int64)
    n = len(labels)
    lo, hi = rank_slice(n, rank, world)
    cached = open_cache(cache_dir, images, labels, seed, version, rank, world) if cache_dir else set()
    todo = [c for c in corruptions if c not in cached]
    made = SEVERITIES if cache_dir else severities  # a cached file holds all five
    bar = tqdm(total=(hi - lo) * len(todo) * len(made), desc='corrupting', unit='img', file=sys.stderr,
               disable=not (progress and todo))
    pool = None  # spawned, not forked: this process already runs torch's threads
    if workers and todo:
        pool = concurrent.futures.ProcessPoolExecutor(workers, multiprocessing.get_context('spawn'))
    counts = torch.zeros(len(corruptions) + 1, len(severities), dtype=torch.float64, device=device)
    try:
        for i, c in enumerate(corruptions):
            if c in todo:  # chunks of 100 images of this rank's slice, at each severity
                tasks = [(images[j:min(j + 100, hi)], j, c, s, seed) for s in made for j in range(lo, hi, 100)]
                parts = []
                for part in pool.map(corrupt_chunk, tasks) if pool else map(corrupt_chunk, tasks):
                    parts.append(part)
                    bar.update(len(part))
                k = len(range(lo, hi, 100))
                rows = {s: np.concatenate(parts[m * k:(m + 1) * k] or [images[:0]]) for m, s in enumerate(made)}
                if cache_dir:
                    write_cache(cache_dir, c, rows, n, lo, hi, rank, world)
            else:
                data = np.load(os.path.join(cache_dir, f'{c}.npy'), mmap_mode='r')
                rows = {s: data[(s - 1) * n + lo:(s - 1) * n + hi] for s in severities}
            for j, s in enumerate(severities):
                counts[i, j] = count_array(model, rows[s], labels[lo:hi], mean, std, batch_size, amp)
    finally:
        bar.close()
        if pool:
            pool.shutdown(cancel_futures=True)
    counts[-1, 0] = count_array(model, images[lo:hi], labels[lo:hi], mean, std, batch_size, amp)
    counts = all_reduce(counts, world).long().tolist()
    r = summarize({c: {s: (counts[i][j], n) for j, s in enumerate(severities)} for i, c in enumerate(corruptions)},
                  (counts[-1][0], n))
    which = 'CIFAR-10-C' if images.shape[1] == 32 else 'ImageNet-C (224 px, saved as JPEG)'
    r['note'] = NOTE.format(v=version, h=images.shape[1], w=images.shape[2], seed=seed, which=which)
    return r


def write_cache(cache_dir, corruption, rows, n, lo, hi, rank, world):
    """Each rank writes its rows of <corruption>.npy.tmp, which rank 0 made, then renames."""
    path = os.path.join(cache_dir, f'{corruption}.npy')
    if rank == 0:
        np.lib.format.open_memmap(f'{path}.tmp', 'w+', np.uint8, (len(SEVERITIES) * n, *rows[1].shape[1:])).flush()
    barrier(world)
    out = np.lib.format.open_memmap(f'{path}.tmp', 'r+')
    for s, block in rows.items():
        out[(s - 1) * n + lo:(s - 1) * n + hi] = block
    out.flush()
    del out
    barrier(world)
    if rank == 0:
        os.replace(f'{path}.tmp', path)


# -----------------------------------------------------------------------------
# Published benchmarks.
def read_cifar10c(root, corruptions, num_classes):
    """{corruption: (5N, H, W, 3) uint8 memmap}, labels (5N,), in the layout RobustBench's
    load_corruptions_cifar reads; every file is checked against labels.npy."""
    found = sorted(f for f in os.listdir(root) if f.endswith('.npy')) if os.path.isdir(root) else None
    if found is None:
        raise UserError(f'--data {root}: no such folder (CIFAR-10-C: DIR/<corruption>.npy and DIR/labels.npy)')
    for name in [f'{c}.npy' for c in corruptions] + ['labels.npy']:
        if name not in found:
            raise UserError(f'{os.path.join(root, name)} not found; {root} has: {", ".join(found) or "no .npy files"}')
    labels = np.load(os.path.join(root, 'labels.npy'))
    arrays = {c: np.load(os.path.join(root, f'{c}.npy'), mmap_mode='r') for c in corruptions}
    for c, a in arrays.items():
        if a.dtype != np.uint8 or a.ndim != 4 or a.shape[-1] != 3 or len(a) % len(SEVERITIES):
            raise UserError(f'{root}/{c}.npy is {a.dtype} {a.shape}; expected uint8 (5 x N, H, W, 3)')
        if len(a) != len(labels):
            raise UserError(f'{root}/labels.npy has {len(labels)} labels but {c}.npy has {len(a)} images')
    if labels.min() < 0 or labels.max() >= num_classes:
        raise UserError(f'{root}/labels.npy holds labels outside 0..{num_classes - 1}, the model\'s classes')
    return arrays, labels


def evaluate_arrays(model, arrays, labels, clean, mean, std, severities, batch_size, rank, world, amp):
    """Counts on C-layout arrays (severity s: rows (s-1)N..sN) and on clean = (images HWC, labels)."""
    counts = torch.zeros(len(arrays) + 1, len(severities), dtype=torch.float64, device=mean.device)
    for i, a in enumerate(arrays.values()):
        n = len(a) // len(SEVERITIES)
        lo, hi = rank_slice(n, rank, world)
        for j, s in enumerate(severities):
            rows = slice((s - 1) * n + lo, (s - 1) * n + hi)
            counts[i, j] = count_array(model, a[rows], labels[rows], mean, std, batch_size, amp)
    lo, hi = rank_slice(len(clean[1]), rank, world)
    counts[-1, 0] = count_array(model, clean[0][lo:hi], clean[1][lo:hi], mean, std, batch_size, amp)
    counts = all_reduce(counts, world).long().tolist()
    return ({c: {s: (counts[i][j], len(a) // len(SEVERITIES)) for j, s in enumerate(severities)}
             for i, (c, a) in enumerate(arrays.items())}, (counts[-1][0], len(clean[1])))


def imagenet_c_samples(root, corruption, severity, class_to_idx):
    """[(path, class index)] of root/<corruption>/<severity>/<wnid>/*. Every wnid folder must be a
    class of the clean set, whose index it gets, whichever wnids this folder holds."""
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


def imagenet_r_mask(class_wnids):
    """The indices, among the model's classes, of ImageNet-R's 200 wnids. The list is timm's package data
    (timm/data/_info/imagenet_r_synsets.txt, the imagenet_r_wnids of hendrycks/imagenet-r eval.py)."""
    if importlib.util.find_spec('timm') is None:
        raise UserError('ImageNet-R takes its list of 200 wnids from the timm package: pip install timm')
    r_wnids = pkgutil.get_data('timm.data', '_info/imagenet_r_synsets.txt').decode().split()
    missing = [w for w in r_wnids if w not in class_wnids]
    if missing:
        raise UserError(f'the --clean classes lack {len(missing)} of ImageNet-R\'s wnids (first: {missing[0]}): '
                        'ImageNet-R needs an ImageNet-1k model and its val folder')
    return torch.tensor(sorted(class_wnids.index(w) for w in r_wnids)), r_wnids


class Samples(torch.utils.data.Dataset):
    """(path, label) pairs -> (uint8 image (3, H, W), label, index). An image PIL cannot decode comes
    back with label -1 (an exception in a loader worker arrives wrapped in its traceback); the
    main process then names the file (evaluate_folders, attack_counts)."""

    def __init__(self, samples, transform, size):
        self.samples, self.transform, self.size = samples, transform, size

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        try:
            return self.transform(default_loader(self.samples[i][0])), self.samples[i][1], i
        except (OSError, ValueError):  # PIL: cannot identify image file, truncated, ...
            return torch.zeros(3, self.size, self.size, dtype=torch.uint8), -1, i


def loader(samples, transform, batch_size, workers, rank, world):
    """Rank r reads samples r, r + W, ... (no padding, no duplicates)."""
    size = transform.transforms[1].size[0]  # the centre crop's
    subset = torch.utils.data.Subset(Samples(samples, transform, size), range(rank, len(samples), world))
    for x, y, i in torch.utils.data.DataLoader(subset, batch_size, num_workers=workers,
                                               pin_memory=torch.cuda.is_available()):
        if (y < 0).any():  # still on the CPU: no host sync
            bad = samples[int(i[y < 0][0])][0]
            raise UserError(f'cannot decode {bad} (corrupt or truncated); replace or delete it')
        yield x, y, i


def evaluate_folders(model, groups, transform, mean, std, batch_size, workers, rank, world, amp, mask=None):
    """groups {name: [(path, label)]} -> {name: (correct, n)}. With mask (ImageNet-R), the groups named
    'imagenet-r' and 'clean_200' are scored on the masked logits, the others on all of them."""
    names = list(groups)
    group_of = torch.tensor([g for g, name in enumerate(names) for _ in groups[name]], device=mean.device)
    masked = torch.tensor([name in ('imagenet-r', 'clean_200') for name in names], device=mean.device)
    counts = torch.zeros(len(names), 2, dtype=torch.float64, device=mean.device)
    mask = None if mask is None else mask.to(mean.device)
    model.eval()
    for x, y, i in loader([s for name in names for s in groups[name]], transform, batch_size, workers, rank, world):
        x, y, g = x.to(mean.device), y.to(mean.device), group_of[i.to(mean.device)]
        pred = predict(model, x, mean, std, amp)
        if mask is not None:
            pred = torch.where(masked[g], predict(model, x, mean, std, amp, mask), pred)
        counts.index_put_((g, torch.zeros_like(g)), (pred == y).double(), accumulate=True)
        counts.index_put_((g, torch.ones_like(g)), torch.ones_like(y, dtype=torch.float64), accumulate=True)
    counts = all_reduce(counts, world).long().tolist()
    return {name: tuple(kn) for name, kn in zip(names, counts)}


# -----------------------------------------------------------------------------
# The attack: clean and robust accuracy; each image's random start is seeded from (seed, its index).
def attack_counts(model, batches, mean, std, kind, eps, alpha, steps, seed):
    """batches of (uint8 x, labels, indices) -> [clean correct, robust correct, n] on this process, fp32."""
    pixels = lambda v: normalize(v * 255, mean, std)  # noqa: E731  eps is measured on [0, 1] pixels
    counts = torch.zeros(3, dtype=torch.float64, device=mean.device)
    model.eval()
    for x_u8, y, idx in batches:
        x_u8, y = x_u8.to(mean.device), y.to(mean.device)
        x = x_u8.float() / 255
        if kind == 'fgsm':
            x_adv = fgsm(model, x, y, eps, normalize=pixels)
        else:  # U(-eps, eps) per image from its own generator: independent of batches and ranks
            gens = [torch.Generator().manual_seed(image_seed(seed, int(i))) for i in idx]
            start = torch.stack([torch.rand(x.shape[1:], generator=g) for g in gens]).to(x.device) * 2 * eps - eps
            x_adv = pgd(model, x, y, eps, alpha, steps, random_start=start, normalize=pixels)
        with torch.no_grad():
            counts += torch.stack([(predict(model, x_u8, mean, std) == y).sum(),
                                   (model(pixels(x_adv)).argmax(1) == y).sum()] + [torch.tensor(len(y))]).double()
    return counts


# -----------------------------------------------------------------------------
# Model and preprocessing from the command line and the checkpoint.
def load_model(args, stored, dataset, num_classes, device):
    """-> model (eval mode, on device), its name, model_kw strings, preprocessing dict."""
    name = args.model or stored.get('model')
    if not name:
        raise UserError(f'give --model: {args.checkpoint} does not say which model it holds')
    kw = args.model_kw if args.model_kw is not None else stored.get('model_kw') or []
    if dataset == 'imagenet':
        recipe = train_imagenet.RECIPES[stored.get('recipe') or 'sam']
        prep = {k: getattr(args, k) or stored.get(k) or recipe.get(k) for k in ('norm', 'crop_pct', 'eval_interp')}
        prep['img_size'] = args.img_size or stored.get('img_size') or 224
        prep['mean'], prep['std'] = train_imagenet.MEANS[prep['norm']]
        model = train_imagenet.build_model(name, num_classes, prep['img_size'], train_imagenet.parse_model_kw(kw))
        train_imagenet.load_weights(model, args.checkpoint)
    else:
        prep = dict(img_size=32, mean=train_cifar.MEAN[dataset], std=train_cifar.STD[dataset])
        model = train_cifar.build_model(name, train_cifar.NUM_CLASSES[dataset], train_cifar.parse_model_kw(kw))
        train_cifar.load_weights(model, args.checkpoint)
    return model.to(device).eval(), name, kw, prep


def eval_transform(prep):
    """train_imagenet.eval_transform's resize, centre crop and PILToTensor (uint8); its ToDtype +
    Normalize run on the device instead (augment.normalize: the same arithmetic)."""
    t = train_imagenet.eval_transform(prep['img_size'], prep['crop_pct'], prep['eval_interp'], prep['norm'])
    assert isinstance(t.transforms[-1], v2.Normalize) and isinstance(t.transforms[-2], v2.ToDtype)
    return v2.Compose(t.transforms[:-2])


def folder_samples(root, subset=0):
    """An ImageFolder set: (sorted wnids, [(path, class index)]); subset: the first N/C of each class."""
    try:
        classes, class_to_idx = find_classes(root)
    except (FileNotFoundError, NotADirectoryError) as e:
        raise UserError(f'{root}: {e} (expected DIR/<wnid>/*.JPEG)')
    samples = make_dataset(root, class_to_idx, extensions=IMG_EXTENSIONS, allow_empty=True)
    if subset:
        picked = [[s for s in samples if s[1] == c][:subset // len(classes) + (c < subset % len(classes))]
                  for c in range(len(classes))]
        samples = sorted(s for p in picked for s in p)
        if len(samples) < subset:
            raise UserError(f'{root} has too few images of some class for a class-balanced --subset {subset}')
    return classes, samples


# -----------------------------------------------------------------------------
# Output: a console table, results.json, results.csv, heatmap.png; `compare` draws bars of two or more.
def atomic(path, write):
    """write(file) into PATH.tmp, then os.replace: a reader sees the old file or the new one."""
    try:
        with open(f'{path}.tmp', 'wb') as f:
            write(f)
        os.replace(f'{path}.tmp', path)
    except OSError as e:
        if os.path.exists(f'{path}.tmp'):
            os.remove(f'{path}.tmp')
        raise UserError(f'could not write {path}: {e.strerror or e}')


def table(r):
    out = [f'{r["benchmark"]} on {r["dataset"]} | {r["model"]} | {r["checkpoint"]} | clean {r["clean"]["acc"]:.2f}% '
           f'of {r["clean"]["n"]:,} images']
    if 'acc' in r:
        sev = sorted({s for per in r['acc'].values() for s in per}, key=int)
        out.append(f'{"corruption":<18}' + ''.join(f'{"s" + s:>7}' for s in sev) + '   mean')
        out += [f'{c:<18}' + ''.join(f'{per[s]:7.2f}' for s in sev) + f'{r["corruption_mean"][c]:7.2f}'
                for c, per in r['acc'].items()]
        out.append('groups: ' + ' | '.join(f'{g} {a:.2f}' for g, a in r['groups'].items()))
        mce = '' if r['mce'] is None else f' | mCE {r["mce"]:.2f} (15 corruptions, AlexNet = 100)'
        out.append(f'mean corruption accuracy {r["mean_acc"]:.2f}% ({sum(map(len, r["acc"].values()))} cells) | '
                   f'clean {r["clean"]["acc"]:.2f}% | gap {r["gap"]:.2f} points{mce}')
    if 'imagenet_r' in r:
        out.append(f'ImageNet-R {r["imagenet_r"]["acc"]:.2f}% of {r["imagenet_r"]["n"]:,} (200-class logits) | '
                   f'clean val, same 200 classes {r["clean_200"]["acc"]:.2f}% | gap {r["gap"]:.2f} points')
    if 'attack' in r:
        a = r['attack']
        out.append(f'{a["name"]} | clean {a["clean_acc"]:.2f}% | robust {a["robust_acc"]:.2f}% of {a["n"]:,} images')
    return '\n'.join(out + ([f'note: {r["note"]}'] if 'note' in r else []))


def csv_text(r):
    group = {c: g for g, names in GROUPS.items() for c in names}
    rows = [['benchmark', 'corruption', 'group', 'severity', 'correct', 'n', 'acc'],
            [r['benchmark'], 'clean', '', '', r['clean']['correct'], r['clean']['n'], r['clean']['acc']]]
    for c, per in r.get('counts', {}).items():
        rows += [[r['benchmark'], c, group[c], s, k, n, r['acc'][c][s]] for s, (k, n) in per.items()]
    rows += [[r['benchmark'], key, '', '', r[key]['correct'], r[key]['n'], r[key]['acc']]
             for key in ('imagenet_r', 'clean_200') if key in r]
    if 'attack' in r:
        a = r['attack']
        rows.append([a['name'], 'robust', '', '', a['robust_correct'], a['n'], a['robust_acc']])
    f = io.StringIO()
    csv.writer(f, lineterminator='\n').writerows(rows)
    return f.getvalue()


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise UserError(f'plots need matplotlib; {EXTRAS} (or pass --no-plot)') from None
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    return plt


def heatmap(r, path):
    plt = pyplot()
    sev = sorted({s for per in r['acc'].values() for s in per}, key=int)
    grid = np.array([[per[s] for s in sev] for per in r['acc'].values()])
    fig, ax = plt.subplots(figsize=(1.1 * len(sev) + 3.5, 0.32 * len(grid) + 1.6))
    im = ax.imshow(grid, cmap='viridis', vmin=0, vmax=100, aspect='auto')
    for (i, j), a in np.ndenumerate(grid):
        ax.text(j, i, f'{a:.1f}', ha='center', va='center', fontsize=7, color='w' if a < 60 else 'k')
    ax.set_xticks(range(len(sev)), [f'severity {s}' for s in sev], fontsize=8)
    ax.set_yticks(range(len(grid)), list(r['acc']), fontsize=8)
    ax.set_title(f'{r["model"]}, {r["benchmark"]} on {r["dataset"]}: mean {r["mean_acc"]:.1f}%, '
                 f'clean {r["clean"]["acc"]:.1f}%', fontsize=9)
    fig.colorbar(im, ax=ax, label='top-1 accuracy (%)')
    fig.tight_layout()
    atomic(path, lambda f: fig.savefig(f, format='png', dpi=120))
    plt.close(fig)


def compare(argv):
    """robustness.py compare A.json B.json ... --out chart.png: bars per corruption, the mean and clean."""
    p = argparse.ArgumentParser(prog='robustness.py compare', description=compare.__doc__)
    p.add_argument('results', nargs='+', help='results.json of two or more robustness.py --benchmark runs')
    p.add_argument('--labels', nargs='+', help='a legend entry per file (default: model and checkpoint)')
    p.add_argument('--out', required=True, help='the PNG to write')
    args = p.parse_args(argv)
    if len(args.results) < 2 or (args.labels and len(args.labels) != len(args.results)):
        raise UserError('compare needs two or more results.json files (and as many --labels, if any)')
    runs = []
    for path in args.results:
        try:
            with open(path) as f:
                runs.append(json.load(f))
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f'cannot read {path}: {e}')
        if 'corruption_mean' not in runs[-1]:
            raise UserError(f'{path} holds no corruption figures (from a --benchmark run of robustness.py)')
    plt = pyplot()
    keys = [c for c in runs[0]['corruption_mean'] if all(c in r['corruption_mean'] for r in runs)] + ['mean', 'clean']
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(0.3 * len(keys) * len(runs) + 2.5, 4))
    for k, (r, label) in enumerate(zip(runs, args.labels or [f'{r["model"]} ({r["checkpoint"]})' for r in runs])):
        values = [r['corruption_mean'][c] for c in keys[:-2]] + [r['mean_acc'], r['clean']['acc']]
        ax.bar(np.arange(len(keys)) + (k - (len(runs) - 1) / 2) * width, values, width, label=label)
    ax.set_xticks(range(len(keys)), keys, rotation=60, ha='right', fontsize=8)
    ax.set_ylabel('top-1 accuracy (%), mean over severities')
    ax.set_title(runs[0]['benchmark'], fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic(args.out, lambda f: fig.savefig(f, format='png', dpi=120))
    plt.close(fig)
    print(f'wrote {args.out}')


# -----------------------------------------------------------------------------
def main(argv=None):
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    if argv[:1] == ['compare']:
        return compare(argv[1:])
    args = get_args(argv)
    t_start = time.time()

    # --- before anything slow: the output folder, the optional packages, the checkpoint ---
    out_json = os.path.join(args.out, 'results.json')
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UserError(f'--out {args.out} is a file, not a folder')
    if os.path.exists(out_json) and not args.overwrite:
        raise UserError(f'--out {args.out} already holds results.json; pick another --out or pass --overwrite')
    try:  # a real write now, not after hours of evaluation (permission bits do not stop root)
        os.makedirs(args.out, exist_ok=True)
        tempfile.TemporaryFile(dir=args.out).close()
    except OSError as e:
        raise UserError(f'--out {args.out} is not writable: {e.strerror or e}')
    if args.benchmark and not args.no_plot:
        pyplot()
    if args.benchmark == 'corrupt':
        corruption_package()
    if not os.path.isfile(args.checkpoint):
        raise UserError(f'--checkpoint {args.checkpoint}: no such file')
    stored = train_imagenet.stored_args(args.checkpoint) or {}  # our last.pt (either script), else {}
    dataset = (args.dataset or stored.get('dataset') or ('imagenet' if 'recipe' in stored else None)
               or ('cifar10' if args.benchmark == 'cifar10-c' else 'imagenet'))
    if args.benchmark in ('imagenet-c', 'imagenet-r') and dataset != 'imagenet':
        raise UserError(f'--benchmark {args.benchmark} needs an ImageNet model; {args.checkpoint} is a '
                        f'{dataset} one')
    if args.benchmark == 'cifar10-c' and dataset != 'cifar10':
        raise UserError(f'CIFAR-10-C has the 10 classes of cifar10; {args.checkpoint} is a {dataset} model')

    # --- distributed setup, the torchrun way ---------------------------------
    rank, world = int(os.environ.get('RANK', 0)), int(os.environ.get('WORLD_SIZE', 1))
    device = torch.device(f'cuda:{os.environ.get("LOCAL_RANK", 0)}' if torch.cuda.is_available() else 'cpu')
    if device.type == 'cuda':
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group('nccl' if device.type == 'cuda' else 'gloo')
    master = rank == 0
    amp = args.amp == 'bf16' or (args.amp == 'auto' and device.type == 'cuda')

    # --- model and clean set --------------------------------------------------
    clean_root = args.clean if args.benchmark in ('imagenet-c', 'imagenet-r', 'cifar10-c') else args.data
    if dataset == 'imagenet':
        classes, samples = folder_samples(clean_root, args.subset)
        model, name, kw, prep = load_model(args, stored, dataset, len(classes), device)
        transform = eval_transform(prep)
        if args.benchmark == 'imagenet-r' and len(classes) != 1000:
            raise UserError(f'ImageNet-R needs 1000-class logits (an ImageNet-1k model and its val folder); '
                            f'--clean {clean_root} has {len(classes)} classes')
    else:
        model, name, kw, prep = load_model(args, stored, dataset, None, device)
        x_clean, y_clean = train_cifar.load_cifar(clean_root, dataset, train=False, subset=args.subset)
    mean, std = (torch.tensor(prep[k], dtype=torch.float32, device=device).view(1, 3, 1, 1) for k in ('mean', 'std'))
    r = {'benchmark': args.benchmark or 'attack', 'model': name, 'model_kw': kw, 'checkpoint': args.checkpoint,
         'dataset': dataset, 'data': args.data, 'clean_set': clean_root, 'preprocessing': prep, 'seed': args.seed,
         'world_size': world, 'amp': amp, 'device': str(device)}
    batch = args.eval_batch_size

    # --- the benchmark ---------------------------------------------------------
    if args.benchmark == 'cifar10-c':
        arrays, labels = read_cifar10c(args.data, args.corruptions, 10)
        clean = (x_clean.permute(0, 2, 3, 1).numpy(), y_clean.numpy())
        r.update(summarize(*evaluate_arrays(model, arrays, labels, clean, mean, std, args.severities, batch,
                                            rank, world, amp)))
    elif args.benchmark == 'imagenet-c':
        class_to_idx = {w: i for i, w in enumerate(classes)}
        groups = {(c, s): imagenet_c_samples(args.data, c, s, class_to_idx) for c in args.corruptions
                  for s in args.severities}
        k = evaluate_folders(model, {**groups, 'clean': samples}, transform, mean, std, batch, args.workers,
                             rank, world, amp)
        r.update(summarize({c: {s: k[(c, s)] for s in args.severities} for c in args.corruptions}, k['clean'],
                           with_mce=True))
    elif args.benchmark == 'imagenet-r':
        mask, r_wnids = imagenet_r_mask(classes)
        r_classes, r_samples = folder_samples(args.data)
        for w in set(r_classes) - set(r_wnids):
            raise UserError(f'{args.data}/{w} is not one of ImageNet-R\'s 200 wnids')
        r_samples = [(p, classes.index(r_classes[label])) for p, label in r_samples]  # labels: the model's indices
        in_r = set(mask.tolist())
        k = evaluate_folders(model, {'imagenet-r': r_samples, 'clean': samples,
                                     'clean_200': [s for s in samples if s[1] in in_r]},
                             transform, mean, std, batch, args.workers, rank, world, amp, mask)
        r.update(imagenet_r=pct(*k['imagenet-r']), clean=pct(*k['clean']), clean_200=pct(*k['clean_200']))
        r['gap'] = r['clean_200']['acc'] - r['imagenet_r']['acc']
    elif args.benchmark == 'corrupt':
        if dataset == 'imagenet':
            x_clean = torch.stack([transform(default_loader(p)) for p, _ in samples])
            y_clean = torch.tensor([label for _, label in samples])
        r.update(corruption_accuracy(model, x_clean, y_clean, prep['mean'], prep['std'], args.corruptions,
                                     args.severities, args.seed, args.cache or os.path.join(args.out, 'corrupted'),
                                     batch, workers=args.workers, rank=rank, world=world, amp=amp, progress=master))

    # --- the attack, on the clean set ------------------------------------------
    if args.attack:
        if dataset == 'imagenet':
            n, batches = len(samples), loader(samples, transform, batch, args.workers, rank, world)
        else:
            n = len(y_clean)
            lo, hi = rank_slice(n, rank, world)
            batches = ((x_clean[s:e], y_clean[s:e], torch.arange(s, e))
                       for s, e in ((s, min(s + batch, hi)) for s in range(lo, hi, batch)))
        k = all_reduce(attack_counts(model, batches, mean, std, args.attack, args.eps / 255, args.alpha / 255,
                                     args.steps, args.seed), world).long().tolist()
        label = f'PGD-{args.steps} eps {args.eps:g}/255 alpha {args.alpha:g}/255' if args.attack == 'pgd' \
            else f'FGSM eps {args.eps:g}/255'
        r['attack'] = dict(name=label, kind=args.attack, eps=args.eps, alpha=args.alpha if args.attack == 'pgd'
                           else args.eps, steps=args.steps if args.attack == 'pgd' else 1,
                           clean_correct=k[0], robust_correct=k[1], n=k[2], clean_acc=100 * k[0] / k[2],
                           robust_acc=100 * k[1] / k[2])
        r.setdefault('clean', pct(k[0], k[2]))

    # --- report ----------------------------------------------------------------
    r['wall_s'] = time.time() - t_start
    if master:
        print(table(r))
        atomic(out_json, lambda f: f.write(json.dumps(r, indent=1, allow_nan=False).encode()))
        atomic(os.path.join(args.out, 'results.csv'), lambda f: f.write(csv_text(r).encode()))
        if 'acc' in r and not args.no_plot:
            heatmap(r, os.path.join(args.out, 'heatmap.png'))
        print(f'done | {name} | {r["benchmark"]} | {train_cifar.fmt_time(r["wall_s"])} wall | {args.out}')
    if world > 1:
        dist.destroy_process_group()
    return r


if __name__ == '__main__':
    try:
        main()
    except (UserError, train_cifar.UserError, train_imagenet.UserError) as e:
        sys.exit(f'robustness.py: error: {e}')
