"""gpu_check.py: every CUDA figure of the repo from one lent GPU, sized to the lease, into ONE JSON file.

    python gpu_check.py --data DIR --out OUT                                     # call 1: all but compile, 540 s
    python gpu_check.py --data DIR --out OUT --parts rest compile --budget-s 200  # call 2: merges into call 1's JSON
    python gpu_check.py --data DIR --out OUT --dry-run                           # any machine: toy sizes (the suite)

DIR: the full CIFAR-10 (train_cifar.py --data; the dry run takes a small copy too). The parts, cheapest first:
  versions  python, torch, CUDA, cuDNN, the GPU and its memory, torchvision, timm, einops
  augment   augment.py's ops, Augment.__call__ and train_contrastive.py's MoCo view on CUDA against the CPU with the
            same inputs and draws, under setup()'s TF32 / cudnn flags: differing pixels per op
  memory    peak memory of one vit_b16 SAM step (bf16) at micro-batches 64, 256 (the old --max-micro-batch) and the
            default this GPU derives (utils.micro_batch_cap)
  syncs     host syncs per training step under torch.cuda.set_sync_debug_mode('warn'): a run of 2k steps minus one
            of k, for train_cifar.py (default, --sam, --sam --amp fp16, --adv pgd), train_imagenet.py (convmixer
            recipe: MixUp/CutMix, erasing, on_device; --sam over 2 micro-batches), train_contrastive.py --sam. These
            runs time nothing, so they share the GPU (SYNC_JOBS at once)
  cifar     train_cifar.py's default 25-epoch run (bf16, channels_last): accuracy beside locuslab's 92.5% and the
            data it ran on, wall time, img/s; and a short run in the other layout (img/s)
  bench     bench.py's GPU rows (vit_b16, mixer_b16, convmixer_768_32 in both layouts, cifar): img/s, MFU of the data
            sheet's peak and of a bf16 matmul's measured in the same run
  smoke     train_imagenet.py (--synthetic, and a folder made from DIR), train_contrastive.py --sam, robustness.py
  compile   the cifar run with --compile (only when --parts names it)
The lease (one GPU, 10 minutes a command, 15 of device time with the start, 8 files back): --budget-s is the whole
command's time. A part starts only if NEED_S says it fits in what is left (else it is skipped and named); every
subprocess gets the time left as its timeout; the process exits before the budget. OUT receives two files only,
gpu_check.json (rewritten atomically after every part, merged with the one an earlier call left there) and
gpu_check_logs.tar.gz (every log); run folders live in a temporary folder, removed at the end. It runs the other
scripts through their command lines (no script imports another) and installs nothing.
"""
import argparse
import importlib.util
import io
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

import augment
from models import build_model
from runs import save_atomic
from sam import SAM, first_pass, second_pass
from utils import UserError, micro_batch_cap, one_line, setup

HERE = Path(__file__).resolve().parent
PARTS = ('versions', 'augment', 'memory', 'syncs', 'cifar', 'bench', 'smoke', 'compile')
# Seconds a part needs (on an H200, dry run on the suite's 2-core CPU). GPU: sized from the part's work, NOT timed
# (no GPU has run it yet); dry: measured on the shared VM under load. A part starts only when this much is left.
NEED_S = dict(versions=(5, 3), augment=(30, 30), memory=(30, 2), syncs=(60, 90), cifar=(150, 40), bench=(120, 90),
              smoke=(60, 90), compile=(180, 0))  # GPU: 455 s for the seven default parts, 180 for compile
