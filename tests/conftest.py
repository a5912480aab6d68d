"""Shared fixtures. The real-data fixture extracts the shared CIFAR-10 JPEG copy once per session."""
import os
import shutil
import signal
import sys
import tarfile
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the experiment files live flat at the top level

# The suite's asserts are calibrated on the CPU in fp32 (bit-identical resumes, exact DDP evaluation, oracles to
# 1e-6): hide every GPU from the in-process tests and, through the environment, from the torchrun and script
# subprocesses (which would otherwise put rank 1 on cuda:1 and autocast in bf16). Set before any test touches
# CUDA (torch initialises it lazily). A test written for CUDA would run in a subprocess with its own environment.
os.environ['CUDA_VISIBLE_DEVICES'] = ''

# The Ctrl-C tests send SIGINT to a run: a pytest started as a background job (`cmd &` in a shell without job
# control) inherits SIGINT ignored, and so would every run it starts (an ignored signal survives exec). Give this
# process Python's own handler: the children then start with the default action, as from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# ../shared/data beside the checkout (CI lays a copy of shared/ beside its clone too).
CIFAR_TARBALL = Path(os.environ.get('CIFAR10_TARBALL',
                                    REPO.parent / 'shared' / 'data' / 'cifar10-jpeg.tar.gz'))


# Extracted per class: the first files by name, which are what the tests' class-balanced subsets take (the
# largest: 3,000 training and 5,000 test images). 8,000 files, not 60,000: on a slow disk the full tree took
# 15-45 s to write.
PER_CLASS = {'train': 300, 'test': 500}


@pytest.fixture(scope='session')
def cifar10_dir(tmp_path_factory):
    """Path to an extracted `cifar10/{train,test}/<class>/NNNN.jpg` tree: the first PER_CLASS[split] images of
    each class, by file name. Outside CI a missing archive skips the test; under CI (CI=true) it is a failure.
    """
    if not CIFAR_TARBALL.is_file():
        msg = f'CIFAR-10 archive not found at {CIFAR_TARBALL} (set CIFAR10_TARBALL to point at it)'
        if os.environ.get('CI', '').lower() == 'true':
            pytest.fail(msg)
        pytest.skip(msg)
    root = tmp_path_factory.mktemp('data')
    with tarfile.open(CIFAR_TARBALL) as tar:
        names = defaultdict(list)  # (split, class) -> the names of its images
        for m in tar.getmembers():
            if m.isfile():
                names[tuple(m.name.split('/')[1:3])].append(m.name)
        keep = {n for (split, _), ns in names.items() for n in sorted(ns)[:PER_CLASS[split]]}
        # in archive order: a gzip stream read out of order is decompressed again from the start
        tar.extractall(root, members=[m for m in tar.getmembers() if m.name in keep], filter='data')
    return root / 'cifar10'


@pytest.fixture(scope='session')
def imagenet_dir(cifar10_dir, tmp_path_factory):
    """40 CIFAR training and 10 test images in train_imagenet.py's folder layout (the SAM family's ImageNet-flag
    tests)."""
    root = tmp_path_factory.mktemp('imagenet')
    for split, src, n in (('train', 'train', 4), ('val', 'test', 1)):
        for c in sorted(os.listdir(cifar10_dir / src)):
            (root / split / c).mkdir(parents=True)
            for f in sorted(os.listdir(cifar10_dir / src / c))[:n]:
                shutil.copy(cifar10_dir / src / c / f, root / split / c / f.replace('.jpg', '.JPEG'))
    return root


@pytest.fixture
def one_thread():
    """In-process work on one thread, like the OMP_NUM_THREADS=1 subprocesses: tiny ops gain nothing from a
    second thread and lose a lot to contention on a shared 2-core machine. Restored afterwards."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def write_bomb_png(path, side=14000):
    """A PNG whose header says side x side 1-bit pixels (196 M for 14000: over PIL's decompression-bomb limit of
    2 x Image.MAX_IMAGE_PIXELS = 178,956,970) and whose data is one empty row: PIL refuses it when opening it,
    from the header alone, as it refuses the real 24 MB image (issue 34's `bomb` folder)."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack('>I', len(data)) + kind + data + struct.pack('>I', zlib.crc32(kind + data))
    header = struct.pack('>IIBBBBB', side, side, 1, 0, 0, 0, 0)  # width, height, 1 bit, greyscale
    path.write_bytes(b'\x89PNG\r\n\x1a\n' + chunk(b'IHDR', header) + chunk(b'IDAT', zlib.compress(b'\0'))
                     + chunk(b'IEND', b''))
    return path
