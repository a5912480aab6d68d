"""bench.py: this repo's speed, measured side by side in one run, against the code people would
otherwise use. Prints markdown tables headed by the machine, the torch version, the date and the
command, ready for the README "Performance" section.

  1. Training step, ours vs timm: fwd + bwd + AdamW(foreach=True) img/s of our model and of timm's
     model of the same config, same weights, same batch and dtype. The two sides (and the SAM step
     of section 2) take turns within every repeat, so load changes hit both; median over repeats.
     Also the peak memory of each side and the model's training FLOPs (3x forward).
  2. SAM overhead: one full SAM step (two fwd/bwd, first_step, second_step incl. AdamW) over one
     base step (one fwd/bwd + AdamW), same model, same batch.
  3. CIFAR augmentation: train_cifar.make_augment at its default recipe on uint8 batches, against
     the locuslab/convmixer-cifar10 reference (torchvision PIL transforms, one image at a time),
     both on one thread; plus the default model's training img/s on this machine.
     Also the estimated epoch time of the default CIFAR run (a real one with --cifar-epoch).
  4. On a GPU: achieved TFLOP/s and MFU (bf16) per row and side.

Needs timm and torchvision (the test dependencies) besides torch.

    python bench.py --quick                       # every row, small sizes: < 3 min on 2 CPU cores
    python bench.py                               # full sizes (~20 min on 2 CPU cores)
    python bench.py --rows vit_b16,mixer_b16 --compile
"""
import argparse
import ctypes
import datetime
import gc
import math
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

# -----------------------------------------------------------------------------
# What is measured. Per row: our config, timm's model of the same config, and
# (image px, batch) at --quick size, at full size on CPU, and at full size on a GPU.
# Paper-size rows run small batches at --quick size (and ConvMixer-768/32 at 112 px, where one
# 224 px step takes seconds on a CPU core); the table prints the px and batch actually used.
ROWS = {
    'vit_s16': dict(family='vit', timm='vit_small_patch16_224',
                    quick=(224, 4), cpu=(224, 16), cuda=(224, 256)),
    'vit_b16': dict(family='vit', timm='vit_base_patch16_224',
                    quick=(224, 2), cpu=(224, 8), cuda=(224, 128)),
    'mixer_s16': dict(family='mixer', timm='mixer_s16_224',
                      quick=(224, 4), cpu=(224, 16), cuda=(224, 256)),
    'mixer_b16': dict(family='mixer', timm='mixer_b16_224',
                      quick=(224, 2), cpu=(224, 8), cuda=(224, 128)),
    'convmixer_256_8': dict(family='convmixer',  # not a timm config: built from timm's class
                            timm=dict(dim=256, depth=8, kernel_size=5, patch_size=2, num_classes=10),
                            quick=(32, 32), cpu=(32, 128), cuda=(32, 512)),
    'convmixer_768_32': dict(family='convmixer', timm='convmixer_768_32',
                             quick=(112, 2), cpu=(224, 4), cuda=(224, 64)),
}