MARGIN_S = 10  # kept back for the last writes and the exit
SYNC_JOBS = 6  # sync-counting runs at once on the GPU (they time nothing)
RESULT, LOGS = 'gpu_check.json', 'gpu_check_logs.tar.gz'
TINY = ['--model-kw', 'dim=32', 'depth=2', 'patch_size=4', 'kernel_size=3']  # a ConvMixer for the dry run
VIT = ['--model', 'vit_ti16', '--model-kw', 'depth=2', 'dim=64', 'heads=2']
SYNC = 'called a synchronizing CUDA operation'
# A script's command line with CUDA's sync debug mode on: every host sync warns, with the line that caused it.
SYNC_WRAPPER = ("import runpy, sys, warnings, torch; warnings.simplefilter('always'); "
                "torch.cuda.is_available() and torch.cuda.set_sync_debug_mode('warn'); "
                "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
LOCUSLAB = ('locuslab/convmixer-cifar10 README: ~92.5% after 25 epochs, on the original CIFAR-10 release; a JPEG '
            're-encoding runs a little below it (shared/data/README.md). A figure, not a pass/fail')


class OutOfTime(Exception):  # a part ran into the end of --budget-s
    pass


class Skip(Exception):  # a part that does not apply here
    pass


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--data', required=True, metavar='DIR', help='the CIFAR-10 data (train_cifar.py --data)')
    p.add_argument('--out', required=True, metavar='DIR', help=f'receives {RESULT} and {LOGS}, nothing else')
    p.add_argument('--parts', nargs='+', default=list(PARTS[:-1]), choices=[*PARTS, 'rest'], help='which parts, in '
                   f'this order (default: all but compile); rest: those not ok in OUT/{RESULT}, compile apart')
    p.add_argument('--budget-s', type=float, default=540, help='seconds this command may take in all (default: one '
                   '10-minute lease command with margin)')
    p.add_argument('--dry-run', action='store_true', help='every part at a toy size, on the CPU if there is no GPU')
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise UserError('no CUDA device: this check is for a GPU (pass --dry-run to exercise it on the CPU)')
    if not (math.isfinite(args.budget_s) and args.budget_s > MARGIN_S):
        raise UserError(f'--budget-s must be more than {MARGIN_S} s (kept back to write the results), got '
                        f'{args.budget_s}')
    # Absolute paths: the scripts run in the repo folder, --data and --out are the caller's (W11, W12).
    args.data, args.out = Path(args.data).resolve(), Path(args.out).resolve()
    if args.out.exists() and not args.out.is_dir() or (args.out / RESULT).is_dir():
        raise UserError(f'--out {args.out}: not a folder for {RESULT}')
    args.per_class = cifar_counts(args)
    return args


def process_start():
    """When this process started (Linux /proc: the imports before main() count against the budget too), else now."""
    try:
        ticks = int(Path('/proc/self/stat').read_text().rsplit(')', 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in open('/proc/stat') if line.startswith('btime'))
        t = boot + ticks / os.sysconf('SC_CLK_TCK')
        return t if time.time() - 600 < t <= time.time() else time.time()
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def cifar_counts(args):
    """(train, test) images of the smallest class of --data, before any part runs: one line for what cannot be used."""
    if (args.data / 'cifar-10-batches-py').is_dir():
        return 5000, 1000  # torchvision's copy of the original release
    if not ((args.data / 'train').is_dir() and (args.data / 'test').is_dir()):
        raise UserError(f'--data {args.data}: expected CIFAR-10 as DIR/train/<class>/*, DIR/test/<class>/* or '
                        'torchvision\'s DIR/cifar-10-batches-py')
    counts = [[len(os.listdir(d)) for d in sorted((args.data / s).iterdir()) if d.is_dir()] for s in ('train', 'test')]
    if [len(c) for c in counts] != [10, 10] or min(map(min, counts)) < 10:
        raise UserError(f'--data {args.data}: needs 10 class folders with 10 or more images each in train/ and test/')
    per_class = min(counts[0]), min(counts[1])
    if not args.dry_run and (per_class[0] < 5000 or per_class[1] < 1000):
        raise UserError(f'--data {args.data} holds {per_class[0]} / {per_class[1]} train / test images in its '
                        'smallest class: the GPU run needs the full CIFAR-10 (5,000 / 1,000); --dry-run takes this')
    return per_class


# ----- Running the other scripts: one log each, the time left as the timeout, the whole process group stopped.
def script(args, name, argv, log, wrapper=None):
    """`python NAME ARGV` (under `python -c WRAPPER NAME ARGV`) in the repo folder, into log -> (status, stderr, s)."""
    cmd = [sys.executable, *(['-c', wrapper] if wrapper else []), str(HERE / name), *map(str, argv)]
    t, left = time.time(), args.deadline - time.time()
    if left < 1:
        raise OutOfTime(f'{name}: no time left of --budget-s {args.budget_s:g}')
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE,
                            start_new_session=True)  # its own group: its loader workers are stopped with it
    try:
        (out, err), late = proc.communicate(timeout=left), False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        (out, err), late = proc.communicate(), True
        err += f'\n(stopped after {time.time() - t:.0f} s: the end of --budget-s {args.budget_s:g})'
    with open(log, 'a') as f:
        f.write(f'$ {" ".join([name, *map(str, argv)])}\n{out}{err}(exit {proc.returncode}, '
                f'{time.time() - t:.1f} s)\n\n')
    if late:
        raise OutOfTime(f'{name} ran into the end of --budget-s {args.budget_s:g} after {time.time() - t:.0f} s')
    return proc.returncode, err, time.time() - t


def check(code, err, what):
    if code:
        raise RuntimeError(f'{what} failed (exit {code}): {err.strip().splitlines()[-1] if err.strip() else ""}')


def versions(args, work):
    import torchvision
    mods = {n: importlib.import_module(n).__version__ for n in ('timm', 'einops') if importlib.util.find_spec(n)}
    cuda = torch.cuda.is_available()
    return dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                cudnn=torch.backends.cudnn.version(), torchvision=torchvision.__version__, **mods,
                gpu=torch.cuda.get_device_name() if cuda else None,
                gpu_memory_mib=torch.cuda.get_device_properties(0).total_memory / 2 ** 20 if cuda else None,
                max_micro_batch=micro_batch_cap(), cpus=len(os.sched_getaffinity(0)), dry_run=args.dry_run)


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


