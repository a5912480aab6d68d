"""gpu_check.py: every CUDA figure of the repo from one lent GPU, sized to the lease, into ONE JSON file.

    python3 gpu_check.py --data .gc/cifar10-jpeg.tar.gz --out $OUT --budget-s 340   # call 1: all but Table 1
    python3 gpu_check.py --data .gc/cifar10-jpeg.tar.gz --out $OUT --parts table1 --budget-s 540   # a call of its own
    python3 gpu_check.py --data DIR --out OUT --dry-run                 # any machine: every part at a toy size

--data: the full CIFAR-10, a folder (train_cifar.py --data) or its .tar.gz, unpacked here inside the budget (the dry run
takes a small copy too). The parts, in this order (the first four time nothing, so they share the GPU at once):
  versions  python, torch, CUDA, cuDNN, the GPU, the packages (gpu_probe.py)
  augment   augment.py's ops, Augment.__call__ and the MoCo views on CUDA against the CPU with the same inputs and
            draws, under setup()'s TF32 / cudnn flags: differing pixels per op (gpu_probe.py)
  syncs     host syncs per training step under torch.cuda.set_sync_debug_mode('warn'): a run of 2k steps minus one
            of k, for train_cifar.py (default, --amp fp16, --sam, --sam --amp fp16, GSAM, --adv pgd, --compile),
            train_imagenet.py (convmixer recipe under --sam over 2 micro-batches; --decode gpu) and
            train_contrastive.py --sam (MoCo), SYNC_JOBS at once
  smoke     train_imagenet.py (--synthetic, and a folder made from the data), train_contrastive.py --sam, robustness.py
  memory    peak memory of a vit_b16 SAM step (bf16) at 64, 256 and the default micro-batch (gpu_probe.py), alone
  cifar     train_cifar.py's default 25-epoch run (bf16, channels_last): accuracy beside locuslab's 92.5%, wall, img/s
            from epoch 2 on (epoch 1 holds cuDNN's autotuning); 3 epochs in the other layout (img/s)
  bench     bench.py's GPU rows: img/s, SAM/base, GSAM/SAM, MFU of the data sheet's peak and of a bf16 matmul's
  compile   the cifar run with --compile (its graphs already in inductor's cache from the syncs part's runs)
  table1    Table 1 on one GPU (table1.py --preset gpu, six runs side by side), its epochs sized from the img/s of a
            short calibration run to the budget; only when --parts names it, in a call of its own
The lease (one GPU, 10 minutes a command with a 3-4 minute start, 15 of device time, 8 files back): --budget-s is
this command's time from its start, the unpacking and imports counted. A part starts only if NEED_S says it fits in
what is left (else it is skipped and named); every subprocess gets the time left as its timeout, and a part it stops
keeps what it finished. OUT receives gpu_check.json (rewritten after every part), gpu_check_logs.tar.gz (every log),
.lock, and for table1 its table, JSON and figures; run folders live in a temporary folder, removed at the end. It runs
the other scripts through their command lines (no script imports another) and installs nothing: a package it needs
that is missing is named, with the wheel to carry, in the JSON, before any part runs.
"""
import argparse
import importlib.util
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from runs import discard_new_dirs, prepare_out, save_atomic
from utils import UserError, one_line

