"""gpu_check.py: every CUDA path of the repo in one command, on one GPU, each figure written as JSON beside its log.

    python gpu_check.py --data DIR --out DIR              # one GPU: sized for ~8 minutes on an H200 (untimed)
    python gpu_check.py --data DIR --out DIR --dry-run    # any machine: every part shrunk to seconds (the suite)

DIR is the CIFAR-10 data train_cifar.py takes. The parts, each OUT/<part>.json (+ OUT/<part>.log of the scripts
it ran); a part that fails is recorded as failed and the others still run (the exit status is 1 then):
  versions  python, torch, CUDA, cuDNN, the GPU, torchvision, timm, einops
  cifar     train_cifar.py's default 25-epoch run (bf16; the goal: >= 92.5% in <= 2 minutes on an H200), and with
            --compile: wall time, test accuracy, images/s
  syncs     host syncs per training step of train_cifar.py (default, --sam, --sam --amp fp16, --adv pgd), counted
            under torch.cuda.set_sync_debug_mode('warn') as the difference of a run of 2k and one of k steps
  augment   augment.py's ops on CUDA against the same ops, with the same parameters, on the CPU: differing pixels
  memory    peak memory of one vit_b16 SAM step (bf16) at two micro-batches
  bench     bench.py's GPU rows (vit_b16, mixer_b16, convmixer_768_32, cifar): img/s, MFU, SAM/base, beside timm
  smoke     train_imagenet.py (--synthetic, and a tiny folder made from DIR), train_contrastive.py --sam,
            robustness.py --attack pgd
It runs the other scripts through their command lines (no script imports another) with this Python, and
installs nothing: the lent machine's own torch, torchvision, timm and einops (older than ours) must do.
"""
import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

import augment
from models import build_model
from runs import save_atomic
from sam import SAM, first_pass, second_pass
from utils import UserError
HERE = Path(__file__).resolve().parent
PARTS = ('versions', 'cifar', 'syncs', 'augment', 'memory', 'bench', 'smoke')
TINY = ['--model-kw', 'dim=32', 'depth=2', 'patch_size=4', 'kernel_size=3']  # a ConvMixer for the dry run
SYNC = 'called a synchronizing CUDA operation'
# A script's command line with CUDA's sync debug mode on: every host sync warns, with the line that caused it.
SYNC_WRAPPER = ("import runpy, sys, warnings, torch; warnings.simplefilter('always'); "
                "torch.cuda.is_available() and torch.cuda.set_sync_debug_mode('warn'); "
                "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--data', required=True, metavar='DIR', help='the CIFAR-10 data (train_cifar.py --data)')
    p.add_argument('--out', required=True, metavar='DIR', help='receives <part>.json and <part>.log')
    p.add_argument('--parts', nargs='+', default=list(PARTS), choices=PARTS, help='which parts, in this order')
    p.add_argument('--dry-run', action='store_true', help='every part at a toy size, on the CPU if there is no GPU')
    p.add_argument('--no-compile', action='store_true', help='cifar: skip the --compile run')
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise UserError('no CUDA device: this check is for a GPU (pass --dry-run to exercise it on the CPU)')
    if not Path(args.data).is_dir():
        raise UserError(f'--data {args.data}: no such folder (the CIFAR-10 data train_cifar.py takes)')
    return args


def script(name, argv, log, wrapper=None, timeout=1800):
    """`python NAME ARGV` (under `python -c WRAPPER NAME ARGV` when given), its output appended to log.
    -> (exit status, stderr text, seconds)"""
    cmd = [sys.executable, *(['-c', wrapper] if wrapper else []), str(HERE / name), *map(str, argv)]
    t = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=HERE)
    with open(log, 'a') as f:
        f.write(f'$ {" ".join(cmd[1:] if not wrapper else [name, *map(str, argv)])}\n{r.stdout}{r.stderr}'
                f'(exit {r.returncode}, {time.time() - t:.1f} s)\n\n')
    return r.returncode, r.stderr, time.time() - t


def check(code, err, what):
    if code:
        raise RuntimeError(f'{what} failed (exit {code}): {err.strip().splitlines()[-1] if err.strip() else ""}')


def versions(args, out):
    import torchvision
    mods = {name: __import__(name).__version__ for name in ('timm', 'einops') if _importable(name)}
    return dict(python=platform.python_version(), torch=torch.__version__, cuda=torch.version.cuda,
                cudnn=torch.backends.cudnn.version(), torchvision=torchvision.__version__, **mods,
                gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                date=time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime()), dry_run=args.dry_run)


def _importable(name):
    try:
        __import__(name)
        return True
    except ImportError:
        return False


