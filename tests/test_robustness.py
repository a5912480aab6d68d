"""robustness.py: each benchmark's figures against a direct evaluation or a hand computation.

The oracles here are independent of the code under test: corrupted arrays made with the
imagecorruptions package directly, model outputs computed by plain torch, ImageNet-C accuracies
known by construction of the fixture, AlexNet's errors and ImageNet-R's class indices typed in or
read from timm's own index file. Subprocesses run with OMP_NUM_THREADS=1 (see test_train_cifar.py).
"""
import json
import os
import pkgutil
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image

import robustness as rb
import data
import models
from conftest import REPO

imagecorruptions = pytest.importorskip('imagecorruptions')

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2471, 0.2435, 0.2616)  # CIFAR-10's, as train_cifar uses
KW = dict(dim=32, depth=1, patch_size=4, kernel_size=3)  # a 32-channel ConvMixer: trains in ~2 s


pytestmark = pytest.mark.usefixtures('one_thread')  # tests/conftest.py


def normalise(x_u8):  # (N, 3, H, W) uint8 -> the model's input, written out independently
    return (x_u8.float() / 255 - torch.tensor(MEAN).view(1, 3, 1, 1)) / torch.tensor(STD).view(1, 3, 1, 1)


@pytest.fixture(scope='module')
def trained(cifar10_dir, tmp_path_factory):
    """A tiny ConvMixer trained 3 epochs on 2,000 CIFAR-10 images (~30% on the test set), saved
    as a train_cifar.py checkpoint; and 200 class-balanced test images."""
    torch.set_num_threads(1)
    x, y = data.load_cifar(cifar10_dir, 'cifar10', train=True, subset=2000)
    xt, yt = data.load_cifar(cifar10_dir, 'cifar10', train=False, subset=200)
    torch.manual_seed(0)
    model = models.build_model('convmixer_256_8', 10, 32, KW, cifar=True)
    opt = torch.optim.AdamW(model.parameters(), 1e-2)
    for _ in range(3):
        perm = torch.randperm(len(y))
        for i in range(0, len(y), 100):
            b = perm[i:i + 100]
            opt.zero_grad()
            F.cross_entropy(model(normalise(x[b])), y[b]).backward()
            opt.step()
    model.eval()
    path = tmp_path_factory.mktemp('ckpt') / 'last.pt'
    torch.save({'model': model.state_dict(), 'optimizer': opt.state_dict(), 'scaler': {}, 'epoch': 3, 'step': 60,
                'history': [], 'args': {'model': 'convmixer_256_8', 'model_kw': [f'{k}={v}' for k, v in KW.items()],
                                        'dataset': 'cifar10'}}, path)  # what train_cifar.py's last.pt holds
    return model, xt, yt, path


def direct_correct(model, images_hwc, labels):
    with torch.no_grad():
        logits = model(normalise(torch.from_numpy(np.ascontiguousarray(images_hwc)).permute(0, 3, 1, 2)))
    return int((logits.argmax(1) == torch.as_tensor(labels)).sum())


