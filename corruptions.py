"""The corrupted set on disk: ImageNet-C's corruptions (Hendrycks & Dietterich 2019) applied here with the benchmark's
own code and kept in CIFAR-10-C's layout, one uint8 .npy memmap a corruption (severity s in rows (s-1)N..sN),
filled in place by every torchrun rank. robustness.py --benchmark corrupt scores what it holds.
Made so that a run never corrupts another's files: meta.json first marks a folder ours; each file is made under a
name of its own, its space reserved (a full disk is one line, not SIGBUS), and renamed whole once every rank wrote."""
import fcntl
import importlib.metadata
import math
import os
import shutil
import signal
import tempfile
import uuid

import numpy as np
import torch
import torch.distributed as dist

from runs import read_json, save_atomic
from utils import EXTRAS, UserError, epoch_seed, one_line

# The benchmark's constants (Hendrycks & Dietterich 2019, Sec. 3 and Fig. 1).
GROUPS = {'noise': ['gaussian_noise', 'shot_noise', 'impulse_noise'],
          'blur': ['defocus_blur', 'glass_blur', 'motion_blur', 'zoom_blur'],
          'weather': ['snow', 'frost', 'fog', 'brightness'],
          'digital': ['contrast', 'elastic_transform', 'pixelate', 'jpeg_compression'],
          'extra': ['speckle_noise', 'gaussian_blur', 'spatter', 'saturate']}
CORRUPTIONS = [c for names in GROUPS.values() for c in names]  # also imagecorruptions' order
SEVERITIES = (1, 2, 3, 4, 5)
CACHE_MARK = 'robustness.py --benchmark corrupt'  # meta.json's made_by: what makes a folder our cache
# The unit no two processes write into: a network filesystem's client writes back whole pages, so two nodes filling
# neighbouring rows of one page would each write the other's bytes back stale. 64 KiB covers 4 and 64 KiB pages.
PAGE = 1 << 16


# -----------------------------------------------------------------------------
# On-the-fly corruption through the imagecorruptions-imaug fork (the original 1.1.2 no longer imports on current
# setuptools). Each image is seeded from its own key (seed, corruption, severity, index): no RNG stream is shared,
# so batches, workers and ranks agree.
def corrupt_chunk(task):
    """(images (B, H, W, 3) uint8, index of the first, corruption, severity, seed) -> corrupted copy."""
    from imagecorruptions import corrupt
    images, start, corruption, severity, seed = task
    out = np.empty_like(images)
    for i, image in enumerate(images):
        s = epoch_seed(seed, CORRUPTIONS.index(corruption), severity, start + i)
        np.random.seed(s)  # most corruptions draw from numpy's global RNG, but these two from a fresh
        kw = {'seed': s} if corruption in ('glass_blur', 'impulse_noise') else {}  # default_rng unless seeded
        out[i] = corrupt(image, severity=severity, corruption_name=corruption, **kw)
    return out


def package():
    """The fork's version, or a UserError saying how to install it (the 1.1.2 original fails to import)."""
    try:
        import imagecorruptions  # noqa: F401
        return importlib.metadata.version('imagecorruptions-imaug')
    except (ImportError, importlib.metadata.PackageNotFoundError):
        raise UserError(f'on-the-fly corruption needs the imagecorruptions-imaug package; {EXTRAS}') from None


class Corrupted(torch.utils.data.Dataset):
    """Item k: this rank's image k % m (of `rows`: a uint8 tensor (m, 3, H, W), or the path of a .npy (m, H, W, 3) of
    images decoded once, opened in each loader worker) corrupted by corruptions[k // m] at each of `severities`
    -> (uint8 (S, H, W, 3), its index lo + k % m)."""

    def __init__(self, rows, m, corruptions, severities, seed, lo):
        self.rows, self.m, self.corruptions, self.severities, self.seed, self.lo = (rows, m, corruptions, severities,
                                                                                   seed, lo)

    def __len__(self):
        return len(self.corruptions) * self.m

    def __getitem__(self, k):
        if isinstance(self.rows, str):
            self.rows = np.load(self.rows, mmap_mode='r')
        c, i = self.corruptions[k // self.m], k % self.m
        image = self.rows[i] if isinstance(self.rows, np.ndarray) else self.rows[i].permute(1, 2, 0).numpy()
        j = self.lo + i
        return torch.from_numpy(np.concatenate([corrupt_chunk((image[None], j, c, s, self.seed))
                                                for s in self.severities])), j


def deaf(_):  # a loader worker ignores Ctrl-C: the main process stops it, no traceback from each
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def loader(dataset, workers, **kw):
    """A DataLoader, its workers spawned, not forked (this process runs torch's threads)."""
    return torch.utils.data.DataLoader(dataset, num_workers=workers, pin_memory=torch.cuda.is_available(),
                                       **dict(multiprocessing_context='spawn', worker_init_fn=deaf) if workers else {},
                                       **kw)


# -----------------------------------------------------------------------------
# Files: reserved when made, filled page by page, read back a rank's rows at a time.
def reserve(path, shape, what, advice):
    """A new uint8 .npy of `shape` at path whose blocks are allocated now (os.posix_fallocate): np.lib.format's
    open_memmap alone makes a sparse file, and a memmap write the full disk cannot back kills the process with SIGBUS
    (no message, temp files left). A disk without the room: ENOSPC here, one line (what, advice), the file removed."""
    try:
        np.lib.format.open_memmap(path, 'w+', np.uint8, shape).flush()  # (the header; closed as it is dropped)
        with open(path, 'r+b') as f:
            os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size)
    except OSError as e:
        if os.path.exists(path):
            os.remove(path)
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
        raise UserError(f'{what}, its disk has {free / 1e9:.3g} GB free ({e.strerror or e}); {advice}') from None


