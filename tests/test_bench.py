"""bench.py measures what its table claims: img/s is images / torch.utils.benchmark's median, the
FLOPs are a closed form's and timm's, the CPU peak memory is a fresh child's (a known allocation
shows at its size), the timed SAM step is SAM, a bad row is one clear line, and the CUDA-only
TFLOP/s and MFU arithmetic is checked here with made-up rows and named devices.
Speed itself is never asserted: the figures are reported as measured."""
import copy
import functools
import json
import os
import math
import re
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
import torch.utils.benchmark

import bench
from conftest import REPO

CPU = torch.device('cpu')


pytestmark = pytest.mark.usefixtures('one_thread')  # tests/conftest.py


def markdown_tables(text):
    """Every markdown table in text, as a list of [row dicts]."""
    tables, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith('|') and i + 1 < len(lines) and lines[i + 1].startswith('|---'):
            head = [c.strip() for c in line.strip('|').split('|')]
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith('|'):
                    break
                rows.append(dict(zip(head, (c.strip() for c in row.strip('|').split('|')))))
            tables.append(rows)
    return tables


def num(cell):
    return float(cell.replace(',', '').rstrip('%'))


def close(cell, exact, decimals=None):
    """A table cell equals exact to its printed rounding: `decimals` places, else bench.fmt's
    (an integer from 100 up, 3 significant digits below)."""
    if decimals is None:
        decimals = 0 if abs(exact) >= 100 else 2 - math.floor(math.log10(abs(exact)))
    return abs(num(cell) - exact) <= 0.5 * 10 ** -decimals * 1.001


def convmixer_train_gflops(dim, depth, k, p, px, classes):
    """Closed form: 3 x 2 x the multiply-adds of the stem, depthwise + pointwise convs and head."""
    grid = px // p
    macs = 3 * p * p * dim * grid ** 2 + depth * (dim * k * k + dim * dim) * grid ** 2 + dim * classes
    return 3 * 2 * macs / 1e9


