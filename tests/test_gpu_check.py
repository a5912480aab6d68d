"""gpu_check.py, the prepared command for a lent GPU (10 minutes a command with a 3-4 minute start, 8 files back),
must fit the lease before a GPU ever sees it: its dry run (every part at a toy size, on the CPU) stops inside
--budget-s, skips and names what would not fit, leaves one JSON and one log archive under --out, takes --data (a folder
or the archive, unpacked inside the budget) and --out relative to the caller's folder; a second call is independent
(its own --out). What a part finished survives its stop; a missing package is named in the JSON before any part runs.
Without CUDA the real run refuses in one line."""
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time

import pytest

from conftest import REPO

PARTS = ('versions', 'augment', 'syncs', 'smoke', 'memory', 'cifar', 'bench', 'compile', 'table1')
# The ops issue 33 lists: torchvision RandAugment's 14, the MoCo v3 view's, and whole pipelines.
RANDAUGMENT = ('Identity', 'ShearX', 'ShearY', 'TranslateX', 'TranslateY', 'Rotate', 'Brightness', 'Color', 'Contrast',
               'Sharpness', 'Posterize', 'Solarize', 'AutoContrast', 'Equalize')
LISTED = ('gaussian_blur', 'adjust_hue', 'color_jitter', 'resized_crop_rect_flip', 'random_erasing',
          'resized_crop_flip', 'pad_crop_flip', 'Augment.__call__ (strong)', 'Augment.__call__ (locuslab)',
          'Augment.__call__ (basic)', 'moco_view 0', 'moco_view 1')


def run(cwd, *args):
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'CUDA_VISIBLE_DEVICES': '', 'TMPDIR': str(cwd / 'tmp')}
    (cwd / 'tmp').mkdir(exist_ok=True)
    t = time.time()
    r = subprocess.run([sys.executable, str(REPO / 'gpu_check.py'), *map(str, args)], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=600)
    return r, time.time() - t


@pytest.fixture(scope='module')
def two_calls(cifar10_dir, tmp_path_factory):
    """Call 1: a budget too short for most parts; call 2, independent (its own --out, --data the archive): the augment
    and cifar parts. Both from a folder outside the repo, with --data and --out relative to it (W11, W12)."""
    home = tmp_path_factory.mktemp('caller')
    for split, n in (('train', 20), ('test', 10)):  # a small copy (W01): the dry run sizes itself to it
        for c in sorted(os.listdir(cifar10_dir / split)):
            (home / 'd' / 'cifar10' / split / c).mkdir(parents=True)
            for f in sorted(os.listdir(cifar10_dir / split / c))[:n]:
                shutil.copy(cifar10_dir / split / c / f, home / 'd' / 'cifar10' / split / c)
    data = os.path.join('d', 'cifar10')  # relative to the caller's folder (W11, W12)
    with tarfile.open(home / 'c10.tar.gz', 'w:gz') as tar:  # the archive a lease carries
        tar.add(home / data, arcname='cifar10')
    first = run(home, '--dry-run', '--data', data, '--out', 'gc', '--budget-s', 60, '--parts', 'versions', 'memory',
                'syncs', 'bench', 'smoke', 'compile')
    after_first = json.loads((home / 'gc' / 'gpu_check.json').read_text())
    second = run(home, '--dry-run', '--data', 'c10.tar.gz', '--out', 'gc2', '--parts', 'augment', 'cifar')
    return home, first, after_first, second, json.loads((home / 'gc2' / 'gpu_check.json').read_text())