# Dense bf16 tensor-core peak FLOP/s (vendor data sheets, without sparsity), matched in order
# against torch.cuda.get_device_name(); unknown GPUs print 'n/a' for MFU.
PEAK_BF16 = [('H200', 989e12), ('H100 PCIe', 756e12), ('H100 NVL', 835e12), ('H100', 989e12), ('A100', 312e12),
             ('L40S', 362e12), ('L4', 121e12)]

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2471, 0.2435, 0.2616)  # locuslab's values
CIFAR_TRAIN_IMAGES = 50_000


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0] + ' Needs timm and torchvision.',
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--quick', action='store_true',
                   help='small batches and images, few repeats: every row in < 3 min on 2 CPU cores')
    p.add_argument('--rows', default=','.join(ROWS),
                   help=f'comma-separated models for sections 1, 2 and 4 (default: all): {", ".join(ROWS)}')
    p.add_argument('--sections', default='model,sam,data',
                   help='comma-separated subset of model (ours vs timm + memory), sam, data '
                        '(the GPU section follows on CUDA)')
    p.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu',
                   choices=['cpu', 'cuda'], help='default: cuda when available')
    p.add_argument('--dtype', choices=['fp32', 'bf16'], default=None,
                   help='fp32, or bf16 autocast (weights and optimizer stay fp32); '
                        'default fp32 on CPU, bf16 on CUDA')
    p.add_argument('--batch', type=int, default=None, help='images per step for every row (overrides the table)')
    p.add_argument('--img-size', type=int, default=None, help='image side in px for every row (overrides the table)')
    p.add_argument('--repeats', type=int, default=None,
                   help='timed repeats per row, the median is reported (default 3 quick, 5 full)')
    p.add_argument('--steps', type=int, default=None,
                   help='steps per timed repeat (default 1, 10 full CUDA)')
    p.add_argument('--warmup', type=int, default=None,
                   help='untimed steps per side first, >= 1; the peak memory is taken over them '
                        '(default 1 quick, 2 full CPU, 5 full CUDA)')
    p.add_argument('--clock', choices=['wall', 'cpu'], default='wall',
                   help='wall: elapsed time (the figure to publish). cpu: this process\'s CPU time '
                        '(time.process_time), for comparing sides on a loaded machine with --threads 1: '
                        'time lost to other processes is then not counted (multi-thread rows then read '
                        'img per CPU-second, not throughput)')
    p.add_argument('--threads', type=int, default=None,
                   help="torch CPU threads (default: torch's); section 3's per-core rows use 1 either way")
    p.add_argument('--compile', action='store_true',
                   help='also time torch.compile(model) for both sides (a failure is reported in the row)')
    p.add_argument('--channels-last', choices=['on', 'off'], default='on',
                   help='ConvMixer rows, both sides: channels_last weights and input (default on)')
    p.add_argument('--data-images', type=int, default=None,
                   help='images through the PIL reference pipeline (default 300 quick, 2000 full); '
                        'ours runs at least as many, in batches of the recipe\'s batch size')
    p.add_argument('--cifar-epoch', action='store_true',
                   help='also time one real epoch of `train_cifar.py` at its defaults (needs the data)')
    p.add_argument('--cifar-data', default=None, metavar='DIR',
                   help="CIFAR-10 in either of train_cifar.py's --data layouts: section 3 then augments "
                        "real images instead of synthetic ones, and --cifar-epoch trains on it")
    args = p.parse_args(argv)
    args.rows = [r for r in args.rows.split(',') if r]
    bad = [r for r in args.rows if r not in ROWS]
    if bad:
        p.error(f'unknown row(s) {", ".join(bad)}; valid rows: {", ".join(ROWS)}')
    args.sections = [s for s in args.sections.split(',') if s]
    bad = [s for s in args.sections if s not in ('model', 'sam', 'data')]
    if bad:
        p.error(f'unknown section(s) {", ".join(bad)}; valid: model, sam, data')
    if args.device == 'cuda' and not torch.cuda.is_available():
        p.error('--device cuda but torch.cuda.is_available() is False')
    if args.clock == 'cpu' and args.device == 'cuda':
        p.error('--clock cpu measures CPU time: use it with --device cpu')
    if args.cifar_epoch and not args.cifar_data:
        p.error("--cifar-epoch needs --cifar-data DIR (either of train_cifar.py's --data layouts)")
    cuda = args.device == 'cuda'
    args.dtype = args.dtype or ('bf16' if cuda else 'fp32')
    for name in ('batch', 'img_size', 'repeats', 'steps', 'warmup', 'data_images', 'threads'):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f'--{name.replace("_", "-")} must be >= 1')
    defaults = dict(repeats=(3, 5, 5), steps=(1, 1, 10), warmup=(1, 2, 5), data_images=(300, 2000, 2000))
    for name, (quick, cpu, gpu) in defaults.items():  # the defaults the help strings give
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else (gpu if cuda else cpu))
    return args