HERE = Path(__file__).resolve().parent
PARTS = ('versions', 'augment', 'syncs', 'smoke', 'memory', 'cifar', 'bench', 'compile', 'table1')
TOGETHER = ('versions', 'augment', 'syncs', 'smoke')  # they time nothing: at once, sharing the GPU and the cores
# Seconds a part needs (GPU: an H100 or H200; dry run: the suite's 2-core CPU). GPU: ESTIMATED from each part's work
# (no GPU has run them; the JSON records the real seconds); dry: measured on the shared VM under load. A part starts
# only when this much is left. GPU estimates: a process's start (python, torch, CUDA) ~8 s; syncs: 24 runs of ~15 s,
# SYNC_JOBS at once, the two --compile runs ~60 s beside them; cifar: 25 epochs of 1.1 PFLOP at ~25-40% of the bf16
# peak (depthwise convs), the evaluations and 3 NCHW epochs; bench: 7 rows of 6-7 sides, ~1.2 s each; compile: the
# cifar run with its graphs in the cache; table1: the whole call (table1_part sizes its epochs to what is left).
# Call 1: the four at once ~100 s (syncs'), then 25 + 85 + 60 + 50: 320 s, the 330 that --budget-s 340 leaves.
NEED_S = dict(versions=(10, 10), augment=(25, 30), syncs=(100, 100), smoke=(60, 90), memory=(25, 10),
              cifar=(85, 40), bench=(60, 90), compile=(50, 0), table1=(300, 120))
MARGIN_S = 10  # kept back for the last writes and the exit
SYNC_JOBS = 8  # sync-counting runs at once on the GPU (they time nothing)
RESULT, LOGS = 'gpu_check.json', 'gpu_check_logs.tar.gz'
# What the parts import beyond torch (module, pip name, requirement): required ones missing stop the call before any
# part, naming the wheel to carry; timm only loses bench's side by side, imagecorruptions Table 1's corruption column.
NEEDS = [('torchvision', 'torchvision', 'torchvision>=0.21'), ('numpy', 'numpy', 'numpy>=1.24'),
         ('einops', 'einops', 'einops>=0.7'), ('PIL', 'pillow', 'pillow')]
OPTIONAL = [('timm', 'timm', 'timm>=1.0.9'), ('matplotlib', 'matplotlib', 'matplotlib>=3.7'),
            ('imagecorruptions', 'imagecorruptions-imaug', 'imagecorruptions-imaug==1.1.5')]
WHEEL = ("carry its wheel: here, python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 "
         "--platform manylinux2014_x86_64 -d .whl '{}'; in the call, carry .whl and begin with python3 -m pip install "
         "--no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site")
TINY = ['--model-kw', 'dim=32', 'depth=2', 'patch_size=4', 'kernel_size=3']  # a ConvMixer for the dry run
VIT = ['--model', 'vit_ti16', '--model-kw', 'depth=2', 'dim=64', 'heads=2']
SYNC = 'called a synchronizing CUDA operation'
# A script's command line with CUDA's sync debug mode on: every host sync warns, with the line that caused it.
SYNC_WRAPPER = ("import runpy, sys, warnings, torch; warnings.simplefilter('always'); "
                "torch.cuda.is_available() and torch.cuda.set_sync_debug_mode('warn'); "
                "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
LOCUSLAB = ('locuslab/convmixer-cifar10 README: ~92.5% after 25 epochs, on the original CIFAR-10 release; a JPEG '
            're-encoding runs a little below it (shared/data/README.md). A figure, not a pass/fail')
MEASURE_S = 90  # table1: seconds kept for measuring the last runs after their training (an estimate, see table1_part)


class OutOfTime(Exception):  # a part ran into the end of --budget-s
    pass


class Skip(Exception):  # a part that does not apply here
    pass


def get_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--data', required=True, metavar='DIR', help='CIFAR-10: a folder (train_cifar.py --data) or a '
                   '.tar.gz of one (unpacked into the temporary folder, inside the budget)')
    p.add_argument('--out', required=True, metavar='DIR', help=f'receives {RESULT}, {LOGS} (and table1\'s files)')
    p.add_argument('--parts', nargs='+', default=list(PARTS[:-1]), choices=PARTS, help='which parts, in the order '
                   'above (default: all but table1)')
    p.add_argument('--budget-s', type=float, default=340, help='seconds this command may take in all, from its '
                   'start (default: a 10-minute lease command less a 4-minute start and the transfers)')
    p.add_argument('--dry-run', action='store_true', help='every part at a toy size, on the CPU if there is no GPU')
    args = p.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        raise UserError('no CUDA device: this check is for a GPU (pass --dry-run to exercise it on the CPU)')
    if not (math.isfinite(args.budget_s) and MARGIN_S < args.budget_s <= 86400):  # (W04: 1e12 overflowed a timer)
        raise UserError(f'--budget-s must be more than {MARGIN_S} s (kept back to write the results) and at most '
                        f'86400 (a day), got {args.budget_s:g}')
    # Absolute paths: the scripts run in the repo folder, --data and --out are the caller's (W11, W12).
    args.data, args.out = Path(args.data).resolve(), Path(args.out).resolve()
    if not args.data.exists():
        raise UserError(f'--data {args.data}: no such folder or file')
    if (args.out / RESULT).exists():
        raise UserError(f'--out {args.out} already holds {RESULT}; pick another --out (each call its own) or move it')
    args.per_class = cifar_counts(args) if args.data.is_dir() else None  # (an archive: once unpacked, in main)
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