def test_a_short_budget_stops_in_time_and_names_every_skipped_part(two_calls):
    home, (r, wall), got, _, _ = two_calls
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert got['calls'][0]['wall_s'] <= 60 - 10  # from the process's start: the budget less the last writes' margin
    assert wall < 60  # the whole process, as the caller sees it
    assert set(got['parts']) == set(PARTS)  # every part named, the ones not asked for too
    status = {p: got['parts'][p]['status'] for p in PARTS}
    assert status == dict(versions='ok', memory='ok', syncs='skipped', bench='skipped', smoke='skipped',
                          compile='skipped', augment='not run', cifar='not run', table1='not run'), status
    for part in ('syncs', 'bench', 'smoke'):  # (each needs 90 s or more, at most 50 are left)
        assert 'needs ~' in got['parts'][part]['reason'] and '--budget-s 60' in got['parts'][part]['reason']
        assert any(line.startswith(part) and 'skipped' in line and 'needs ~' in line for line in r.stdout.splitlines())
    assert 'dry run does not compile' in got['parts']['compile']['reason']
    assert r.stdout.splitlines()[-1].startswith('done | 2 ok | 0 failed | 4 skipped (syncs, smoke, bench, compile)')


def test_a_second_call_is_its_own_and_files_stay_under_out_and_few(two_calls):
    home, _, first, (r, _), got = two_calls
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert len(got['calls']) == 1 and got['parts']['versions']['status'] == 'not run'  # nothing of call 1
    assert {p: got['parts'][p]['status'] for p in ('augment', 'cifar')} == dict.fromkeys(('augment', 'cifar'), 'ok')
    for out in ('gc', 'gc2'):  # <= 8, the lease's limit; .lock: one call into an --out at a time
        assert sorted(p.name for p in (home / out).rglob('*')) == ['.lock', 'gpu_check.json', 'gpu_check_logs.tar.gz']
    assert not [f for f in os.listdir(home / 'tmp') if f.startswith('gpu_check')]  # run folders, tiny ImageNet: gone
    assert not (REPO / 'gc').exists()
    cifar = got['parts']['cifar']
    assert 0 < cifar['eager']['test_acc'] <= 100 and cifar['source']['data'].endswith('cifar10')  # (unpacked)
    assert cifar['source']['images'] == '200 train / 100 test'
    assert cifar['source']['format'].startswith('JPEG') and '92.5%' in cifar['reference']
    assert cifar['eager']['channels_last'] is False and cifar['eager_other_layout']['channels_last'] is True  # (CPU)
    with tarfile.open(home / 'gc2' / 'gpu_check_logs.tar.gz') as tar:
        assert 'cifar.log' in tar.getnames()


# augment.py's other functions and the compared ops they run inside (a new op must be compared, or listed here)
INSIDE = dict(per_image='RandAugment', grayscale='Color', smooth='Sharpness', blend_ops='color_jitter',
              posterize='Posterize', solarize='Solarize', affine_basis='Rotate', ra_magnitudes='Augment.__call__',
              apply_ra_ops='RandAugment', normalize='Augment.__call__', no_tf32='gaussian_blur',
              make_augment='Augment.__call__', check_settings='Augment.__call__', moco_view='moco_view 0')


def test_the_augment_part_compares_every_listed_op(two_calls):
    import inspect

    import augment
    got = two_calls[-1]['parts']['augment']['differing_pixels']
    assert set(RANDAUGMENT) == set(augment.RA_OPS)  # the names gpu_check takes the ops by
    assert set(got) == set(RANDAUGMENT) | set(LISTED)
    assert all(v == 0 for v in got.values())  # the CPU against itself: the plumbing, not the GPU
    functions = {n for n, f in vars(augment).items() if inspect.isfunction(f) and f.__module__ == 'augment'}
    assert functions - set(INSIDE) <= set(LISTED), functions - set(INSIDE) - set(LISTED)


def test_fixed_draws_are_replayed_whatever_the_generator():
    """The device run gets the CPU run's draws (a CUDA generator would draw others): replayed in order."""
    import torch
    import gpu_probe
    draws = []
    with gpu_probe.fixed_draws(draws):
        a = torch.rand(3, generator=torch.Generator().manual_seed(0)), torch.randint(0, 9, (4,))
    with gpu_probe.fixed_draws(draws, 'cpu'):
        b = torch.rand(3, generator=torch.Generator().manual_seed(1)), torch.randint(0, 9, (4,))
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and not draws


