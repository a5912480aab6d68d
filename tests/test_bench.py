"""bench.py runs end to end and prints what it claims: a tiny --quick run on one row, its tables
parsed and checked against closed forms (FLOPs, ratios) and a known allocation (peak memory).
Speed itself is never asserted: the figures are reported as measured."""
import math
import re
import subprocess
import sys

import pytest
import torch

import bench
from conftest import REPO

MODEL_COLUMNS = ['model', 'px', 'batch', 'dtype', 'mode', 'ours img/s', 'timm img/s', 'ours/timm',
                 'ours train GFLOP/img', 'ours peak MiB', 'timm peak MiB']
SAM_COLUMNS = ['model', 'px', 'batch', 'dtype', 'mode', 'base ms/step', 'SAM ms/step', 'SAM/base']
DATA_COLUMNS = ['pipeline', 'device', 'threads', 'batch', 'img/s', 'vs reference']


def markdown_tables(text):
    """Every markdown table in text, as {header string: [row dicts]}."""
    tables, lines = {}, text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith('|') and i + 1 < len(lines) and lines[i + 1].startswith('|---'):
            header = [c.strip() for c in line.strip('|').split('|')]
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith('|'):
                    break
                rows.append(dict(zip(header, (c.strip() for c in row.strip('|').split('|')))))
            tables[' | '.join(header)] = rows
    return tables


def positive(cell):
    value = float(cell.replace(',', ''))
    assert value > 0 and math.isfinite(value), cell
    return value


def close(printed, exact, sig=3):
    """printed (rounded for the table) agrees with exact to the rounding of a few digits."""
    return abs(printed - exact) <= 0.006 + 2 * 10 ** -sig * abs(exact)


def ratio_of_printed(ratio, num, den):
    """ratio (printed to 2 decimals) agrees with num / den, where num and den are themselves printed
    to 3 significant digits, so each may be off its exact value by up to 0.5%."""
    lo, hi = num * 0.995 / (den * 1.005), num * 1.005 / (den * 0.995)
    return lo - 0.005 <= ratio <= hi + 0.005


def convmixer_256_8_train_gflops():
    """Closed form at 32 px: 3 x 2 x multiply-adds of the convs and the head (k5, p2: 16x16 grid)."""
    dim, depth, k, p, grid = 256, 8, 5, 2, 16
    stem = 3 * p * p * dim * grid ** 2
    block = dim * k * k * grid ** 2 + dim * dim * grid ** 2  # depthwise + pointwise
    return 3 * 2 * (stem + depth * block + dim * 10) / 1e9


@pytest.fixture(scope='module')
def quick_run():
    cmd = [sys.executable, 'bench.py', '--quick', '--rows', 'convmixer_256_8', '--batch', '4',
           '--repeats', '2', '--data-images', '48', '--threads', '1']
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_header_names_machine_torch_date_and_command(quick_run):
    assert re.search(r'^## bench\.py, \d{4}-\d\d-\d\d \d\d:\d\d UTC$', quick_run, re.M)
    machine = next(line for line in quick_run.splitlines() if line.startswith('Machine: '))
    assert f'torch {torch.__version__}' in machine and 'cores' in machine and 'torch threads 1' in machine
    assert '`python bench.py --quick --rows convmixer_256_8 --batch 4' in quick_run


def test_model_table_columns_values_and_flops(quick_run):
    rows = markdown_tables(quick_run)[' | '.join(MODEL_COLUMNS)]
    assert len(rows) == 1
    r = rows[0]
    assert (r['model'], r['px'], r['batch'], r['dtype'], r['mode']) == ('convmixer_256_8', '32', '4', 'fp32', 'eager')
    ours, timm, ratio = positive(r['ours img/s']), positive(r['timm img/s']), positive(r['ours/timm'])
    assert ratio_of_printed(ratio, ours, timm)
    assert close(positive(r['ours train GFLOP/img']), convmixer_256_8_train_gflops())
    # Peak memory of a training step at batch 4 holds at least the weights, grads and AdamW state.
    assert positive(r['ours peak MiB']) >= 4 * 594_186 * 4 / 2**20
    assert positive(r['timm peak MiB']) >= 4 * 594_186 * 4 / 2**20


def test_sam_table(quick_run):
    rows = markdown_tables(quick_run)[' | '.join(SAM_COLUMNS)]
    assert [r['model'] for r in rows] == ['convmixer_256_8']
    base, sam, ratio = (positive(rows[0][c]) for c in ('base ms/step', 'SAM ms/step', 'SAM/base'))
    assert ratio_of_printed(ratio, sam, base)


