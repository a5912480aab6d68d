"""table1.py, the paper's Table 1 in miniature: its presets end to end at a tiny size, its command lines against the
parsers of the scripts it runs (train_cifar.py, geometry.py), reuse of finished runs and measurements, and its bad
inputs (one line, before anything is trained). The measurements themselves are geometry.py's (tests/test_geometry.py,
tests/test_hessian.py)."""
import argparse
import contextlib
import importlib
import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import models
import table1 as T
from conftest import REPO
from test_geometry import hold_lock

pytestmark = pytest.mark.usefixtures('one_thread')  # tests/conftest.py

TINY = {'resnet20': ('resnet20', ['stem_stride=2'], 60, 8e-3, 0.05),
        'vit': ('vit_s4_cifar', ['patch_size=8', 'dim=16', 'depth=1', 'heads=2'], 80, 2e-3, 0.1),
        'mixer': ('mixer_s4_cifar', ['patch_size=8', 'dim=16', 'depth=1', 'tokens_mlp_dim=8', 'channels_mlp_dim=32'],
                  80, 2e-3, 0.1)}


def in_process(name, argv, log_path):
    """table1.script without a new Python (the start-up of ~30 interpreters is most of this test's time otherwise):
    the script's main(argv) on this thread, its output appended to the log as script() does; a refusal a UserError.
    What a subprocess adds (its OMP thread count, the exit code read) is tested on its own below."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, 'a') as log, contextlib.redirect_stdout(log):
        importlib.import_module(name[:-3]).main([str(a) for a in argv])


def test_gpu_preset_end_to_end_at_a_tiny_size(cifar10_dir, tmp_path, monkeypatch):
    """`table1.py --preset gpu` with its flags scaled down (--train-subset, --epochs-scale, --hessian-n, --ntk-n) and
    its families shrunk to a few thousand parameters, on the CPU: every run trains in fp32 (--amp off) at the
    preset's batch, is measured by geometry.py's command lines (their JSONs the table's figures), and table1.md names
    the runs above the training-error threshold; a rerun of the same command trains and measures nothing again."""
    monkeypatch.setitem(T.PRESETS['gpu'], 'table', TINY)
    monkeypatch.setattr(T, 'script', in_process)
    argv = ['--preset', 'gpu', '--data', str(cifar10_dir), '--out', str(tmp_path), '--train-subset', '1024',
            '--epochs-scale', '0.01', '--hessian-n', '20', '--ntk-n', '10', '--corruption-n', '0', '--jobs', '1']
    T.main(argv)
    table = json.loads((tmp_path / 'table1.json').read_text())
    assert [r['run'] for r in table['rows']] == ['resnet20_adamw', 'resnet20_sam', 'vit_adamw', 'vit_sam',
                                                 'mixer_adamw', 'mixer_sam']
    for r in table['rows']:
        ran = json.loads((tmp_path / 'runs' / r['run'] / 'args.json').read_text())
        assert (ran['amp'], ran['batch_size'], ran['train_subset'], ran['epochs']) == ('off', 512, 1024, 1)
        assert math.isfinite(r['lambda_max']) and r['train_error'] > T.LOW_ERROR
        hessian = json.loads((tmp_path / 'runs' / r['run'] / 'geometry' / 'hessian.json').read_text())
        assert r['lambda_max'] == hessian['lambda_max_mean'] and len(hessian['repeats']) == 4
        assert (hessian['n'], hessian['iters'], hessian['flags']['trace']) == (20, 20, 10)
    init = json.loads((tmp_path / 'init' / 'vit_sum' / 'ntk.json').read_text())
    assert table['rows'][2]['kappa_sum'] == init['kappa'] and init['n'] == 10 and init['head_drawn']
    md = (tmp_path / 'table1.md').read_text()
    assert 'training error above 5%: resnet20_adamw' in md and 'parts not class-balanced: 10 classes' in md  # 2 a class
    # K12: the table moved away as the refusal says, the same command reuses every finished run and measurement
    os.rename(tmp_path / 'table1.json', tmp_path / 'old.json')
    monkeypatch.setattr(T, 'script', lambda *a: pytest.fail(f'ran again: {a}'))
    T.main(argv)
    assert json.loads((tmp_path / 'table1.json').read_text())['rows'] == table['rows']


def test_gpu_preset_models_build():
    with torch.device('meta'):
        sizes = {f: sum(p.numel() for p in models.build_model(m, 10, 32, models.parse_model_kw(kw), cifar=True)
                        .parameters()) for f, (m, kw, *_) in T.TABLE1_GPU.items()}
    assert all(2e5 < s < 2e6 for s in sizes.values()), sizes


@pytest.mark.parametrize('preset', sorted(T.PRESETS))
def test_command_lines_carry_every_flag_it_compares(preset, tmp_path):
    """C02, K12, K14: train_flags dropped flags of value 0 (0 == False: --log-every 0, --seed 0), so every run's
    args.json differed from what table1 compares and no finished run was ever reused. The oracle is each script's
    own parser: the command line table1 launches gives every value table1 later compares (train_cifar.py's args.json,
    geometry.py's `flags` in its JSON)."""
    import geometry
    import train_cifar
    table, n = T.PRESETS[preset]['table'], T.PRESETS[preset]['train_subset']
    for f, (m, kw, ep, lr, rho) in table.items():
        for sam in (False, True):
            want = dict(model=m, model_kw=kw, epochs=ep, lr=lr, train_subset=n,
                        batch_size=T.PRESETS[preset]['batch_size'], **T.TRAIN_FLAGS, sam=sam,
                        **(dict(rho=rho) if sam else {}))
            got = vars(train_cifar.get_args(['--data', 'd', *map(str, T.command_line(want)), '--out', 'x']))
            assert {k: got[k] for k in want} == want
        want = dict(model=m, model_kw=kw, dataset='cifar10', seed=0, images=50, reduce='sum')
        got = geometry.get_args(['ntk', '--data', 'd', *map(str, T.command_line(want)), '--out', 'x']).flags
        assert {k: got[k] for k in want} == want
    want = dict(images=2000, repeats=4, seed=0, **T.HESSIAN)
    got = geometry.get_args(['hessian', '--data', 'd', *map(str, T.command_line(want)), '--out', 'x']).flags
    assert {k: got[k] for k in want} == want


def finished_run(folder, want, epochs):  # what train_cifar leaves: last.pt, then args.json
    folder.mkdir(parents=True)
    torch.save({'epoch': epochs, 'args': want}, folder / 'last.pt')
    (folder / 'args.json').write_text(json.dumps(want))


def test_reuses_finished_runs_and_names_damaged_or_other_ones(tmp_path, monkeypatch):
    """K12/K14: a finished run (also one of an older table1 that stored train_cifar's log_every 50) is reused, no
    training started; C01: another run names only the flags that differ; K15: a damaged args.json is one line."""
    started = []
    monkeypatch.setattr(T, 'script', lambda *a: started.append(a))
    want = dict(model='resnet20', epochs=2, lr=1e-3, train_subset=200, **T.TRAIN_FLAGS)
    args = argparse.Namespace(out=str(tmp_path), data='d')
    finished_run(tmp_path / 'runs' / 'old', {**want, 'log_every': 50}, 2)
    T.train_run(args, 'old', want)
    assert not started
    finished_run(tmp_path / 'runs' / 'other', {**want, 'train_subset': 140}, 2)
    with pytest.raises(T.UserError, match=r'runs/other holds another run \(train_subset differ\)'):
        T.train_run(args, 'other', want)
    finished_run(tmp_path / 'runs' / 'cut', want, 2)
    text = (tmp_path / 'runs' / 'cut' / 'args.json').read_text()
    (tmp_path / 'runs' / 'cut' / 'args.json').write_text(text[:len(text) // 2])
    with pytest.raises(T.UserError, match=r'runs/cut/args.json cannot be read \(.*\); move the run away'):
        T.train_run(args, 'cut', want)
    assert (tmp_path / 'runs' / 'cut' / 'args.json').read_text() == text[:len(text) // 2] and not started


def test_a_measurement_is_reused_only_with_the_same_flags(tmp_path, monkeypatch):
    """A geometry JSON measured with other flags (another --hessian-n, say) is measured again (--overwrite), one with
    the same flags is reused whatever the paths; its paths are passed, not compared."""
    ran = []
    monkeypatch.setattr(T, 'script', lambda name, argv, log: ran.append(argv))
    args, out = argparse.Namespace(data='d'), tmp_path / 'geo'
    out.mkdir()
    (out / 'neurons.json').write_text(json.dumps(dict(active={'a': 0.5}, flags=dict(images=20, batch_size=250,
                                                                                     data='elsewhere'))))
    assert T.geometry(args, 'neurons', dict(images=20, batch_size=250), str(out), 'log', checkpoint='c.pt') == \
        json.loads((out / 'neurons.json').read_text()) and not ran
    T.geometry(args, 'neurons', dict(images=40, batch_size=250), str(out), 'log', checkpoint='c.pt')
    assert ran == [['neurons', '--data', 'd', '--images', 40, '--batch-size', 250, '--checkpoint', 'c.pt', '--out',
                    str(out), '--overwrite']]


@pytest.mark.parametrize('subset, scale, words', [
    (100, 0.01, '--train-subset 100 and --epochs-scale 0.01 give a run 1 epoch(s) of 0 step(s) of the preset\'s '
                'batch 128: raise them to 2 steps at least (--train-subset 256)'),  # R30
    (130, 0.01, '1 epoch(s) of 1 step(s)'),  # R30b: one step of a one-cycle schedule
    (100, 1.0, '15 epoch(s) of 0 step(s)'),  # fewer images than the batch: no step at all
])
def test_refuses_a_budget_of_less_than_two_steps_before_measuring(subset, scale, words, tmp_path, monkeypatch):
    monkeypatch.setattr(T, 'script', lambda *a: pytest.fail('ran before refusing'))
    monkeypatch.setattr(T, 'load_cifar', lambda root, dataset, train, n: (  # n train / 1,000 test images, 10 classes
        torch.zeros(n or 1000, 3, 32, 32, dtype=torch.uint8), torch.arange(n or 1000) % 10))
    with pytest.raises(T.UserError, match=re.escape(words)):
        T.main(['--data', str(tmp_path), '--out', str(tmp_path / 'o'), '--train-subset', str(subset),
                '--epochs-scale', str(scale), '--hessian-n', '20', '--ntk-n', '10', '--corruption-n', '0'])
    assert not (tmp_path / 'o').exists()


def test_bad_inputs_are_one_line_before_anything_runs(cifar10_dir, tmp_path, monkeypatch):
    """A table already there is never replaced; too few test images; under torchrun; each one UserError, nothing
    started, nothing written."""
    monkeypatch.setattr(T, 'script', lambda *a: pytest.fail('ran before refusing'))
    (tmp_path / 'done').mkdir()
    (tmp_path / 'done' / 'table1.json').write_text('{}')
    with pytest.raises(T.UserError, match='already holds table1.json'):
        T.main(['--data', str(tmp_path), '--out', str(tmp_path / 'done')])
    assert (tmp_path / 'done' / 'table1.json').read_text() == '{}'
    few = tmp_path / 'few'  # 10 training and 20 test images a class
    for split, n in (('train', 10), ('test', 20)):
        for c in sorted(os.listdir(cifar10_dir / split)):
            (few / split / c).mkdir(parents=True)
            for f in sorted(os.listdir(cifar10_dir / split / c))[:n]:
                shutil.copy(cifar10_dir / split / c / f, few / split / c / f)
    with pytest.raises(T.UserError, match='table1 tests on 100 images of each class; some class has fewer'):
        T.main(['--data', str(few), '--train-subset', '100', '--hessian-n', '10', '--ntk-n', '10', '--corruption-n',
                '0', '--out', str(tmp_path / 'out')])
    assert not (tmp_path / 'out').exists()
    monkeypatch.setenv('WORLD_SIZE', '2')  # torchrun's environment
    with pytest.raises(T.UserError, match='table1.py runs in one process'):
        T.main(['--data', str(tmp_path), '--out', str(tmp_path / 'ddp')])


def test_a_second_table1_into_a_held_out_is_refused_in_one_line(cifar10_dir, tmp_path):
    """Issue 42: two table1.py into one --out would train the same runs twice and both write table1.json. While
    another process holds OUT/.lock, `python table1.py` is refused in one line, exit 1, before it trains."""
    holder = hold_lock(tmp_path / 'out')
    try:
        r = subprocess.run([sys.executable, 'table1.py', '--data', str(cifar10_dir), '--train-subset', '1024',
                            '--hessian-n', '20', '--ntk-n', '10', '--corruption-n', '0', '--out',
                            str(tmp_path / 'out')], cwd=REPO, capture_output=True, text=True,
                           env={**os.environ, 'OMP_NUM_THREADS': '1'})
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f'table1.py: error: --out {tmp_path / "out"} is in use by another run now (it holds '
        f'{tmp_path / "out" / ".lock"}); pick another --out'], r.stderr
    assert sorted(os.listdir(tmp_path / 'out')) == ['.lock']


def test_script_runs_a_real_subprocess_and_names_its_log_when_it_fails(tmp_path):
    """script(): `python NAME ARGV` with one OpenMP thread, its output and the command appended to the log; a
    non-zero exit is one UserError naming the script and the log (here geometry.py refusing an unknown flag)."""
    log = tmp_path / 'logs' / 'x.log'
    with pytest.raises(T.UserError, match=re.escape(f'geometry.py failed (exit 2); see {log}')):
        T.script('geometry.py', ['neurons', '--no-such-flag'], str(log))
    text = log.read_text()
    assert text.startswith(f'$ {os.path.join(T.HERE, "geometry.py")} neurons --no-such-flag\n')
    assert 'the following arguments are required: --data, --out' in text
