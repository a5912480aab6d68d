"""gpu_probe.py: gpu_check.py's measurements that run inside one Python process, each its own process so that
gpu_check's deadline can end it (a wedged CUDA call too), writing one JSON:

    python gpu_probe.py versions --json FILE   # python, torch, CUDA, cuDNN, the GPU, the packages gpu_check needs
    python gpu_probe.py augment --json FILE    # every augment.py op on the device against the CPU: differing pixels
    python gpu_probe.py memory --json FILE     # a ViT-B/16 SAM step's peak memory; the default micro-batches

On a machine without CUDA each runs on the CPU (gpu_check.py --dry-run): the plumbing, not the figures.
"""
import argparse
import importlib.metadata
import os
import platform
from contextlib import contextmanager
from unittest import mock

import torch
import torch.nn.functional as F

import augment
from models import build_model
from runs import save_atomic
from sam import SAM, first_pass, second_pass
from utils import micro_batch_cap, one_line, setup

PACKAGES = ('torch', 'torchvision', 'numpy', 'einops', 'pillow', 'timm', 'matplotlib', 'imagecorruptions-imaug')
# The default micro-batch (utils.micro_batch_cap) of the models and sizes that ran out of an 80 GB card at 256 per 40 GB
CAPS = dict(vit_b16=224, vit_l16=224, vit_b8=224, vit_b16_384=384)


def versions(args):
    def version(dist):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None
    cuda = torch.cuda.is_available()
    return dict(python=platform.python_version(), cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(),
                packages={p: version(p) for p in PACKAGES}, gpu=torch.cuda.get_device_name() if cuda else None,
                gpu_memory_mib=torch.cuda.get_device_properties(0).total_memory / 2 ** 20 if cuda else None,
                cpus=len(os.sched_getaffinity(0)))


# ----- augment: CUDA against the CPU, op by op, with the same inputs and the same random draws.
@contextmanager
def fixed_draws(draws, device=None):
    """torch.rand / torch.randint as the pipelines call them: device None (the CPU run) appends each draw to draws;
    else they are replayed in order, moved to device (a CUDA generator draws other numbers than a CPU one)."""
    real = dict(rand=torch.rand, randint=torch.randint)

    def draw(name):
        def f(*a, **k):
            if device is None:
                draws.append(real[name](*a, **k))
                return draws[-1]
            return draws.pop(0).to(device)
        return f
    with mock.patch.object(torch, 'rand', draw('rand')), mock.patch.object(torch, 'randint', draw('randint')):
        yield


def both(fn, device, *inputs):
    """fn(*inputs) on the CPU and on device (inputs moved there, draws replayed) -> differing output pixels."""
    draws = []
    with fixed_draws(draws):
        cpu = fn(*inputs)
    with fixed_draws(draws, device):
        dev = fn(*[v.to(device) if torch.is_tensor(v) else v for v in inputs]).cpu()
    return int((cpu != dev).sum())


def augment_ops(args):
    """Every op of augment.py on the device against the CPU (tests/test_gpu_check.py lists them), under setup()'s
    flags (TF32, cudnn.benchmark, as in training): TF32 or a kernel that rounds otherwise shows as differing pixels."""
    device = setup('auto').device  # TF32 and cudnn flags on, as in every training run
    g = torch.Generator().manual_seed(0)
    B = 64
    x = torch.randint(0, 256, (B, 3, 32, 32), dtype=torch.uint8, generator=g)
    u = lambda *s: torch.rand(*s, generator=g, dtype=torch.float64)  # noqa: E731
    mags = torch.tensor(augment.ra_magnitudes(12), dtype=torch.float64)
    rows = {}
    for k, name in enumerate(augment.RA_OPS):
        sign = torch.where(u(B) < 0.5, -1.0, 1.0).double()
        mag = mags[k] * (sign if name in augment.RA_SIGNED else torch.ones(B, dtype=torch.float64))
        rows[name] = both(lambda x, op, m: augment.apply_ra_ops(x.float(), op, m), device, x, torch.full((B,), k), mag)
    side, flip = torch.randint(24, 33, (B,), generator=g).double(), u(B) < 0.5
    top = ((32 - side + 1) * u(B)).floor()
    rows['resized_crop_flip'] = both(lambda *a: augment.resized_crop_flip(a[0].float(), *a[1:]), device, x, top,
                                     torch.zeros(B).double(), side, flip)
    rows['pad_crop_flip'] = both(augment.pad_crop_flip, device, x, *torch.randint(0, 9, (2, B), generator=g), flip)
    h, w = torch.randint(8, 33, (2, B), generator=g).double()
    rows['resized_crop_rect_flip'] = both(lambda x, *a: augment.resized_crop_rect_flip(x.float(), *a, 48, flip.to(
        x.device)), device, x, ((32 - h + 1) * u(B)).floor(), ((32 - w + 1) * u(B)).floor(), h, w)
    sigma = (0.1 + 1.9 * u(B)).float()
    rows['gaussian_blur'] = both(lambda x, s: augment.gaussian_blur(x.float(), s, 5), device, x, sigma)
    rows['adjust_hue'] = both(lambda x, f: augment.adjust_hue(x.float(), f), device, x, (u(B, 1, 1) - 0.5).float())
    factors = torch.cat([1 + 0.4 * (2 * u(B, 3) - 1), 0.1 * (2 * u(B, 1) - 1)], 1)
    rows['color_jitter'] = both(lambda x, f, o: augment.color_jitter(x.float(), f, o), device, x, factors,
                                u(B, 4).argsort(1))
    rows['random_erasing'] = both(lambda x: augment.random_erasing(x.float() / 255, 0.5), device, x)
    for recipe, kw in {'strong': dict(), 'locuslab': dict(scale=0.75, randaug_n=1, randaug_m=8, jitter=0.1,
                                                          reprob=0.25), 'basic': dict(aug='basic')}.items():
        rows[f'Augment.__call__ ({recipe})'] = both(lambda x: augment.make_augment(
            **kw, mean=(0.5,) * 3, std=(0.25,) * 3, device=x.device)(x), device, x)
    rows.update(moco_view_diff(augment.moco_view))
    return dict(differing_pixels=rows, pixels_per_op=x.numel(), device=str(device),
                tf32=dict(matmul=torch.backends.cuda.matmul.allow_tf32, cudnn=torch.backends.cudnn.allow_tf32))


