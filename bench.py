"""bench.py: this repo's speed beside the code people would otherwise use, as ONE markdown table.

Model rows: a training step (fwd + bwd + AdamW) of our model beside timm's model of the same config,
same weights, batch and dtype (without timm: ours alone); our SAM step over our base step, GSAM over SAM, LookSAM
(k 5: per step, over a cycle) and MSAM over the base step, with their forward passes per step counted; peak memory;
training FLOPs; on CUDA the achieved TFLOP/s and MFU. --json is rewritten after every row, every figure a number.
cifar rows: augment.make_augment at train_cifar.py's default recipe beside locuslab/convmixer-cifar10's PIL pipeline
(one image at a time), both on one core; then its share of a CIFAR step.
loader rows: train_imagenet.py's input per loader worker core, for each recipe and --decode path, on ImageNet-sized
JPEGs made here, beside torchvision's ImageFolder + transforms.v2 with the same recipe.

    python bench.py --quick            # every row at small sizes: a few minutes on 2 CPU cores
    python bench.py                    # full sizes
    python bench.py --rows vit_b16,mixer_b16,convmixer_768_32,cifar --compile --json bench.json
    python bench.py --rows loader      # the ImageNet input rows only
"""
import argparse
import contextlib
import datetime
import math
import multiprocessing
import os
import platform
import resource
import sys
import tempfile
import time

import torch
import torch._dynamo
import torch.nn.functional as F
import torch.utils.benchmark as benchmark
import torchvision
import torchvision.transforms as T
from torch.utils.flop_counter import FlopCounterMode

import augment
import convmixer
import data
import loader
import mixer
import vit
from data import MEAN, STD
from flags import refuse_loose
from models import channels_last
from runs import save_atomic
from gsam import GSAM
from looksam import LookSAM
from msam import MSAM
from sam import SAM, first_pass, second_pass
from utils import UserError

try:  # the reference side of the model rows: without timm (a bare GPU machine) they time ours alone, and say so
    import timm
except ImportError:
    timm = None

LOOK_K = 5  # the LookSAM column's k: its paper's and the MSAM paper's comparison's (looksam.py)
# name: (timm's model: a timm name, or the kwargs of timm's class; (px, batch) at --quick, at full
# size on CPU, at full size on CUDA). --quick keeps the paper sizes but small batches, and runs
# ConvMixer-768/32 at 112 px, where one 224 px step takes seconds on a CPU core.
ROWS = {
    'vit_s16': ('vit_small_patch16_224', (224, 4), (224, 16), (224, 256)),
    'vit_b16': ('vit_base_patch16_224', (224, 2), (224, 8), (224, 128)),
    'mixer_s16': ('mixer_s16_224', (224, 4), (224, 16), (224, 256)),
    'mixer_b16': ('mixer_b16_224', (224, 2), (224, 8), (224, 128)),
    'convmixer_256_8': (dict(dim=256, depth=8, kernel_size=5, patch_size=2, num_classes=10),
                        (32, 32), (32, 128), (32, 512)),  # not a timm config: timm's class
    'convmixer_768_32': ('convmixer_768_32', (112, 2), (224, 4), (224, 64)),
}

# A model row's timed steps: key -> (side, optimizer, m-sharpness groups); each gives the row's KEY_s. RATIOS: each a
# number in the JSON and a table column (header, numerator, denominator). A new optimizer: a key here, a ratio there.
STEPS = dict(ours=('ours', False, False), ref=('timm', False, False), sam=('ours', True, False),
             sam_m=('ours', True, True), gsam=('ours', 'gsam', False), look=('ours', 'look', False),
             msam=('ours', 'msam', False))
RATIOS = dict(sam_over_base=('SAM/base', 'sam', 'ours'), sam_m_over_base=('SAM m/base', 'sam_m', 'ours'),
              gsam_over_sam=('GSAM/SAM', 'gsam', 'sam'), look_over_base=(f'LookSAM-{LOOK_K}/base', 'look', 'ours'),
              msam_over_base=('MSAM/base', 'msam', 'ours'))

# The default CIFAR run: train_cifar.py's defaults (tests/test_bench.py checks that they still are).
CIFAR_RUN = dict(model='convmixer_256_8', batch_size=512, aug='strong', scale=1.0, randaug_n=2, randaug_m=12,
                 jitter=0.0, reprob=0.0)