def missing_packages():
    """(required, optional) modules that are not installed, each with the wheel to carry; nothing is imported."""
    return [[dict(module=m, package=p, fix=WHEEL.format(spec)) for m, p, spec in needs
             if not importlib.util.find_spec(m)] for needs in (NEEDS, OPTIONAL)]


def unpack(args, work):
    """--data as a .tar.gz: unpacked into work -> the folder in it that holds train/ and test/."""
    try:
        with tarfile.open(args.data) as tar:
            tar.extractall(work / 'data', filter='data')
    except (tarfile.TarError, OSError) as e:
        raise UserError(f'--data {args.data}: neither a folder nor a readable .tar.gz ({one_line(e)})')
    found = [p.parent for p in sorted((work / 'data').rglob('train')) if (p.parent / 'test').is_dir()]
    if not found:
        raise UserError(f'--data {args.data}: the archive holds no folder with train/ and test/')
    return found[0]


def cifar_counts(args):
    """(train, test) images of the smallest class of the data, before any part: one line for what cannot be used."""
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


def probe(name):  # a part that runs in one Python process: gpu_probe.py's, in a process of its own
    def part(args, work):
        code, err, _ = script(args, 'gpu_probe.py', [name, '--json', work / f'{name}.json'], work / f'{name}.log')
        check(code, err, f'gpu_probe.py {name}')
        return json.loads((work / f'{name}.json').read_text())
    return part


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
    """name -> (script, argv for a run of s steps, k). Dry: a few (no CUDA: nothing to count; the flags are checked)."""
    n = 10 * min(args.per_class[1], 20)
    cifar = lambda *extra, test=n: ('train_cifar.py', lambda s: [  # noqa: E731
        '--data', args.data, '--train-subset', s * (50 if args.dry_run else 512), '--test-subset', test,
        '--batch-size', 50 if args.dry_run else 512, '--epochs', 1, '--log-every', 0, *(TINY * args.dry_run),
        *extra], 2 if args.dry_run else 10)
    imagenet = lambda *extra: ('train_imagenet.py', lambda s: [  # noqa: E731
        '--data', args.tiny, '--recipe', 'convmixer', '--model', 'convmixer_768_32', '--model-kw', 'dim=32', 'depth=2',
        'patch_size=4', '--img-size', 32, '--batch-size', 20, '--max-micro-batch', 10, '--workers', 2, '--max-steps',
        s, '--log-every', 0, *extra], 4)
    runs = {'cifar_default': cifar(), 'cifar_fp16': cifar('--amp', 'fp16'), 'cifar_sam': cifar('--sam'),
            'cifar_sam_fp16': cifar('--sam', '--amp', 'fp16'),
            'cifar_gsam': cifar('--sam', '--gsam-alpha', 0.4, '--rho-min', 0.02),
            'cifar_looksam': cifar('--sam', '--look-k', 5), 'cifar_msam': cifar('--msam'),
            'cifar_pgd': cifar('--adv', 'pgd', '--adv-steps', 2),
            'cifar_compile': cifar('--compile', test=1030),  # the eval graph of the timed run: 1,024 images a batch
            'imagenet_convmixer_sam': imagenet('--sam'), 'imagenet_decode_gpu': imagenet('--decode', 'gpu'),
            'contrastive_sam': ('train_contrastive.py', lambda s: [
                '--data', args.data, '--train-subset', s * 20, '--test-subset', n, *VIT, '--proj-hidden', 64,
                '--proj-dim', 16, '--batch-size', 20, '--epochs', 1, '--warmup-epochs', 0, '--eval', 'knn',
                '--eval-every', 0, '--eval-batch-size', 1024, '--sam', '--log-every', 0], 4)}
    return {k: v for k, v in runs.items() if not args.dry_run or k in ('cifar_gsam', 'imagenet_decode_gpu',
                                                                         'imagenet_convmixer_sam', 'contrastive_sam')}