def augment_ops(args, work):
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


def memory(args, work):
    """Peak memory of one SAM training step (both passes, AdamW) of ViT-B/16 in bf16 at 64, 256 (the fixed default
    --max-micro-batch had) and the default derived for this GPU; MiB per image from the slope."""
    if not torch.cuda.is_available():
        return dict(measured=False, note='CPU: no allocator peak to read', max_micro_batch=micro_batch_cap())
    rows = {}
    for batch in sorted({64, 256, micro_batch_cap()}):
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
    return dict(measured=True, peak_mib=rows, mib_per_image=per_image, max_micro_batch=micro_batch_cap(),
                gpu_memory_mib=torch.cuda.get_device_properties(0).total_memory / 2 ** 20)


def tiny_imagenet(args, work):
    """An ImageNet-layout folder of CIFAR images (20 train, 4 val a class) for train_imagenet.py and robustness.py."""
    tiny = work / 'tiny_imagenet'
    for split, (src, n) in {'train': ('train', 20), 'val': ('test', 4)}.items():
        for c in sorted(os.listdir(args.data / src)):
            if not (tiny / split / c).is_dir():
                (tiny / split / c).mkdir(parents=True)
                for f in sorted(os.listdir(args.data / src / c))[:n]:
                    shutil.copy(args.data / src / c / f, tiny / split / c / f)
    return tiny


def sync_runs(args, work):
    """name -> (script, argv for a run of s steps, k). Dry: one path per script (no CUDA: nothing to count)."""
    tiny, n = tiny_imagenet(args, work), 10 * min(args.per_class[1], 20)
    cifar = lambda *extra: ('train_cifar.py', lambda s: [  # noqa: E731
        '--data', args.data, '--train-subset', s * (50 if args.dry_run else 512), '--test-subset', n, '--batch-size',
        50 if args.dry_run else 512, '--epochs', 1, '--log-every', 0, *(TINY * args.dry_run), *extra], 2 if
        args.dry_run else 10)
    runs = {'cifar_default': cifar(), 'cifar_sam': cifar('--sam'), 'cifar_sam_fp16': cifar('--sam', '--amp', 'fp16'),
            'cifar_pgd': cifar('--adv', 'pgd', '--adv-steps', 2),
            'imagenet_convmixer_sam': ('train_imagenet.py', lambda s: [
                '--data', tiny, '--recipe', 'convmixer', '--model', 'convmixer_768_32', '--model-kw', 'dim=32',
                'depth=2', 'patch_size=4', '--img-size', 32, '--batch-size', 20, '--max-micro-batch', 10, '--workers',
                2, '--sam', '--max-steps', s, '--log-every', 0], 4),
            'contrastive_sam': ('train_contrastive.py', lambda s: [
                '--data', args.data, '--train-subset', s * 20, '--test-subset', n, *VIT, '--proj-hidden', 64,
                '--proj-dim', 16, '--batch-size', 20, '--epochs', 1, '--warmup-epochs', 0, '--eval', 'knn',
                '--eval-every', 0, '--eval-batch-size', 1024, '--sam', '--log-every', 0], 4)}
    return {k: v for k, v in runs.items() if not args.dry_run or k in ('cifar_sam', 'imagenet_convmixer_sam',
                                                                         'contrastive_sam')}