# -----------------------------------------------------------------------------
# Small measuring tools.

def sync(device):
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


class PeakMemory:
    """Peak memory a block of work adds on top of what was in use when reset() was called.

    CUDA: torch.cuda.max_memory_allocated (reset per measurement). CPU: the process's peak resident
    set (VmHWM), which Linux lets us reset by writing 5 to /proc/self/clear_refs; freed heap pages
    are first handed back with malloc_trim so that they cannot hide new allocations. Where that is
    unavailable (not Linux), the process's peak so far (ru_maxrss, which never goes down) is
    reported whole: an upper bound.
    """

    def __init__(self, device):
        self.device = device
        self.method = 'torch.cuda.max_memory_allocated' if device.type == 'cuda' else 'VmHWM'
        if device.type == 'cpu':
            try:
                with open('/proc/self/clear_refs', 'w') as f:
                    f.write('5')
                self._status('VmHWM')
            except OSError:
                self.method = 'ru_maxrss: the process peak so far, an upper bound'
            try:
                self._trim = ctypes.CDLL('libc.so.6').malloc_trim
            except OSError:
                self._trim = None

    @staticmethod
    def _status(key):  # MiB
        with open('/proc/self/status') as f:
            for line in f:
                if line.startswith(key + ':'):
                    return int(line.split()[1]) / 1024
        raise OSError(key)

    def reset(self):
        gc.collect()
        if self.device.type == 'cuda':
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device) / 2**20
            return
        if self._trim is not None:
            self._trim(0)
        if self.method == 'VmHWM':
            with open('/proc/self/clear_refs', 'w') as f:
                f.write('5')  # VmHWM := VmRSS
            self.base = self._status('VmRSS')
        else:
            self.base = 0.0

    def peak(self):  # MiB above the baseline
        if self.device.type == 'cuda':
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) / 2**20 - self.base
        if self.method == 'VmHWM':
            return self._status('VmHWM') - self.base
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return peak / (2**20 if sys.platform == 'darwin' else 1024)


def forward_gflops(build, px):
    """Forward GFLOPs per image (2 per multiply-add) of the model build() makes, counted by torch's
    FlopCounterMode on meta tensors (no compute). Training is counted as 3x forward, the usual
    convention (backward = grad wrt inputs + grad wrt weights); FlopCounterMode's own backward
    count is not used: it ignores groups in depthwise convolutions (torch 2.14)."""
    from torch.utils.flop_counter import FlopCounterMode
    with torch.device('meta'):
        model = build().eval()
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.empty(1, 3, px, px, device='meta'))
    return counter.get_total_flops() / 1e9


def machine_line(device):
    cpu = platform.processor() or platform.machine()
    try:
        with open('/proc/cpuinfo') as f:
            cpu = next(line.split(':', 1)[1].strip() for line in f if line.startswith('model name'))
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()
    gpu = torch.cuda.get_device_name(device) if device.type == 'cuda' else 'no GPU used'
    import timm
    import torchvision
    load = ' / '.join(f'{x:.1f}' for x in os.getloadavg()) if hasattr(os, 'getloadavg') else 'n/a'
    return (f'{cpu}, {cores} cores (torch threads {torch.get_num_threads()}); {gpu}; '
            f'torch {torch.__version__}, timm {timm.__version__}, torchvision {torchvision.__version__}, '
            f'Python {platform.python_version()}; load average at start {load} (1/5/15 min)')


def table(header, rows):
    out = ['| ' + ' | '.join(header) + ' |', '|' + '|'.join('---' for _ in header) + '|']
    out += ['| ' + ' | '.join(str(c) for c in row) + ' |' for row in rows]
    return '\n'.join(out)