def syncs(args, work):
    """Host syncs per step: a run of 2k steps minus one of k (start, evaluation and saving are the same in both).
    The --compile runs go first: they also fill inductor's cache for the compile part's graphs."""
    def count(name, file, make_argv, steps):  # -> the sync warnings' lines, or the run's error (the others go on)
        argv = [*make_argv(steps), '--out', work / f'syncs_{name}_{steps}', '--overwrite']
        try:
            code, err, _ = script(args, file, argv, work / f'syncs_{name}_{steps}.log', SYNC_WRAPPER)
            check(code, err, f'{file} ({name}, {steps} steps)')
        except (OutOfTime, RuntimeError) as e:
            return f'{type(e).__name__}: {one_line(e)}'
        return [re.sub(r':\s*UserWarning.*', '', line).strip() for line in err.splitlines() if SYNC in line]
    runs = sync_runs(args, work)
    jobs = sorted(((name, file, make_argv, s) for name, (file, make_argv, k) in runs.items()
                   for s in ((k,) if args.dry_run else (k, 2 * k))), key=lambda job: 'compile' not in job[0])
    with ThreadPoolExecutor(2 if args.dry_run else SYNC_JOBS) as pool:
        got = dict(zip([job[::3] for job in jobs], pool.map(lambda job: count(*job), jobs)))
    rows = {}
    for name, (_, _, k) in runs.items():
        lines = [got[name, s] for s in ((k,) if args.dry_run else (k, 2 * k))]
        if bad := [c for c in lines if isinstance(c, str)]:
            rows[name] = dict(error=bad[0])
            continue
        rows[name] = dict(per_step=(len(lines[1]) - len(lines[0])) / k if len(lines) == 2 else None,
                          runs=[len(c) for c in lines], steps=[k, 2 * k][:len(lines)],
                          where=dict(Counter(sum(lines, [])).most_common(10)), measured=torch.cuda.is_available())
    bad = {n: r['error'] for n, r in rows.items() if 'error' in r}  # the counts of the others kept
    return dict(rows, **(dict(status='failed', error='; '.join(f'{n}: {e}' for n, e in bad.items())) if bad else {}))


def steady(train_rows):
    """img/s of a run from its per-epoch train rows: epoch 2 on where there is one (epoch 1 holds cuDNN's autotuning,
    compile's graphs, the first allocations), and epoch 1's apart."""
    later = [r['img_per_s'] for r in train_rows if r['epoch'] > 1] or [r['img_per_s'] for r in train_rows]
    return dict(img_per_s=sum(later) / len(later), img_per_s_epoch1=train_rows[0]['img_per_s'])