def test_a_subprocess_past_the_budget_is_stopped_there(tmp_path):
    import argparse
    import gpu_check
    args = argparse.Namespace(deadline=time.time() + 3, budget_s=99)
    t = time.time()
    with pytest.raises(gpu_check.OutOfTime, match='end of --budget-s 99'):
        gpu_check.script(args, 'train_cifar.py', [], tmp_path / 'x.log', wrapper='import time; time.sleep(60)')
    assert time.time() - t < 10


def test_data_it_cannot_use_is_one_line_before_any_part(tmp_path, monkeypatch):
    import gpu_check
    from utils import UserError
    (tmp_path / 'tiny' / 'train' / 'a').mkdir(parents=True)  # an ImageNet layout (W08)
    (tmp_path / 'tiny' / 'val' / 'a').mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as e:
        gpu_check.get_args(['--dry-run', '--data', 'tiny', '--out', 'gc'])
    assert str(e.value) == (f'--data {tmp_path / "tiny"}: expected CIFAR-10 as DIR/train/<class>/*, '
                            "DIR/test/<class>/* or torchvision's DIR/cifar-10-batches-py")


def test_without_cuda_the_real_run_is_one_line(cifar10_dir, tmp_path):
    r, _ = run(tmp_path, '--data', cifar10_dir, '--out', tmp_path)
    assert r.returncode == 1 and 'Traceback' not in r.stderr
    assert r.stderr.strip().splitlines() == ['gpu_check.py: error: no CUDA device: this check is for a GPU (pass '
                                             '--dry-run to exercise it on the CPU)']


# -----------------------------------------------------------------------------
# issue 45: one lease, every figure; nothing finished is lost; the device's own packages
def fake_args(tmp_path, left=300, **kw):
    import argparse
    return argparse.Namespace(deadline=time.time() + left, budget_s=left + 10, dry_run=False, data=tmp_path / 'data',
                              per_class=(5000, 1000), out=tmp_path / 'out', part_start=time.time() - 100, **kw)


def write_run(out, epochs_img_per_s, acc=90.0):
    """A train_cifar.py run folder: a train and an eval row per epoch (the epoch's img/s), and its args.json."""
    out.mkdir(parents=True, exist_ok=True)
    rows = [r for e, ips in enumerate(epochs_img_per_s, 1) for r in (
        dict(kind='train', epoch=e, img_per_s=ips), dict(kind='eval', epoch=e, top1=acc, elapsed_s=10.0 * e))]
    (out / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in rows))
    (out / 'args.json').write_text(json.dumps(dict(channels_last=True)))


def test_a_stopped_layout_run_keeps_the_default_run_and_its_own_wall_time(tmp_path, monkeypatch):
    """The cifar part: the 25-epoch run finished, then the budget stopped the layout run before its first evaluation.
    The part kept the finished run's figures (it used to fail whole, dropping them) and says the layout run stopped;
    img/s is the mean from epoch 2 on (epoch 1: cuDNN's autotuning, 10x slower here); a stopped run's wall time is its
    own, not the part's since it started (args.part_start, 100 s earlier here)."""
    import gpu_check

    def script(args, name, argv, log, wrapper=None):
        out = argv[argv.index('--out') + 1]
        if out.name == 'cifar_eager':
            write_run(out, [100.0, 1000.0, 1200.0])
            return 0, '', 12.0
        time.sleep(0.5)
        raise gpu_check.OutOfTime(f'{name} ran into the end of --budget-s')
    monkeypatch.setattr(gpu_check, 'script', script)
    got = gpu_check.cifar(fake_args(tmp_path), tmp_path)
    assert got['eager']['test_acc'] == 90.0 and got['eager']['img_per_s'] == 1100.0
    assert got['eager']['img_per_s_epoch1'] == 100.0
    assert got['status'] == 'stopped' and 'end of --budget-s' in got['eager_other_layout']['failed']
    write_run(tmp_path / 'cifar_late', [100.0])  # a run stopped after its first epoch: the epoch it finished

    def late(*a, **k):
        time.sleep(0.5)
        raise gpu_check.OutOfTime('stopped')
    monkeypatch.setattr(gpu_check, 'script', late)
    row = gpu_check.cifar_run(fake_args(tmp_path), tmp_path, 'late', [], tmp_path / 'log')
    assert row['stopped_by_budget'] == 'stopped' and row['epochs'] == 1 and 0.5 <= row['wall_s'] < 5