# -----------------------------------------------------------------------------
# CIFAR-10-C: a fixture in the published layout (2 corruptions x 5 severities x 200 images), through the script.
def test_cifar10c_equals_direct_evaluation(trained, cifar10_dir, tmp_path):
    model, xt, yt, ckpt = trained
    images = xt.permute(0, 2, 3, 1).numpy()
    root = tmp_path / 'CIFAR-10-C'
    root.mkdir()
    for c in ('gaussian_noise', 'contrast'):
        blocks = []
        for s in range(1, 6):
            np.random.seed(s)
            blocks.append(np.stack([imagecorruptions.corrupt(im, severity=s, corruption_name=c) for im in images]))
        np.save(root / f'{c}.npy', np.concatenate(blocks))  # (1000, 32, 32, 3): severity s = rows (s-1)*200..
    np.save(root / 'labels.npy', np.tile(yt.numpy(), 5))
    args = ['--benchmark', 'cifar10-c', '--data', root, '--clean', cifar10_dir, '--subset', 200, '--checkpoint', ckpt,
            '--eval-batch-size', 64, '--corruptions', 'gaussian_noise', 'contrast']
    r = rb.main(args + ['--out', tmp_path / 'out'])
    for c in ('gaussian_noise', 'contrast'):
        data = np.load(root / f'{c}.npy')
        for s in range(1, 6):
            assert r['counts'][c][str(s)] == [direct_correct(model, data[(s - 1) * 200:s * 200], yt), 200], (c, s)
    assert r['clean'] == rb.pct(direct_correct(model, images, yt), 200)
    assert 20 <= r['clean']['acc']  # a trained model, so the comparison is not between constants
    cells = [100 * k / n for per in r['counts'].values() for k, n in per.values()]
    assert len(cells) == 10 and r['mean_acc'] == pytest.approx(np.mean(cells))
    assert r['gap'] == pytest.approx(r['clean']['acc'] - np.mean(cells))
    assert (tmp_path / 'out' / 'heatmap.png').stat().st_size > 1000
    rows = (tmp_path / 'out' / 'results.csv').read_text().splitlines()
    assert len(rows) == 12 and rows[1].startswith('cifar10-c,clean,,,')
    res = tmp_path / 'out' / 'results.json'  # compare: the bar chart of two runs
    rb.main(['compare', res, res, '--labels', 'AdamW', 'SAM', '--out', tmp_path / 'bars.png'])
    assert (tmp_path / 'bars.png').read_bytes()[:4] == b'\x89PNG'
    with pytest.raises(rb.UserError, match='compare needs two or more results.json files'):
        rb.main(['compare', res, '--out', tmp_path / 'one.png'])
    # bad input: a missing file is named beside what was found; a label count that does not fit; a model
    # whose class count is not CIFAR-10's
    found = r'has: contrast\.npy, gaussian_noise\.npy, labels\.npy'
    with pytest.raises(rb.UserError, match=r'fog\.npy not found; .* ' + found):
        rb.main(args[:-2] + ['fog', '--out', tmp_path / 'x'])
    with pytest.raises(rb.UserError, match='CIFAR-10-C has the 10 classes of cifar10; .* is a cifar100 model'):
        rb.main(args + ['--dataset', 'cifar100', '--out', tmp_path / 'y'])
    np.save(root / 'labels.npy', yt.numpy())
    with pytest.raises(rb.UserError, match='labels.npy has 200 labels but gaussian_noise.npy has 1000 images'):
        rb.read_cifar10c(str(root), ['gaussian_noise'], 10)


# -----------------------------------------------------------------------------
# ImageNet-C: the published folder layout, with accuracies known by construction.
WNIDS = ['n01440764', 'n01443537', 'n01484850']  # the model's classes 0, 1, 2 (sorted, as ImageFolder)
ALEXNET = {'gaussian_noise': 0.886428, 'shot_noise': 0.894468, 'impulse_noise': 0.922640,
           'defocus_blur': 0.819880, 'glass_blur': 0.826268, 'motion_blur': 0.785948, 'zoom_blur': 0.798360,
           'snow': 0.866816, 'frost': 0.826572, 'fog': 0.819324, 'brightness': 0.564592,
           'contrast': 0.853204, 'elastic_transform': 0.646056, 'pixelate': 0.717840, 'jpeg_compression': 0.606500}


class ColourNet(nn.Module):
    """Predicts the brightest channel: an image painted in channel k is class k."""

    def __init__(self):
        super().__init__()
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return x.mean((2, 3)) + 0 * self.dummy


def paint(path, k):
    rgb = [0, 0, 0]
    rgb[k] = 255
    Image.new('RGB', (24, 20), tuple(rgb)).save(path, quality=95)