def cifar_run(args, work, name, extra, log):
    """One train_cifar.py run -> its figures (a run stopped by the budget: the epochs it finished; its own wall)."""
    small = ['--train-subset', 10 * min(args.per_class[0], 50), '--test-subset', 10 * min(args.per_class[1], 20),
             '--epochs', 2, '--batch-size', 50, *TINY] * args.dry_run
    run_dir, t = work / f'cifar_{name}', time.time()
    try:
        code, err, wall = script(args, 'train_cifar.py', ['--data', args.data, '--out', run_dir, '--overwrite',
                                                          '--log-every', 0, *small, *extra], log)
        check(code, err, f'train_cifar.py ({name})')
    except OutOfTime as e:
        stopped, wall = str(e), time.time() - t  # this run's own time, not the part's
    else:
        stopped = None
    history = [json.loads(line) for line in open(run_dir / 'metrics.jsonl')] if (run_dir / 'metrics.jsonl').exists() \
        else []
    evals, train = [r for r in history if r['kind'] == 'eval'], [r for r in history if r['kind'] == 'train']
    if not evals:
        raise OutOfTime(stopped) if stopped else RuntimeError(f'train_cifar.py ({name}) wrote no evaluation')
    run_args = json.load(open(run_dir / 'args.json')) if (run_dir / 'args.json').exists() else {}
    return dict(test_acc=evals[-1]['top1'], wall_s=wall, train_s=evals[-1]['elapsed_s'], epochs=evals[-1]['epoch'],
                **steady(train), channels_last=run_args.get('channels_last'), stopped_by_budget=stopped,
                flags=list(map(str, extra)))


def cifar(args, work):
    """The default run (accuracy, wall, img/s, beside locuslab's figure and the data it ran on), and the other layout
    (channels_last off on CUDA, on elsewhere) for 3 epochs: its img/s beside the default's. A stopped or failed
    layout run keeps the default's figures."""
    jpeg = not (args.data / 'cifar-10-batches-py').is_dir()
    source = dict(data=str(args.data), images=f'{10 * args.per_class[0]} train / {10 * args.per_class[1]} test',
                  format='JPEG re-encoding (image folder)' if jpeg else 'the original release (torchvision)')
    rows = dict(eager=cifar_run(args, work, 'eager', [], work / 'cifar.log'))
    other = '--no-channels-last' if torch.cuda.is_available() else '--channels-last'
    try:
        if rows['eager']['stopped_by_budget'] or args.deadline - time.time() < NEED_S['cifar'][args.dry_run] / 5:
            raise Skip('too little of --budget-s left')
        rows['eager_other_layout'] = cifar_run(args, work, 'layout', [other, *['--epochs', 3] * (not args.dry_run)],
                                               work / 'cifar.log')
    except (Skip, OutOfTime, RuntimeError) as e:
        rows['eager_other_layout'] = dict(skipped=str(e)) if isinstance(e, Skip) else dict(failed=one_line(e))
    return dict(rows, source=source, reference=LOCUSLAB, **stopped(rows['eager'], rows['eager_other_layout']))


def compile_run(args, work):
    if args.dry_run:
        raise Skip('the dry run does not compile (minutes on a CPU); --compile is timed on the GPU only')
    row = cifar_run(args, work, 'compile', ['--compile'], work / 'compile.log')
    return dict(compile=row, reference=LOCUSLAB, **stopped(row))


def stopped(*rows):  # a run the budget ended: its figures so far, and a status that says so
    why = [r.get('stopped_by_budget') or r.get('failed') for r in rows]
    return dict(status='stopped', error='; '.join(w for w in why if w)) if any(why) else {}


def bench(args, work):
    """bench.py's GPU rows; a stopped bench keeps the rows it finished (it rewrites its JSON after each)."""
    argv = (['--quick', '--rows', 'convmixer_256_8', '--batch-size', 2, '--min-run-time', 0.1] if args.dry_run else
            ['--rows', 'vit_b16,mixer_b16,convmixer_768_32,convmixer_256_8,cifar', '--min-run-time', 0.5])
    try:
        code, err, wall = script(args, 'bench.py', [*argv, '--json', work / 'bench_rows.json'], work / 'bench.log')
        check(code, err, 'bench.py')
        end = dict(wall_s=wall)
    except (OutOfTime, RuntimeError) as e:
        if not (work / 'bench_rows.json').exists():
            raise
        end = dict(status='stopped' if isinstance(e, OutOfTime) else 'failed', error=one_line(e))
    return dict(json.loads((work / 'bench_rows.json').read_text()), **end)


