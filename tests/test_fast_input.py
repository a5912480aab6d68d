"""The ImageNet loader's and MoCo views' speed-ups keep every number: the views against a copy of the
function they replaced (kept here as the oracle), the per-image seeding against torch.manual_seed, the
--decode gpu path (run on the CPU device) against the PIL path, the EMA against its closed form."""
import math
import zlib
from pathlib import Path

import pytest
import torch

import augment
import train_contrastive as tc

pytestmark = pytest.mark.usefixtures('one_thread')  # tests/conftest.py


# -----------------------------------------------------------------------------
# The oracle: train_contrastive.moco_view and augment.color_jitter as they were before issue 37 (every op on
# every image, kept where drawn by torch.where).
def old_color_jitter(x, factors, order):
    B = len(x)
    for slot in range(4):
        k = order[:, slot]
        x = augment.blend_ops(x, torch.where(k == 3, 1.0, factors.gather(1, k[:, None])[:, 0]), k == 2, k == 1)
        x = torch.where((k == 3).view(B, 1, 1, 1), augment.adjust_hue(x, factors[:, 3].float().view(B, 1, 1)), x)
    return x


def old_moco_view(x_u8, gen, B, lo, hi, view, size, crop_min, mean, std):
    AUG = augment.MOCO_AUG

    def rand(*shape, dtype=torch.float32):
        return torch.rand(B, *shape, generator=gen, device=gen.device, dtype=dtype)[lo:hi]

    x = x_u8.float()
    b, _, H, W = x.shape
    area = H * W * (crop_min + (1 - crop_min) * rand(10, dtype=torch.float64))
    lo_r, hi_r = (math.log(r) for r in AUG['ratio'])
    ratio = torch.exp(lo_r + (hi_r - lo_r) * rand(10, dtype=torch.float64))
    w, h = torch.sqrt(area * ratio).round(), torch.sqrt(area / ratio).round()
    fits = (w >= 1) & (w <= W) & (h >= 1) & (h <= H)
    first, any_fit = fits.int().argmax(1, keepdim=True), fits.any(1)
    w = torch.where(any_fit, w.gather(1, first)[:, 0], float(W))
    h = torch.where(any_fit, h.gather(1, first)[:, 0], float(H))
    top = (rand(dtype=torch.float64) * (H - h + 1)).floor()
    left = (rand(dtype=torch.float64) * (W - w + 1)).floor()
    x = augment.resized_crop_rect_flip(x, top, left, h, w, size, rand() < AUG['p_flip'])
    u = 2 * rand(4, dtype=torch.float64) - 1
    factors = torch.stack([(1.0 if i < 3 else 0.0) + j * u[:, i] for i, j in enumerate(AUG['jitter'])], 1)
    order = rand(4).argsort(1)
    x = torch.where((rand() < AUG['p_jitter']).view(b, 1, 1, 1), old_color_jitter(x, factors, order), x)
    x = torch.where((rand() < AUG['p_gray']).view(b, 1, 1, 1), augment.grayscale(x).expand_as(x), x)
    s0, s1 = (s * size / 224 for s in AUG['blur_sigma'])
    blurred = augment.gaussian_blur(x, s0 + (s1 - s0) * rand(), 2 * round(size / 20) + 1)
    x = torch.where((rand() < AUG['p_blur'][view]).view(b, 1, 1, 1), blurred, x)
    x = augment.solarize(x, torch.where(rand() < AUG['p_solarize'][view], 128.0, 256.0))
    return augment.normalize(x, mean, std)