def moco_view_diff(moco_view):
    """Both MoCo v3 views of 64 images (224 px at 96 px: blur, solarize, jitter, grey) on the device and the CPU."""
    device = setup('auto').device
    x = torch.randint(0, 256, (64, 3, 64, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    mean, std = torch.full((1, 3, 1, 1), 0.5), torch.full((1, 3, 1, 1), 0.25)
    rows = {}
    for view in (0, 1):
        def fn(x, mean, std):
            gen = torch.Generator(x.device).manual_seed(0)
            return moco_view(x, gen, 64, 0, 64, view, 96, 0.08, mean, std)
        rows[f'moco_view {view}'] = both(fn, device, x, mean, std)
    return rows


def memory(args):
    """Peak memory of one SAM training step (both passes, AdamW) of ViT-B/16 in bf16 at 64 and 256 images and at the
    default micro-batch utils.micro_batch_cap derives for it (MiB per image from the slope: is the cap's count
    right?); the defaults it derives for ViT-L/16 and ViT-B/8 at 224 px and ViT-B/16 at 384 px."""
    caps = {k: micro_batch_cap(lambda: build_model(k.split('_384')[0], 1000, px), px) for k, px in CAPS.items()}
    if not torch.cuda.is_available():
        return dict(measured=False, note='CPU: no allocator peak to read', max_micro_batch=caps)
    rows = {}
    for batch in sorted({64, 256, caps['vit_b16']}):
        try:
            model = build_model('vit_b16', 1000, 224).cuda()
            opt = SAM(model.parameters(), torch.optim.AdamW, lr=1e-4)
            x, y = torch.randn(batch, 3, 224, 224, device='cuda'), torch.randint(0, 1000, (batch,), device='cuda')
            torch.cuda.reset_peak_memory_stats()
            for ctx in (first_pass, second_pass):
                with ctx(model), torch.autocast('cuda', torch.bfloat16):
                    loss = F.cross_entropy(model(x), y)
                loss.backward()
                if ctx is first_pass:
                    opt.first_step(zero_grad=True)
            opt.second_step(zero_grad=True)
            rows[batch] = torch.cuda.max_memory_allocated() / 2 ** 20
        except torch.cuda.OutOfMemoryError as e:
            rows[batch] = f'out of memory: {one_line(e)[:200]}'
        model = opt = x = y = loss = None
        torch.cuda.empty_cache()
    per_image = (rows[256] - rows[64]) / 192 if all(isinstance(rows[b], float) for b in (64, 256)) else None
    return dict(measured=True, peak_mib=rows, mib_per_image=per_image, max_micro_batch=caps,
                gpu_memory_mib=torch.cuda.get_device_properties(0).total_memory / 2 ** 20)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('part', choices=['versions', 'augment', 'memory'])
    p.add_argument('--json', required=True, metavar='FILE', help='where the figures go')
    args = p.parse_args(argv)
    save_atomic(args.json, dict(versions=versions, augment=augment_ops, memory=memory)[args.part](args))


if __name__ == '__main__':
    main()