def syncs(args, work):
    """Host syncs per step: a run of 2k steps minus one of k (start, evaluation and saving are the same in both)."""
    def count(name, file, make_argv, steps):
        argv = [*make_argv(steps), '--out', work / f'syncs_{name}_{steps}', '--overwrite']
        code, err, _ = script(args, file, argv, work / f'syncs_{name}_{steps}.log', SYNC_WRAPPER)
        check(code, err, f'{file} ({name}, {steps} steps)')
        return [re.sub(r':\s*UserWarning.*', '', line).strip() for line in err.splitlines() if SYNC in line]
    jobs = {(name, s): (name, file, make_argv, s) for name, (file, make_argv, k) in sync_runs(args, work).items()
            for s in ((k,) if args.dry_run else (k, 2 * k))}
    with ThreadPoolExecutor(2 if args.dry_run else SYNC_JOBS) as pool:
        got = dict(zip(jobs, pool.map(lambda job: count(*job), jobs.values())))
    rows = {}
    for name, (_, _, k) in sync_runs(args, work).items():
        lines = [got[name, s] for s in ((k,) if args.dry_run else (k, 2 * k))]
        rows[name] = dict(per_step=(len(lines[1]) - len(lines[0])) / k if len(lines) == 2 else None,
                          runs=[len(c) for c in lines], steps=[k, 2 * k][:len(lines)],
                          where=dict(Counter(sum(lines, [])).most_common(10)), measured=torch.cuda.is_available())
    return rows


def cifar_run(args, work, name, extra, log):
    """One train_cifar.py run -> its figures (a run stopped by the budget: the epochs it finished)."""
    small = ['--train-subset', 10 * min(args.per_class[0], 50), '--test-subset', 10 * min(args.per_class[1], 20),
             '--epochs', 2, '--batch-size', 50, *TINY] * args.dry_run
    run_dir = work / f'cifar_{name}'
    try:
        code, err, wall = script(args, 'train_cifar.py', ['--data', args.data, '--out', run_dir, '--overwrite',
                                                          '--log-every', 0, *small, *extra], log)
        check(code, err, f'train_cifar.py ({name})')
    except OutOfTime as e:
        stopped, wall = str(e), time.time() - args.part_start
    else:
        stopped = None
    history = [json.loads(line) for line in open(run_dir / 'metrics.jsonl')] if (run_dir / 'metrics.jsonl').exists() \
        else []
    evals, train = [r for r in history if r['kind'] == 'eval'], [r for r in history if r['kind'] == 'train']
    if not evals:
        raise OutOfTime(stopped) if stopped else RuntimeError(f'train_cifar.py ({name}) wrote no evaluation')
    run_args = json.load(open(run_dir / 'args.json')) if (run_dir / 'args.json').exists() else {}
    return dict(test_acc=evals[-1]['top1'], wall_s=wall, train_s=evals[-1]['elapsed_s'], epochs=evals[-1]['epoch'],
                img_per_s=sum(r['img_per_s'] for r in train) / len(train), channels_last=run_args.get('channels_last'),
                stopped_by_budget=stopped, flags=list(map(str, extra)))


def cifar(args, work):
    """The default run (accuracy, wall, img/s, beside locuslab's figure and the data it ran on), and the other layout
    (channels_last off on CUDA, on elsewhere) for 3 epochs: its img/s beside the default's."""
    jpeg = not (args.data / 'cifar-10-batches-py').is_dir()
    source = dict(data=str(args.data), images=f'{10 * args.per_class[0]} train / {10 * args.per_class[1]} test',
                  format='JPEG re-encoding (image folder)' if jpeg else 'the original release (torchvision)')
    rows = dict(eager=cifar_run(args, work, 'eager', [], work / 'cifar.log'))
    other = '--no-channels-last' if torch.cuda.is_available() else '--channels-last'
    if rows['eager']['stopped_by_budget'] or args.deadline - time.time() < NEED_S['cifar'][args.dry_run] / 5:
        rows['eager_other_layout'] = dict(skipped='too little of --budget-s left')
    else:
        rows['eager_other_layout'] = cifar_run(args, work, 'layout', [other, *['--epochs', 3] * (not args.dry_run)],
                                               work / 'cifar.log')
    return dict(rows, source=source, reference=LOCUSLAB, **stopped(rows['eager']))