def natural(n, side, seed=0):
    """Smooth uint8 images (bilinear upsampling of coarse noise): hue, grey and blur all move their pixels."""
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(n, 3, side // 8 + 1, side // 8 + 1, generator=g) * 255
    return torch.nn.functional.interpolate(coarse, size=side, mode='bilinear').round().to(torch.uint8)


@pytest.mark.parametrize('side, size, B, lo, hi', [(40, 32, 24, 0, 24), (40, 32, 24, 8, 16), (256, 224, 6, 0, 6)])
def test_moco_view_equals_the_function_it_replaced(side, size, B, lo, hi):
    """The same pixels, bit for bit, and the same generator state after (the same draws), for both views, a rank's
    slice of the global batch, and the 224 px view's 23 x 23 blur."""
    x = natural(hi - lo, side)
    mean, std = torch.tensor(tc.IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(tc.IMAGENET_STD).view(1, 3, 1, 1)
    for view in (0, 1):
        g_new, g_old = torch.Generator().manual_seed(7 + view), torch.Generator().manual_seed(7 + view)
        new = augment.moco_view(x, g_new, B, lo, hi, view, size, 0.08, mean, std)
        old = old_moco_view(x, g_old, B, lo, hi, view, size, 0.08, mean, std)
        assert torch.equal(new, old), (view, (new - old).abs().max())
        assert torch.equal(g_new.get_state(), g_old.get_state())


def test_moco_view_runs_hue_grey_and_blur_on_the_images_that_drew_them_only(monkeypatch):
    """The rows each op computes: hue once per jittered image (was 4 x every image), grey and blur only on the
    images that drew them (was every image)."""
    seen = {'adjust_hue': 0, 'grayscale': 0, 'gaussian_blur': 0}
    for name in seen:
        def counted(x, *a, _f=getattr(augment, name), _n=name, **kw):
            seen[_n] += len(x)
            return _f(x, *a, **kw)
        monkeypatch.setattr(augment, name, counted)
    B = 400
    x, mean, std = natural(B, 40), torch.zeros(1, 3, 1, 1), torch.ones(1, 3, 1, 1)
    augment.moco_view(x, torch.Generator().manual_seed(0), B, 0, B, 1, 32, 0.08, mean, std)
    # draws: p_jitter 0.8, p_gray 0.2 (grayscale also runs inside each jitter slot's blend: 4 per jittered image),
    # p_blur 0.1 in view 1; binomial(400, p) within 5 standard deviations
    for got, p, per in ((seen['adjust_hue'], 0.8, 1), (seen['gaussian_blur'], 0.1, 1)):
        assert abs(got / per - B * p) < 5 * math.sqrt(B * p * (1 - p)), (got, p)
    assert seen['grayscale'] < 4 * 0.8 * B + 0.2 * B + 5 * 20


def test_ema_is_one_foreach_lerp_and_its_closed_form():
    """theta_k <- m theta_k + (1 - m) theta_q (MoCo eq. 2) in float64 against one fp32 update: within the rounding
    of a lerp (a few ulp); and one aten::_foreach_lerp_ for all parameters (was 3 launches per parameter)."""
    torch.manual_seed(0)
    backbone = tc.build_backbone(tc.get_args(['--model', 'vit_ti16', '--model-kw', 'dim=64', 'depth=2', 'heads=2',
                                              'patch_size=8']))
    moco = tc.MoCo(backbone, 32, 64, 0.2)
    for p in moco.base_encoder.parameters():
        p.data.add_(torch.randn_like(p))
    q = [p.detach().double() for p in moco.base_encoder.parameters()]
    k = [p.detach().double() for p in moco.momentum_encoder.parameters()]
    m = 0.99
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        moco.update_momentum_encoder(m)
    names = [e.name for e in prof.events()]
    assert names.count('aten::_foreach_lerp_') == 1 and 'aten::mul' not in names and 'aten::copy_' not in names
    for pk, kk, qq in zip(moco.momentum_encoder.parameters(), k, q):
        want = m * kk + (1 - m) * qq
        assert torch.allclose(pk.double(), want, rtol=0, atol=4 * torch.finfo(torch.float32).eps * want.abs().max())


# -----------------------------------------------------------------------------
# The ImageNet loaders of train_contrastive.py: built once, their workers living through the epochs.
@pytest.fixture(scope='module')
def jpeg_folder(tmp_path_factory):
    """DIR/{train,val}/<class>/*.JPEG: 2 classes, 12 + 4 images of 72 x 56 px (not square)."""
    from PIL import Image
    root = tmp_path_factory.mktemp('jpegs')
    for split, n in (('train', 12), ('val', 4)):
        for c in ('a', 'b'):
            (root / split / c).mkdir(parents=True)
            # (a fixed seed per folder: Python's hash() of a str changes with every process, and so did these images)
            for i, x in enumerate(natural(n, 72, seed=zlib.crc32(f'{split}/{c}'.encode()) % 1000)):
                Image.fromarray(x[:, :56].permute(1, 2, 0).numpy()).save(root / split / c / f'{i}.JPEG', quality=90)
    return root


def test_contrastive_imagenet_loaders_are_built_once_and_their_workers_persist(jpeg_folder, tmp_path, monkeypatch):
    """Two epochs with a k-NN evaluation after each: 3 DataLoaders (train, train features, val features) made once,
    each starting its one worker once (was: a new train loader every epoch, two feature loaders per evaluation)."""
    made, started = [], []
    init, start = torch.utils.data.DataLoader.__init__, torch.multiprocessing.Process.start
    monkeypatch.setattr(torch.utils.data.DataLoader, '__init__', lambda self, *a, **kw: made.append(kw) or
                        init(self, *a, **kw))
    monkeypatch.setattr(torch.multiprocessing.Process, 'start', lambda self: started.append(1) or start(self))
    tc.main([str(a) for a in ['--dataset', 'imagenet', '--data', jpeg_folder, '--img-size', 32, '--model', 'vit_ti16',
                              '--model-kw', 'dim=32', 'depth=1', 'heads=2', 'patch_size=8', '--proj-hidden', 32,
                              '--proj-dim', 16, '--batch-size', 8, '--epochs', 2, '--warmup-epochs', 0, '--eval', 'knn',
                              '--eval-every', 1, '--workers', 1, '--log-every', 0, '--out', tmp_path / 'run']])
    assert len(made) == 3 and all(kw['persistent_workers'] for kw in made) and len(started) == 3
    assert (tmp_path / 'run' / 'last.pt').is_file()


def test_linear_probe_is_few_full_batch_steps_to_the_optimum():
    """With an L2 penalty the probe's objective is strictly convex: at the probe's weights its gradient, computed
    here in float64 from the closed-form softmax cross-entropy gradient, vanishes; and it took at most L-BFGS's
    max_eval (1.25 x --linear-epochs) passes over the features (was 100 epochs x n/256 steps of 256)."""
    import argparse
    g = torch.Generator().manual_seed(0)
    f, y = torch.randn(600, 24, generator=g), torch.randint(0, 5, (600,), generator=g)
    f[:, :5] += 1.5 * torch.nn.functional.one_hot(y, 5)  # some signal
    args = argparse.Namespace(seed=0, linear_epochs=60, linear_wd=1e-2)
    calls = []
    hook = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: calls.append(len(i[0])))
    try:
        clf, mu, sd = tc.linear_probe(f, y, 5, args)
    finally:
        hook.remove()
    assert len(calls) <= 1.25 * 60 + 1 and set(calls) == {600}
    z, W, b = ((f - mu) / sd).double(), clf.weight.detach().double(), clf.bias.detach().double()
    err = torch.softmax(z @ W.T + b, 1) - torch.nn.functional.one_hot(y, 5).double()  # d(mean CE)/d(logits) x n
    grad_w, grad_b = err.T @ z / len(y) + args.linear_wd * W, err.mean(0)
    assert grad_w.abs().max() < 1e-4 and grad_b.abs().max() < 1e-4
    assert (clf((f - mu) / sd).argmax(1) == y).float().mean() > 0.5


# -----------------------------------------------------------------------------
# train_imagenet.py's loader: per-image seeding, --workers, --decode gpu (run here on the CPU device).
def imagenet_args(folder, recipe, *extra):
    import train_imagenet as ti
    return ti, ti.get_args(['--data', str(folder), '--recipe', recipe, '--img-size', '48', *extra])


@pytest.mark.parametrize('recipe', ['sam', 'convmixer'])
def test_each_image_draws_what_torch_manual_seed_drew_without_calling_it(jpeg_folder, recipe, monkeypatch):
    """The oracle is the code before issue 37: torch.manual_seed(seed), then the transform. Now only the CPU
    generator is seeded: the same crops, flips and RandAugment ops, and torch.manual_seed is never called."""
    import data
    ti, args = imagenet_args(jpeg_folder, recipe)
    ds = data.ImageFolder(jpeg_folder, 'train', ti.train_transform(args, ti.MEANS[args.norm][0]), 48)
    items = [(i, 77 + 1000 * i) for i in range(len(ds))]
    want = []
    for i, seed in items:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            want.append(ds.transform(ds.loader(ds.samples[i][0])))
    monkeypatch.setattr(torch, 'manual_seed', lambda *a: pytest.fail('torch.manual_seed called per image'))
    state = torch.get_rng_state()
    got = [ds[it][0] for it in items]
    assert torch.equal(torch.stack(got), torch.stack(want)) and torch.equal(torch.get_rng_state(), state)


def test_workers_default_is_the_cores_per_local_process_minus_one(jpeg_folder, monkeypatch):
    cores = len(__import__('os').sched_getaffinity(0))
    monkeypatch.setenv('LOCAL_WORLD_SIZE', '1')
    assert imagenet_args(jpeg_folder, 'sam')[1].workers == cores - 1
    assert tc.get_args(['--dataset', 'imagenet']).workers == cores - 1
    monkeypatch.setenv('LOCAL_WORLD_SIZE', str(cores))  # one core each: load in the main process
    assert imagenet_args(jpeg_folder, 'sam')[1].workers == 0
    assert imagenet_args(jpeg_folder, 'sam', '--workers', '3')[1].workers == 3


@pytest.mark.parametrize('recipe, max_diff, frac_over_1', [('sam', 2, 1e-3), ('convmixer', 255, 0.1)])
def test_decode_gpu_on_the_cpu_device_matches_the_pil_path(jpeg_folder, recipe, max_diff, frac_over_1):
    """--decode gpu's code with device cpu against the PIL path, image for image under the same seeds, through the
    training loader (2 workers reading bytes) and the validation transform. decode_jpeg (libjpeg-turbo) and PIL
    decode to the same pixels; the crop box and the flip are the same draws; the resize is torch's antialiased
    interpolate on uint8 instead of PIL's fixed-point one: +-1 on some pixels, +-2 on a rare one ('sam'; measured
    2026-12-07 on 200 seeds of 4 such images, pillow 13.0: max 1 on 197, 2 on one value of 27,648 on 3).
    RandAugment's ops on a tensor are torchvision's tensor kernels, not PIL's (rotation and shear resample
    differently, and the fill): the 'convmixer' recipe differs more on the images that drew them (measured: ~4% of the values by more than 1)."""
    import data
    import loader
    ti, args = imagenet_args(jpeg_folder, recipe)
    tf = ti.train_transform(args, ti.MEANS[args.norm][0])
    pil = data.ImageFolder(jpeg_folder, 'train', tf, 48)
    raw = data.ImageFolder(jpeg_folder, 'train', tf, 48, decode='gpu')
    items = [(i, 5 + 1000 * i) for i in range(len(pil))]
    want = torch.stack([pil[it][0] for it in items])
    batches = torch.utils.data.DataLoader(raw, batch_size=5, sampler=items, num_workers=2,
                                          collate_fn=loader.collate_bytes)
    mean, std = torch.zeros(1, 3, 1, 1), torch.full((1, 3, 1, 1), 1 / 255)  # normalize() then gives 0..255 back
    got = torch.cat([x for x, _ in loader.on_device(batches, mean, std)]).round().to(torch.uint8)
    diff = (got.int() - want.int()).abs()
    assert diff.max() <= max_diff and (diff > 1).float().mean() <= frac_over_1
    if recipe == 'sam':  # and the evaluation transform (resize, centre crop)
        val = data.ImageFolder(jpeg_folder, 'val', data.eval_transform(48, to_float=False), 48)
        val_raw = data.ImageFolder(jpeg_folder, 'val', val.transform, 48, decode='gpu')
        batch = loader.collate_bytes([val_raw[i] for i in range(len(val_raw))])
        ref = torch.stack([val[i][0] for i in range(len(val))])
        diff = (loader.decode_batch(batch[0], *batch[2:], val_raw, 'cpu').int() - ref.int()).abs()
        assert diff.max() <= max_diff and (diff > 1).float().mean() <= frac_over_1


def test_train_imagenet_decode_gpu_runs_on_the_cpu_device_and_names_a_file_it_cannot_decode(jpeg_folder, odd_files,
                                                                                            tmp_path):
    """--decode gpu through train_imagenet.main (a loader worker reading bytes, decode and crop on the CPU device):
    an epoch over a folder holding every odd kind of file among its JPEGs (D14: a 16-bit PNG crashed it), and an
    exact evaluation of the validation images; a file that is no image is one clear error."""
    import shutil
    import train_imagenet as ti
    from utils import UserError
    argv = ['--model', 'vit_ti16', '--model-kw', 'depth=1', 'dim=32', 'heads=2', '--img-size', '32', '--batch-size', '4',
            '--epochs', '1', '--warmup-steps', '1', '--workers', '1', '--decode', 'gpu', '--log-every', '1',
            '--eval-batch-size', '3']
    mixed = tmp_path / 'mixed'
    shutil.copytree(jpeg_folder, mixed)
    for f in (odd_files[0] / 'odd' / 'a').iterdir():  # the 12 kinds into train/a: 36 images, 9 steps of 4
        shutil.copy(f, mixed / 'train' / 'a' / f.name)
    shutil.copy(odd_files[0] / 'odd' / 'b' / 'b_jpeg.JPEG', mixed / 'val' / 'b')  # 9 validation images
    res = ti.main(['--data', str(mixed), *argv, '--out', str(tmp_path / 'run')])
    assert res['n'] == 9 and math.isfinite(res['loss'])
    bad = tmp_path / 'bad'
    shutil.copytree(jpeg_folder, bad)
    (bad / 'val' / 'b' / '2.JPEG').write_bytes(b'not a JPEG at all')
    with pytest.raises(UserError, match=r'cannot decode the image .*val/b/2\.JPEG \(corrupt or truncated\)'):
        ti.main(['--data', str(bad), *argv, '--out', str(tmp_path / 'run_bad')])


# -----------------------------------------------------------------------------
# Issue 42 (D14, D18): both decoders give the same pixels for every kind of file a folder of .JPEG may hold.
def png16(path, pixels):
    """A 16-bit RGB PNG of (H, W, 3) uint16 pixels, written by hand from the PNG spec (PIL writes no 16-bit RGB)."""
    import struct

    def chunk(kind, data):
        return struct.pack('>I', len(data)) + kind + data + struct.pack('>I', zlib.crc32(kind + data))
    h, w, _ = pixels.shape
    rows = b''.join(b'\0' + row.astype('>u2').tobytes() for row in pixels)  # filter 0 (none) on every row
    path.write_bytes(b'\x89PNG\r\n\x1a\n' + chunk(b'IHDR', struct.pack('>IIBBBBB', w, h, 16, 2, 0, 0, 0))
                     + chunk(b'IDAT', zlib.compress(rows)) + chunk(b'IEND', b''))


@pytest.fixture(scope='module')
def odd_files(tmp_path_factory):
    """bad-inputs-3's d/i_mixed kinds, and their kin, as ROOT/odd/a/<kind>.JPEG, made from known 8-bit pixels ->
    (ROOT, {kind: the (H, W, 3) pixels any reader must give, or None for a lossy JPEG}). The oracle is the
    construction: 16 bits v * 257 are v in 8 bits; an alpha channel is dropped (PIL's convert('RGB'), libpng's
    strip); a palette is its colours; grey is replicated."""
    import numpy as np
    from PIL import Image
    root = tmp_path_factory.mktemp('odd')
    for c in ('a', 'b'):  # (b: an RGB JPEG; a folder of one class is refused)
        (root / 'odd' / c).mkdir(parents=True)
    rgb = natural(1, 32, seed=3)[0].permute(1, 2, 0).numpy()
    grey = rgb[..., 0]
    pal = Image.fromarray(rgb).quantize(16)
    kinds = {
        'grey16_png': (Image.fromarray(grey.astype(np.uint16) * 257), 'PNG', np.repeat(grey[..., None], 3, 2)),
        'rgba_png': (Image.fromarray(np.dstack([rgb, 255 - grey]), 'RGBA'), 'PNG', rgb),
        'grey_png': (Image.fromarray(grey), 'PNG', np.repeat(grey[..., None], 3, 2)),
        'grey_alpha_png': (Image.fromarray(np.dstack([grey, grey]), 'LA'), 'PNG', np.repeat(grey[..., None], 3, 2)),
        'palette_gif': (pal, 'GIF', np.array(pal.getpalette()[:48]).reshape(16, 3)[np.asarray(pal)]),
        'png': (Image.fromarray(rgb), 'PNG', rgb),
        'bmp': (Image.fromarray(rgb), 'BMP', rgb),
        'one_px_jpeg': (Image.fromarray(rgb[:1, :1]), 'JPEG', None),
        'cmyk_jpeg': (Image.fromarray(rgb).convert('CMYK'), 'JPEG', None),
        'grey_jpeg': (Image.fromarray(grey), 'JPEG', None),
        'rgb_jpeg': (Image.fromarray(rgb), 'JPEG', None),
    }
    for name, (img, fmt, _) in kinds.items():
        img.save(root / 'odd' / 'a' / f'{name}.JPEG', format=fmt)
    png16(root / 'odd' / 'a' / 'rgb16_png.JPEG', rgb.astype(np.uint16) * 257)
    Image.fromarray(255 - rgb).save(root / 'odd' / 'b' / 'b_jpeg.JPEG')
    return root, {**{name: want for name, (_, _, want) in kinds.items()}, 'rgb16_png': rgb}


def pil_pixels(path):  # --decode cpu's reading of a file: images.load_rgb, as (3, H, W) uint8
    import numpy as np
    import images
    return torch.from_numpy(np.array(images.load_rgb(path))).permute(2, 0, 1)


@pytest.mark.parametrize('kind', ['grey16_png', 'rgb16_png', 'rgba_png', 'grey_png', 'grey_alpha_png', 'palette_gif',
                                  'png', 'bmp', 'one_px_jpeg', 'cmyk_jpeg', 'grey_jpeg', 'rgb_jpeg'])
def test_decode_gpu_and_cpu_give_the_same_pixels_for_every_kind_of_file(odd_files, kind):
    """--decode cpu (images.load_rgb) and --decode gpu (loader.decode_batch on the CPU device, from the loader
    workers' data.ImageFolder item through collate_bytes) give the construction's pixels (the lossless kinds), and
    each other's, bit for bit, as (3, H, W) uint8. Fails if a 16-bit kind comes back uint16 or unscaled (D18), or if
    a greyscale or RGBA file is decoded without the conversion to RGB (mutant 7 of issue 42)."""
    import numpy as np
    import data
    import loader
    root, wants = odd_files
    ds = data.ImageFolder(root, 'odd', lambda x: x, 32, decode='gpu')
    i = [Path(p).stem for p, _ in ds.samples].index(kind)
    batch = loader.collate_bytes([ds[i]])
    gpu, cpu = loader.decode_batch(batch[0], *batch[2:], ds, 'cpu')[0], pil_pixels(ds.samples[i][0])
    assert gpu.dtype == torch.uint8 and gpu.shape == cpu.shape and gpu.shape[0] == 3
    assert torch.equal(gpu, cpu)
    if wants[kind] is not None:
        assert torch.equal(cpu, torch.from_numpy(np.array(wants[kind], dtype=np.uint8)).permute(2, 0, 1))
    if kind == 'grey_jpeg':
        assert torch.equal(cpu[0], cpu[1]) and torch.equal(cpu[0], cpu[2])


def test_decode_gpu_reads_a_batch_mixing_every_kind_of_file(odd_files):
    """One batch of all the kinds (D14: a 16-bit PNG among 8-bit files crashed torch.stack, uint8 with uint16),
    through 2 loader workers, against load_rgb per file with the same (deterministic) transform on the tensor."""
    import data
    import loader
    from torchvision.transforms import v2
    tf = v2.Resize((16, 16), antialias=True)
    ds = data.ImageFolder(odd_files[0], 'odd', tf, 16, decode='gpu')
    got = torch.cat([loader.decode_batch(b[0], *b[2:], ds, 'cpu') for b in torch.utils.data.DataLoader(
        ds, batch_size=len(ds), num_workers=2, collate_fn=loader.collate_bytes)])
    assert got.dtype == torch.uint8 and torch.equal(got, torch.stack([tf(pil_pixels(p)) for p, _ in ds.samples]))
