"""The paper's Table 1 in miniature (Chen, Hsieh & Gong, ICLR 2022, Table 1: ResNet-152, ViT-B/16 and Mixer-B/16,
each with and without SAM, on ImageNet) on CIFAR-10: three small families, each trained with AdamW and with SAM by
train_cifar.py, measured by geometry.py (NTK kappa at initialisation, Hessian lambda_max and tr H, active neurons;
the ViTs' loss landscape and attention distance) and robustness.py (CIFAR-10-C), each through its command line and
its JSON; the training error and test accuracy are evaluated here. Then table1.md, table1.json and two figures.
A rerun reuses every finished run and every measurement made with the same flags."""
import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

import figures
from data import MEAN, STD, evaluate, load_cifar
from flags import check_ranges
from models import build_model, load_weights, parse_model_kw
from runs import discard_new_dirs, prepare_out, read_checkpoint, read_json, save_atomic
from utils import UserError, fmt_time, setup

# The CPU preset: three families of 0.27-0.33M parameters, 10,000 CIFAR-10 images, crop + flip (--aug basic, the
# paper's), AdamW and SAM on the same epochs, <= 45 min on 2 CPU cores (38 measured). Deviation: no model reaches a
# low training error there. ViT/Mixer: 16 tokens of 8 px (4 px cost ~3x per image, fitted no faster in a pilot);
# resnet20 with a stride-2 stem (4x cheaper, as ResNet-152's stem downsamples 4x: 15 epochs where the original would
# get 4). rho: not tuned.
TABLE1 = {  # family: (model, model_kw, epochs, peak lr, rho)
    'resnet20': ('resnet20', ['stem_stride=2'], 15, 4e-3, 0.05),
    'vit': ('vit_s4_cifar', ['patch_size=8', 'dim=80', 'depth=4', 'heads=4'], 22, 2e-3, 0.1),
    'mixer': ('mixer_s4_cifar', ['patch_size=8', 'dim=96', 'depth=4', 'tokens_mlp_dim=48', 'channels_mlp_dim=384'],
              22, 2e-3, 0.1),
}
# --preset gpu: 50,000 images, models that can fit them (resnet20 as He et al.; ViT, Mixer on 64 tokens of 4 px), batch
# 512, long enough (estimated) for a train error <= LOW_ERROR % (eval mode, no augmentation); table1.md says.
TABLE1_GPU = {'resnet20': ('resnet20', [], 60, 8e-3, 0.05), 'vit': ('vit_s4_cifar', ['dim=128', 'depth=6', 'heads=4'],
                                                                    80, 2e-3, 0.1),
              'mixer': ('mixer_s4_cifar', ['dim=128', 'depth=6', 'tokens_mlp_dim=64', 'channels_mlp_dim=512'], 80,
                        2e-3, 0.1)}
PRESETS = dict(cpu=dict(table=TABLE1, train_subset=10_000, batch_size=128),
               gpu=dict(table=TABLE1_GPU, train_subset=50_000, batch_size=512))
LOW_ERROR = 5.0
# lambda_max: Lanczos to PyHessian's tol (<= 20 HVPs); tr H: 10 Hutchinson probes per repeat (the std over the
# repeats, not these probes' s.e., is the error bar); batches of 250 images
HESSIAN = dict(iters=20, tol=1e-3, trace=10, hvp='reverse', batch_size=250)
# fp32 training (TF32 matmuls on a GPU, as train_cifar sets them), never bf16: the table is fp32
TRAIN_FLAGS = dict(aug='basic', wd=0.05, seed=0, test_subset=1000, log_every=0, amp='off')
HERE = os.path.dirname(os.path.abspath(__file__))
PRECISION, EVAL_NOTE = 'fp32, TF32 off', 'eval mode: BatchNorm uses its running statistics; no dropout, drop-path'