def test_a_stopped_bench_keeps_the_rows_it_finished(tmp_path, monkeypatch):
    import gpu_check

    def script(args, name, argv, log, wrapper=None):
        path = argv[argv.index('--json') + 1]
        path.write_text(json.dumps(dict(rows=[dict(row='vit_b16', img_per_s=1000.0, sam_over_base=2.0)],
                                        finished=False)))
        raise gpu_check.OutOfTime('bench.py ran into the end of --budget-s 330 after 80 s')
    monkeypatch.setattr(gpu_check, 'script', script)
    got = gpu_check.bench(fake_args(tmp_path), tmp_path)
    assert got['status'] == 'stopped' and got['rows'][0]['img_per_s'] == 1000.0 and got['finished'] is False


def test_budget_bounds_and_the_seconds_left_round_down(tmp_path, monkeypatch):
    """W04: --budget-s 1e12 overflowed the timer (a traceback); W10: 'needs ~40 s, 40 s left' for 39.9 left."""
    import gpu_check
    from utils import UserError
    with pytest.raises(UserError, match=r'--budget-s must be more than 10 s .* at most 86400 \(a day\), got 1e\+12'):
        gpu_check.get_args(['--dry-run', '--data', str(tmp_path), '--out', str(tmp_path / 'o'), '--budget-s', '1e12'])
    monkeypatch.setitem(gpu_check.NEED_S, 'versions', (40, 40))
    record = gpu_check.run_part(fake_args(tmp_path, left=39.95), 'versions', tmp_path)
    assert record['status'] == 'skipped' and record['reason'].startswith('needs ~40 s, 39 s left'), record


def test_a_missing_package_is_named_with_its_wheel_in_the_json_before_any_part(cifar10_dir, tmp_path, monkeypatch):
    """The lent machine has its own Python: a package this repo needs that is missing there stops the call before any
    part, with gpu_check.json written, naming it and the wheel to carry (it used to die at import, nothing written).
    A missing optional one (timm: bench's side by side) is named and the parts run."""
    import gpu_check
    from utils import UserError
    monkeypatch.setattr(gpu_check, 'NEEDS', [*gpu_check.NEEDS, ('no_such_module', 'no-such-package', 'no-such==1.0')])
    with pytest.raises(UserError, match='no-such-package not installed, no part run; carry its wheel'):
        gpu_check.main(['--dry-run', '--data', str(cifar10_dir), '--out', str(tmp_path / 'o'), '--parts', 'versions'])
    got = json.loads((tmp_path / 'o' / 'gpu_check.json').read_text())
    (missing,) = got['imports']['missing']
    assert missing['package'] == 'no-such-package' and "-d .whl 'no-such==1.0'" in missing['fix']
    assert '--target /tmp/site .whl/*.whl' in missing['fix']
    assert {p['status'] for p in got['parts'].values()} == {'not run'}


def test_one_call_into_an_out_at_a_time_and_never_over_an_earlier_one(cifar10_dir, tmp_path):
    """--out is locked as the training scripts lock theirs (runs.prepare_out's flock); a call never overwrites the
    gpu_check.json of another (each call its own --out)."""
    import fcntl

    import gpu_check
    from utils import UserError
    (tmp_path / 'o').mkdir()
    with open(tmp_path / 'o' / '.lock', 'a') as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another call holds it
        with pytest.raises(UserError, match='is in use by another run now'):
            gpu_check.main(['--dry-run', '--data', str(cifar10_dir), '--out', str(tmp_path / 'o')])
    (tmp_path / 'o' / 'gpu_check.json').write_text('{}')
    with pytest.raises(UserError, match='already holds gpu_check.json; pick another --out'):
        gpu_check.get_args(['--dry-run', '--data', str(cifar10_dir), '--out', str(tmp_path / 'o')])