# train_imagenet.py's recipes, as the loader rows need them (tests/test_bench.py checks them against its RECIPES):
# the crop's smallest area, RandAugment ops and magnitude bin, and the normalisation.
LOADER_RECIPES = {'sam': dict(crop_min=0.08, randaug_n=0, randaug_m=27, norm='jax'),
                  'convmixer': dict(crop_min=0.08, randaug_n=2, randaug_m=27, norm='imagenet')}

# Dense bf16 tensor-core peak FLOP/s by the exact torch.cuda.get_device_name() (a substring match gave "H200 NVL"
# the H200's 989 and "L40" the L4's). NVIDIA data sheets, with 2:4 sparsity (halved here): H100 and H200 SXM 1,979,
# H100 PCIe 1,513, H100 / H200 NVL 1,671, L4 242; dense as printed: A100 312, L40S 362.05, L40 181.05 TFLOP/s.
# Another name: no MFU, and a note to give --peak-tflops.
PEAK_BF16 = {'NVIDIA H100 80GB HBM3': 989.5e12, 'NVIDIA H100 PCIe': 756.5e12, 'NVIDIA H100 NVL': 835.5e12,
             'NVIDIA H200': 989.5e12, 'NVIDIA H200 NVL': 835.5e12, 'NVIDIA A100-SXM4-80GB': 312e12,
             'NVIDIA A100-SXM4-40GB': 312e12, 'NVIDIA A100-PCIE-40GB': 312e12, 'NVIDIA A100 80GB PCIe': 312e12,
             'NVIDIA L40S': 362.05e12, 'NVIDIA L40': 181.05e12, 'NVIDIA L4': 121e12}


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    p.add_argument('--rows', default=','.join([*ROWS, 'cifar', 'loader']), help='comma-separated rows (default: all)')
    p.add_argument('--quick', action='store_true', help='small batches (and 112 px for ConvMixer-768/32)')
    p.add_argument('--device', default='auto', choices=['auto', 'cuda', 'cpu'], help='auto = cuda if available')
    p.add_argument('--amp', default='auto', choices=['auto', 'bf16', 'off'], help='autocast dtype, both sides; '
                   'auto = bf16 on CUDA, off on CPU; weights and AdamW stay fp32 (fp16 would need a GradScaler)')
    p.add_argument('--batch-size', type=int, help='images per step for every row (default: per row)')
    p.add_argument('--img-size', type=int, help='image side in px for every model row (default: per row)')
    p.add_argument('--channels-last', action=argparse.BooleanOptionalAction, help='NHWC weights and input, both sides; '
                   'unset: ConvMixer rows on CUDA in both layouts (NHWC is the training default there), else NCHW')
    p.add_argument('--compile', action='store_true', help='also time torch.compile(model), both sides')
    p.add_argument('--min-run-time', type=float, help='seconds blocked_autorange times each step (default 2, full 10)')
    p.add_argument('--json', metavar='FILE', help='also write the rows (seconds, MiB, GFLOP) as JSON')
    p.add_argument('--peak-tflops', type=float, help="the GPU's dense bf16 peak for MFU (default: PEAK_BF16's)")
    p.add_argument('--sam-m', type=int, help='m of the m-sharpness SAM step (Foret et al. Sec. 4.1; default 32, a '
                   'quarter of a batch not above 32; at or above the batch: the batch, one group, plain SAM)')
    args = p.parse_args(argv)
    args.rows = [r for r in args.rows.split(',') if r]
    if not args.rows:
        raise UserError(f'--rows names no row; valid rows: {", ".join(ROWS)}, cifar, loader')
    if bad := [r for r in args.rows if r not in (*ROWS, 'cifar', 'loader')]:
        raise UserError(f'unknown row(s) {", ".join(bad)}; valid rows: {", ".join(ROWS)}, cifar, loader')
    for name in ('batch_size', 'img_size', 'min_run_time', 'peak_tflops', 'sam_m'):
        if (v := getattr(args, name)) is not None and not (math.isfinite(v) and v > 0):  # nan: blocked_autorange hangs
            raise UserError(f'--{name.replace("_", "-")} must be a finite number > 0, got {v}')
    cuda = args.device == 'cuda' or (args.device == 'auto' and torch.cuda.is_available())
    refuse_loose(p, argv, [(set(args.rows) - {'cifar', 'loader'},
                            'a model row in --rows (the cifar and loader rows: no model to size, eager, no SAM)',
                            ('img_size', 'sam_m', 'compile')), (cuda, 'a GPU (MFU)', ('peak_tflops',))])
    for name in (r for r in args.rows if args.img_size and r not in ('cifar', 'loader')):  # before building: one line
        patch = {'vit': vit, 'mixer': mixer, 'convmixer': convmixer}[name.split('_')[0]].configs[name]['patch_size']
        if args.img_size % patch if not name.startswith('convmixer') else args.img_size < patch:
            raise UserError(f'--img-size {args.img_size} does not fit {name}\'s {patch} px patches (ViT, Mixer: a '
                            'multiple of them; ConvMixer: at least one)')
    if args.json:  # a real write into its folder now, not after the whole benchmark ran
        try:
            if os.path.isdir(args.json):
                raise IsADirectoryError(21, 'a folder, not a file')
            tempfile.TemporaryFile(dir=os.path.dirname(os.path.abspath(args.json))).close()
        except OSError as e:
            raise UserError(f'--json {args.json} cannot be written: {e.strerror or e}')
    if args.device == 'cuda' and not torch.cuda.is_available():
        raise UserError('--device cuda, but torch.cuda.is_available() is False; use --device cpu')
    args.device = torch.device('cuda' if cuda else 'cpu')
    args.amp = args.amp if args.amp != 'auto' else ('bf16' if cuda else 'off')
    args.min_run_time = args.min_run_time or (2.0 if args.quick else 10.0)
    args.size = 0 if args.quick else 2 if cuda else 1  # which of a row's (px, batch)
    for name in (r for r in args.rows if args.sam_m and r not in ('cifar', 'loader')):  # k equal groups of m, as
        batch = args.batch_size or ROWS[name][1 + args.size][1]  # the training scripts refuse --sam-m otherwise
        if args.sam_m < batch and batch % args.sam_m:
            raise UserError(f'--sam-m {args.sam_m} does not divide the batch of {batch} images of {name}: '
                            'm-sharpness takes k equal groups of m images (pass a divisor, or --batch-size)')
    return args


