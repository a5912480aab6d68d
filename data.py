"""The data sets every script reads, and their statistics.

CIFAR-10/100: decoded once into uint8 tensors (N, 3, 32, 32), from torchvision's CIFAR folder or an image folder
DIR/{train,test}/<class>/*, with class-balanced subsets; evaluated from the device, exactly under DDP.
ImageNet-style folders: DIR/{train,val}/<wnid>/*, read by torchvision's ImageFolder in loader workers.
"""
import itertools
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import torchvision
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset
from torchvision.transforms import v2

from augment import normalize
from images import UNREADABLE, load_rgb, plain_jpeg, read_rgb, reread_reason
from loader import seeded
from utils import UserError, epoch_seed, one_line, score

# -----------------------------------------------------------------------------
# CIFAR
NUM_CLASSES = {'cifar10': 10, 'cifar100': 100}
# Per-channel mean/std of the training images (CIFAR-10's are the locuslab script's).
MEAN = {'cifar10': (0.4914, 0.4822, 0.4465), 'cifar100': (0.5071, 0.4865, 0.4409)}
STD = {'cifar10': (0.2471, 0.2435, 0.2616), 'cifar100': (0.2673, 0.2564, 0.2762)}


def load_cifar(root, dataset, train, subset=0, classes=None, classes_flag=None, subset_flag=None):
    """uint8 images (N, 3, 32, 32), int64 labels (N,): from an image folder root/{train,test}/<class>/*, else
    from torchvision's CIFAR folder in root (downloaded when absent). subset: the first subset/C per class.
    classes: only these, relabelled 0..k-1 in this order. classes_flag: the caller's flag that picks them, if any.
    subset_flag: the caller's flag for subset, where every class needs an image (a classifier's data)."""
    root, num_classes, split = Path(root), NUM_CLASSES[dataset], 'train' if train else 'test'
    k = len(classes) if classes else num_classes
    if subset_flag and 0 < subset < k:  # (a class never trained on, or a test of some classes only)
        raise UserError(f'{subset_flag} {subset} leaves {k - subset} of the {k} classes without an image (a class-'
                        f'balanced subset takes subset/{k} of each): pass 0 (all) or {k} or more')
    if not ((root / 'train').is_dir() and (root / 'test').is_dir()):
        cls = {'cifar10': torchvision.datasets.CIFAR10, 'cifar100': torchvision.datasets.CIFAR100}[dataset]
        new = not root.exists()
        try:
            ds = cls(root, train=train, download=True)  # a no-op when the files are there and pass their md5
        except (OSError, RuntimeError) as e:  # offline (URLError is an OSError), or a download failing its md5
            if new and root.is_dir() and not any(root.iterdir()):
                root.rmdir()  # torchvision made it: a mistyped --data leaves nothing behind
            found = 'files that fail their md5 check' if (root / cls.base_folder).exists() else f'no {dataset}'
            raise UserError(f'{root} holds {found}, and torchvision could not download it ({one_line(e)}). Fetch '
                            f'{cls.url} into {root}, or pass --data DIR with DIR/train/<class>/*, DIR/test/<class>/*')
        labels = torch.tensor(ds.targets)
        keep = balanced_subset(labels, subset, classes or num_classes)
        return torch.from_numpy(ds.data[keep.numpy()]).permute(0, 3, 1, 2).contiguous(), relabel(labels[keep], classes)
    try:  # torchvision's ImageFolder: the sorted class folders, their index is the label
        ds = torchvision.datasets.ImageFolder(root / split)
    except FileNotFoundError as e:  # an empty class folder, or none at all
        raise UserError(f'{root / split}: {e}')
    train_classes = torchvision.datasets.folder.find_classes(root / 'train')[0]
    if ds.classes == train_classes and len(ds.classes) != num_classes:
        raise UserError(f'{root / split} has {len(ds.classes)} class folders, {dataset} has {num_classes}: --data '
                        f'must hold all {num_classes}' + (f' ({classes_flag} picks some)' if classes_flag else ''))
    if ds.classes != train_classes:
        raise UserError(f'{root / split} must hold the {num_classes} class folders of {root / "train"}; only in '
                        f'{split}: {sorted(set(ds.classes) - set(train_classes))}, only in train: '
                        f'{sorted(set(train_classes) - set(ds.classes))}')
    labels = torch.tensor(ds.targets)
    keep = balanced_subset(labels, subset, classes or num_classes)
    x = []
    for path, _ in (ds.samples[i] for i in keep):  # ~30 us per 32x32 image
        x.append(np.asarray(read_rgb(path)))  # PIL, as RGB
        if x[-1].shape != (32, 32, 3):
            raise UserError(f'{path} is {x[-1].shape[1]}x{x[-1].shape[0]} px; CIFAR images are 32x32')
    return torch.from_numpy(np.stack(x)).permute(0, 3, 1, 2).contiguous(), relabel(labels[keep], classes)