def cifar(args, out):
    """The default run (and --compile): the last epoch's test accuracy, the wall time, the mean train img/s."""
    small = ['--train-subset', 500, '--test-subset', 200, '--epochs', 2, '--batch-size', 100, *TINY] * args.dry_run
    rows = {}
    for name, extra in (('eager', []), ('compile', ['--compile'])):
        if name == 'compile' and (args.no_compile or args.dry_run):
            continue
        run_dir = out / f'cifar_{name}'
        code, err, wall = script('train_cifar.py', ['--data', args.data, '--out', run_dir, '--overwrite',
                                                    '--log-every', 0, *small, *extra], out / 'cifar.log')
        check(code, err, f'train_cifar.py ({name})')
        history = [json.loads(line) for line in open(run_dir / 'metrics.jsonl')]
        evals, train = [r for r in history if r['kind'] == 'eval'], [r for r in history if r['kind'] == 'train']
        rows[name] = dict(test_acc=evals[-1]['top1'], wall_s=wall, train_s=evals[-1]['elapsed_s'],
                          img_per_s=sum(r['img_per_s'] for r in train) / len(train), epochs=evals[-1]['epoch'])
    return rows


def syncs(args, out):
    """Host syncs per step: a run of 2k steps minus one of k steps (the rest, evaluation and saving, is the same).
    The dry run (no GPU: nothing to count) runs each path once."""
    batch, k = (50, 2) if args.dry_run else (512, 10)
    paths = {'default': [], 'sam': ['--sam'], 'sam_fp16': ['--sam', '--amp', 'fp16'],
             'pgd': ['--adv', 'pgd', '--adv-steps', 2]}
    rows = {}
    for name, extra in paths.items():
        counts, where = [], Counter()
        for steps in (k,) if args.dry_run else (k, 2 * k):
            code, err, _ = script('train_cifar.py', ['--data', args.data, '--train-subset', steps * batch,
                                                     '--test-subset', 100, '--batch-size', batch, '--epochs', 1,
                                                     '--log-every', 0, '--out', out / f'syncs_{name}', '--overwrite',
                                                     *(TINY * args.dry_run), *extra], out / 'syncs.log', SYNC_WRAPPER)
            check(code, err, f'train_cifar.py {" ".join(map(str, extra))}')
            lines = [line for line in err.splitlines() if SYNC in line]
            counts.append(len(lines))
            where.update(re.sub(r':\s*UserWarning.*', '', line).strip() for line in lines)
        rows[name] = dict(per_step=(counts[1] - counts[0]) / k if len(counts) == 2 else None, runs=counts,
                          steps=[k, 2 * k][:len(counts)], where=dict(where.most_common(10)),
                          measured=torch.cuda.is_available())
    return rows


def augment_ops(args, out):
    """Each RandAugment op, the square crop, the pad-and-crop and the normalisation on the device against the CPU
    with the same inputs and parameters: TF32 or a kernel that rounds otherwise would show as differing pixels."""
    device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    g = torch.Generator().manual_seed(0)
    B = 64
    x = torch.randint(0, 256, (B, 3, 32, 32), dtype=torch.uint8, generator=g)
    mags = torch.tensor(augment.ra_magnitudes(12), dtype=torch.float64)
    rows = {}
    for k, name in enumerate(augment.RA_OPS):
        op = torch.full((B,), k)
        sign = torch.where(torch.rand(B, generator=g) < 0.5, -1.0, 1.0).double()
        mag = mags[op] * torch.where(torch.tensor([name in augment.RA_SIGNED] * B), sign, 1.0)
        cpu, dev = (augment.apply_ra_ops(x.to(d).float(), op.to(d), mag.to(d)).cpu() for d in ('cpu', device))
        rows[name] = int((cpu != dev).sum())
    side = torch.randint(24, 33, (B,), generator=g).double()
    top, left = ((32 - side + 1) * torch.rand(B, generator=g, dtype=torch.float64)).floor(), torch.zeros(B).double()
    flip = torch.rand(B, generator=g) < 0.5
    crop = [augment.resized_crop_flip(x.to(d).float(), top.to(d), left.to(d), side.to(d), flip.to(d)).cpu()
            for d in ('cpu', device)]
    rows['resized_crop_flip'] = int((crop[0] != crop[1]).sum())
    dy, dx = torch.randint(0, 9, (2, B), generator=g)
    pad = [augment.pad_crop_flip(x.to(d), dy.to(d), dx.to(d), flip.to(d)).cpu() for d in ('cpu', device)]
    rows['pad_crop_flip'] = int((pad[0] != pad[1]).sum())
    return dict(differing_pixels=rows, pixels_per_op=x.numel(), device=str(device))