def test_imagenet_c_folder_counts_labels_and_mce(tmp_path):
    """Counts per (corruption, severity) through the ImageNet-C layout, and mCE by hand from AlexNet's errors
    (typed in above). The clean set has an error, so that an mCE normalised by the model's own clean error
    fails the mCE assertion itself (with a clean accuracy of 100% it failed only by a ZeroDivisionError)."""
    clean, root = tmp_path / 'val', tmp_path / 'imagenet-c'
    for k, w in enumerate(WNIDS):
        (clean / w).mkdir(parents=True)
        for j in range(2):  # one clean image painted as the next class: a clean error of 1/6, not 0
            paint(clean / w / f'{j}.JPEG', (k + 1) % 3 if (k, j) == (1, 1) else k)
    expect = {}  # (corruption, severity) -> (correct, n)
    for ci, c in enumerate(ALEXNET):
        for s in range(1, 6):
            correct = n = 0
            for k, w in enumerate(WNIDS):
                if k == 0 and s == 2:
                    continue  # a folder without class 0: ImageFolder alone would shift the labels
                (root / c / str(s) / w).mkdir(parents=True)
                for j in range(1 + (ci + k) % 3):
                    right = (j + ci + s) % 3 != 0  # the others are painted as the next class
                    paint(root / c / str(s) / w / f'{j}.JPEG', k if right else (k + 1) % 3)
                    correct, n = correct + right, n + 1
            expect[(c, s)] = (correct, n)
    class_to_idx = {w: i for i, w in enumerate(WNIDS)}
    samples = rb.imagenet_c_samples(str(root), 'fog', 2, class_to_idx)
    assert len(samples) == expect[('fog', 2)][1]
    assert sorted({label for _, label in samples}) == [1, 2]  # wnid -> index through the clean classes
    assert all(label == WNIDS.index(os.path.basename(os.path.dirname(p))) for p, label in samples)
    groups = {(c, s): rb.imagenet_c_samples(str(root), c, s, class_to_idx) for c in ALEXNET for s in range(1, 6)}
    groups['clean'] = [(str(clean / w / f'{j}.JPEG'), k) for k, w in enumerate(WNIDS) for j in range(2)]
    transform = rb.uint8_transform(dict(img_size=16, crop_pct=0.875, eval_interp='bilinear', norm='jax'))
    zero, one = torch.zeros(1, 3, 1, 1), torch.ones(1, 3, 1, 1)
    counts = {}
    for key, g in groups.items():  # as two ranks would: images 0, 2, 4, ... and 1, 3, 5, ...
        k = sum(rb.count(ColourNet(), rb.folder_batches(g, transform, 3, 0, rank, 2), zero, one) for rank in (0, 1))
        counts[key] = tuple(int(v) for v in k)
    assert counts == {**expect, 'clean': (5, 6)}
    report = rb.summarize({cell: counts[cell] for cell in expect}, counts['clean'], with_mce=True)
    err = {c: 1 - np.mean([expect[(c, s)][0] / expect[(c, s)][1] for s in range(1, 6)]) for c in ALEXNET}
    # normalised by AlexNet's errors, not the model's own clean error (1/6 here, so the two readings differ)
    assert report['mce'] == pytest.approx(100 * np.mean([err[c] / ALEXNET[c] for c in ALEXNET]), rel=1e-12)
    assert report['clean']['acc'] == pytest.approx(100 * 5 / 6)
    assert report['groups']['noise'] == pytest.approx(100 * (1 - np.mean([err[c] for c in list(ALEXNET)[:3]])))
    with pytest.raises(rb.UserError, match=r'spatter.1 not found; .* has: brightness, contrast'):
        rb.imagenet_c_samples(str(root), 'spatter', 1, class_to_idx)


# -----------------------------------------------------------------------------
# ImageNet-R: logits restricted to the 200 classes before the argmax.
class FixedLogits(nn.Module):
    def __init__(self, logits):
        super().__init__()
        self.register_buffer('logits', logits)
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return self.logits[:len(x)]