def fmt(x, digits=3):
    """Significant digits, no exponent: 1234 -> 1234, 12.345 -> 12.3, 0.01234 -> 0.0123."""
    if x is None:
        return '—'
    if x == 0 or not math.isfinite(x):
        return str(x)
    decimals = max(0, digits - 1 - int(math.floor(math.log10(abs(x)))))
    return f'{x:.{decimals}f}'


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# -----------------------------------------------------------------------------
# Sections 1 and 2: one row = our model and timm's, same weights, base and SAM steps interleaved.

def size_kw(name, px):
    """ViT and Mixer are built for one input size (both sides alike); ConvMixer takes any."""
    return {} if ROWS[name]['family'] == 'convmixer' else {'img_size': px}


def build_timm(name, px):
    import timm
    spec = ROWS[name]
    if isinstance(spec['timm'], dict):
        from timm.models.convmixer import ConvMixer as TimmConvMixer
        return TimmConvMixer(**spec['timm'])
    return timm.create_model(spec['timm'], pretrained=False, **size_kw(name, px))


def build_ours(name, px):
    import convmixer
    import mixer
    import vit
    return {'vit': vit, 'mixer': mixer, 'convmixer': convmixer}[ROWS[name]['family']].create(name, **size_kw(name, px))


def sizes(name, args):
    px, batch = ROWS[name]['quick' if args.quick else args.device]
    return args.img_size or px, args.batch or batch


def train_step(model, opt, x, y, amp):
    def step():
        opt.zero_grad(set_to_none=True)
        with amp():
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
    return step


def sam_train_step(model, module, opt, x, y, amp):
    """One full SAM step in the sam.py contract's order (without a GradScaler)."""
    from sam import first_pass, second_pass

    def step():
        with first_pass(module), amp():
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.first_step(zero_grad=True)   # w <- w + eps_hat
        with second_pass(module), amp():
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.second_step(zero_grad=True)  # w <- w, then AdamW with the SAM gradient
    return step


def adamw(params):
    # Identical settings on both sides. foreach=True: the multi-tensor path (PyTorch's default on
    # CUDA; on CPU the default is a per-parameter loop, slower for models with many tensors).
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.05, foreach=True)