def compile_run(args, work):
    if args.dry_run:
        raise Skip('the dry run does not compile (minutes on a CPU); --compile is timed on the GPU only')
    row = cifar_run(args, work, 'compile', ['--compile'], work / 'compile.log')
    return dict(compile=row, reference=LOCUSLAB, **stopped(row))


def stopped(row):  # a run the budget ended: its figures so far, and a status that --parts rest runs again
    return dict(status='stopped', error=row['stopped_by_budget']) if row['stopped_by_budget'] else {}


def bench(args, work):
    argv = (['--quick', '--rows', 'convmixer_256_8', '--batch-size', 2, '--min-run-time', 0.1] if args.dry_run else
            ['--rows', 'vit_b16,mixer_b16,convmixer_768_32,cifar', '--min-run-time', 3])
    code, err, wall = script(args, 'bench.py', [*argv, '--json', work / 'bench_rows.json'], work / 'bench.log')
    check(code, err, 'bench.py')
    return dict(json.load(open(work / 'bench_rows.json')), wall_s=wall)


def smoke(args, work):
    """Each other script once, briefly, on this device: three at once, then the attack on the folder run's last.pt."""
    tiny = tiny_imagenet(args, work)
    runs = {
        'imagenet_synthetic': ('train_imagenet.py', ['--synthetic', *VIT, '--img-size', 32, '--batch-size', 64,
                                                     '--max-steps', 20, '--log-every', 10, '--sam']),
        'imagenet_folder': ('train_imagenet.py', ['--data', tiny, *VIT, '--img-size', 32, '--batch-size', 20,
                                                  '--epochs', 1, '--workers', 2, '--log-every', 5]),
        'contrastive_sam': ('train_contrastive.py', ['--data', args.data, '--train-subset', 10 * min(
            args.per_class[0], 25), '--test-subset', 100, *VIT, '--proj-hidden', 128, '--proj-dim', 32,
            '--batch-size', 50, '--epochs', 1, '--warmup-epochs', 0, '--eval-every', 0, '--sam']),
        'robustness_pgd': ('robustness.py', ['--attack', 'pgd', '--steps', 3, '--data', tiny / 'val', '--checkpoint',
                                             work / 'smoke_imagenet_folder' / 'last.pt', '--no-plot'])}

    def one(name):
        file, argv = runs[name]
        code, err, wall = script(args, file, [*argv, '--out', work / f'smoke_{name}', '--overwrite'],
                                 work / f'smoke_{name}.log')
        return dict(ok=code == 0, wall_s=wall, error=err.strip().splitlines()[-1] if code and err.strip() else None)
    with ThreadPoolExecutor(3) as pool:
        rows = dict(zip(list(runs)[:3], pool.map(one, list(runs)[:3])))
    rows['robustness_pgd'] = one('robustness_pgd')
    if bad := {n: r['error'] for n, r in rows.items() if not r['ok']}:
        raise RuntimeError('; '.join(f'{n}: {e}' for n, e in bad.items()))
    return rows


RUN = dict(versions=versions, augment=augment_ops, memory=memory, syncs=syncs, cifar=cifar, bench=bench, smoke=smoke,
           compile=compile_run)


# ----- The budget, the one JSON, the one archive.
def previous(out):
    """The JSON and the logs an earlier call left in OUT (merged into, never overwritten)."""
    try:
        result = json.loads((out / RESULT).read_text()) if (out / RESULT).exists() else dict(parts={}, calls=[])
        assert isinstance(result.get('parts'), dict) and isinstance(result.get('calls'), list)
    except (ValueError, AssertionError, OSError) as e:
        raise UserError(f'{out / RESULT} is not a {RESULT} of this script ({one_line(e) or "no parts/calls"}); move '
                        'it away or pick another --out')
    logs = {}
    if (out / LOGS).exists():
        try:
            with tarfile.open(out / LOGS) as tar:
                logs = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
        except (tarfile.TarError, OSError) as e:
            raise UserError(f'{out / LOGS} cannot be read ({one_line(e)}); move it away or pick another --out')
    return result, logs