def test_data_table(quick_run):
    rows = markdown_tables(quick_run)[' | '.join(DATA_COLUMNS)]
    ref, ours, model = rows[0], rows[1], rows[-1]
    assert ref['pipeline'].startswith('locuslab reference') and ref['threads'] == '1'
    assert ours['pipeline'].startswith('ours') and ours['threads'] == '1' and ours['batch'] == '512'
    assert model['pipeline'].startswith('model: convmixer_256_8') and model['batch'] == '4'
    assert close(positive(ours['vs reference']), positive(ours['img/s']) / positive(ref['img/s']), sig=2)
    pipe, train = positive(ours['img/s']), positive(model['img/s'])  # one thread: this row is the pipeline
    per_core = float(re.search(r'Per core: ours / reference = ([\d.]+)x', quick_run).group(1))
    assert per_core == float(ours['vs reference'])
    over = float(re.search(r'/ model training \([\d.]+ img/s\) = ([\d.]+)x', quick_run).group(1))
    assert ratio_of_printed(over, pipe, train)
    # closed form: 97 steps of 512 images (the last partial batch dropped), augment then train
    epoch = float(re.search(r'default CIFAR run here: ([\d,]+) s', quick_run).group(1).replace(',', ''))
    assert epoch == pytest.approx(50_000 // 512 * 512 * (1 / pipe + 1 / train), rel=0.011, abs=0.6)


def test_unknown_row_is_a_clear_error():
    proc = subprocess.run([sys.executable, 'bench.py', '--rows', 'resnet50'], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and 'Traceback' not in proc.stderr
    assert 'resnet50' in proc.stderr and all(name in proc.stderr for name in bench.ROWS)


@pytest.mark.parametrize('size', ['table', 112])
def test_every_row_is_the_same_config_on_both_sides(size):
    """Ours takes timm's state dict strictly and counts the same FLOPs, except our ViT, which skips
    exactly the last block's work on the tokens its class-token head never reads; at the rows' own
    size and at another (--img-size)."""
    for name in bench.ROWS:
        px = bench.ROWS[name]['cpu'][0] if size == 'table' else size
        with torch.device('meta'):
            ours, theirs = bench.build_ours(name, px), bench.build_timm(name, px)
        ours.load_state_dict(theirs.state_dict(), strict=True, assign=True)
        f_ours = bench.forward_gflops(lambda: bench.build_ours(name, px), px)
        f_timm = bench.forward_gflops(lambda: bench.build_timm(name, px), px)
        if name.startswith('vit'):
            D, N = ours.pos_embed.shape[-1], ours.pos_embed.shape[1]  # width, tokens incl. class
            hidden = ours.blocks[-1].mlp.fc1.out_features
            # the last block at N-1 fewer tokens: proj and MLP (D^2 + 2 D hidden) per token, and the
            # two attention products (2 N D) per query
            skipped = 2 * (N - 1) * (D * D + 2 * D * hidden + 2 * N * D) / 1e9
            assert f_ours == pytest.approx(f_timm - skipped, rel=1e-9)
        else:
            assert f_ours == f_timm


def test_peak_memory_sees_a_known_allocation():
    mem = bench.PeakMemory(torch.device('cpu'))
    mem.reset()
    x = torch.ones(64 * 2**20 // 4)  # 64 MiB, every page written
    peak = mem.peak()
    del x
    assert 63 <= peak <= 80, peak
    if mem.method == 'VmHWM':  # resettable: a fresh measurement does not remember the 64 MiB
        mem.reset()
        assert mem.peak() < 16


def test_gpu_mfu_section_arithmetic(monkeypatch):
    """Section 4 runs only on CUDA; its arithmetic is checked here with a named device and made-up
    rows: achieved = img/s x 3 x forward FLOPs, MFU = achieved / the device's dense bf16 peak."""
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda device=None: 'NVIDIA H200')
    rows = [dict(name='vit_b16', px=224, batch=64, dtype='bf16', mode='eager', ours_imgs=1000.0,
                 timm_imgs=900.0, gflops=16.5, gflops_timm=17.6),
            dict(name='mixer_b16', error='compile failed')]  # an errored row is left out
    args = type('Args', (), {'dtype': 'bf16'})()
    out = '\n'.join(bench.run_gpu(args, 'cuda', rows))
    assert 'NVIDIA H200, peak 989 TFLOP/s dense bf16' in out
    table = markdown_tables(out)['model | side | px | batch | dtype | mode | img/s | TFLOP/s | MFU']
    assert [(r['model'], r['side']) for r in table] == [('vit_b16', 'ours'), ('vit_b16', 'timm')]
    for r, imgs, gflops in zip(table, (1000.0, 900.0), (16.5, 17.6)):
        achieved = imgs * 3 * gflops * 1e9
        assert close(float(r['TFLOP/s']), achieved / 1e12)
        assert abs(float(r['MFU'].rstrip('%')) - 100 * achieved / 989e12) < 0.051
    args.dtype = 'fp32'  # no fp32 peak in the table: MFU is not made up
    out = '\n'.join(bench.run_gpu(args, 'cuda', rows[:1]))
    assert 'n/a (not in the table, or not bf16)' in out and out.count('| n/a |') == 2


def test_sam_step_runs_two_passes_and_moves_like_sam():
    """The timed SAM step is a real SAM step: two forward passes against the base step's one, and
    the same update as SAM's own step(closure), which is not the plain step's. (SGD as the base
    optimizer here, so that a different gradient shows in the update.)"""
    from sam import SAM
    torch.manual_seed(0)
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    make = lambda: torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.GELU(), torch.nn.Linear(7, 3))  # noqa: E731
    no_amp = lambda: torch.autocast('cpu', enabled=False)  # noqa: E731
    plain, ours, ref = make(), make(), make()
    for m in (ours, ref):
        m.load_state_dict(plain.state_dict())
    calls = []
    for m in (plain, ours):
        m.register_forward_hook(lambda *a, m=m: calls.append(m))
    bench.train_step(plain, torch.optim.SGD(plain.parameters(), lr=0.5), x, y, no_amp)()
    bench.sam_train_step(ours, ours, SAM(ours.parameters(), torch.optim.SGD, rho=0.5, lr=0.5), x, y, no_amp)()
    assert (calls.count(plain), calls.count(ours)) == (1, 2)
    ref_opt = SAM(ref.parameters(), torch.optim.SGD, rho=0.5, lr=0.5)

    def closure():
        ref_opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ref(x), y)
        loss.backward()
        return loss
    ref_opt.step(closure)
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    assert max((p - w).abs().max() for p, w in zip(ours.parameters(), plain.parameters())) > 1e-3