def smoke(args, work):
    """Each other script once, briefly, on this device: three at once, then the attack on the folder run's last.pt."""
    runs = {
        'imagenet_synthetic': ('train_imagenet.py', ['--synthetic', *VIT, '--img-size', 32, '--batch-size', 64,
                                                     '--max-steps', 20, '--log-every', 10, '--sam']),
        'imagenet_folder': ('train_imagenet.py', ['--data', args.tiny, *VIT, '--img-size', 32, '--batch-size', 20,
                                                  '--epochs', 1, '--workers', 2, '--log-every', 5]),
        'contrastive_sam': ('train_contrastive.py', ['--data', args.data, '--train-subset', 10 * min(
            args.per_class[0], 25), '--test-subset', 100, *VIT, '--proj-hidden', 128, '--proj-dim', 32,
            '--batch-size', 50, '--epochs', 1, '--warmup-epochs', 0, '--eval-every', 0, '--sam']),
        'robustness_pgd': ('robustness.py', ['--attack', 'pgd', '--steps', 3, '--data', args.tiny / 'val',
                                             '--checkpoint', work / 'smoke_imagenet_folder' / 'last.pt', '--no-plot'])}

    def one(name):
        file, argv = runs[name]
        try:
            code, err, wall = script(args, file, [*argv, '--out', work / f'smoke_{name}', '--overwrite'],
                                     work / f'smoke_{name}.log')
        except OutOfTime as e:
            return dict(ok=False, error=str(e))
        return dict(ok=code == 0, wall_s=wall, error=err.strip().splitlines()[-1] if code and err.strip() else None)
    with ThreadPoolExecutor(3) as pool:
        rows = dict(zip(list(runs)[:3], pool.map(one, list(runs)[:3])))
    rows['robustness_pgd'] = one('robustness_pgd')
    bad = {n: r['error'] for n, r in rows.items() if not r['ok']}  # the others' rows kept
    return dict(rows, **(dict(status='failed', error='; '.join(f'{n}: {e}' for n, e in bad.items())) if bad else {}))