def test_imagenet_r_masking(tmp_path):
    timm_data = pytest.importorskip('timm.data')
    classes = timm_data.ImageNetInfo().label_names()  # the 1000 ImageNet-1k wnids, sorted
    mask = rb.imagenet_r_mask(classes)
    oracle = [int(i) for i in pkgutil.get_data('timm.data', '_info/imagenet_r_indices.txt').decode().split()]
    assert mask.tolist() == oracle
    outside = [i for i in range(1000) if i not in oracle]
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    logits[0, outside[0]], logits[0, oracle[5]] = 50.0, 40.0  # overall argmax outside the 200
    logits[1, oracle[7]] = 60.0                                # inside: masking changes nothing
    logits[2, outside[3]], logits[2, oracle[0]], logits[2, oracle[199]] = 9.0, 8.0, 8.5
    model = FixedLogits(logits)
    x = torch.zeros(3, 3, 4, 4, dtype=torch.uint8)
    zero, one = torch.zeros(1, 3, 1, 1), torch.ones(1, 3, 1, 1)
    assert rb.predict(model, x, zero, one).tolist() == [outside[0], oracle[7], outside[3]]
    assert rb.predict(model, x, zero, one, mask=mask).tolist() == [oracle[5], oracle[7], oracle[199]]
    # through the folder path: the ImageNet-R group is masked, the clean group is not
    paint(tmp_path / 'a.jpg', 0)
    img = str(tmp_path / 'a.jpg')
    transform = rb.uint8_transform(dict(img_size=4, crop_pct=1.0, eval_interp='bilinear', norm='jax'))
    batches = lambda: rb.folder_batches([(img, oracle[5])], transform, 1, 0, 0, 1)  # noqa: E731
    assert rb.count(model, batches(), zero, one, mask=mask).tolist() == [1, 1]
    assert rb.count(model, batches(), zero, one).tolist() == [0, 1]
    # a class count that does not fit: ImageNet-R needs the 1000 ImageNet-1k classes
    with pytest.raises(rb.UserError, match='ImageNet-R needs 1000-class logits .* got 3 classes, 198 of the 200 wnids missing'):
        rb.imagenet_r_mask(WNIDS)


# -----------------------------------------------------------------------------
# On the fly: deterministic per image, and it hurts.
FEW = ['gaussian_noise', 'impulse_noise', 'glass_blur', 'frost']  # global RNG, skimage seed, numba seed, crops


def test_on_the_fly_same_seed_same_images_and_cache(trained, tmp_path, monkeypatch):
    model, xt, yt, _ = trained
    x, y = xt[:12], yt[:12]
    a = rb.corruption_accuracy(model, x, y, MEAN, STD, FEW, seed=3, cache_dir=str(tmp_path / 'a'), batch_size=5)
    b = rb.corruption_accuracy(model, x, y, MEAN, STD, FEW, seed=3, cache_dir=str(tmp_path / 'b'), batch_size=7)
    rb.corruption_accuracy(model, x, y, MEAN, STD, FEW[1:3], seed=4, cache_dir=str(tmp_path / 'c'))  # another seed
    for name in FEW:
        fa, fb = (np.load(tmp_path / d / f'{name}.npy') for d in 'ab')
        assert fa.shape == (60, 32, 32, 3)
        assert np.array_equal(fa, fb), name
        assert name not in FEW[1:3] or not np.array_equal(fa, np.load(tmp_path / 'c' / f'{name}.npy'))  # seed matters
        for s in range(1, 6):  # and the counts are those of the cached images
            want = [direct_correct(model, fa[(s - 1) * 12:s * 12], y), 12]
            assert a['counts'][name][str(s)] == want and b['counts'][name][str(s)] == want, (name, s)
    assert np.array_equal(np.load(tmp_path / 'a' / 'labels.npy'), np.tile(y.numpy(), 5))
    assert 'NOT the published CIFAR-10-C' in a['note'] and '32x32 px' in a['note']
    # a second run only evaluates: nothing is corrupted again
    monkeypatch.setattr(rb, 'corrupt_chunk', lambda task: pytest.fail('corrupted again'))
    again = rb.corruption_accuracy(model, x, y, MEAN, STD, FEW, seed=3, cache_dir=str(tmp_path / 'a'))
    assert again['counts'] == a['counts']
    with pytest.raises(rb.UserError, match='another seed'):
        rb.corruption_accuracy(model, x, y, MEAN, STD, FEW, seed=5, cache_dir=str(tmp_path / 'a'))


