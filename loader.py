"""The ImageNet loader's parts that are not the data set: loader workers per process from the node, the training
transform, per-image seeding, and --decode gpu (the files' bytes from the workers, decoded and transformed on the
device), and on_device, the batches' last stage. data.ImageFolder uses them; train_imagenet.py, train_contrastive.py
and bench.py too."""
import contextlib
import io
import os

import torch
import torchvision
from torchvision.io import ImageReadMode
from torchvision.transforms import v2

from augment import normalize
from images import UNREADABLE, check_decoded, load_rgb, unreadable_reason
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
    count, seeds, indices, whether each is a plain JPEG (B,)): one tensor through shared memory (a tensor per file
    took a descriptor each)."""
    data, label, seed, index, plain = zip(*batch)
    return (torch.frombuffer(bytearray(b''.join(data)), dtype=torch.uint8), torch.tensor(label),
            torch.tensor([len(d) for d in data]), torch.tensor(seed), torch.tensor(index), torch.tensor(plain))


def decode_batch(data, sizes, seeds, index, plain, dataset, device):
    """--decode gpu: the plain JPEGs (images.plain_jpeg, found by the loader workers) decoded by torchvision.io.
    decode_jpeg on `device` (nvJPEG on CUDA, all at once), every other file (a PNG, GIF or 16-bit image named .JPEG,
    CMYK) by images.load_rgb, the --decode cpu path's own decoder, and moved to the device. Then dataset.transform
    per image on the device under the image's seed: the crop, resize and flip draw exactly what the PIL path draws
    (the same transform, the same RNG, and its draws depend on the image size only). The pixels: decode_jpeg on the
    CPU (libjpeg-turbo) gives PIL's, bit for bit (tests/test_fast_input.py, every kind of file); nvJPEG's inverse
    DCT may round otherwise (not measured here: no GPU). The resize is torch's antialiased interpolate, not PIL's
    (tests/test_train_imagenet.py says how much). data: the files' bytes end to end (sizes: each file's count).
    -> uint8 (B, 3, S, S) on device."""
    data, plain = list(data.split(sizes.tolist())), plain.tolist()
    try:
        jpegs = iter(torchvision.io.decode_jpeg([d for d, p in zip(data, plain) if p], mode=ImageReadMode.RGB,
                                                device=device) if any(plain) else [])
    except RuntimeError:  # decode_jpeg takes libjpeg's warnings (a damaged file) for errors, PIL not all: read the
        jpegs, plain = None, [False] * len(data)  # batch as --decode cpu does, and name the file PIL cannot read
    out = []
    for d, p, seed, i in zip(data, plain, seeds.tolist(), index.tolist()):
        image = next(jpegs) if p else read_rgb(d, dataset.samples[i][0]).to(device)
        with seeded(seed if seed >= 0 else None):
            out.append(dataset.transform(image))
    return torch.stack(out)


def read_rgb(data, path):
    """A file's bytes (a uint8 tensor) -> (3, H, W) uint8 by images.load_rgb, as --decode cpu reads the file."""
    try:
        return v2.functional.pil_to_tensor(load_rgb(io.BytesIO(data.numpy())))
    except UNREADABLE as e:
        raise UserError(f'cannot decode the image {path} ({unreadable_reason(e)}); replace or delete it') from None


def on_device(loader, mean, std, fmt=torch.preserve_format):
    """The loader's uint8 batches normalised on the device of mean, std ((1, 3, 1, 1) tensors): a quarter of the
    bytes of float32 through shared memory and the copy, non_blocking from pinned memory. An image that could not
    be decoded (label < 0) is named while the labels are still on the CPU (no host sync). --decode gpu: decode_batch."""
    for x, y, *rest in loader:
        check_decoded(loader.dataset, y)
        if rest:  # bytes, labels, byte counts, seeds, indices, plain JPEG or not
            x = decode_batch(x, *rest, loader.dataset, mean.device)
        x = normalize(x.to(mean.device, non_blocking=True), mean, std)
        yield x.contiguous(memory_format=fmt), y.to(mean.device, non_blocking=True)
