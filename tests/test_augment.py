"""augment.py against torchvision (the oracle), image by image.

RandAugment's ops, signs and magnitudes come from torchvision.transforms.v2.RandAugment itself: under
a seeded global RNG it draws the op index and the sign; the test reads the same draws, applies our op
with them, and compares the pixels (they agree exactly but for < 0.1% of pixels, where float rounding
of an affine grid or a blend lands on the other side of .5).
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import torchvision.transforms.v2 as T
import torchvision.transforms.v2.functional as TF
from torchvision.datasets import ImageFolder

import augment as A

MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2471, 0.2435, 0.2616)


pytestmark = pytest.mark.usefixtures('one_thread')  # tests/conftest.py


@pytest.fixture(scope='module')
def images(cifar10_dir):
    """The first 200 CIFAR-10 test images (20 per class): (200, 3, 32, 32) uint8."""
    ds = ImageFolder(cifar10_dir / 'test')
    per_class = [[p for p, y in ds.samples if y == c][:20] for c in range(10)]
    return torch.stack([torch.from_numpy(np.array(ds.loader(p))).permute(2, 0, 1)
                        for paths in per_class for p in paths])


def make(**kw):
    return A.make_augment(mean=MEAN, std=STD, device='cpu', **kw)


# -----------------------------------------------------------------------------
# RandAugment: the oracle is torchvision's RandAugment(num_ops=1, magnitude=m), one image at a time.
def torchvision_draw(seed):
    """The op index and sign torchvision's RandAugment draws after torch.manual_seed(seed): it picks
    the op with torch.randint(14, ()) and, for a signed op, negates with torch.rand(()) <= 0.5."""
    torch.manual_seed(seed)
    k = int(torch.randint(len(A.RA_OPS), ()))
    negative = A.RA_OPS[k] in A.RA_SIGNED and bool(torch.rand(()) <= 0.5)  # a wrong RA_SIGNED shows below
    return k, negative


@pytest.fixture(scope='module')
def draws():
    return [torchvision_draw(seed) for seed in range(1500)]


@pytest.mark.parametrize('name', A.RA_OPS)
def test_randaugment_op_matches_torchvision(images, draws, name):
    seeds = [s for s, (k, _) in enumerate(draws) if k == A.RA_OPS.index(name)][:40]
    differ, changed, negatives = 0, 0, 0
    for i, seed in enumerate(seeds):
        img, m = images[i * 5 % len(images)], (0, 30, 8, 12, 20, 3)[i % 6] if i < 6 else (7 * i) % 31
        torch.manual_seed(seed)
        ref = T.RandAugment(num_ops=1, magnitude=m)(img)  # interpolation nearest, fill 0: the defaults
        k, negative = torchvision_draw(seed)
        magnitude = A.ra_magnitudes(m)[k] * (-1.0 if negative else 1.0)
        ours = A.apply_ra_ops(img[None].float(), torch.tensor([k]), torch.tensor([magnitude], dtype=torch.float64))[0]
        differ += (ours != ref.float()).sum().item()
        changed += not torch.equal(ours, img.float())
        negatives += negative
    assert len(seeds) == 40
    assert differ <= 1e-3 * 40 * img.numel(), f'{name}: {differ} of {40 * img.numel()} pixels differ'
    if name != 'Identity':  # the op did something, and a signed op was drawn with both signs
        assert changed >= 30
    assert (name in A.RA_SIGNED) == (negatives > 0)


@pytest.mark.parametrize('m', [9, 17])
def test_make_augment_randaug_m_is_torchvision_magnitude_m(images, draws, m):
    """For the pipeline building its table at another bin than --randaug-m (m + 1, say): make_augment(randaug_m=m)
    end to end, crop off (scale 1), RandAugment(1, m) only. Every output image is torchvision's own
    RandAugment(num_ops=1, magnitude=m) of the image or of its mirror, for one of the 23 (op, sign) draws,
    each forced through torchvision's forward by a seed that draws it; at most 1% of its values differ."""
    seeds = {}  # (op, sign) -> the first seed under which torchvision draws it
    for seed, key in enumerate(draws):
        seeds.setdefault(key, seed)
    assert len(seeds) == 14 + len(A.RA_SIGNED)
    out = make(scale=1.0, randaug_n=1, randaug_m=m, seed=m)(images)
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    ours = ((out * std + mean) * 255).round()  # the integers 0..255 again (test_flip_only_and_normalisation
    # checks the normalisation itself)
    fewest = torch.full((len(images),), images[0].numel())  # per image: the fewest values differing from a draw
    for x in (images, images.flip(3)):
        for seed in seeds.values():
            torch.manual_seed(seed)
            ref = T.RandAugment(num_ops=1, magnitude=m)(x)  # the whole batch, one draw
            fewest = torch.minimum(fewest, (ref.float() != ours).flatten(1).sum(1))
    off = (fewest > 0.01 * images[0].numel()).sum().item()
    assert off == 0, f'{off} of {len(images)} images are no draw of RandAugment(1, {m}): {sorted(fewest.tolist())[-8:]}'