# One training step, built the same way for both sides.
def build(name, side, px):
    """Our model or timm's (fresh random init) for row `name`; ViT/Mixer are built for px. side 'timm' needs timm."""
    spec, size = ROWS[name][0], {} if name.startswith('convmixer') else {'img_size': px}
    if side == 'timm':
        return timm.models.convmixer.ConvMixer(**spec) if isinstance(spec, dict) else timm.create_model(spec, **size)
    return {'vit': vit, 'mixer': mixer, 'convmixer': convmixer}[name.split('_')[0]].create(name, **size)


def make_step(name, side, px, batch, amp, channels_last, device, compile=False, sam=False, m=None):
    """(step, module, opt, x, y): step() runs one training step (SAM if sam, GSAM if 'gsam', MSAM if 'msam'; m:
    m-sharpness), or with sam 'look' a cycle of LOOK_K LookSAM steps (bench_model divides its time by LOOK_K)."""
    torch.manual_seed(0)  # the same weights on both sides: ours loads timm's (the same keys), if timm is there
    module = theirs = build(name, 'timm', px) if timm else None
    if side == 'ours':
        module = build(name, 'ours', px)
        if theirs is not None:
            module.load_state_dict(theirs.state_dict())
    layout = torch.channels_last if channels_last else torch.contiguous_format
    module = module.to(device, memory_format=layout).train()
    model = torch.compile(module) if compile else module
    x = torch.randn(batch, 3, px, px, device=device).contiguous(memory_format=layout)
    y = torch.randint(0, module.num_classes, (batch,), device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp == 'bf16')
    kw = dict(lr=1e-4, weight_decay=0.05, foreach=True)  # foreach: the default on CUDA, opt-in on CPU
    opt = (GSAM(module.parameters(), torch.optim.AdamW, alpha=0.4, **kw) if sam == 'gsam' else SAM(module.parameters(),
           torch.optim.AdamW, rho=0.05, **kw) if sam is True else LookSAM(module.parameters(), torch.optim.AdamW,
           k=LOOK_K, **kw) if sam == 'look' else MSAM(module.parameters(), torch.optim.AdamW, **kw) if sam == 'msam'
           else torch.optim.AdamW(module.parameters(), **kw))  # (rho: SAM's 0.05, MSAM's 3)
    groups = list(zip(x.split(m or batch), y.split(m or batch)))  # m-sharpness: k groups of m images (k = 1: plain SAM)

    def step():
        if sam in ('look', 'msam'):  # a whole LookSAM cycle (two passes on its first step only: looksam.py's loop), or
            for _ in range(LOOK_K if sam == 'look' else 1):  # an MSAM step (one pass, at w - rho m/||m||: msam.py's)
                two = sam == 'look' and opt.refresh
                if sam == 'msam':
                    opt.perturb()
                with first_pass(module) if two else contextlib.nullcontext(), autocast:
                    loss = F.cross_entropy(model(x), y)
                loss.backward()
                if two:
                    opt.first_step(zero_grad=True)
                    with second_pass(module), autocast:
                        loss = F.cross_entropy(model(x), y)
                    loss.backward()
                if sam == 'look':
                    opt.look_gradient()
                opt.second_step(zero_grad=True)
        elif sam:  # Foret et al. Algorithm 1 in sam.py's m-sharpness group loop (k = 1: the plain SAM step, bitwise)
            for j, (xg, yg) in enumerate(groups):
                with first_pass(module), autocast:
                    loss = F.cross_entropy(model(xg), yg)
                loss.backward()
                opt.first_step(zero_grad=True)  # w <- w + eps_hat_j; .grad <- the g_sam set aside so far
                with second_pass(module, sync=j == len(groups) - 1 and sam != 'gsam'), autocast:
                    loss = F.cross_entropy(model(xg), yg) / len(groups)
                loss.backward()
                if j < len(groups) - 1:
                    opt.next_group()  # w <- w_old; the sum of g_sam set aside
            if sam == 'gsam':
                opt.gsam_gradient()  # .grad <- g_p - alpha g_perp (gsam.py: before the step, which refuses without it)
            opt.second_step(zero_grad=True)  # w <- w_old, then AdamW with the mean g_sam (GSAM: d)
        else:
            opt.zero_grad(set_to_none=True)
            with autocast:
                loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
    return step, module, opt, x, y