def table1_part(args, work):
    """Table 1 on one GPU in the time left: table1.py --preset gpu, its six train_cifar runs side by side (--jobs 6:
    these small models leave a GPU idle between kernels). First a calibration, the same six runs side by side for one
    epoch of 25,600 images with cheap measurements: each run's img/s as it will run, and table1.py's own overhead. Then
    --epochs-scale is the largest (at most 1: the preset's epochs) that ends the longest run's training MEASURE_S
    before the budget (an estimate of what measuring the last runs takes). table1.md / .json and the figures are
    copied into OUT, with the hardware and the sizing."""
    cmd = ['table1.py'] if (HERE / 'table1.py').exists() else ['geometry.py', 'table1']  # (before table1.py was split)
    n = 10 * min(args.per_class[0], 40) if args.dry_run else 50_000  # the main run's training images (the preset's)
    preset = ['--preset', 'cpu', '--train-subset', n] if args.dry_run else ['--preset', 'gpu']
    quick = ['--hessian-n', 20 if args.dry_run else 250, '--hessian-repeats', 1, '--ntk-n', 4 if args.dry_run else 10]
    cal, main_out, log = work / 'table1_calibration', work / 'table1', work / 'table1.log'
    code, err, cal_s = script(args, cmd[0], [*cmd[1:], *preset, '--data', args.data, '--out', cal, '--jobs', 6,
                                             '--epochs-scale', 1e-3, *['--train-subset', 25_600] * (not args.dry_run),
                                             *quick, '--corruption-n', 0], log)
    check(code, err, f'{" ".join(cmd)} (calibration)')
    families = {f: v[2] for f, v in json.loads((cal / 'table1.json').read_text())['args']['table'].items()}
    cal_n = n if args.dry_run else 25_600
    runs = {}  # run -> its img/s side by side, the seconds of its preset epochs at that pace, its start-up seconds
    for run in sorted(p.name for p in (cal / 'runs').iterdir()):
        rows = [json.loads(line) for line in open(cal / 'runs' / run / 'metrics.jsonl')]
        ips, ev = [r for r in rows if r['kind'] == 'train'][-1]['img_per_s'], [r for r in rows if r['kind'] == 'eval']
        epochs = families[run.rsplit('_', 1)[0]]
        runs[run] = dict(img_per_s=ips, preset_epochs=epochs, preset_s=epochs * n / ips,
                         startup_s=max(0.0, ev[-1]['elapsed_s'] - cal_n / ips), calibration_s=ev[-1]['elapsed_s'])
    fixed = max(0.0, cal_s - max(r['calibration_s'] for r in runs.values()))  # table1's own: data, kappa, measuring
    left = args.deadline - time.time() - fixed - MEASURE_S - max(r['startup_s'] for r in runs.values())
    scale = min(1.0, left / max(r['preset_s'] for r in runs.values()))
    sizing = dict(calibration=runs, calibration_s=cal_s, table1_overhead_s=fixed, measure_s=MEASURE_S,
                  epochs_scale=scale, epochs={r: max(1, round(v['preset_epochs'] * scale)) for r, v in runs.items()})
    if scale < 0.05:
        raise Skip(f'too little of --budget-s left for Table 1: {left:.0f} s of training for runs that need '
                   f'{max(r["preset_s"] for r in runs.values()):.0f} s; {json.dumps(sizing)}')
    corrupt = ['--corruption-n', 20 if args.dry_run else 500] if importlib.util.find_spec('imagecorruptions') else [
        '--corruption-n', 0]  # (without the package: the column left out, the wheel named above)
    try:
        code, err, wall = script(args, cmd[0], [*cmd[1:], *preset, '--data', args.data, '--out', main_out, '--jobs', 6,
                                                '--epochs-scale', f'{scale:.4f}', *(quick if args.dry_run else []),
                                                *corrupt], log)
        check(code, err, ' '.join(cmd))
    except OutOfTime as e:  # what it finished: each measured run's figures
        done = {p.parent.name: json.loads(p.read_text()) for p in (main_out / 'runs').glob('*/geometry.json')}
        return dict(status='stopped', error=str(e), finished_runs=done, sizing=sizing)
    hardware = dict(gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU',
                    torch=torch.__version__, cuda=torch.version.cuda, date=time.strftime('%Y-%m-%d %H:%M UTC',
                                                                                          time.gmtime()))
    table = json.loads((main_out / 'table1.json').read_text())
    save_atomic(args.out / 'table1.json', dict(table, hardware=hardware, sizing=sizing))
    md = (main_out / 'table1.md').read_text()
    save_atomic(args.out / 'table1.md', lambda f: f.write(
        f'{hardware["gpu"]}, torch {hardware["torch"]}, CUDA {hardware["cuda"]}, {hardware["date"]}; '
        f'--epochs-scale {scale:.4f} (gpu_check.py: sized to the budget from a calibration\'s img/s)\n\n{md}'.encode()))
    for png in sorted(main_out.glob('*.png')):
        shutil.copy(png, args.out / png.name)
    return dict(rows=table['rows'], wall_s=wall, hardware=hardware, sizing=sizing,
                files=['table1.json', 'table1.md', *(p.name for p in sorted(main_out.glob('*.png')))])


RUN = dict(versions=probe('versions'), augment=probe('augment'), memory=probe('memory'), syncs=syncs, cifar=cifar,
           bench=bench, smoke=smoke, compile=compile_run, table1=table1_part)