def test_severity_5_hurts_more_than_severity_1(trained):
    model, xt, yt, _ = trained
    names = ['gaussian_noise', 'shot_noise', 'defocus_blur', 'contrast', 'pixelate']
    r = rb.corruption_accuracy(model, xt, yt, MEAN, STD, names, severities=(1, 5), seed=0)
    s1, s5 = (np.mean([r['acc'][c][s] for c in names]) for s in ('1', '5'))
    assert s5 < s1 - 5 and s1 <= r['clean']['acc'] + 2, (s1, s5, r['acc'])
    assert r['clean']['acc'] == 100 * direct_correct(model, xt.permute(0, 2, 3, 1).numpy(), yt) / 200


def test_on_the_fly_images_are_the_package_s_own_at_each_severity(tmp_path):
    """For a severity passed off by one (s - 1, or max(s - 1, 1), which still hurts more at 5 than at 1): each
    corrupted image equals imagecorruptions.corrupt(image, severity=s) bit for bit, under the per-image seed
    written out here from the module's documented key (seed, corruption's index in the package, s, index)."""
    images = np.random.default_rng(0).integers(0, 256, (3, 32, 32, 3), dtype=np.uint8)
    order = imagecorruptions.get_corruption_names('all')  # the package's own order of its 19 corruptions
    names = ['contrast', 'pixelate', 'gaussian_noise']  # two without randomness, one from numpy's global RNG

    def oracle(c, s, i, seed):
        np.random.seed(np.random.SeedSequence([seed, order.index(c), s, i]).generate_state(1)[0])
        return imagecorruptions.corrupt(images[i], severity=s, corruption_name=c)

    for c in names:  # one chunk, severities 2..5 (the package refuses a severity of 0)
        for s in range(2, 6):
            got = rb.corrupt_chunk((images, 0, c, s, 9))
            assert all(np.array_equal(got[i], oracle(c, s, i, 9)) for i in range(3)), (c, s)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 10))
    x = torch.from_numpy(images).permute(0, 3, 1, 2).contiguous()
    rb.corruption_accuracy(model, x, torch.arange(3), MEAN, STD, names, seed=9, cache_dir=str(tmp_path))
    for c in names:  # end to end: the cache holds severity s in rows (s - 1) N .. s N
        cached = np.load(tmp_path / f'{c}.npy')
        for s in range(1, 6):
            assert all(np.array_equal(cached[(s - 1) * 3 + i], oracle(c, s, i, 9)) for i in range(3)), (c, s)