def get_args(argv=None):
    p = argparse.ArgumentParser(prog='table1.py', description=__doc__.split('\n\n')[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument('--data', required=True, metavar='DIR', help='the CIFAR-10 copy (train_cifar.py --data)')
    p.add_argument('--out', required=True, metavar='DIR', help='runs/<run>/, init/, table1.md, table1.json, figures')
    p.add_argument('--preset', default='cpu', choices=sorted(PRESETS), help='cpu: the miniature; gpu: all 50,000 '
                   'images, larger models, to a low training error (docs/table1.md)')
    p.add_argument('--train-subset', type=int, default=0, help='class-balanced training images; 0 = the preset\'s')
    p.add_argument('--epochs-scale', type=float, default=1.0, help="every run's epochs times this (at least 1)")
    p.add_argument('--hessian-n', type=int, default=2000, help='training images for lambda_max (and active neurons)')
    p.add_argument('--ntk-n', type=int, default=50, help='training images for kappa')
    p.add_argument('--hessian-repeats', type=int, default=4, help='lambda_max and tr H on this many disjoint parts '
                   'of the --hessian-n images (batches of 250), as mean +- std')
    p.add_argument('--corruption-n', type=int, default=500, help='test images for robustness.py --benchmark corrupt '
                   '(19 corruptions x 5 severities); 0 = leave the column out')
    p.add_argument('--jobs', type=int, default=2, help='training runs at a time, one thread each')
    args = p.parse_args(argv)
    check_ranges(args, ['hessian_n', 'ntk_n', 'hessian_repeats', 'epochs_scale', 'jobs'],
                 ['train_subset', 'corruption_n'], dict(corruption_n=10_000))
    if os.path.isfile(args.out):
        raise UserError(f'--out {args.out} is a file; pass a folder')
    return args


def script(name, argv, log_path):
    """`python NAME ARGV` as a user runs it (one OpenMP thread), output appended to log_path; failure: UserError."""
    cmd = [sys.executable, os.path.join(HERE, name), *map(str, argv)]
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, 'a') as log:
        log.write(f'$ {" ".join(cmd[1:])}\n')
        log.flush()
        r = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    if r.returncode:
        raise UserError(f'{name} failed (exit {r.returncode}); see {log_path}')


def command_line(want):  # the command line for the flags in `want` (as args.json / a JSON's flags write them)
    flag = lambda k: '--' + k.replace('_', '-')  # noqa: E731  (a bool by its type: 0 == False, yet --seed 0 is a value)
    return [a for k, v in want.items() for a in ([flag(k)] * v if isinstance(v, bool) else [] if v == [] else
                                                [flag(k), *v] if isinstance(v, list) else [flag(k), v])]


def finished(args, run, want):
    """Whether OUT/runs/RUN holds this run, finished; a folder of another run (or a damaged one) is refused."""
    folder = os.path.join(args.out, 'runs', run)
    if not os.path.exists(os.path.join(folder, 'args.json')):
        return False
    have = read_json(os.path.join(folder, 'args.json'), 'move the run away')
    # log_every changes the console only (runs of table1 before issue 34 stored train_cifar's default, 50)
    if differ := [k for k, v in want.items() if k != 'log_every' and have.get(k) != v]:
        raise UserError(f'{folder} holds another run ({", ".join(differ)} differ); move it away or pick another --out')
    return read_checkpoint(os.path.join(folder, 'last.pt'), 'table1 run').get('epoch', 0) >= want['epochs']


def train_run(args, run, want):
    """train_cifar.py into OUT/runs/RUN (log OUT/logs/RUN.log); a finished run reused, another run's refused."""
    folder = os.path.join(args.out, 'runs', run)
    last, log = os.path.join(folder, 'last.pt'), os.path.join(args.out, 'logs', f'{run}.log')
    if finished(args, run, want):
        return print(f'  {run}: finished run in {folder}, reused', flush=True)
    argv = ['--data', args.data, *command_line(want), *(['--resume', last] if os.path.exists(last) else
                                                         ['--out', folder])]
    print(f'  {run}: train_cifar.py {" ".join(map(str, argv))}', flush=True)
    script('train_cifar.py', argv, log)
    with open(log) as f:
        print(f'  {run}: {[line for line in f if line.startswith("done")][-1].strip()}', flush=True)


def geometry(args, command, want, out, log, **paths):
    """`geometry.py COMMAND` with the flags in `want` (and the paths, e.g. checkpoint=) into OUT; -> its JSON. A JSON
    there measured with the same flags is reused (paths aside: a moved --data or --out measures the same)."""
    path = os.path.join(out, f'{command}.json')
    have = read_json(path, 'delete it (it is measured again)') if os.path.exists(path) else {}
    if any(have.get('flags', {}).get(k) != v for k, v in want.items()) or not have:
        script('geometry.py', [command, '--data', args.data, *command_line({**want, **paths}), '--out', out,
                               '--overwrite'], log)
        have = read_json(path, 'delete it (it is measured again)')
    return have


LOCK = threading.Lock()  # one robustness.py at a time: its corruption cache is shared by the runs


def measure_run(args, run, family, d):
    """train_run, then geometry.py's measurements into OUT/runs/RUN/geometry, this script's evaluation and
    robustness.py's into OUT/runs/RUN/scores.json; a rerun adds only what is missing. -> the run's row."""
    train_run(args, run, d['runs'][run])
    folder, log = os.path.join(args.out, 'runs', run), os.path.join(args.out, 'logs', f'{run}.log')
    last, geo = os.path.join(folder, 'last.pt'), os.path.join(folder, 'geometry')
    # lambda_max and tr H on --hessian-repeats disjoint class-balanced parts; active neurons on the same images
    h = geometry(args, 'hessian', dict(images=args.hessian_n, repeats=args.hessian_repeats, seed=0, **HESSIAN), geo,
                 log, checkpoint=last)
    many = args.hessian_repeats > 1
    m = dict(lambda_max=h['lambda_max_mean' if many else 'lambda_max'], lambda_max_std=h.get('lambda_max_std'),
             trace=h['trace_mean' if many else 'trace'], trace_std=h.get('trace_std'), hessian_repeats=h.get('repeats'),
             repeats_note=h.get('repeats_note'))  # (parts not class-balanced: --hessian-n / 10 not a multiple of R)
    m['active'] = geometry(args, 'neurons', dict(images=args.hessian_n, batch_size=250), geo, log,
                           checkpoint=last)['active']
    if family == 'vit':  # the same directions seed for both ViTs
        land = geometry(args, 'landscape', dict(images=500, dims=2, steps=11, span=1.0, seed=0, batch_size=250), geo,
                        log, checkpoint=last)
        m.update(landscape=dict(coords=land['coords'], loss=land['loss']), attention_distance_px=geometry(
            args, 'attention', dict(split='test', images=128, maps=8), geo, log, checkpoint=last)['distance_px'])
    path = os.path.join(folder, 'scores.json')
    scores = read_json(path, 'delete it (it is measured again)') if os.path.exists(path) else {}
    if 'test_acc' not in scores:  # eval mode, no augmentation; the whole training subset and test set
        model = build_model(args.table[family][0], 10, 32, parse_model_kw(args.table[family][1]), cifar=True)
        load_weights(model, last)
        model.to(d['device']).eval()
        scores['train_error'] = 100 - evaluate(model, d['train_u8'], d['train_y'], *d['stats'], 500)['top1']
        scores['test_acc'] = evaluate(model, d['test_u8'], d['test_y'], *d['stats'], 500)['top1']
    if args.corruption_n and scores.get('corruption_n') != args.corruption_n:  # robustness.py on the same test images
        rob = os.path.join(folder, 'robustness')
        with LOCK:
            script('robustness.py', ['--benchmark', 'corrupt', '--data', args.data, '--subset', args.corruption_n,
                                     '--checkpoint', last, '--seed', 0, '--workers', 0, '--eval-batch-size', 500,
                                     '--no-plot', '--overwrite', '--out', rob,
                                     '--cache', os.path.join(args.out, f'cifar10c-{args.corruption_n}')], log)
        with open(os.path.join(rob, 'results.json')) as f:
            r = json.load(f)
        scores.update(corruption_n=args.corruption_n, corruption_acc=r['mean_acc'], corruption_gap=r['gap'],
                      corruption_note=r['note'])  # gap: clean accuracy on the same images minus corruption_acc
    save_atomic(path, scores)
    print(f"  {run}: lambda_max {m['lambda_max']:.4g} | train error {scores['train_error']:.2f}% | test acc "
          f"{scores['test_acc']:.2f}%", flush=True)
    return {**m, **scores}


def ntk_at_init(args, family):
    """NTK kappa (trace and sum) at the runs' initial weights (train_cifar seeds with --seed 0, then builds), by
    geometry.py ntk: the official zero head drawn like the other dense layers, BatchNorm statistics of the images."""
    name, kw, *_ = args.table[family]
    out, log = {}, os.path.join(args.out, 'logs', 'init.log')
    for red in ('trace', 'sum'):
        j = geometry(args, 'ntk', dict(model=name, model_kw=kw, dataset='cifar10', seed=0, images=args.ntk_n,
                                       reduce=red), os.path.join(args.out, 'init', f'{family}_{red}'), log)
        out.update({f'kappa_{red}': j['kappa'], 'params': j['params'], 'head_drawn': j['head_drawn'],
                    'bn_calibrated': j['bn_calibrated']})
        print(f"  {family} at init: kappa ({red}) {j['kappa']:.4g}", flush=True)
    return out


def main(argv=None):
    args = get_args(argv)
    t0, preset, proc = time.time(), PRESETS[args.preset], setup('off')  # the device; never autocast
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # (the evaluation, as measured)
    if proc.ddp:
        raise UserError('table1.py runs in one process (python table1.py ...): it launches its own')
    if os.path.exists(os.path.join(args.out, 'table1.json')):
        raise UserError(f'--out {args.out} already holds table1.json; move it away (OUT/runs/* are reused)')
    args.table, args.train_subset = preset['table'], args.train_subset or preset['train_subset']
    if max(args.hessian_n, args.ntk_n) > args.train_subset:
        raise UserError('--hessian-n and --ntk-n are images of the --train-subset: pick them <= it')
    if args.hessian_repeats > args.hessian_n:
        raise UserError(f'--hessian-repeats {args.hessian_repeats} > --hessian-n {args.hessian_n}: an image per part')
    runs = {f'{f}_{opt}': dict(model=m, model_kw=kw, epochs=max(1, round(ep * args.epochs_scale)), lr=lr,
                               train_subset=args.train_subset, batch_size=preset['batch_size'], **TRAIN_FLAGS,
                               sam=opt == 'sam', **(dict(rho=rho) if opt == 'sam' else {}))
            for opt in ('sam', 'adamw') for f, (m, kw, ep, lr, rho) in args.table.items()}  # longer SAM runs first
    for run, want in runs.items():  # every run folder checked now, not after hours of the others' training
        finished(args, run, want)
    dev, (train_u8, train_y), (test_u8, test_y) = proc.device, *(load_cifar(args.data, 'cifar10', t, k)
                                                                   for t, k in ((True, args.train_subset), (False, 0)))
    if (test_y.bincount(minlength=10) < (need := max(TRAIN_FLAGS['test_subset'], args.corruption_n) // 10)).any():
        raise UserError(f'{args.data}: table1 tests on {need} images of each class; some class has fewer')
    steps, few = args.train_subset // preset['batch_size'], min(max(1, round(ep * args.epochs_scale))
                                                                 for _, _, ep, *_ in preset['table'].values())
    if steps * few < 2:  # train_cifar drops the last partial batch; one step of a one-cycle schedule is no training
        raise UserError(f'--train-subset {args.train_subset} and --epochs-scale {args.epochs_scale:g} give a run '
                        f'{few} epoch(s) of {steps} step(s) of the preset\'s batch {preset["batch_size"]}: raise them '
                        f'to 2 steps at least (--train-subset {math.ceil(2 / few) * preset["batch_size"]})')
    prepare_out(argparse.Namespace(out=args.out, overwrite=True, resume=None))  # writable, and locked: one table1
    print(f'table1.py --preset {args.preset} | {len(runs)} runs on {args.train_subset:,} CIFAR-10 training images, '
          f'trained in fp32 | measured by geometry.py, evaluated on {dev}, {PRECISION} | {EVAL_NOTE}')
    d = dict(runs=runs, train_u8=train_u8.to(dev), train_y=train_y.to(dev), test_u8=test_u8.to(dev),
             test_y=test_y.to(dev), device=dev,
             stats=[torch.tensor(v, device=dev).view(1, 3, 1, 1) for v in (MEAN['cifar10'], STD['cifar10'])])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # each worker thread evaluates on one core, beside its neighbour's training
    with ThreadPoolExecutor(args.jobs) as pool:  # 1. kappa at init; 2. train and measure, --jobs runs at a time
        init = dict(zip(args.table, pool.map(lambda f: ntk_at_init(args, f), args.table)))
        measured = dict(zip(runs, pool.map(lambda r: measure_run(args, r, r.rsplit('_', 1)[0], d), runs)))
    torch.set_num_threads(threads)  # (an importer's setting: main may be called in-process)
    rows = []
    for f, run in ((f, f'{f}_{opt}') for f in args.table for opt in ('adamw', 'sam')):
        m = measured[run]
        sites = [k for k in m['active'] if not k.endswith('mlp_tokens')]  # Mixer: its channel MLPs
        rows.append(dict(run=run, family=f, sam=run.endswith('sam'), **init[f], **m, active_first=m['active'][sites[0]],
                         active_last=m['active'][sites[-1]]))
    write_table(args, rows, time.time() - t0)


def write_table(args, rows, wall):
    """The figures (ViT with and without SAM), table1.json and table1.md."""
    vits = [(t, next(r for r in rows if r['run'] == run)) for t, run in (('ViT', 'vit_adamw'), ('ViT+SAM', 'vit_sam'))]
    figures.save_figure(figures.surfaces([(t, *(torch.tensor(r['landscape'][k]) for k in ('coords', 'loss')))
                                          for t, r in vits]), os.path.join(args.out, 'landscape_vit.png'))
    figures.save_figure(figures.attention_distances([(t, torch.tensor(r['attention_distance_px'])) for t, r in vits],
                                                    32), os.path.join(args.out, 'attention_distance_vit.png'))
    corrupt, nan = any('corruption_acc' in r for r in rows), lambda v: math.nan if v is None else v  # noqa: E731
    lines = ['| model | params | NTK kappa (trace) | NTK kappa (sum) | Hessian lambda_max | tr H | train error % | '
             'test acc % | active first % | active last %' + ' | corrupted acc % | gap (pts)' * corrupt + ' |',
             '|---' * (10 + 2 * corrupt) + '|'] + [
        f"| {r['family']}{' + SAM' * r['sam']} | {r['params']:,} | {r['kappa_trace']:.4g} | {r['kappa_sum']:.4g} | "
        f"{r['lambda_max']:.4g} +- {nan(r['lambda_max_std']):.2g} | {r['trace']:.4g} +- {nan(r['trace_std']):.2g} | "
        f"{r['train_error']:.2f} | {r['test_acc']:.2f} | {100 * r['active_first']:.1f} | "
        f"{100 * r['active_last']:.1f} |" + (f" {r.get('corruption_acc', math.nan):.2f} | "
                                              f"{r.get('corruption_gap', math.nan):.1f} |") * corrupt for r in rows]
    lines.append(f'\nlambda_max, tr H: mean +- std over {args.hessian_repeats} disjoint parts of the {args.hessian_n} '
                 f'images (geometry.py hessian: Lanczos; Hutchinson, {HESSIAN["trace"]} probes each)'
                 + f"; parts {rows[0]['repeats_note']}" * bool(rows[0]['repeats_note']))
    high = [f"{r['run']} {r['train_error']:.1f}%" for r in rows if r['train_error'] > LOW_ERROR]
    md = '\n'.join(lines) + (f'\n\ntraining error above {LOW_ERROR:g}%: ' + ', '.join(high) if high else '') + \
        f'\n\nwall {fmt_time(wall)} | --preset {args.preset} | trained in fp32 | measured {PRECISION}\n'
    save_atomic(os.path.join(args.out, 'table1.json'), dict(rows=rows, wall_s=wall, args=vars(args),
                                                            train_flags=TRAIN_FLAGS, hessian=HESSIAN))
    save_atomic(os.path.join(args.out, 'table1.md'), lambda f: f.write(md.encode()))
    print(md + f'done | table1 | {fmt_time(wall)} wall | {os.path.join(args.out, "table1.md")}')


if __name__ == '__main__':
    try:
        main()
    except UserError as e:
        sys.exit(discard_new_dirs() or f'table1.py: error: {e}')
    except KeyboardInterrupt:  # every finished run and measurement is kept: the same command goes on from them
        sys.exit(print('table1.py: interrupted; finished runs and measurements are kept (rerun to go on)',
                       file=sys.stderr) or 130)