# ----- The budget, the one JSON, the one archive.
def write(out, result, work):
    """gpu_check.json and the log archive, each written to .tmp and renamed."""
    save_atomic(out / RESULT, result)

    def tar(f):
        with tarfile.open(fileobj=f, mode='w:gz') as t:
            for p in sorted(work.glob('*.log')):
                data = p.read_bytes()
                info = tarfile.TarInfo(p.name)
                info.size, info.mtime = len(data), time.time()
                t.addfile(info, io.BytesIO(data))
    save_atomic(out / LOGS, tar)


def log_tail(work, part, n=15):
    lines = [line for p in sorted(work.glob(f'{part}*.log')) for line in p.read_text(errors='replace').splitlines()]
    return lines[-n:]


def run_part(args, part, work):
    """One part within the budget -> its record: figures, or the error and its log's last lines, or why skipped."""
    need, left, start = NEED_S[part][args.dry_run], args.deadline - time.time(), time.time()
    if need > left:  # (floor: "needs ~40 s, 40 s left" read as enough, W10)
        return dict(status='skipped', reason=f'needs ~{need} s, {math.floor(max(left, 0))} s left of --budget-s '
                                             f'{args.budget_s:g}; run it in another call (--parts {part})')
    try:
        record = {'status': 'ok', **RUN[part](args, work)}
    except Skip as e:
        record = dict(status='skipped', reason=str(e))
    except Exception as e:  # a failed part is a result: the others still run (one GPU call gets them all)
        record = dict(status='stopped' if isinstance(e, OutOfTime) else 'failed', error=f'{type(e).__name__}: '
                      f'{one_line(e)}', log_tail=log_tail(work, part) or [f'{type(e).__name__}: {one_line(e)}'])
    return dict(record, seconds=round(time.time() - start, 1),
                finished=time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime()))


def main(argv=None):
    t0 = process_start() if argv is None else time.time()
    args = get_args(argv)
    args.deadline = t0 + args.budget_s - MARGIN_S
    prepare_out(argparse.Namespace(out=args.out, overwrite=False, resume=None))  # OUT/.lock: one call into OUT
    parts, (need, optional) = [p for p in PARTS if p in args.parts], missing_packages()
    call = dict(argv=sys.argv[1:] if argv is None else list(map(str, argv)), budget_s=args.budget_s, parts=parts,
                started=time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime()), dry_run=args.dry_run,
                torch=torch.__version__, cuda=torch.version.cuda,
                gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    result = dict(calls=[call], imports=dict(missing=need, optional_missing=optional),
                  parts={p: dict(status='not run', reason='not in --parts') for p in PARTS})
    work, lock = Path(tempfile.mkdtemp(prefix='gpu_check_')), threading.Lock()  # run folders: not under --out

    def done(part, record):  # (from the threads of the parts run together)
        with lock:
            result['parts'][part] = record
            call['wall_s'] = round(time.time() - t0, 1)
            write(args.out, result, work)
            why = record.get('error') or record.get('reason') or ''
            print(f'{part:9s} {record["status"]:7s} {record.get("seconds", 0):6.1f} s  {why}', flush=True)
    try:
        write(args.out, result, work)
        if need:
            raise UserError(f'{", ".join(m["package"] for m in need)} not installed, no part run; '
                            f'{need[0]["fix"]} (each named in {args.out / RESULT})')
        for m in optional:
            print(f'(no {m["package"]}: {"bench without timm" if m["module"] == "timm" else "table1 without it"}; '
                  f'to have it, {m["fix"]})', flush=True)
        if not args.data.is_dir():
            args.data = unpack(args, work)  # (inside the budget)
            args.per_class = cifar_counts(args)
        args.tiny = tiny_imagenet(args, work) if {'syncs', 'smoke'} & set(parts) else None
        together = [p for p in parts if p in TOGETHER]
        with ThreadPoolExecutor(max(1, len(together))) as pool:
            list(pool.map(lambda p: done(p, run_part(args, p, work)), together))
        for part in (p for p in parts if p not in TOGETHER):
            done(part, run_part(args, part, work))
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
        discard_new_dirs()
        sys.exit(f'gpu_check.py: error: {e}')