def balanced_subset(labels, n, classes):
    """Sorted indices of the first n // k (+1 for the first n % k) images of each of k classes (a list, or
    range(classes)); n = 0: all of their images."""
    classes = range(classes) if isinstance(classes, int) else classes
    quota = [n // len(classes) + (j < n % len(classes)) if n else len(labels) for j in range(len(classes))]
    picked = [(labels == c).nonzero()[:q, 0] for c, q in zip(classes, quota)]
    if n and any(len(idx) < q for idx, q in zip(picked, quota)):
        raise UserError(f'a class-balanced subset of {n} images needs {max(quota)} of every class; some have fewer')
    return torch.cat(picked).sort().values


def relabel(y, classes):  # --classes 5 6 7: labels 5, 6, 7 -> 0, 1, 2
    return torch.tensor([classes.index(c) for c in y.tolist()], dtype=torch.int64) if classes else y


def resize(x, img_size):  # (B, 3, 32, 32) -> (B, 3, img_size, img_size), bilinear, on the device
    return x if x.shape[-1] == img_size else F.interpolate(x, size=img_size, mode='bilinear', antialias=False)


def evaluate(model, x_u8, y, mean, std, batch_size=1024, rank=0, world=1, autocast=None, channels_last=False,
             img_size=32):
    """utils.score() on uint8 images, exact under DDP: rank r takes the images [r*N/W, (r+1)*N/W)."""
    lo, hi = len(y) * rank // world, len(y) * (rank + 1) // world
    fmt = torch.channels_last if channels_last else torch.preserve_format
    batches = ((resize(normalize(xb, mean, std), img_size).to(memory_format=fmt), yb)
               for xb, yb in zip(x_u8[lo:hi].split(batch_size), y[lo:hi].split(batch_size)))
    return score(model, batches, autocast, world > 1)


def measurement_images(root, dataset, train, n, img_size, norm='jax', classes=None, rank=0, world=1, crop_pct=0.875,
                       interp='bilinear'):
    """n images for a measurement (geometry.py), this process's slice [n r / W, n (r + 1) / W) of them (as evaluate).
    CIFAR: class-balanced, normalised and upsampled as train_cifar.py feeds them; 'imagenet': DIR/train or DIR/val,
    evenly over the sorted images, the eval crop. -> (x, y, the images in [0, 1] for figures, n of all processes)"""
    if dataset == 'imagenet':
        folder = os.path.join(root, 'train' if train else 'val')
        if not os.path.isdir(folder):
            raise UserError(f'{folder} is not a folder; {LAYOUT}')
        ds = torchvision.datasets.ImageFolder(folder, eval_transform(img_size, crop_pct, interp, norm), loader=load_rgb)
        pick = torch.linspace(0, len(ds) - 1, min(n, len(ds))).long()  # only this process's images are read
        x, y = map(torch.stack, zip(*[(ds.transform(read_rgb(ds.samples[i][0])), torch.tensor(ds.targets[i]))
                                      for i in pick[len(pick) * rank // world:len(pick) * (rank + 1) // world]]))
        return x, y, (x - x.min()) / (x.max() - x.min()), len(pick)  # the network's input, for the figures
    u8, y = load_cifar(root, dataset, train, n, classes)
    part = slice(len(y) * rank // world, len(y) * (rank + 1) // world)
    stats = [torch.tensor(v[dataset]).view(1, 3, 1, 1) for v in (MEAN, STD)]
    return resize(normalize(u8[part], *stats), img_size), y[part], u8[part].float() / 255, len(y)


# -----------------------------------------------------------------------------
# ImageNet-style folders
MEANS = {'imagenet': ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
         'jax': ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))}  # official JAX input pipeline: x / 127.5 - 1
LAYOUT = ('expected ImageNet-1k in ImageFolder layout: DIR/train/<wnid>/*.JPEG and DIR/val/<wnid>/*.JPEG (the '
          'validation images sorted into the same class folders, e.g. by the valprep.sh of the PyTorch ImageNet '
          'example; the tars come from image-net.org)')


def eval_transform(img_size, crop_pct=0.875, interp='bilinear', norm='jax', to_float=True):
    """Resize the shorter side to img_size / crop_pct, centre-crop img_size; to_float: then [0, 1] and normalise
    (else uint8, for augment.normalize on the device: the same arithmetic)."""
    mode = {'bilinear': v2.InterpolationMode.BILINEAR, 'bicubic': v2.InterpolationMode.BICUBIC}[interp]
    t = [v2.Resize(int(img_size / crop_pct), mode, antialias=True), v2.CenterCrop(img_size), v2.PILToTensor()]
    return v2.Compose(t + ([v2.ToDtype(torch.float32, scale=True), v2.Normalize(*MEANS[norm])] if to_float else []))


class ImageFolder(torchvision.datasets.ImageFolder):
    """torchvision's, with three changes. An index (i, seed) draws image i's augmentation from its own seed (loader.
    seeded; ResumableSampler gives one per image and epoch), whatever the worker, batch size or resume. An image PIL
    cannot decode comes back blank with label -1 - i (on_device() names the file: a worker's exception arrives inside
    its traceback). decode='gpu': the workers read the file's bytes and its header only (for loader.decode_batch)."""

    def __init__(self, root, split, transform, img_size, decode='cpu'):
        try:
            super().__init__(os.path.join(root, split), transform=transform, loader=load_rgb)
        except (FileNotFoundError, NotADirectoryError, RuntimeError) as e:  # none, a file, no class folders, empty
            raise UserError(f'--data {root}: {e}; {LAYOUT}') from None
        if len(self.classes) < 2:  # one output: cross-entropy 0 from the first step, accuracy 100%, nothing learned
            raise UserError(f'--data {root}: {split} holds 1 class folder ({self.classes[0]}); a classifier (or a '
                            'probe) needs 2 or more')
        self.img_size, self.decode = img_size, decode

    def __getitem__(self, index):
        index, seed = index if isinstance(index, tuple) else (index, None)
        if self.decode == 'gpu':  # (the file's bytes, label, the seed of its draws or -1, index, plain JPEG or not)
            try:  # for loader.collate_bytes; a file PIL refuses from its header on (or unreadable): as below
                data = Path(self.samples[index][0]).read_bytes()
                return data, self.targets[index], -1 if seed is None else seed, index, plain_jpeg(data)
            except UNREADABLE:
                return b'', -1 - index, -1, index, False
        try:  # only decoding: an error of the transform (e.g. an impossible resize) is not the file's
            image = self.loader(self.samples[index][0])
        except UNREADABLE:  # PIL: cannot identify image file, image file is truncated, a decompression bomb, ...
            return torch.zeros(3, self.img_size, self.img_size, dtype=torch.uint8), -1 - index
        with seeded(seed):
            return self.transform(image), self.targets[index]


class ResumableSampler(torch.utils.data.DistributedSampler):
    """Whole optimizer steps only, from step `start` of the epoch on. Each epoch is one permutation that rank r
    reads at r, r + W, ... (drop_last), so step s covers the same images on ANY world size and a resume is a slice."""

    def __init__(self, n, num_replicas, rank, seed, per_step):
        super().__init__(range(n), num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.per_step, self.start = per_step, 0  # per_step: samples this process takes per optimizer step
        self.steps = self.num_samples // per_step  # optimizer steps per epoch (= N // batch); the tail is dropped

    def __iter__(self):  # (image index, the seed of its augmentation: from (seed, epoch, index) only)
        base = epoch_seed(self.seed, self.epoch) << 21
        return iter([(i, base + i) for i in list(super().__iter__())[self.start * self.per_step:
                                                                     self.steps * self.per_step]])

    def __len__(self):
        return (self.steps - self.start) * self.per_step


class OneBatch:
    """--synthetic: one random, normalised batch made once on the device and served every step: the model's speed,
    not the loader's."""

    def __init__(self, size, img_size, num_classes, device):
        self.batch = (torch.randn(size, 3, img_size, img_size, device=device),
                      torch.randint(0, num_classes, (size,), device=device))

    def __iter__(self):
        return itertools.repeat(self.batch)


def folder_samples(root, subset=0):
    """An ImageFolder set DIR/<wnid>/*: (sorted wnids, [(path, class index)]); subset: the first N/C of each class."""
    try:
        classes, class_to_idx = find_classes(root)
    except (FileNotFoundError, NotADirectoryError) as e:
        raise UserError(f'{root}: {e} (expected DIR/<wnid>/*.JPEG)')
    if set(classes) <= {'train', 'val', 'test'}:  # a data set's root, not one of its splits: no 2-class model here
        raise UserError(f'{root} holds the splits {", ".join(classes)}, not class folders: pass {root}/<split>')
    samples = make_dataset(root, class_to_idx, extensions=IMG_EXTENSIONS, allow_empty=True)
    if subset:
        per = [[s for s in samples if s[1] == c][:subset // len(classes) + (c < subset % len(classes))]
               for c in range(len(classes))]
        samples = sorted(s for p in per for s in p)
        if len(samples) < subset:
            raise UserError(f'{root} has too few images of some class for a class-balanced --subset {subset}')
    return classes, samples


class Samples(torch.utils.data.Dataset):
    """(path, label) pairs -> (uint8 image (3, S, S), label, index). An image PIL cannot decode comes back
    with label -1 (an exception in a loader worker arrives inside its traceback); folder_batches names it."""

    def __init__(self, samples, transform):
        self.samples, self.transform, self.size = samples, transform, transform.transforms[1].size  # centre crop's

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        try:  # only decoding: an error of the transform (e.g. an impossible resize) is not the file's
            image = load_rgb(self.samples[i][0])
        except UNREADABLE:  # PIL: cannot identify image file, truncated, a decompression bomb, ...
            return torch.zeros(3, *self.size, dtype=torch.uint8), -1, i
        return self.transform(image), self.samples[i][1], i


def folder_batches(samples, transform, batch_size, workers, rank, world):
    """Rank r reads samples r, r + W, ... -> (x uint8 (B, 3, S, S), y, index into samples)."""
    data = torch.utils.data.Subset(Samples(samples, transform), range(rank, len(samples), world))
    loader = torch.utils.data.DataLoader(data, batch_size, num_workers=workers, pin_memory=torch.cuda.is_available())
    for x, y, i in loader:
        if (y < 0).any():  # still on the CPU: no host sync
            path = samples[int(i[y < 0][0])][0]
            raise UserError(f'cannot decode {path} ({reread_reason(path)}); replace or delete it')
        yield x, y, i

