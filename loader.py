"""The ImageNet loader's parts that are not the data set: loader workers per process from the node, the training
transform, per-image seeding, and --decode gpu (the files' bytes from the workers, decoded and transformed on the
device), and on_device, the batches' last stage. data.ImageFolder uses them; train_imagenet.py, train_contrastive.py
and bench.py too."""
import contextlib
import os

import torch
import torchvision
from torchvision.transforms import v2

from augment import normalize
from images import check_decoded
from utils import UserError


def node_workers():
    """Loader processes per training process: the CPU cores this process may use, shared by the node's local
    processes (torchrun's LOCAL_WORLD_SIZE), less one for the process itself (at least 0: the main process)."""
    return max(0, len(os.sched_getaffinity(0)) // int(os.environ.get('LOCAL_WORLD_SIZE', 1)) - 1)


def train_transform(args, mean):
    """train_imagenet.py's training transform (args: img_size, crop_min, randaug_n, randaug_m; bench.py times it).
    In the loader workers, per image: crop, flip, RandAugment, to uint8 (normalised on the device: on_device)."""
    t = [v2.RandomResizedCrop(args.img_size, scale=(args.crop_min, 1.0), antialias=True), v2.RandomHorizontalFlip()]
    if args.randaug_n > 0:  # torchvision's 31 bins; filled with the mean pixel, as timm. Deviations from timm's
        # rand-m9-mstd0.5: m9 of 10 is bin 27 of 30, with no N(m, 0.5) jitter of m; torchvision's op set.
        t.append(v2.RandAugment(args.randaug_n, args.randaug_m, 31, v2.InterpolationMode.BILINEAR,
                                fill=[round(255 * m) for m in mean]))
    return v2.Compose(t + [v2.PILToTensor()])


@contextlib.contextmanager
def seeded(seed):
    """torch's CPU RNG seeded with seed inside (None: untouched), the caller's state restored after. Only the CPU
    generator, where torchvision's transforms draw: torch.manual_seed would also seed CUDA (lazily, formatting a
    stack trace each call when CUDA is not initialised) and other backends: ~270 us a call on this repo's CPU, this
    ~14 us (README, Performance). The same draws: torch.manual_seed seeds this very generator with the same seed."""
    with torch.random.fork_rng(devices=[], enabled=seed is not None):
        if seed is not None:
            torch.default_generator.manual_seed(seed)
        yield


def collate_bytes(batch):
    """ImageFolder(decode='gpu') items -> (all files' bytes end to end (n,) uint8, labels (B,), each file's byte
    count, seeds, indices (B,)): one tensor through shared memory (a tensor per file took a descriptor each)."""
    data, label, seed, index = zip(*batch)
    return (torch.frombuffer(bytearray(b''.join(data)), dtype=torch.uint8), torch.tensor(label),
            torch.tensor([len(d) for d in data]), torch.tensor(seed), torch.tensor(index))


def decode_batch(data, sizes, seeds, index, dataset, device):
    """--decode gpu: the files' bytes decoded by torchvision.io.decode_jpeg on `device` (nvJPEG on CUDA, all at once;
    a file nvJPEG refuses, e.g. a PNG named .JPEG as one ImageNet training image, by decode_image on the CPU), then
    dataset.transform per image on the device under the image's seed: the crop, resize and flip draw exactly what
    the PIL path draws (the same transform, the same RNG, and its draws depend on the image size only). The pixels
    differ by the resize: torch's antialiased interpolate, not PIL's (tests/test_train_imagenet.py says how much).
    data: the files' bytes end to end (sizes: each file's count). -> uint8 (B, 3, S, S) on device."""
    data = list(data.split(sizes.tolist()))
    try:
        images = torchvision.io.decode_jpeg(data, mode=torchvision.io.ImageReadMode.RGB, device=device)
    except RuntimeError:  # not a JPEG (or CMYK on nvJPEG): decode one at a time, and name a file nothing decodes
        images = []
        for d, i in zip(data, index.tolist()):
            try:
                images.append(torchvision.io.decode_image(d, mode=torchvision.io.ImageReadMode.RGB).to(device))
            except RuntimeError:
                raise UserError(f'cannot decode the image {dataset.samples[i][0]} (corrupt or truncated); replace '
                                'or delete it') from None
    out = []
    for image, seed in zip(images, seeds.tolist()):
        with seeded(seed if seed >= 0 else None):
            out.append(dataset.transform(image))
    return torch.stack(out)


def on_device(loader, mean, std, fmt=torch.preserve_format):
    """The loader's uint8 batches normalised on the device of mean, std ((1, 3, 1, 1) tensors): a quarter of the
    bytes of float32 through shared memory and the copy, non_blocking from pinned memory. An image that could not
    be decoded (label < 0) is named while the labels are still on the CPU (no host sync). --decode gpu: decode_batch."""
    for x, y, *rest in loader:
        if rest:  # bytes, labels, byte counts, seeds, indices
            x = decode_batch(x, *rest, loader.dataset, mean.device)
        else:
            check_decoded(loader.dataset, y)
        x = normalize(x.to(mean.device, non_blocking=True), mean, std)
        yield x.contiguous(memory_format=fmt), y.to(mean.device, non_blocking=True)