def test_randaugment_draws_an_op_per_image(images):
    """One image 240 times, RandAugment(1, 9) only: every image draws its own op and sign. (One op for
    the whole batch would leave at most 4 different results: 2 signs x 2 flips.)"""
    x = images[7:8].expand(240, -1, -1, -1)
    out = make(randaug_n=1, randaug_m=9)(x)
    distinct = {tuple(o.flatten()[::3].tolist()) for o in out}
    assert len(distinct) >= 20, len(distinct)


def test_no_host_sync(images):
    """Every op runs on the meta device, where anything that would wait for the GPU (nonzero, boolean
    indexing, .item(), bincount) raises: the whole pipeline is free of host syncs."""
    for kw in (dict(scale=0.75, randaug_n=2, randaug_m=12, jitter=0.1, reprob=0.25), dict(aug='basic')):
        aug = make(**kw)
        aug.generator = None  # meta tensors have no generator; the global one is fine here
        for name in ('mean', 'std', 'ra_magnitude', 'ra_signed'):
            setattr(aug, name, getattr(aug, name).to('meta'))
        out = aug(images.to('meta'))
        assert out.shape == images.shape and out.dtype == torch.float32 and out.device.type == 'meta'


# -----------------------------------------------------------------------------
# Crops, flips, normalisation, erasing.
def test_resized_crop_flip_matches_torchvision(images):
    B = len(images)
    gen = torch.Generator().manual_seed(1)
    side = torch.randint(10, 33, (B,), generator=gen).double()
    top = (torch.rand(B, generator=gen, dtype=torch.float64) * (33 - side)).floor()
    left = (torch.rand(B, generator=gen, dtype=torch.float64) * (33 - side)).floor()
    flip = torch.rand(B, generator=gen) < 0.5
    ours = A.resized_crop_flip(images.float(), top, left, side, flip)
    ref = []
    for img, t, l, s, f in zip(images.float(), top.int().tolist(), left.int().tolist(), side.int().tolist(), flip):
        r = TF.resized_crop(img, t, l, s, s, [32, 32], antialias=True)  # float path: no uint8 fixed point
        ref.append(TF.horizontal_flip(r) if f else r)
    assert torch.equal(ours, torch.stack(ref).round())


def test_pad_crop_flip_closed_form(images):
    B = len(images)
    gen = torch.Generator().manual_seed(2)
    dy, dx = torch.randint(0, 9, (2, B), generator=gen)
    flip = torch.rand(B, generator=gen) < 0.5
    ours = A.pad_crop_flip(images, dy, dx, flip)
    padded = F.pad(images, (4, 4, 4, 4))
    for b in range(B):
        ref = padded[b, :, dy[b]:dy[b] + 32, dx[b]:dx[b] + 32]
        assert torch.equal(ours[b], ref.flip(-1) if flip[b] else ref)