STUB_TABLE1 = '''\
import json, sys, pathlib
argv = sys.argv[1:]
out = pathlib.Path(argv[argv.index('--out') + 1])
scale = float(argv[argv.index('--epochs-scale') + 1])
with open(pathlib.Path(__file__).parent / 'calls.jsonl', 'a') as f:
    f.write(json.dumps(argv) + '\\n')
ips = dict(resnet20_adamw=20000, resnet20_sam=10000, vit_adamw=10000, vit_sam=5000, mixer_adamw=12500, mixer_sam=6250)
for run, v in ips.items():
    (out / 'runs' / run).mkdir(parents=True)
    rows = [dict(kind='train', epoch=1, img_per_s=v), dict(kind='eval', epoch=1, top1=50.0, elapsed_s=2 + 25600 / v)]
    (out / 'runs' / run / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\\n' for r in rows))
table = dict(resnet20=['resnet20', [], 60, 8e-3, 0.05], vit=['vit_s4_cifar', [], 80, 2e-3, 0.1],
             mixer=['mixer_s4_cifar', [], 80, 2e-3, 0.1])
(out / 'table1.json').write_text(json.dumps(dict(rows=[dict(run='vit_sam', lambda_max=5.0)], args=dict(table=table))))
(out / 'table1.md').write_text('| model | lambda_max |\\n')
(out / 'landscape_vit.png').write_bytes(b'png')
'''


def test_table1_sizes_its_epochs_from_a_calibrations_img_per_s(tmp_path, monkeypatch):
    """The table1 part: a calibration run of table1.py (stubbed: its six runs' img/s side by side, the preset's
    epochs in its table1.json), then table1.py with the --epochs-scale whose longest run (here vit_sam: 80 epochs of
    50,000 images at 5,000 img/s, 800 s) ends MEASURE_S (90 s) and the largest start-up (2 s) before the budget; the
    table, its JSON with the hardware and the sizing, and the figures land in --out. Too little time: skipped."""
    import gpu_check
    (tmp_path / 'repo').mkdir()
    (tmp_path / 'repo' / 'table1.py').write_text(STUB_TABLE1)
    monkeypatch.setattr(gpu_check, 'HERE', tmp_path / 'repo')
    args = fake_args(tmp_path, left=300)
    args.out.mkdir()
    got = gpu_check.table1_part(args, tmp_path / 'work')
    calls = [json.loads(line) for line in (tmp_path / 'repo' / 'calls.jsonl').read_text().splitlines()]
    assert len(calls) == 2 and calls[0][calls[0].index('--train-subset') + 1] == '25600'
    assert calls[1][calls[1].index('--jobs') + 1] == '6' and '--preset' in calls[1] and 'gpu' in calls[1]
    scale = float(calls[1][calls[1].index('--epochs-scale') + 1])
    assert (300 - 90 - 2 - 5) / 800 <= scale <= (300 - 90 - 2) / 800  # (the stub's own seconds come off the budget)
    assert got['sizing']['epochs'] == dict(resnet20_adamw=round(60 * scale), resnet20_sam=round(60 * scale),
                                           vit_adamw=round(80 * scale), vit_sam=round(80 * scale),
                                           mixer_adamw=round(80 * scale), mixer_sam=round(80 * scale))
    assert sorted(os.listdir(args.out)) == ['landscape_vit.png', 'table1.json', 'table1.md']
    saved = json.loads((args.out / 'table1.json').read_text())
    assert saved['rows'] == [dict(run='vit_sam', lambda_max=5.0)] and saved['hardware']['torch']
    assert saved['sizing']['calibration']['vit_sam']['img_per_s'] == 5000
    head = (args.out / 'table1.md').read_text().splitlines()[0]  # the hardware, then the sizing
    assert head.startswith('no GPU, torch ') and f'--epochs-scale {scale:.4f}' in head
    short = fake_args(tmp_path, left=120)
    short.out.mkdir(exist_ok=True)
    with pytest.raises(gpu_check.Skip, match='too little of --budget-s left for Table 1'):
        gpu_check.table1_part(short, tmp_path / 'work2')