def bench_row(name, mode, args, device, want_sam, time_timm=True):
    """Time ours / timm / (ours with SAM) for one row in one mode ('eager' or 'compile').
    time_timm=False builds timm's model only for its weights (section 3 needs just ours)."""
    px, batch = sizes(name, args)
    family = ROWS[name]['family']
    amp_dtype = torch.bfloat16 if args.dtype == 'bf16' else None
    amp = lambda: torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None)  # noqa: E731
    channels_last = family == 'convmixer' and args.channels_last == 'on'
    fmt_ = torch.channels_last if channels_last else torch.contiguous_format
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, px, px, generator=g).to(device).contiguous(memory_format=fmt_)
    mem = PeakMemory(device)
    result = dict(name=name, mode=mode, px=px, batch=batch, dtype=args.dtype,
                  layout='channels_last' if channels_last else 'NCHW')

    # Build each side after a memory reset and warm it up: its peak covers weights, grads,
    # AdamW state and activations. The side built first (timm) is warmed before ours exists.
    steps = {}
    mem_build = mode == 'eager' or device.type == 'cuda'  # CPU RSS under compile counts the compiler
    for side in ('timm', 'ours'):  # ours last: `module` and `model` below are ours
        mem.reset()
        if side == 'timm':
            module = theirs = build_timm(name, px).to(device)
            y = torch.randint(0, theirs.num_classes, (batch,), generator=g).to(device)
            if not time_timm:
                continue
        else:
            module = build_ours(name, px).to(device)
            module.load_state_dict(theirs.state_dict())  # timm-identical keys: same weights both sides
        module = module.to(memory_format=fmt_).train()
        model = torch.compile(module) if mode == 'compile' else module
        steps[side] = train_step(model, adamw(module.parameters()), x, y, amp)
        for _ in range(args.warmup):
            steps[side]()
        sync(device)
        result[f'{side}_peak_mib'] = mem.peak() if mem_build else None
    result['mem_method'] = mem.method
    result['gflops'] = forward_gflops(lambda: build_ours(name, px), px)
    result['gflops_timm'] = forward_gflops(lambda: build_timm(name, px), px)
    if want_sam:
        from sam import SAM
        sam = SAM(module.parameters(), torch.optim.AdamW, rho=0.05, lr=1e-4, weight_decay=0.05, foreach=True)
        steps['sam'] = sam_train_step(model, module, sam, x, y, amp)
        for _ in range(args.warmup):
            steps['sam']()

    # Timed: every repeat runs each candidate for args.steps steps, in an order that rotates
    # from repeat to repeat; the median over repeats is reported.
    names = list(steps)
    times = {k: [] for k in names}
    clock = time.process_time if args.clock == 'cpu' else time.perf_counter
    for r in range(args.repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for k in order:
            sync(device)
            t0 = clock()
            for _ in range(args.steps):
                steps[k]()
            sync(device)
            times[k].append((clock() - t0) / args.steps)
    for k in names:
        result[f'{k}_s'] = statistics.median(times[k])
        result[f'{k}_imgs'] = batch / result[f'{k}_s']
    if time_timm:
        result['ratio'] = result['ours_imgs'] / result['timm_imgs']
    if want_sam:
        result['sam_over_base'] = result['sam_s'] / result['ours_s']
    return result


def vit_flops_note(results):
    """How many fewer FLOPs our ViT rows count than timm's (their last block updates only the
    class token, the one token the head reads), measured per row; '' without a ViT row."""
    parts = [f"{r['name']} at {r['px']} px {100 * (1 - r['gflops'] / r['gflops_timm']):.1f}%"
             for r in results if 'gflops' in r and r['mode'] == 'eager' and ROWS[r['name']]['family'] == 'vit']
    return (' but for ViT, where ours skips the last block\'s work on the tokens the head never reads: '
            + ', '.join(parts) + ' fewer') if parts else ''


def run_models(args, device, want_model, want_sam):
    results, modes = [], ['eager'] + (['compile'] if args.compile else [])
    for mode in modes:
        for name in args.rows:
            log(f'[bench] {name} ({mode}) ...')
            t0 = time.perf_counter()
            try:
                results.append(bench_row(name, mode, args, device, want_sam))
            except Exception as e:  # a compile that does not work here is reported, not fatal
                if mode == 'eager':
                    raise
                results.append(dict(name=name, mode=mode, error=f'{type(e).__name__}: {str(e)[:80]}'))
            log(f'[bench] {name} ({mode}) done in {time.perf_counter() - t0:.1f} s')
            gc.collect()
    out = []
    if want_model:
        rows = []
        for r in results:
            if 'error' in r:
                rows.append([r['name'], '', '', '', r['mode'], f"failed ({r['error']})", '', '', '', '', ''])
                continue
            rows.append([r['name'], r['px'], r['batch'], r['dtype'], r['mode'], fmt(r['ours_imgs']),
                         fmt(r['timm_imgs']), f"{r['ratio']:.2f}", fmt(3 * r['gflops']),
                         fmt(r['ours_peak_mib']), fmt(r['timm_peak_mib'])])
        method = next((r['mem_method'] for r in results if 'mem_method' in r), '')
        skipped = vit_flops_note(results)
        out += ['### 1. Training step: ours vs timm',
                f'fwd + bwd + AdamW(foreach=True), same weights, batch and dtype; {args.clock}-clock median '
                f'of {args.repeats} repeats of {args.steps} step(s), the sides taking turns. train GFLOP/img = '
                f"3 x forward (FlopCounterMode), the same on both sides{skipped}. Peak MiB: memory added by "
                f'building the model + its optimizer and running {args.warmup} training step(s) ({method}). '
                f'ConvMixer rows: '
                f'{"channels_last" if args.channels_last == "on" else "NCHW"} on both sides.', '',
                table(['model', 'px', 'batch', 'dtype', 'mode', 'ours img/s', 'timm img/s', 'ours/timm',
                       'ours train GFLOP/img', 'ours peak MiB', 'timm peak MiB'], rows), '']
    if want_sam:
        rows = [[r['name'], r['px'], r['batch'], r['dtype'], r['mode'], fmt(1e3 * r['ours_s']),
                 fmt(1e3 * r['sam_s']), f"{r['sam_over_base']:.2f}"] for r in results if 'error' not in r]
        out += ['### 2. SAM overhead (ours)',
                'SAM step = fwd/bwd, first_step, fwd/bwd, second_step (incl. AdamW); base step = fwd/bwd + '
                'AdamW. Same model and batch, timed in turn with section 1. Goal: SAM/base <= 2.05.', '',
                table(['model', 'px', 'batch', 'dtype', 'mode', 'base ms/step', 'SAM ms/step', 'SAM/base'],
                      rows), '']
    return results, out


# -----------------------------------------------------------------------------
# Section 3: the CIFAR augmentation pipeline against the locuslab reference.

def reference_transform(recipe):
    """locuslab/convmixer-cifar10's train transform, built from torchvision's PIL transforms."""
    import torchvision.transforms as T
    ops = [T.RandomResizedCrop(32, scale=(recipe['scale'], 1.0), ratio=(1.0, 1.0)),
           T.RandomHorizontalFlip(),
           T.RandAugment(num_ops=recipe['ra_n'], magnitude=recipe['ra_m'])]
    if recipe['jitter'] > 0:
        ops.append(T.ColorJitter(recipe['jitter'], recipe['jitter'], recipe['jitter']))
    ops += [T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)]
    if recipe['reprob'] > 0:
        ops.append(T.RandomErasing(p=recipe['reprob']))
    return T.Compose(ops)