def warm_up(*step_args, n=2):
    """Build one side and run n training steps (what the peak memory covers)."""
    step = make_step(*step_args)[0]
    for _ in range(n):
        step()


def median_s(fn, min_run_time, threads=None, clock=None):
    """Median seconds per call of fn() from torch.utils.benchmark (which syncs CUDA per block); clock: its clock
    (default wall time; time.process_time: this process's CPU seconds, what one core spends whatever the load)."""
    timer = benchmark.Timer('fn()', globals={'fn': fn}, num_threads=threads or torch.get_num_threads(),
                            **({'timer': clock} if clock else {}))
    return timer.blocked_autorange(min_run_time=min_run_time).median


def rss_added_mib(fn, *args):
    """Runs in a fresh child: how far fn(*args) raises this process's peak resident set."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    fn(*args)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024


def peak_mib(device, fn, *args):
    """MiB that fn(*args) adds to the peak: CUDA's allocator peak in this process, or on CPU the
    ru_maxrss of a fresh child. Forked by a 'forkserver': a 'spawn' child starts at its parent's peak
    (Linux carries ru_maxrss across the exec), and that would hide everything below it."""
    if device.type == 'cuda':
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn(*args)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    ctx = multiprocessing.get_context('forkserver')
    ctx.set_forkserver_preload(['__main__', __name__])  # children start with torch, timm, bench imported
    with ctx.Pool(1) as pool:
        return pool.apply(rss_added_mib, (fn, *args))


def train_gflops(model_fn, px):
    """Training GFLOP/img = 3 x forward (backward = grad wrt inputs + grad wrt weights), counted on
    meta tensors; not FlopCounterMode's backward: it ignores groups in depthwise convs (torch 2.14)."""
    with torch.device('meta'):
        model = model_fn()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.empty(1, 3, px, px, device='meta'))
    return 3 * counter.get_total_flops() / 1e9