def memory(args, out):
    """Peak memory of one SAM training step (both passes, AdamW) in bf16 at two micro-batches."""
    if not torch.cuda.is_available():
        return dict(measured=False, note='CPU: no allocator peak to read')
    rows = {}
    for batch in ((2, 4) if args.dry_run else (64, 128)):
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
        del model, opt, x, y, loss
        torch.cuda.empty_cache()
    return dict(measured=True, peak_mib=rows)


def bench(args, out):
    argv = (['--quick', '--rows', 'convmixer_256_8', '--batch-size', 2, '--min-run-time', 0.1] if args.dry_run else
            ['--rows', 'vit_b16,mixer_b16,convmixer_768_32,cifar', '--min-run-time', 3])
    code, err, wall = script('bench.py', [*argv, '--json', out / 'bench_rows.json'], out / 'bench.log')
    check(code, err, 'bench.py')
    return dict(json.load(open(out / 'bench_rows.json')), wall_s=wall)


def smoke(args, out):
    """Each other script once, briefly, on this device; the tiny ImageNet folder: 20 + 4 CIFAR images a class."""
    tiny = out / 'tiny_imagenet'
    for split, (src, n) in {'train': ('train', 20), 'val': ('test', 4)}.items():
        for c in sorted(os.listdir(Path(args.data) / src)):
            (tiny / split / c).mkdir(parents=True, exist_ok=True)
            for f in sorted(os.listdir(Path(args.data) / src / c))[:n]:
                shutil.copy(Path(args.data) / src / c / f, tiny / split / c / f)
    vit = ['--model', 'vit_ti16', '--model-kw', 'depth=2', 'dim=64', 'heads=2', '--img-size', 32]
    runs = {
        'imagenet_synthetic': ('train_imagenet.py', ['--synthetic', *vit, '--batch-size', 64, '--max-steps', 20,
                                                     '--log-every', 10, '--sam', '--out', out / 'smoke_syn']),
        'imagenet_folder': ('train_imagenet.py', ['--data', tiny, *vit, '--batch-size', 20, '--epochs', 1,
                                                  '--workers', 2, '--log-every', 5, '--out', out / 'smoke_in']),
        'contrastive_sam': ('train_contrastive.py', ['--data', args.data, '--train-subset', 256, '--test-subset',
                                                     100, '--model', 'vit_ti16', '--model-kw', 'dim=64', 'depth=2',
                                                     'heads=2', '--proj-hidden', 128, '--proj-dim', 32, '--batch-size',
                                                     64, '--epochs', 1, '--warmup-epochs', 0, '--eval-every', 0,
                                                     '--sam', '--out', out / 'smoke_moco']),
        'robustness_pgd': ('robustness.py', ['--attack', 'pgd', '--steps', 3, '--data', tiny / 'val', '--checkpoint',
                                             out / 'smoke_in' / 'last.pt', '--no-plot', '--out', out / 'smoke_rob']),
    }
    rows = {}
    for name, (file, argv) in runs.items():  # (the attack needs the folder run's last.pt)
        code, err, wall = script(file, [*argv, '--overwrite'], out / 'smoke.log')
        rows[name] = dict(ok=code == 0, wall_s=wall, error=err.strip().splitlines()[-1] if code and err.strip()
                          else None)
    if not all(r['ok'] for r in rows.values()):
        raise RuntimeError(f'failed: {[n for n, r in rows.items() if not r["ok"]]}; see smoke.log')
    return rows


def main(argv=None):
    args = get_args(argv)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f'--out {out}: {e.strerror or e}')
    run = dict(versions=versions, cifar=cifar, syncs=syncs, augment=augment_ops, memory=memory, bench=bench,
               smoke=smoke)
    failed = []
    for part in args.parts:
        t = time.time()
        try:
            result = dict(status='ok', **run[part](args, out))
        except Exception as e:  # a failed part is a result: the others still run (one GPU call gets them all)
            result, failed = dict(status='failed', error=f'{type(e).__name__}: {e}'), failed + [part]
        result['seconds'] = time.time() - t
        save_atomic(out / f'{part}.json', result)
        print(f'{part:9s} {result["status"]:6s} {result["seconds"]:7.1f} s  {out / part}.json', flush=True)
    print(f'done | {len(args.parts) - len(failed)}/{len(args.parts)} parts ok | {out}')
    return 1 if failed else 0


if __name__ == '__main__':
    try:
        sys.exit(main())
    except UserError as e:
        sys.exit(f'gpu_check.py: error: {e}')