def write(out, result, logs, work):
    """gpu_check.json and the log archive (earlier calls' logs + this call's), each written to .tmp and renamed."""
    save_atomic(out / RESULT, result)
    logs = {**logs, **{p.name: p.read_bytes() for p in sorted(work.glob('*.log'))}}

    def tar(f):
        with tarfile.open(fileobj=f, mode='w:gz') as t:
            for name, data in sorted(logs.items()):
                info = tarfile.TarInfo(name)
                info.size, info.mtime = len(data), time.time()
                t.addfile(info, io.BytesIO(data))
    save_atomic(out / LOGS, tar)


def log_tail(work, part, n=15):
    lines = [line for p in sorted(work.glob(f'{part}*.log')) for line in p.read_text(errors='replace').splitlines()]
    return lines[-n:]


def run_part(args, part, work):
    """One part within the budget -> its record: figures, or the error and its log's last lines, or why skipped."""
    need, left = NEED_S[part][args.dry_run], args.deadline - time.time()
    if need > left:
        return dict(status='skipped', reason=f'needs ~{need} s, {max(left, 0):.0f} s left of --budget-s '
                                             f'{args.budget_s:g}; run it in another call (--parts {part} or rest)')
    args.part_start = time.time()

    def alarm(*_):  # an in-process part past the end (the subprocesses have their own timeouts)
        raise OutOfTime(f'{part} ran into the end of --budget-s {args.budget_s:g}')
    signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, max(left + 2, 0.1))
    try:
        record = {'status': 'ok', **RUN[part](args, work)}
    except Skip as e:
        record = dict(status='skipped', reason=str(e))
    except Exception as e:  # a failed part is a result: the others still run (one GPU call gets them all)
        record = dict(status='failed', error=f'{type(e).__name__}: {one_line(e)}',
                      log_tail=log_tail(work, part) or traceback.format_exc().splitlines()[-8:])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return dict(record, seconds=round(time.time() - args.part_start, 1),
                finished=time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime()))


def main(argv=None):
    t0 = process_start() if argv is None else time.time()
    args = get_args(argv)
    args.deadline = t0 + args.budget_s - MARGIN_S
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f'--out {args.out}: {e.strerror or e}')
    result, logs = previous(args.out)
    rest = [p for p in PARTS[:-1] if result['parts'].get(p, {}).get('status') != 'ok']
    parts = list(dict.fromkeys(q for p in args.parts for q in (rest if p == 'rest' else [p])))
    call = dict(argv=sys.argv[1:] if argv is None else list(map(str, argv)), budget_s=args.budget_s, parts=parts,
                started=time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime()), dry_run=args.dry_run,
                torch=torch.__version__, gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    result['calls'].append(call)
    for p in PARTS:  # the JSON names every part
        result['parts'].setdefault(p, dict(status='not run', reason='in no call\'s --parts yet'))
    work = Path(tempfile.mkdtemp(prefix='gpu_check_'))  # run folders and the tiny ImageNet: not under --out
    try:
        for part in parts:
            result['parts'][part] = record = run_part(args, part, work)
            call['wall_s'] = round(time.time() - t0, 1)
            write(args.out, result, logs, work)
            why = record.get('error') or record.get('reason') or ''
            print(f'{part:9s} {record["status"]:7s} {record.get("seconds", 0):6.1f} s  {why}', flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    by = {s: [p for p in parts if result['parts'][p]['status'] == s] for s in ('ok', 'failed', 'skipped', 'stopped')}
    counts = [f'{len(v)} {s}' + (f' ({", ".join(v)})' if v and s != 'ok' else '') for s, v in by.items()
              if v or s != 'stopped']
    print(f'done | {" | ".join(counts)} | {time.time() - t0:.0f} of {args.budget_s:g} s | {args.out / RESULT}')
    return 1 if by['failed'] else 0


if __name__ == '__main__':
    try:
        sys.exit(main())
    except UserError as e:
        sys.exit(f'gpu_check.py: error: {e}')