def recipe_of(cifar_args):
    """The augmentation settings of train_cifar.py's defaults (its locuslab 'strong' recipe)."""
    if cifar_args.aug != 'strong':
        raise SystemExit(f"bench.py: error: train_cifar.py's default --aug is {cifar_args.aug!r}; "
                         "section 3 compares the locuslab ('strong') recipe")
    return dict(scale=cifar_args.scale, ra_n=cifar_args.ra_n, ra_m=cifar_args.ra_m,
                jitter=cifar_args.jitter, reprob=cifar_args.reprob, batch=cifar_args.batch_size)


def run_data(args, device, model_results):
    import numpy as np
    from PIL import Image

    import train_cifar
    cifar_args = train_cifar.get_args([])
    recipe = recipe_of(cifar_args)
    n_ref, bsz = args.data_images, recipe['batch']
    if args.cifar_data:  # real CIFAR-10 training images (class-balanced first n)
        try:
            images = train_cifar.load_cifar(args.cifar_data, 'cifar10', train=True, subset=n_ref, download=False)[0]
        except train_cifar.UserError as e:
            sys.exit(f'bench.py: error: --cifar-data: {e}')
        source = f'{n_ref} CIFAR-10 training images (the first of each class)'
    else:  # uniform noise: these ops cost about the same whatever the pixel values
        images = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (n_ref, 3, 32, 32), dtype=np.uint8))
        source = f'{n_ref} synthetic 32x32 uint8 images (no --cifar-data given)'
    threads = torch.get_num_threads()
    clock = time.process_time if args.clock == 'cpu' else time.perf_counter
    # ours: the n_ref images tiled into one batch of the recipe's size, at least 2 timed batches
    batch = images.repeat(math.ceil(bsz / n_ref), 1, 1, 1)[:bsz].contiguous()
    n_batches = max(2, math.ceil(n_ref / bsz))
    runs = [('cpu', 1)] + ([('cpu', threads)] if threads > 1 else [])
    runs += [('cuda', None)] if device.type == 'cuda' else []
    samples = {}  # pipeline -> img/s of each repeat; the pipelines take turns, median reported
    try:
        torch.set_num_threads(1)  # per-core rates: one thread for both pipelines
        ref = reference_transform(recipe)
        pil = [Image.fromarray(a) for a in images.permute(0, 2, 3, 1).numpy()]
        for img in pil[:20]:
            ref(img)  # warm-up
        augments = {}
        for dev_type, nthreads in runs:
            dev = device if dev_type == 'cuda' else torch.device('cpu')
            augments[(dev_type, nthreads)] = (train_cifar.make_augment(cifar_args, dev), batch.to(dev), dev)
            augment, b, _ = augments[(dev_type, nthreads)]
            out = augment(b)  # warm-up, and the contract: uint8 in, normalised float batch out
            assert out.shape == (bsz, 3, 32, 32) and out.is_floating_point(), out.shape
        for _ in range(args.repeats):
            torch.set_num_threads(1)
            t0 = clock()
            for img in pil:
                ref(img)
            samples.setdefault('ref', []).append(n_ref / (clock() - t0))
            for key, (augment, b, dev) in augments.items():
                torch.set_num_threads(key[1] or threads)
                sync(dev)
                t0 = clock()
                for _ in range(n_batches):
                    augment(b)
                sync(dev)
                samples.setdefault(key, []).append(n_batches * bsz / (clock() - t0))
    finally:
        torch.set_num_threads(threads)
    rates = {k: statistics.median(v) for k, v in samples.items()}

    desc = (f"RandomResizedCrop(32, scale=({recipe['scale']}, 1), ratio=(1, 1)), flip, "
            f"RandAugment({recipe['ra_n']}, {recipe['ra_m']})"
            + (f", ColorJitter({recipe['jitter']})" if recipe['jitter'] > 0 else '')
            + ', ToTensor, Normalize' + (f", RandomErasing({recipe['reprob']})" if recipe['reprob'] > 0 else ''))
    rows = [['locuslab reference: torchvision PIL transforms, one image at a time', 'cpu', 1, 1,
             fmt(rates['ref']), '1.0']]
    for dev_type, nthreads in runs:
        r = rates[(dev_type, nthreads)]
        rows.append(['ours: train_cifar.make_augment, per-sample random, on uint8 batches', dev_type,
                     nthreads or '—', bsz, fmt(r), f"{r / rates['ref']:.1f}"])

    # The default model's training speed: section 1's eager row when it ran, else measured here.
    train = next((r for r in model_results if r['name'] == 'convmixer_256_8' and r['mode'] == 'eager'), None)
    if train is None:
        log('[bench] convmixer_256_8 training speed for section 3 ...')
        train = bench_row('convmixer_256_8', 'eager', args, device, want_sam=False, time_timm=False)
    rows.append([f"model: convmixer_256_8 training step (ours, {train['dtype']}, {train['layout']})",
                 device.type, threads if device.type == 'cpu' else '—', train['batch'],
                 fmt(train['ours_imgs']), '—'])
    pipe = rates[runs[-1]]  # the pipeline as training uses it: all threads, or the GPU
    per_core = rates[('cpu', 1)] / rates['ref']
    out = ['### 3. CIFAR-10 augmentation pipeline (train_cifar defaults) vs the locuslab reference',
           f'Recipe: {desc}. Input: {source}, the same for both pipelines. Rows with 1 thread ran '
           f'under torch.set_num_threads(1) ({args.clock} clock); the pipelines take turns, median of {args.repeats} repeats. Goals: ours >= 10x the reference '
           f'per core, and faster than the model trains.', '',
           table(['pipeline', 'device', 'threads', 'batch', 'img/s', 'vs reference'], rows), '',
           f"Per core: ours / reference = {per_core:.1f}x (goal >= 10). Pipeline as training runs it "
           f"({fmt(pipe)} img/s) / model training ({fmt(train['ours_imgs'])} img/s) = "
           f"{pipe / train['ours_imgs']:.1f}x (goal > 1).", '']
    steps = CIFAR_TRAIN_IMAGES // bsz  # train_cifar drops the last partial batch
    epoch = steps * bsz * (1 / pipe + 1 / train['ours_imgs'])
    out += [f"Estimated training time per epoch of the default CIFAR run here: {epoch:,.0f} s "
            f"({steps} steps of {bsz} images, augmentation then training step one after the other at the "
            f"rates above; the training rate was measured at batch {train['batch']}; evaluation not included).", '']
    if args.cifar_epoch:
        out += [cifar_epoch(args), '']
    return out