def keep_file(m, shape):
    """A .npy (m, *shape) of this process's, in TMPDIR, reserved: m decoded images kept for their corruptions."""
    path = tempfile.NamedTemporaryFile(suffix='.npy', delete=False).name
    reserve(path, (m, *shape), f"keeping this process's {m:,} decoded images in {os.path.dirname(path)} needs "
            f'{m * math.prod(shape) / 1e9:.3g} GB', 'free some, or set TMPDIR to a disk with room')
    return path


def owned(start, end, rank, page):
    """Of the bytes [start, end) a rank fills, the part it writes itself -> (a, b): rank 0 all of its own; rank r > 0
    the whole pages inside them only. The rest (under a page at each end) goes to rank 0, which writes it: no page of
    the file is written by two processes."""
    if rank == 0:
        return start, end
    a, b = -(-start // page) * page, end // page * page
    return (a, b) if a < b else (start, start)


class Filler:
    """This rank's rows of one cache file (n images x 5 severities, the file rank 0 made): write(s, j, x) puts rows
    j.. of severity s; finish() hands what it may not write itself (owned) to rank 0, which writes it; all flushed."""

    def __init__(self, path, n, lo, hi, rank, world):
        file = np.load(path, mmap_mode='r')
        head, row = file.offset, math.prod(file.shape[1:])  # the .npy header's bytes, an image's
        self.flat, self.rank, self.world, self.pieces = np.memmap(path, np.uint8, 'r+'), rank, world, []
        self.at = lambda s, j: head + ((s - 1) * n + j) * row  # the first byte of image j at severity s
        self.mine = {s: owned(self.at(s, lo), self.at(s, hi), rank, PAGE) for s in SEVERITIES}

    def write(self, s, j, x):
        data, start = np.ascontiguousarray(x).reshape(-1), self.at(s, j)
        end, (a, b) = start + len(data), self.mine[s]
        for lo, hi, own in ((start, min(end, a), 0), (max(start, a), min(end, b), 1), (max(start, b), end, 0)):
            if lo < hi and own:
                self.flat[lo:hi] = data[lo - start:hi - start]
            elif lo < hi:  # bytes of a page another process writes too: rank 0 writes them
                self.pieces.append((lo, data[lo - start:hi - start].tobytes()))

    def finish(self):
        self.flat.flush()
        everyone = [self.pieces] * self.world
        if self.world > 1:  # (a collective: every rank's pages are flushed before rank 0 renames the file)
            dist.gather_object(self.pieces, everyone if self.rank == 0 else None, dst=0)
        if self.rank == 0:
            for start, data in (p for part in everyone[1:] for p in part):
                self.flat[start:start + len(data)] = np.frombuffer(data, np.uint8)
            self.flat.flush()
        del self.flat


def rows(cache_dir, c, s, n, lo, hi):
    """Images lo..hi of severity s in the cache's file of corruption c (a memmap)."""
    return np.load(os.path.join(cache_dir, f'{c}.npy'), mmap_mode='r')[(s - 1) * n + lo:(s - 1) * n + hi]


def load_npy(path, advice):
    """np.load(path) as a memmap, or a UserError naming a damaged file (truncated, not a .npy, pickled objects)."""
    try:
        return np.load(path, mmap_mode='r', allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise UserError(f'{path} is damaged or not a .npy file ({one_line(e)}); {advice}')


# -----------------------------------------------------------------------------
# The folder: its meta.json says which images, seed and package made it.
def open_cache(cache_dir):
    """meta.json of a cache this script made, or None for a folder to make (absent or empty). Anything else is refused:
    a cache never writes into a folder it did not make, nor reads a published CIFAR-10-C's arrays as its own."""
    path = os.path.join(cache_dir, 'meta.json')
    if not os.path.exists(cache_dir) or (os.path.isdir(cache_dir) and not set(os.listdir(cache_dir)) - {'.lock'}):
        return None
    if not os.path.isfile(path):
        raise UserError(f'--cache {cache_dir} is not a cache of robustness.py (no meta.json; a published CIFAR-10-C '
                        'is --benchmark cifar10-c --data DIR): give a new or empty folder')
    meta = read_json(path, f'pick another --cache (or delete {cache_dir} if this script made it)')  # (cut: edited)
    if not isinstance(meta, dict) or meta.get('made_by') != CACHE_MARK:
        raise UserError(f'--cache {cache_dir}: its meta.json is not robustness.py\'s; give a new or empty folder')
    return meta


def use_cache(cache_dir, meta, labels, corruptions):
    """Rank 0: make the cache (meta.json first, marking the folder as ours) or check it holds this set, made by this
    imagecorruptions version (refused otherwise: its images could differ); reserve on its disk a file per corruption
    to add, under a name of this run's (another run on this cache makes its own), which every rank then fills with
    its rows. Under CACHE/.lock: two runs never make or check meta.json at once. -> (cached, {corruption: file})"""
    new = open_cache(cache_dir) is None and not os.path.exists(cache_dir)  # (a folder not ours: refused, untouched)
    try:
        os.makedirs(cache_dir, exist_ok=True)
        lock = open(os.path.join(cache_dir, '.lock'), 'a')
    except OSError as e:
        raise UserError(f'--cache {cache_dir}: {e.strerror or e}')
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (released when closed: another run waits seconds, not for the making)
        try:
            return checked(cache_dir, meta, labels, corruptions)
        except UserError:
            if new and os.listdir(cache_dir) == ['.lock']:  # refused before anything was made: no folder left
                os.remove(lock.name)
                os.rmdir(cache_dir)
            raise


def checked(cache_dir, meta, labels, corruptions):
    old = open_cache(cache_dir)
    if old is not None and old.get('sha256_of') != meta['sha256_of']:  # (before 2026-12-03: of the whole array)
        raise UserError(f'--cache {cache_dir} was made by an older robustness.py, which identified the images '
                        'otherwise; delete it or pick another --cache')
    if old is not None and any(old.get(k) != meta[k] for k in ('seed', 'n', 'image_shape', 'sha256')):
        raise UserError(f'--cache {cache_dir} holds a corrupted set of other images or another seed '
                        f'(seed {old.get("seed")}, {old.get("n")} images); pick another --cache')
    if old is not None and old.get('package') != meta['package']:
        raise UserError(f'--cache {cache_dir} was made by imagecorruptions-imaug {old.get("package")}, this is '
                        f'{meta["package"]}: refused, its images could differ; delete it or pick another --cache')
    cached, want = set(), (len(SEVERITIES) * meta['n'], *meta['image_shape'])
    for c in corruptions:
        if os.path.isfile(path := os.path.join(cache_dir, f'{c}.npy')):
            if (a := load_npy(path, 'delete it')).dtype != np.uint8 or a.shape != want:
                raise UserError(f'{path} is {a.dtype} {a.shape}, not the uint8 {want} of its meta.json; delete it')
            cached.add(c)
    make = [c for c in corruptions if c not in cached]
    what = (f'--cache {cache_dir}: {len(make)} corruptions x {want[0]:,} images of {want[1]}x{want[2]} px need '
            f'{len(make) * math.prod(want) / 1e9:.3g} GB')  # uint8 at the evaluated size: README's table
    advice = 'free some, pick another --cache or fewer --corruptions'
    if len(make) * math.prod(want) > (free := shutil.disk_usage(cache_dir).free):  # (before anything is written)
        raise UserError(f'{what}, its disk has {free / 1e9:.3g} GB free; {advice}')
    if old is None:
        save_atomic(os.path.join(cache_dir, 'meta.json'), meta)  # first: from now on the folder is marked ours
        save_atomic(os.path.join(cache_dir, 'labels.npy'), lambda f: np.save(f, np.tile(labels, len(SEVERITIES))))
    files = {}
    try:
        for c in make:
            files[c] = os.path.join(cache_dir, f'{c}.npy.{uuid.uuid4().hex[:8]}.tmp')  # e.g. fog.npy.3f9a1c07.tmp
            reserve(files[c], want, what, advice)
    except BaseException:
        for path in files.values():
            if os.path.exists(path):
                os.remove(path)
        raise
    return cached, files