def vit_train_gflops(D, depth, patch, px, classes=1000):
    """Closed form: patch embedding, per block qkv + proj + MLP (4D) per token and the two attention
    products per token pair, the head on the class token; 3 x 2 x multiply-adds."""
    n = (px // patch) ** 2 + 1
    macs = (n - 1) * 3 * patch * patch * D + depth * (n * D * (3 * D + D + 8 * D) + 2 * n * n * D) + D * classes
    return 3 * 2 * macs / 1e9


class RecordingTimer(torch.utils.benchmark.Timer):
    """torch's Timer, keeping (num_threads asked for, Measurement.median) of every blocked_autorange;
    it runs on one thread whatever is asked (two spin at barriers on 2 shared cores)."""
    log = []

    def __init__(self, *args, num_threads=1, **kw):
        super().__init__(*args, num_threads=1, **kw)
        self.threads = num_threads

    def blocked_autorange(self, *args, **kw):
        m = super().blocked_autorange(*args, **kw)
        RecordingTimer.log.append((self.threads, m.median))
        return m


def test_timing_is_the_benchmark_median_on_the_threads_asked():
    torch.set_num_threads(2)  # (the fixture restores it)
    threads = []
    s = bench.median_s(lambda: (threads.append(torch.get_num_threads()), time.sleep(0.02)), 0.2, threads=1)
    assert 0.02 <= s < 0.03 and set(threads) == {1}, (s, set(threads))


def test_table_is_batch_over_the_measured_medians(monkeypatch, capsys):
    """One in-process run (a model row and the cifar rows, tiny): every printed figure follows from
    the Measurements torch.utils.benchmark returned, in the order bench takes them; the per-core
    augmentation rows ran on one thread, the others on all. peak_mib is replaced here (its own tests
    are below)."""
    torch.set_num_threads(2)  # what bench asks for its all-threads rows (the fixture restores it)
    RecordingTimer.log = []
    monkeypatch.setattr(bench.benchmark, 'Timer', RecordingTimer)
    monkeypatch.setattr(bench, 'peak_mib', lambda device, fn, name, side, *a: {'ours': 11.0, 'timm': 22.0}[side])
    argv = ['--rows', 'convmixer_256_8,cifar', '--batch-size', '4', '--img-size', '8', '--min-run-time', '0.05']
    bench.main(argv)
    out = capsys.readouterr().out
    assert re.search(r'^## bench\.py, \d{4}-\d\d-\d\d \d\d:\d\d UTC$', out, re.M)
    machine = next(line for line in out.splitlines() if line.startswith('Machine: '))
    assert f'torch {torch.__version__}' in machine and 'timm ' in machine and 'cores' in machine
    assert f'Command: `python bench.py {" ".join(argv)}`' in out
    (table,) = markdown_tables(out)  # ONE table
    model, aug, step = table
    ours, ref, sam, sam_m, gsam, look, msam, aug_ours, aug_ref, aug_dev, train = (m for _, m in RecordingTimer.log)
    assert [threads for threads, _ in RecordingTimer.log] == [2, 2, 2, 2, 2, 2, 2, 1, 1, 2, 2]
    assert model['row'] == 'convmixer_256_8' and (model['px'], model['batch'], model['dtype']) == ('8', '4', 'off')
    assert close(model['ours img/s'], 4 / ours) and close(model['ref img/s'], 4 / ref)
    assert close(model['ours/ref'], ref / ours, 2) and close(model['SAM/base'], sam / ours, 2)
    m_ratio, m = re.fullmatch(r'([\d.]+) \(m (\d+)\)', model['SAM m/base']).groups()  # --sam-m 32 >= batch 4: a quarter
    assert close(m_ratio, sam_m / ours, 2) and m == '1'
    assert close(model['GSAM/SAM'], gsam / sam, 2)
    assert re.fullmatch(r'([\d.]+) \(1\.2 passes/step\)', model['LookSAM-5/base'])  # (a cycle of 5 timed: / 5)
    assert close(model['LookSAM-5/base'].split()[0], look / 5 / ours, 2)
    assert close(model['MSAM/base'].split()[0], msam / ours, 2) and model['MSAM/base'].endswith('(1 passes/step)')
    assert model['peak MiB ours / ref'] == '11 / 22'
    assert close(model['train GFLOP/img'], convmixer_train_gflops(256, 8, 5, 2, 8, 10))
    assert aug['row'] == 'cifar augment, 1 core'
    assert close(aug['ours img/s'], 4 / aug_ours) and close(aug['ref img/s'], 4 / aug_ref)
    assert close(aug['ours/ref'], aug_ref / aug_ours, 2)
    assert step['row'].startswith('cifar step') and close(step['ours img/s'], 4 / (aug_dev + train))
    share = float(re.search(r'augmentation ([\d.]+)% of the step', step['reference; notes']).group(1))
    assert share == pytest.approx(100 * aug_dev / (aug_dev + train), abs=0.051)


def test_peak_memory_child_sees_a_known_allocation():
    """96 MiB allocated in the child shows as 96 MiB, even though this process's own peak is far
    above the child's: a child that inherited it (a 'spawn' child does) would report ~0."""
    x = torch.ones(1024 * 2**18)  # this process's ru_maxrss now >= 1 GiB
    del x
    assert 0.95 * 96 <= bench.peak_mib(CPU, functools.partial(torch.ones, 96 * 2**18)) <= 1.1 * 96
    # a real side: at least weights, gradients and AdamW's two moments (4 x 4 bytes per parameter)
    mib = bench.peak_mib(CPU, bench.warm_up, 'convmixer_256_8', 'ours', 8, 2, 'off', False, CPU, False)
    assert 16 * 594_186 / 2**20 < mib < 1024, mib


def test_every_row_is_timms_config_and_counts_their_flops():
    """Ours takes timm's state dict strictly and counts the FLOPs timm's model counts, which equal
    a closed form for ConvMixer (also at another size) and ViT."""
    for name in bench.ROWS:
        size = bench.ROWS[name][2][0]
        with torch.device('meta'):
            ours, theirs = bench.build(name, 'ours', size), bench.build(name, 'timm', size)
        ours.load_state_dict(theirs.state_dict(), strict=True, assign=True)
        assert bench.train_gflops(lambda: ours, size) == bench.train_gflops(lambda: theirs, size), name
    assert bench.train_gflops(lambda: bench.build('convmixer_256_8', 'ours', 64), 64) == pytest.approx(
        convmixer_train_gflops(256, 8, 5, 2, 64, 10), rel=1e-12)
    assert bench.train_gflops(lambda: bench.build('convmixer_768_32', 'ours', 224), 224) == pytest.approx(
        convmixer_train_gflops(768, 32, 7, 7, 224, 1000), rel=1e-12)
    for name, D in (('vit_s16', 384), ('vit_b16', 768)):
        assert bench.train_gflops(lambda: bench.build(name, 'ours', 224), 224) == pytest.approx(
            vit_train_gflops(D, 12, 16, 224), rel=1e-12)


def sam_grad_by_hand(model, x, y, m, rho=0.05):
    """SAM's gradient written out (Foret et al. Alg. 1, with m-sharpness, Sec. 4.1): per group of m images,
    eps_j = rho g_j / ||g_j|| from that group's own gradient at w, g_sam_j at w + eps_j; -> the mean of the g_sam_j,
    with w back where it was."""
    params, g_sam = list(model.parameters()), None
    for xg, yg in zip(x.split(m), y.split(m)):
        model.zero_grad()
        F.cross_entropy(model(xg), yg).backward()
        with torch.no_grad():
            norm = torch.cat([p.grad.flatten() for p in params]).norm()
            eps = [rho * p.grad / norm for p in params]
            for p, e in zip(params, eps):
                p.add_(e)
        model.zero_grad()
        F.cross_entropy(model(xg), yg).backward()
        with torch.no_grad():
            for p, e in zip(params, eps):
                p.sub_(e)
        g = [p.grad / (len(x) // m) for p in params]
        g_sam = g if g_sam is None else [a + b for a, b in zip(g_sam, g)]
    return g_sam


def rel(a, b):  # ||a - b|| / ||b|| over all parameters
    a, b = torch.cat([u.flatten() for u in a]), torch.cat([v.flatten() for v in b])
    return float((a - b).norm() / b.norm())


def test_timed_sam_step_moves_like_a_reference_sam_step():
    """The SAM step bench times equals SAM written out here (Foret et al. Algorithm 1: eps_hat =
    rho g / ||g||, the gradient at w + eps_hat, then AdamW from w), BatchNorm statistics from the
    clean pass only; and it is not the plain step. Compared as norms over all parameters: float32
    noise (eps_hat's norm may sum in another order) is ~1e-5 of g, SAM's change to g ~0.8."""
    step, module, opt, x, y = bench.make_step('convmixer_256_8', 'ours', 8, 4, 'off', False, CPU, sam=True)
    ref = copy.deepcopy(module)
    w0 = [p.detach().clone() for p in module.parameters()]
    step()
    clean = copy.deepcopy(ref)
    clean(x)  # one train-mode forward at w: the BatchNorm statistics of the clean pass
    params = list(ref.parameters())
    for p, g in zip(params, sam_grad_by_hand(ref, x, y, len(x))):
        p.grad = g
    torch.optim.AdamW(params, lr=1e-4, weight_decay=0.05).step()
    clean_stats = dict(clean.named_buffers())
    # AdamW's first moment after one step is (1 - beta1) x the gradient it was given: g at w + eps_hat
    assert rel([opt.state[p]['exp_avg'] / 0.1 for p in module.parameters()], [p.grad for p in params]) < 1e-4
    updates = [q.detach() - w for q, w in zip(params, w0)]
    assert rel([p.detach() - w for p, w in zip(module.parameters(), w0)], updates) < 1e-2  # ~0.2%: AdamW's lr g/(|g| + eps)
    # amplifies that noise where |g| is near eps
    for k, b in module.named_buffers():
        torch.testing.assert_close(b, clean_stats[k], rtol=0, atol=0, msg=lambda m: f'{k}: {m}')
    plain, plain_module = bench.make_step('convmixer_256_8', 'ours', 8, 4, 'off', False, CPU)[:2]
    plain()
    assert rel([p.detach() - w for p, w in zip(plain_module.parameters(), w0)], updates) > 0.1


def test_unknown_row_is_one_clear_line():
    proc = subprocess.run([sys.executable, 'bench.py', '--rows', 'vit_b16,resnet50'], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and 'Traceback' not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith('bench.py: error: unknown row(s) resnet50; valid rows: ')
    assert all(name in last for name in [*bench.ROWS, 'cifar'])


def test_gpu_columns_tflops_and_mfu_arithmetic(monkeypatch):
    """CUDA-only columns with made-up rows: achieved = img/s x training FLOP/img, MFU = achieved /
    the chip's dense bf16 peak, by its exact torch.cuda.get_device_name() (NVIDIA data sheets, 2:4 sparse
    figures halved: H200 / H100 SXM 1,979, H100 PCIe 1,513, H200 NVL 1,671, L4 242; dense: L40S 362.05,
    L40 181.05). A substring match gave the H200 NVL the H200's peak and the L40 the L4's. An unknown chip gets
    no MFU, not a made-up one, and a note to give --peak-tflops, which also overrides a known one."""
    rows = [dict(row='vit_b16', px=224, batch=64, dtype='bf16', mode='eager', ours_s=0.064, ref_s=0.08,
                 sam_s=0.13, gflops=52.8, ref='timm'),
            dict(row='cifar step', px=32, batch=512, dtype='bf16', mode='eager', ours_s=0.5)]
    for gpu, peak, given in (('NVIDIA H200', 989.5e12, None), ('NVIDIA H200 NVL', 835.5e12, None),
                             ('NVIDIA H100 80GB HBM3', 989.5e12, None), ('NVIDIA H100 PCIe', 756.5e12, None),
                             ('NVIDIA L4', 121e12, None), ('NVIDIA L40', 181.05e12, None),
                             ('NVIDIA L40S', 362.05e12, None), ('Tesla T4', None, None), ('Tesla T4', 65e12, 65),
                             ('NVIDIA H200 NVL', 700e12, 700)):
        text = bench.table(rows, gpu, given)
        assert ('unknown GPU: give --peak-tflops' in text) == (peak is None), gpu
        vit, cifar = markdown_tables(text)[0]
        assert vit['TFLOP/s ours / ref'] == '52.8 / 42.2'  # 1000 and 800 img/s x 52.8 GFLOP
        mfu = vit['MFU ours / ref'].split(' / ')
        if peak is None:
            assert mfu == ['—', '—'], gpu
        else:
            assert [num(m) for m in mfu] == pytest.approx([100 * 52.8e12 / peak, 100 * 42.24e12 / peak], abs=0.051)
        assert (cifar['TFLOP/s ours / ref'], cifar['MFU ours / ref']) == ('— / —', '— / —')
    assert 'MFU ours / ref' not in markdown_tables(bench.table(rows))[0][0]  # CPU: no GPU columns
    # beside the data sheet's peak, the one a bf16 matmul measured in the same run (here: made up, 790 TFLOP/s)
    text = bench.table(rows, 'NVIDIA H200', None, 790e12)
    vit = markdown_tables(text)[0][0]
    assert [num(m) for m in vit['MFU of measured ours / ref'].split(' / ')] == pytest.approx(
        [100 * 52.8 / 790, 100 * 42.24 / 790], abs=0.051)
    assert "data sheet's dense bf16 990 TFLOP/s" in text and 'of 790 TFLOP/s' in text
    assert 'MFU of measured' not in markdown_tables(bench.table(rows, 'NVIDIA H200'))[0][0]
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)  # the CUDA defaults
    args = bench.get_args(['--rows', 'vit_b16'])
    assert (args.device.type, args.amp, bench.ROWS['vit_b16'][1 + args.size]) == ('cuda', 'bf16', (224, 128))


def test_cifar_rows_time_train_cifars_default_run():
    """bench.py does not import train_cifar.py (no script imports another): its CIFAR_RUN must stay the defaults."""
    import train_cifar
    defaults = vars(train_cifar.get_args([]))
    assert {k: defaults[k] for k in bench.CIFAR_RUN} == bench.CIFAR_RUN


def test_loader_rows_time_train_imagenets_recipes(monkeypatch):
    """bench.py does not import train_imagenet.py: its LOADER_RECIPES must stay that script's recipes; and the rows
    come out, one per recipe and --decode path, timed on images of ImageNet's size (the timer patched to a count
    of the images each timed call returns; speed is never asserted)."""
    import train_imagenet
    for name, recipe in bench.LOADER_RECIPES.items():
        assert {k: train_imagenet.RECIPES[name].get(k, train_imagenet.DEFAULTS.get(k)) for k in recipe} == recipe
    timed = []
    monkeypatch.setattr(bench, 'median_s', lambda fn, *a, **kw: timed.append(fn()) or 0.5)
    rows = bench.bench_loader(bench.get_args(['--rows', 'loader', '--quick', '--device', 'cpu']))
    assert [r['row'] for r in rows] == [f'loader {n}, --decode {d}, per worker core' for n in bench.LOADER_RECIPES
                                        for d in ('cpu', 'gpu')]
    ours_cpu = timed[1]  # [ref, ours cpu, ours gpu (bytes), the device part] for the first recipe
    assert len(ours_cpu) == 16 and ours_cpu[0][0].shape == (3, 224, 224) and ours_cpu[0][0].dtype == torch.uint8
    assert timed[0][0][0].dtype == torch.float32 and timed[3].shape == (16, 3, 224, 224)


def cli(argv, monkeypatch):
    """bench.py run as `python bench.py ARGV` (its __main__ block, in this process): the SystemExit's code,
    which Python prints as the one line on stderr (exit status 1) when it is a string."""
    import runpy
    monkeypatch.setattr(sys, 'argv', ['bench.py', *argv])
    monkeypatch.setattr(bench, 'bench_model', lambda *a: pytest.fail('benchmarked before refusing'))
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(REPO / 'bench.py'), run_name='__main__')
    return e.value.code


@pytest.mark.parametrize('argv,line', [
    (['--rows', 'vit_b16', '--img-size', '100'], "--img-size 100 does not fit vit_b16's 16 px patches"),
    (['--rows', 'mixer_s16,cifar', '--img-size', '40'], "--img-size 40 does not fit mixer_s16's 16 px patches"),
    (['--rows', 'convmixer_768_32', '--img-size', '5'], "--img-size 5 does not fit convmixer_768_32's 7 px patches"),
    (['--rows', ''], '--rows names no row; valid rows: vit_s16,'),
    (['--rows', ',', '--quick'], '--rows names no row'),
    (['--min-run-time', 'nan'], '--min-run-time must be a finite number > 0, got nan'),
    (['--min-run-time', 'inf'], '--min-run-time must be a finite number > 0, got inf'),
    (['--peak-tflops', '-1'], '--peak-tflops must be a finite number > 0, got -1.0'),
    (['--sam-m', '0'], '--sam-m must be a finite number > 0, got 0'),
    # bad-inputs-3 (h-data): groups of 3, 3, 2 on a batch of 8, each loss / 3, said done
    (['--rows', 'convmixer_256_8', '--batch-size', '8', '--sam-m', '3'], '--sam-m 3 does not divide the batch of 8'),
    (['--json', 'MISSING/bench.json'], '--json MISSING/bench.json cannot be written: No such file or directory'),
    (['--json', 'DIR'], '--json DIR cannot be written: a folder, not a file'),
    (['--json', '/sys/bench.json'], '--json /sys/bench.json cannot be written: '),  # read-only, even for root
    # issue 34: a flag that acts on nothing (as train_cifar.py refuses --rho without --sam)
    (['--rows', 'cifar', '--img-size', '64', '--compile'], '--img-size, --compile only act with a model row in'),
    (['--rows', 'cifar', '--sam-m', '8'], '--sam-m only acts with a model row in --rows (the cifar and loader rows: no model'),
    (['--rows', 'vit_s16', '--peak-tflops', '900', '--device', 'cpu'], '--peak-tflops only acts with a GPU (MFU)'),
])
def test_bad_flags_are_one_line_before_anything_runs(argv, line, tmp_path, monkeypatch):
    """Each used to be a traceback (a patch size that does not divide, a --json written after the whole benchmark
    ran), an empty table, or a hang (nan). Now: one line, exit status 1, refused before any row runs, no file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'DIR').mkdir()
    code = cli(argv, monkeypatch)
    assert isinstance(code, str) and code.startswith('bench.py: error: ' + line) and '\n' not in code, code
    assert sorted(p.name for p in tmp_path.iterdir()) == ['DIR'] and not any((tmp_path / 'DIR').iterdir())


def test_compiled_sides_start_from_a_clean_dynamo_cache(monkeypatch):
    """torch._dynamo.reset() (its documented public API) before each compiled side: else a later row of the same
    code (ConvMixer-256/8, then -768/32) recompiles with a dynamic batch and is timed as such."""
    events = []
    monkeypatch.setattr(torch._dynamo, 'reset', lambda: events.append('reset'))
    monkeypatch.setattr(torch, 'compile', lambda module: events.append('compile') or module)
    monkeypatch.setattr(bench, 'median_s', lambda fn, *a, **k: fn() or 1.0)
    args = bench.get_args(['--rows', 'convmixer_256_8', '--batch-size', '4', '--img-size', '8', '--device', 'cpu'])
    row = bench.bench_model('convmixer_256_8', args, compile=True)
    assert events == ['reset', 'compile'] * 7 and row['mode'] == 'compile' and 'sam_m_s' in row and 'gsam_s' in row
    events.clear()
    bench.bench_model('convmixer_256_8', args, compile=False)
    assert events == []  # eager rows neither compile nor touch the cache


def test_timed_m_sharpness_step_is_the_group_loop_written_out():
    """--sam-m: the step bench times with m = 2 of a batch of 4 equals m-sharpness written out here (Foret et al.
    Sec. 4.1): per group j of m images, eps_j = rho g_j / ||g_j|| from that group's own gradient at w, g_sam_j at
    w + eps_j; AdamW from w with the mean of the g_sam_j. It is neither the whole-batch SAM step nor a plain one."""
    step, module, opt, x, y = bench.make_step('convmixer_256_8', 'ours', 8, 4, 'off', False, CPU, sam=True, m=2)
    ref = copy.deepcopy(module)
    step()
    g_sam = sam_grad_by_hand(ref, x, y, 2)
    first_moment = [opt.state[p]['exp_avg'] / 0.1 for p in module.parameters()]  # (1 - beta1) x the gradient given
    assert rel(first_moment, g_sam) < 1e-4
    whole = bench.make_step('convmixer_256_8', 'ours', 8, 4, 'off', False, CPU, sam=True)
    whole[0]()
    assert rel([whole[2].state[p]['exp_avg'] / 0.1 for p in whole[1].parameters()], g_sam) > 0.01


# -----------------------------------------------------------------------------
# issue 45: what a GPU run of gpu_check.py needs from bench.py
def test_without_timm_bench_times_ours_alone(tmp_path):
    """A GPU machine without timm (gpu_check.py's bench part): the model rows time our steps and say why there is no
    reference side; bench used to stop at its `import timm`. timm is hidden by a module that fails to import."""
    (tmp_path / 'hide').mkdir()
    (tmp_path / 'hide' / 'timm.py').write_text('raise ImportError("hidden by the test")\n')
    env = {**os.environ, 'PYTHONPATH': str(tmp_path / 'hide'), 'OMP_NUM_THREADS': '1'}
    r = subprocess.run([sys.executable, str(REPO / 'bench.py'), '--rows', 'convmixer_256_8', '--batch-size', '2',
                        '--img-size', '8', '--min-run-time', '0.01', '--json', tmp_path / 'b.json'], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    (row,) = json.loads((tmp_path / 'b.json').read_text())['rows']
    assert 'ours_s' in row and 'sam_s' in row and 'gsam_s' in row and 'ref_s' not in row
    assert row['note'] == 'timm is not installed: our steps alone, no side by side' and row['ours_over_ref'] is None
    assert 'timm not installed' in r.stdout


def test_the_json_holds_each_finished_row_as_numbers(tmp_path, monkeypatch):
    """--json is rewritten after every row, so a run stopped part-way (gpu_check's budget) keeps its finished rows;
    each row's figures are numbers: img/s = batch / median, the step ratios, achieved TFLOP/s and, with a peak, MFU."""
    monkeypatch.setattr(bench, 'median_s', lambda fn, *a, **k: fn() or 0.25)
    monkeypatch.setattr(bench, 'peak_mib', lambda *a: 5.0)
    monkeypatch.setattr(bench, 'bench_cifar', lambda args: (_ for _ in ()).throw(RuntimeError('stopped')))
    with pytest.raises(RuntimeError, match='stopped'):
        bench.main(['--rows', 'convmixer_256_8,cifar', '--batch-size', '4', '--img-size', '8', '--device', 'cpu',
                    '--json', str(tmp_path / 'b.json')])
    got = json.loads((tmp_path / 'b.json').read_text())
    (row,) = got['rows']
    assert got['finished'] is False and row['row'] == 'convmixer_256_8'
    assert row['img_per_s'] == 4 / 0.25 and row['sam_over_base'] == 1.0 and row['gsam_over_sam'] == 1.0
    assert row['tflops'] == pytest.approx(16 * row['gflops'] / 1e3) and row['mfu'] is None  # CPU: no peak
    n = bench.numbers(dict(row, ours_s=0.5), peak=2e12, measured=1e12)
    assert n['mfu'] == pytest.approx(8 * row['gflops'] * 1e9 / 2e12)
    assert n['mfu_measured'] == pytest.approx(8 * row['gflops'] * 1e9 / 1e12)


def test_sam_m_at_or_above_the_batch_is_the_batch(monkeypatch):
    """B04: --sam-m 100 on a batch of 8 was replaced by 2 without a word; m >= the batch is one group of the whole
    batch (plain SAM), and the table says m 8."""
    monkeypatch.setattr(bench, 'median_s', lambda fn, *a, **k: fn() or 1.0)
    monkeypatch.setattr(bench, 'peak_mib', lambda *a: 1.0)
    for given, want, batch in ((100, 8, 8), (8, 8, 8), (2, 2, 8), (None, 2, 8), (None, 6, 30)):  # None: the default,
        # a quarter of the batch, or its largest divisor below that (30: 7 would make groups of 7, 7, 7, 7, 2)
        args = bench.get_args(['--rows', 'convmixer_256_8', '--batch-size', str(batch), '--img-size', '8', '--device',
                               'cpu', *(['--sam-m', str(given)] if given else [])])
        assert bench.bench_model('convmixer_256_8', args)['sam_m'] == want, given