# -----------------------------------------------------------------------------
# Distributed: ranks see disjoint slices whose counts add up to one process's, and a real 2-process
# gloo run of the script gives the same images, accuracies and attack figures as one process.
def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def test_two_process_gloo_run_equals_one_process(trained, cifar10_dir, tmp_path):
    _, _, _, ckpt = trained
    n = 37  # 37 = 18 + 19 per rank: divisible neither by 2 x batch (16) nor by the world size
    names = ['gaussian_noise', 'impulse_noise', 'frost']
    common = ['--benchmark', 'corrupt', '--data', cifar10_dir, '--subset', n, '--checkpoint', ckpt,
              '--corruptions', *names, '--eval-batch-size', 8, '--attack', 'pgd', '--eps', 8, '--alpha', 2,
              '--steps', 2, '--seed', 1, '--workers', 0, '--no-plot']
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    two = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', '2',
                          '--master_port', str(free_port()), str(REPO / 'robustness.py'),
                          *map(str, common + ['--out', tmp_path / 'two'])],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]
    one = rb.main(common + ['--out', tmp_path / 'one'])
    r2 = json.loads((tmp_path / 'two' / 'results.json').read_text())
    assert r2['world_size'] == 2 and one['world_size'] == 1
    assert r2['clean'] == one['clean'] and one['clean']['n'] == n
    assert r2['counts'] == one['counts'] and all(v[1] == n for per in one['counts'].values() for v in per.values())
    assert r2['attack'] == one['attack'] and one['attack']['n'] == n
    assert one['attack']['robust_acc'] < one['attack']['clean_acc']
    for c in names:
        assert np.array_equal(np.load(tmp_path / 'one' / 'corrupted' / f'{c}.npy'),
                              np.load(tmp_path / 'two' / 'corrupted' / f'{c}.npy')), c
    assert 'NOT the published CIFAR-10-C' in two.stdout
    # bad input from the command line: one line on stderr, exit status 1, no traceback
    again = subprocess.run([sys.executable, str(REPO / 'robustness.py'), *map(str, common + ['--out', tmp_path / 'two'])],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 1 and 'Traceback' not in again.stderr
    assert again.stderr.strip().splitlines() == [f'robustness.py: error: --out {tmp_path / "two"} already holds '
                                                 'results.json; pick another --out or pass --overwrite']


# -----------------------------------------------------------------------------
# The attack through the script: FGSM's robust accuracy equals torchattacks' on the same model and images.
def test_fgsm_in_script_equals_torchattacks(trained, cifar10_dir, tmp_path):
    torchattacks = pytest.importorskip('torchattacks')
    model, xt, yt, ckpt = trained
    r = rb.main(['--attack', 'fgsm', '--eps', 4, '--data', cifar10_dir, '--subset', 200, '--checkpoint', ckpt,
                 '--eval-batch-size', 64, '--out', tmp_path])
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    wrapped = nn.Sequential(models.build_model('convmixer_256_8', 10, 32, KW, cifar=True), nn.Identity())
    wrapped[0].load_state_dict(model.state_dict())
    oracle = nn.Sequential(type('Norm', (nn.Module,), {'forward': lambda self, v: (v - mean) / std})(), wrapped).eval()
    x_adv = torchattacks.FGSM(oracle, eps=4 / 255)(xt.float() / 255, yt)
    with torch.no_grad():
        robust = int((oracle(x_adv).argmax(1) == yt).sum())
    assert r['attack']['n'] == 200 and r['attack']['clean_correct'] == direct_correct(model, xt.permute(0, 2, 3, 1).numpy(), yt)
    assert r['attack']['robust_correct'] == robust < r['attack']['clean_correct']


def test_missing_optional_dependency(trained, tmp_path, monkeypatch):
    model, xt, yt, ckpt = trained
    for name in ('imagecorruptions', 'matplotlib', 'timm', 'timm.data'):
        monkeypatch.setitem(sys.modules, name, None)  # `import name` now raises ImportError
    with pytest.raises(rb.UserError, match=r'needs the imagecorruptions-imaug package; pip install -r requirements-extras'):
        rb.corruption_accuracy(model, xt[:2], yt[:2], MEAN, STD, ['fog'])
    args = ['--benchmark', 'corrupt', '--data', tmp_path, '--checkpoint', ckpt, '--out', tmp_path / 'out']
    with pytest.raises(rb.UserError, match=r'needs the imagecorruptions-imaug package; pip install -r requirements-extras'):
        rb.main(args + ['--no-plot'])  # before any data is read
    with pytest.raises(rb.UserError, match=r'plots need matplotlib; pip install -r requirements-extras.txt'):
        rb.main(args)
    with pytest.raises(rb.UserError, match='from the timm package: pip install timm'):
        rb.imagenet_r_mask(WNIDS)