def cifar_epoch(args):
    """One real epoch of `train_cifar.py` at its defaults (but --epochs 1), in a subprocess."""
    import re
    import tempfile
    with tempfile.TemporaryDirectory() as out_dir:
        cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), 'train_cifar.py'),
               '--epochs', '1', '--data', args.cifar_data, '--out', out_dir]
        log('[bench] ' + ' '.join(cmd))
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    shown = 'train_cifar.py --epochs 1 --data DIR'
    if proc.returncode != 0:
        return f'One real epoch (`{shown}`) failed, exit {proc.returncode}: {proc.stderr.strip()[-300:]}'
    # its epoch line: "ep 1/1 | train ... | test loss L acc A% | lr ... | N img/s | S s | eta ..."
    m = re.search(r'test loss [\d.]+ acc ([\d.]+)%.*?\| ([\d,]+) img/s \| ([\d.]+) s', proc.stdout)
    detail = (f'{m.group(3)} s for the epoch incl. evaluation, {m.group(2)} img/s training, test acc '
              f'{m.group(1)}% after 1 epoch; ' if m else '')
    return f'One real epoch (`{shown}`): {detail}{wall:,.0f} s wall including start-up and data loading.'


# -----------------------------------------------------------------------------
# Section 4 (CUDA): achieved FLOP/s and MFU.