def test_flip_only_and_normalisation(images):
    """scale 1, no RandAugment, jitter or erasing: each image is Normalize(ToTensor(x)) or its
    mirror, drawn per image; the normalisation is torchvision's."""
    x = images.repeat(2, 1, 1, 1)
    out = make(scale=1.0, randaug_n=0)(x)
    mean, std = torch.tensor(MEAN).view(1, 3, 1, 1), torch.tensor(STD).view(1, 3, 1, 1)
    assert torch.equal(A.normalize(x, mean, std), TF.normalize(x.float() / 255, MEAN, STD))
    plain, mirrored = TF.normalize(x.float() / 255, MEAN, STD), TF.normalize(x.flip(3).float() / 255, MEAN, STD)
    is_plain, is_mirror = (out == plain).flatten(1).all(1), (out == mirrored).flatten(1).all(1)
    assert (is_plain | is_mirror).all()
    assert 0.35 < is_mirror.float().mean() < 0.65


def test_augment_is_per_image_and_seeded():
    x = torch.full((256, 3, 32, 32), 100, dtype=torch.uint8)
    x[:, :, :16] = 200  # one image, 256 times; top half brighter
    x[:, 0, :, :8] = 30
    kw = dict(scale=0.5, jitter=0.3, reprob=0.5, seed=3)
    aug = make(**kw)
    out = aug(x)
    assert out.shape == (256, 3, 32, 32) and out.dtype == torch.float32
    assert len({tuple(o.flatten()[::7].tolist()) for o in out}) > 240  # (nearly) all different
    # random erasing: zeros (the mean colour after normalisation) on ~reprob of the images
    erased = (out == 0).all(1).flatten(1).any(1).float().mean()
    assert 0.35 < erased < 0.65
    # the same seed gives the same batch; the generator's state replays it
    assert torch.equal(make(**kw)(x), out)
    state = aug.generator.get_state()
    first = aug(x)
    aug.generator.set_state(state)
    assert torch.equal(aug(x), first)
    assert not torch.equal(make(**{**kw, 'seed': 4})(x), out)


def test_random_erasing_boxes():
    """reprob 1: every image has one axis-aligned zero box of 2-33% of the image, aspect 0.3-3.3."""
    x = torch.full((200, 3, 32, 32), 255, dtype=torch.uint8)
    out = make(randaug_n=0, reprob=1.0)(x)
    for o in out:
        box = (o == 0).all(0)
        rows, cols = box.any(1).nonzero()[:, 0], box.any(0).nonzero()[:, 0]
        h, w = len(rows), len(cols)
        assert box.sum() == h * w and rows[-1] - rows[0] + 1 == h and cols[-1] - cols[0] + 1 == w
        # area U(2%, 33%) of 1024 px; h and w are each rounded, so the box area may miss by < 33 px
        assert 15 <= h * w <= 0.33 * 1024 + 33 and h < 32 and w < 32
        assert (o != 0).any(0).sum() == 1024 - h * w


# -----------------------------------------------------------------------------
# On a GPU: kernel launches, TF32, memory layout.
NO_KERNEL = {'aten::' + n for n in (
    'view', 'as_strided', 'as_strided_', 'expand', 'unsqueeze', 'unsqueeze_', 'squeeze', 'select', 'slice', 'unbind',
    'permute', 'reshape', '_reshape_alias', 'alias', 't', 'transpose', 'detach', 'lift_fresh', 'empty', 'empty_like',
    'empty_strided', 'new_empty', 'new_empty_strided', 'resolve_conj', 'resolve_neg', '_unsafe_view', 'split',
    'narrow', 'resize_', 'to', 'contiguous', 'scalar_tensor', 'expand_as', 'view_as', 'flatten', 'unflatten',
    'split_with_sizes', 'chunk', '_local_scalar_dense', 'item')}  # views, allocations, CPU-scalar reads