def layouts(name, args):  # channels_last per row: as asked, else both layouts for a ConvMixer on CUDA
    both = name.startswith('convmixer') and args.device.type == 'cuda'
    return [args.channels_last] if args.channels_last is not None else [False, True] if both else [False]


def bench_model(name, args, compile=False, nhwc=False):
    px, batch = ROWS[name][1 + args.size]
    px, batch = args.img_size or px, args.batch_size or batch
    common = (px, batch, args.amp, nhwc, args.device, compile)
    row = dict(row=name, px=px, batch=batch, dtype=args.amp, mode=('compile' if compile else 'eager') + ' NHWC' * nhwc,
               ref=f'timm {ROWS[name][0] if isinstance(ROWS[name][0], str) else "ConvMixer(256, 8, k5, p2)"}',
               gflops=train_gflops(lambda: build(name, 'ours', px), px))
    # m: 32 at 128; a small batch a quarter (its largest divisor up to that); --sam-m at or above the batch is the
    # batch (one group: SAM itself)
    want = 32 if batch > 32 else max(1, batch // 4)
    row['sam_m'] = m = min(args.sam_m, batch) if args.sam_m else next(d for d in range(want, 0, -1) if batch % d == 0)
    if timm is None:
        row['note'] = 'timm is not installed: our steps alone, no side by side'
    for key, (side, sam, grouped) in STEPS.items():
        if side == 'timm' and timm is None:
            continue
        if compile:  # compiled sides share dynamo's cache: the next would recompile, dynamic in the batch; start clean
            torch._dynamo.reset()
        step, module = make_step(name, side, *common, sam, m if grouped else 0)[:2]
        steps, passes = LOOK_K if sam == 'look' else 1, []  # optimizer steps in one step() call; forward passes
        hook = None if compile else module.register_forward_pre_hook(lambda *_: passes.append(1))  # (eager: counted)
        step()  # first step: AdamW's state, cudnn.benchmark's choice, the compile; its passes counted
        if hook is not None:
            row[f'{key}_passes'] = len(passes) / steps
            hook.remove()
        row[f'{key}_s'] = median_s(step, args.min_run_time) / steps
        del step
        # a compiled side's CPU RSS would count the compiler; it recompiles on CUDA: not measured
        if key in ('ours', 'ref') and not compile:
            row[f'{key}_mib'] = peak_mib(args.device, warm_up, name, side, *common)
    return row


# The CIFAR augmentation beside the locuslab reference, and its share of a CIFAR training step.
def reference_transform(cfg):
    """locuslab/convmixer-cifar10 train.py's train transform as written there (even at jitter/reprob 0)."""
    return T.Compose([T.RandomResizedCrop(32, scale=(cfg.scale, 1.0), ratio=(1.0, 1.0)),
                      T.RandomHorizontalFlip(p=0.5), T.RandAugment(num_ops=cfg.randaug_n, magnitude=cfg.randaug_m),
                      T.ColorJitter(cfg.jitter, cfg.jitter, cfg.jitter), T.ToTensor(),
                      T.Normalize(MEAN['cifar10'], STD['cifar10']),
                      T.RandomErasing(p=cfg.reprob)])


def bench_cifar(args):
    cfg = argparse.Namespace(**CIFAR_RUN)  # the default CIFAR run
    batch = args.batch_size or (128 if args.quick else cfg.batch_size)
    images = torch.randint(0, 256, (batch, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    pil = [T.functional.to_pil_image(im) for im in images]
    recipe = {k: getattr(cfg, k) for k in ('aug', 'scale', 'randaug_n', 'randaug_m', 'jitter', 'reprob')}
    kw = dict(recipe, mean=MEAN['cifar10'], std=STD['cifar10'])
    ours, ref = augment.make_augment(**kw, device=torch.device('cpu')), reference_transform(cfg)
    rows = [dict(row='cifar augment, 1 core', px=32, batch=batch, dtype='uint8', mode='eager',
                 ours_s=median_s(lambda: ours(images), args.min_run_time, threads=1),
                 ref_s=median_s(lambda: [ref(im) for im in pil], args.min_run_time, threads=1),
                 ref='locuslab: torchvision PIL transforms, one image at a time',
                 note='recipe ' + ', '.join(f'{k} {v}' for k, v in recipe.items()))]
    on_device, x = augment.make_augment(**kw, device=args.device), images.to(args.device)
    aug_s = median_s(lambda: on_device(x), args.min_run_time)
    nhwc = channels_last(args.channels_last, cfg.model, args.device)  # as train_cifar.py runs it
    step = make_step(cfg.model, 'ours', 32, batch, args.amp, nhwc, args.device)[0]
    step()  # AdamW's state
    train_s = median_s(step, args.min_run_time)
    rows.append(dict(row=f'cifar step: augment + {cfg.model}', px=32, batch=batch, dtype=args.amp,
                     mode='eager' + ' NHWC' * nhwc,
                     ours_s=aug_s + train_s, aug_s=aug_s, train_s=train_s,
                     note=f'augmentation {100 * aug_s / (aug_s + train_s):.1f}% of the step, on {args.device.type}'))
    return rows


# The ImageNet input: what one loader worker core delivers, per recipe and decode path.
def imagenet_jpegs(root, n, seed=0):
    """n JPEGs of ImageNet's typical 500 x 375 px at quality 90 in root/train/<2 classes>/: smooth noise (bicubic
    upsampling of 83 x 62 random pixels) + N(0, 4) grain, ~76 kB each (ImageNet's average is ~110 kB)."""
    from PIL import Image
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        coarse = torch.rand(1, 3, 375 // 6, 500 // 6, generator=g) * 255
        x = F.interpolate(coarse, size=(375, 500), mode='bicubic') + 4 * torch.randn(1, 3, 375, 500, generator=g)
        os.makedirs(folder := os.path.join(root, 'train', f'c{i % 2}'), exist_ok=True)
        Image.fromarray(x.clamp(0, 255).round().to(torch.uint8)[0].permute(1, 2, 0).numpy()).save(
            os.path.join(folder, f'{i}.JPEG'), quality=90)


def bench_loader(args):
    """Per recipe: ours (data.ImageFolder: PIL, the recipe's transform under each image's seed, uint8 out) and
    --decode gpu's worker part (the file's bytes), each on one core, beside torchvision's ImageFolder + the same
    transforms.v2 recipe with ToDtype + Normalize in the worker (float32 out, as torchvision's reference scripts).
    --decode gpu's device part (decode_jpeg, then the transform per image) is timed on --device: a note. On the CPU
    the clock is the process's CPU time: img/s per second of one core's work, whatever else the machine runs."""
    n = 16 if args.quick else 64
    rows, threads = [], torch.get_num_threads()
    with tempfile.TemporaryDirectory() as root:
        imagenet_jpegs(root, n)
        kb = sum(os.path.getsize(p) for p, _ in torchvision.datasets.ImageFolder(os.path.join(root, 'train')).samples)
        for name, r in LOADER_RECIPES.items():
            mean = data.MEANS[r['norm']]
            tf = loader.train_transform(argparse.Namespace(img_size=224, **r), mean[0])
            ref = torchvision.datasets.ImageFolder(os.path.join(root, 'train'), transform=T.v2.Compose(
                [*tf.transforms[:-1], T.v2.PILToTensor(), T.v2.ToDtype(torch.float32, scale=True),
                 T.v2.Normalize(*mean)]))
            items = [(i, 1000 + i) for i in range(n)]
            torch.set_num_threads(1)
            ref_s = median_s(lambda: [ref[i] for i in range(n)], args.min_run_time, 1, time.process_time)
            recipe = f'recipe {name}: crop (0.08, 1) + flip' + f' + RandAugment({r["randaug_n"]}, {r["randaug_m"]})' * (
                r['randaug_n'] > 0)
            for decode in ('cpu', 'gpu'):
                ds = data.ImageFolder(root, 'train', tf, 224, decode)
                ours_s = median_s(lambda: [ds[it] for it in items], args.min_run_time, 1, time.process_time)
                note = f'{recipe}; {n} JPEGs of 500 x 375 px, {kb / n / 1e3:.0f} kB on average'
                if decode == 'gpu':
                    batch = loader.collate_bytes([ds[it] for it in items])
                    dev_s = median_s(lambda: loader.decode_batch(batch[0], *batch[2:], ds, args.device),
                                     args.min_run_time, *((1, time.process_time) if args.device.type == 'cpu' else
                                                          (threads,)))
                    note += (f'; the worker only reads bytes; decode_jpeg + the transform on {args.device.type}: '
                             f'{n / dev_s:,.0f} img/s' + ' (one core)' * (args.device.type == 'cpu'))
                rows.append(dict(row=f'loader {name}, --decode {decode}, per worker core', px=224, batch=n,
                                 dtype='uint8', mode='eager', ours_s=ours_s, ref_s=ref_s, note=note,
                                 ref='torchvision ImageFolder + transforms.v2, float32 normalised'))
            torch.set_num_threads(threads)
    return rows


# The one table.
def fmt(x):
    return '—' if x is None else f'{x:,.0f}' if abs(x) >= 100 else f'{x:.3g}'


def matmul_peak(device, n=8192):
    """FLOP/s of one n x n x n bf16 matmul on device (median of blocked_autorange): the achievable peak, measured in
    the same run as the rows, beside the data sheet's."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    return 2 * n ** 3 / median_s(lambda: a @ b, 2.0)


def numbers(r, peak=None, measured=None):
    """A row's figures as numbers (the JSON's; the table prints them): img/s per side, ours/ref, the step ratios,
    achieved TFLOP/s (img/s x training FLOP per image); MFU of a peak and of a measured matmul's FLOP/s, if given."""
    ips = {side: r['batch'] / r[f'{key}_s'] if f'{key}_s' in r else None
           for side, key in (('', 'ours'), ('ref_', 'ref'))}
    n = dict(img_per_s=ips[''], ref_img_per_s=ips['ref_'], ours_over_ref=ips[''] / ips['ref_'] if ips['ref_'] else None,
             **{k: r[f'{a}_s'] / r[f'{b}_s'] if f'{a}_s' in r and f'{b}_s' in r else None
                for k, (_, a, b) in RATIOS.items()})
    for side, v in ips.items():
        achieved = v * r['gflops'] * 1e9 if v and r.get('gflops') else None
        n.update({f'{side}tflops': achieved and achieved / 1e12, f'{side}mfu': achieved / peak if achieved and peak
                  else None, f'{side}mfu_measured': achieved / measured if achieved and measured else None})
    return n


def table(rows, gpu=None, peak_tflops=None, measured=None):
    """The markdown table; gpu = the CUDA device's name adds achieved TFLOP/s (img/s x training FLOP
    per image) and MFU (achieved / the peak: peak_tflops, else PEAK_BF16[gpu]; neither: no MFU, a note), per side;
    measured (FLOP/s of a large bf16 matmul in this run) adds the MFU of what this GPU achieves."""
    peak = peak_tflops * 1e12 if peak_tflops else PEAK_BF16.get(gpu)
    head = ['row', 'px', 'batch', 'dtype', 'mode', 'ours img/s', 'ref img/s', 'ours/ref',
            *(h for h, _, _ in RATIOS.values()), 'peak MiB ours / ref', 'train GFLOP/img'] + \
        ['TFLOP/s ours / ref', 'MFU ours / ref'] * bool(gpu) + ['MFU of measured ours / ref'] * bool(gpu and measured)
    lines = ['| ' + ' | '.join(head + ['reference; notes']) + ' |', '|' + '---|' * (len(head) + 1)]
    pct = lambda a, b: ' / '.join(f'{100 * v:.1f}%' if v else '—' for v in (a, b))  # noqa: E731
    for r in rows:
        n = numbers(r, peak, measured)
        cells = [r['row'], r['px'], r['batch'], r['dtype'], r['mode'], fmt(n['img_per_s']), fmt(n['ref_img_per_s']),
                 f"{n['ours_over_ref']:.2f}" if n['ours_over_ref'] else '—',
                 *(f'{n[k]:.2f}' + f" (m {r.get('sam_m')})" * (k == 'sam_m_over_base') + (
                   f" ({r[a + '_passes']:g} passes/step)" if a in ('look', 'msam') and a + '_passes' in r else '')
                   if n[k] else '—' for k, (_, a, _) in RATIOS.items()),
                 f"{fmt(r['ours_mib'])} / {fmt(r.get('ref_mib'))}" if 'ours_mib' in r else '—', fmt(r.get('gflops'))]
        if gpu:
            cells += [f"{fmt(n['tflops'])} / {fmt(n['ref_tflops'])}", pct(n['mfu'], n['ref_mfu'])] + \
                [pct(n['mfu_measured'], n['ref_mfu_measured'])] * bool(measured)
        lines.append('| ' + ' | '.join(map(str, cells + ['; '.join(r[k] for k in ('ref', 'note') if k in r)])) + ' |')
    if gpu and not peak:
        lines.append(f'\nunknown GPU: give --peak-tflops (its dense bf16 peak) for MFU; {gpu!r} is not in PEAK_BF16')
    if gpu:
        lines.append(f'\nMFU: of the data sheet\'s dense bf16 {fmt(peak and peak / 1e12)} TFLOP/s; of measured: of '
                     f'{fmt(measured and measured / 1e12)} TFLOP/s, one 8192^3 bf16 matmul timed in this run')
    return '\n'.join(lines)


def header(args, argv):
    with open('/proc/cpuinfo') as f:
        cpu = next((line.split(':', 1)[1].strip() for line in f if line.startswith('model name')), platform.machine())
    gpu = torch.cuda.get_device_name(args.device) if args.device.type == 'cuda' else 'no GPU used'
    return (f'## bench.py, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n\n'
            f'Machine: {cpu}, {len(os.sched_getaffinity(0))} cores (torch threads {torch.get_num_threads()}); '
            f'{gpu}; torch {torch.__version__}, timm {timm.__version__ if timm else "not installed"}, '
            f'torchvision {torchvision.__version__}; '
            f'load average at start {" / ".join(f"{x:.1f}" for x in os.getloadavg())} (1/5/15 min)\n\n'
            f'Command: `python bench.py {" ".join(sys.argv[1:] if argv is None else argv)}`\n\n'
            f'img/s = batch / median of blocked_autorange(min_run_time={args.min_run_time} s); peak MiB: what '
            'a side and 2 steps add (CPU: ru_maxrss of a fresh child; CUDA: max_memory_allocated)\n')


def main(argv=None):
    args = get_args(argv)
    if args.device.type == 'cuda':  # as the training scripts set them, on both sides
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    head = header(args, argv)
    print(head, flush=True)
    gpu = torch.cuda.get_device_name(args.device) if args.device.type == 'cuda' else None
    measured = matmul_peak(args.device) if gpu else None  # first: every row's MFU is in the JSON as it is written
    peaks = dict(datasheet_tflops=args.peak_tflops or PEAK_BF16.get(gpu, 0) / 1e12 or None,
                 measured_tflops=measured and measured / 1e12)
    rows = []

    def save(new, done=False):  # after every row: a run stopped part-way (gpu_check's budget) keeps what it finished
        rows.extend(new)
        if args.json:  # (its folder was checked before the benchmark ran)
            peak = args.peak_tflops * 1e12 if args.peak_tflops else PEAK_BF16.get(gpu)
            out = [dict(r, **numbers(r, peak, measured)) for r in rows]
            save_atomic(args.json, dict(header=head, rows=out, table=table(rows, gpu, args.peak_tflops, measured),
                                        finished=done, **peaks))
    for compile, name in ((c, r) for c in [False] + [True] * args.compile for r in args.rows
                          if r not in ('cifar', 'loader')):
        for nhwc in layouts(name, args):
            print(f'[bench] {name}{" (compile)" * compile}{" NHWC" * nhwc} ...', file=sys.stderr, flush=True)
            try:
                save([bench_model(name, args, compile, nhwc)])
            except Exception as e:  # a compile that fails here is a row of the table, not the end
                if not compile:
                    raise
                save([dict(row=name, px='', batch=0, dtype=args.amp, mode='compile', note=f'failed: {e!r}'[:120])])
    for name, fn in (('cifar', bench_cifar), ('loader', bench_loader)):
        if name in args.rows:
            print(f'[bench] {name} ...', file=sys.stderr, flush=True)
            save(fn(args))
    save([], done=True)
    print(table(rows, gpu, args.peak_tflops, measured))


if __name__ == '__main__':
    try:
        main()
    except UserError as e:
        sys.exit(f'bench.py: error: {e}')