def run_gpu(args, device, results):
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in PEAK_BF16 if k in name), None) if args.dtype == 'bf16' else None
    rows = []
    for r in results:
        if 'error' in r:
            continue
        for side in ('ours', 'timm'):
            achieved = r[f'{side}_imgs'] * 3e9 * r['gflops' if side == 'ours' else 'gflops_timm']
            rows.append([r['name'], side, r['px'], r['batch'], r['dtype'], r['mode'], fmt(r[f'{side}_imgs']),
                         fmt(achieved / 1e12), f'{100 * achieved / peak:.1f}%' if peak else 'n/a'])
    peak_txt = f'{peak / 1e12:.0f} TFLOP/s dense bf16' if peak else 'n/a (not in the table, or not bf16)'
    return ['### 4. GPU: achieved FLOP/s and MFU',
            f'{name}, peak {peak_txt}; cudnn.benchmark and TF32 on, as in the training scripts. Training '
            f'FLOPs = 3 x forward (FlopCounterMode), each side its own{vit_flops_note(results)}. '
            f'MFU = achieved / peak.', '',
            table(['model', 'side', 'px', 'batch', 'dtype', 'mode', 'img/s', 'TFLOP/s', 'MFU'], rows), '']


def main(argv=None):
    args = get_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == 'cuda':  # as the training scripts set them, on both sides
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    started = time.perf_counter()
    now = datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')
    lines = [f'## bench.py, {now}', '', f'Machine: {machine_line(device)}', '',
             f'Command: `python bench.py {" ".join(argv if argv is not None else sys.argv[1:])}`', '']
    print('\n'.join(lines), flush=True)
    results = []
    if 'model' in args.sections or 'sam' in args.sections:
        results, out = run_models(args, device, 'model' in args.sections, 'sam' in args.sections)
        print('\n'.join(out), flush=True)
    if 'data' in args.sections:
        print('\n'.join(run_data(args, device, results)), flush=True)
    if device.type == 'cuda' and results:
        print('\n'.join(run_gpu(args, device, results)), flush=True)
    print(f'Total bench time: {time.perf_counter() - started:.0f} s')


if __name__ == '__main__':
    main()