def count_launches(fn):
    """The device kernels fn() would launch, counted on the CPU with torch.profiler: each aten op that is not a
    view or an allocation (NO_KERNEL) and runs no such op itself counts once, except a copy or fill of 0-dim
    tensors only (a Python number wrapped on the CPU: a kernel argument on a GPU, not a launch)."""
    from torch.profiler import ProfilerActivity, profile

    def launches(e):
        n = sum(launches(c) for c in e.cpu_children)
        if n or not e.name.startswith('aten::') or e.name in NO_KERNEL:
            return n
        scalar_only = not any(len(s) for s in e.input_shapes if isinstance(s, list))
        return 0 if scalar_only and e.name in ('aten::copy_', 'aten::fill_', 'aten::_to_copy') else 1

    fn()  # warm: lazy initialisation and caches (augment.affine_basis) out of the count
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    return sum(launches(e) for e in prof.events() if e.cpu_parent is None)


def test_default_recipe_launches_few_kernels():
    """train_cifar.py's default recipe (strong, scale 1, RandAugment(2, 12); bench.CIFAR_RUN) on one batch: 360
    launches before its ops were fused by form (augment.py docstring), 201 after; 'basic' takes 17; locuslab's
    recipe 375 before, 258 after. The count does not depend on the batch size."""
    x = torch.randint(0, 256, (64, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    strong, basic = make(aug='strong', scale=1.0, randaug_n=2, randaug_m=12), make(aug='basic')
    locuslab = make(aug='strong', scale=0.75, randaug_n=1, randaug_m=8, jitter=0.1, reprob=0.25)
    assert count_launches(lambda: strong(x)) <= 220
    assert count_launches(lambda: basic(x)) <= 20
    assert count_launches(lambda: locuslab(x)) <= 280


def test_no_tf32_in_augment(images):
    """The training scripts switch TF32 on (utils.setup: torch.backends.cuda.matmul.allow_tf32 and
    torch.backends.cudnn.allow_tf32), which rounds the inputs of float32 matmuls and cuDNN convolutions to 10
    mantissa bits: on a GPU, 0.8-1.5% of the pixels of each sheared, rotated or sharpened image then differ
    from torchvision's. Every matmul and convolution of RandAugment's ops and of gaussian_blur must run in
    float64 (out of TF32's reach) or in float32 with TF32 off at the time of the call, and the flags are
    restored after. Recorded on the CPU with the global flags set: a TorchDispatchMode (semi-private,
    torch.utils._python_dispatch) sees every aten op below autograd, however it was called."""
    from torch.utils._python_dispatch import TorchDispatchMode
    matmuls = {torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm, torch.ops.aten.baddbmm,
               torch.ops.aten.convolution, torch.ops.aten.mkldnn_convolution, torch.ops.aten._convolution}
    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in matmuls:
                calls.append((str(func), args[0].dtype, torch.backends.cudnn.allow_tf32,
                              torch.backends.cuda.matmul.allow_tf32))
            return func(*args, **(kwargs or {}))

    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    try:
        x, B = images[:28].float(), 28
        op = torch.arange(B) % len(A.RA_OPS)  # every op, both signs
        magnitude = torch.tensor(A.ra_magnitudes(20), dtype=torch.float64)[op] * (1 - 2 * (torch.arange(B) >= 14))
        with Record():
            A.apply_ra_ops(x, op, magnitude)
            A.gaussian_blur(x, torch.full((B,), 1.5), 5)
        assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32  # restored
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
    assert calls  # the affine grid's matmul and the blur's convolution at least
    tf32 = [c for c in calls if c[1] == torch.float32 and (c[2] if 'conv' in c[0] else c[3])]
    assert not tf32, tf32


@pytest.mark.parametrize('aug', ['basic', 'strong'])
def test_output_is_contiguous_nchw(images, aug):
    """One layout for every recipe, the caller's choice (train_cifar.py --channels-last converts after):
    'basic' gathered NHWC-strided batches, 'strong' and the evaluation NCHW. Also from an NHWC input."""
    for x in (images, images.contiguous(memory_format=torch.channels_last)):
        out = make(aug=aug, scale=0.5, reprob=0.5, jitter=0.2)(x)
        assert out.is_contiguous() and out.shape == x.shape


def test_random_erasing_pixel_mode_fills_one_box_per_image_with_noise():
    """train_imagenet.py's erasing (timm's 'pixel' mode, the box drawn as make_augment's value-0 erasing, which is
    tested pixel for pixel against torchvision): p = 1 erases one rectangle of 2-33% of each image with N(0, 1)
    noise, the same box in every channel, and leaves every other pixel as it was; p = 0 changes nothing."""
    torch.manual_seed(0)
    x = torch.full((64, 3, 32, 32), 7.0)
    out = A.random_erasing(x, 1.0, noise=True)
    changed = out != x
    assert torch.equal(changed[:, 0], changed[:, 1]) and torch.equal(changed[:, 0], changed[:, 2])
    frac = changed[:, 0].flatten(1).float().mean(1)
    assert (frac > 0.015).all() and (frac < 0.34).all()
    rows, cols = changed[:, 0].any(2), changed[:, 0].any(1)  # a rectangle: its row and column spans fill it
    assert torch.equal(changed[:, 0].sum((1, 2)), rows.sum(1) * cols.sum(1))
    noise = out[changed]
    assert abs(noise.mean()) < 0.05 and abs(noise.std() - 1) < 0.05
    assert torch.equal(A.random_erasing(x, 0.0, noise=True), x)


# -----------------------------------------------------------------------------
# issue 34: augment.py as a library: every setting and input checked where torchvision checks it
@pytest.mark.parametrize('kw,message', [
    (dict(randaug_m=-5), 'randaug_m must be an integer 0..30, got -5'),  # L06: ran with a negative bin
    (dict(randaug_m=31), 'randaug_m must be an integer 0..30, got 31'),  # L05: IndexError at the first call
    (dict(randaug_m=12.5), 'randaug_m must be an integer 0..30, got 12.5'),
    (dict(randaug_n=-1), 'randaug_n must be an integer >= 0, got -1'),
    (dict(jitter=-1.0), 'jitter must be a finite number >= 0, got -1.0'),  # L08: ColorJitter refuses it
    (dict(scale=float('nan')), r'scale must be a number in \(0, 1\]: the smallest crop area, got nan'),  # L13
    (dict(scale=0.0), r'scale must be a number in \(0, 1\]'),
    (dict(reprob=1.5), r'reprob must be a probability in \[0, 1\], got 1.5'),
    (dict(seed='0'), "seed must be an integer, got '0'"),
])
def test_a_bad_setting_is_refused_by_make_augment(kw, message):
    with pytest.raises(ValueError, match=message):
        make(**kw)


@pytest.mark.parametrize('x,aug,message', [
    (torch.rand(4, 3, 32, 32), 'strong', r'uint8 batch \(B, 3, H, W\) of levels 0..255, got torch.float32'),  # L02
    (torch.randint(0, 256, (4, 32, 32, 3), dtype=torch.uint8), 'strong', r'got torch.uint8 \(4, 32, 32, 3\)'),  # L09
    (torch.randint(0, 256, (4, 1, 32, 32), dtype=torch.uint8), 'basic', r'got torch.uint8 \(4, 1, 32, 32\)'),  # L11
    (torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8), 'basic', r'got torch.uint8 \(3, 32, 32\)'),
    (torch.randint(0, 256, (4, 3, 32, 48), dtype=torch.uint8), 'strong', "takes square images only, got 32x48"),  # L10
])
def test_a_bad_batch_is_a_clear_value_error(x, aug, message):
    """Float images in [0, 1] used to come out all -1 (read as levels 0..1); the others failed deep inside."""
    with pytest.raises(ValueError, match=message):
        make(aug=aug)(x)


def test_basic_takes_a_non_square_batch():
    """L10, 'basic': the pad-and-crop is per axis: a 32x48 batch keeps its shape (only 'strong' needs squares)."""
    x = torch.randint(0, 256, (4, 3, 32, 48), dtype=torch.uint8)
    assert make(aug='basic')(x).shape == (4, 3, 32, 48)
