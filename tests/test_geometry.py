"""geometry.py against analytic answers (issue 13): quadratic and full-Hessian oracles for lambda_max,
closed-form NTKs of a linear model, the landscape's origin and filter norms, the Gaussian expectation
of a quadratic for average flatness, biases that fix the active fraction, and uniform attention whose
distance is the mean pairwise distance of the patch grid. Then each sub-command end to end."""
import contextlib
import itertools
import json
import math
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import convmixer
import data
import geometry as G
import hessian
import mixer
import models
import utils
import vit
from torchvision.models.resnet import BasicBlock
from toys import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_vit(**kw):
    return vit.VisionTransformer(**{**dict(img_size=16, patch_size=4, dim=16, depth=2, heads=2, num_classes=5), **kw})


def tiny_mixer():
    return mixer.MlpMixer(img_size=16, patch_size=4, dim=16, depth=2, tokens_mlp_dim=8, channels_mlp_dim=32,
                          num_classes=5)


def tiny_convmixer():
    return convmixer.ConvMixer(dim=8, depth=2, kernel_size=3, patch_size=4, num_classes=5)


class Quadratic(nn.Module):
    """model(x) = 1/2 w^T A w, whatever x: with loss_fn = identity, the loss is the quadratic itself."""

    def __init__(self, A, w):
        super().__init__()
        self.A, self.w = A, nn.Parameter(w.clone())

    def forward(self, x):
        return 0.5 * self.w @ self.A @ self.w


def spd(n, seed, top=10.0):
    """A symmetric positive-definite matrix with eigenvalues in [1, 5] plus one `top`."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    eig = torch.cat([torch.linspace(1, 5, n - 1, dtype=torch.float64), torch.tensor([top], dtype=torch.float64)])
    return q @ torch.diag(eig) @ q.T


ONE_BATCH = [(torch.zeros(1), None)]
IDENTITY_LOSS = lambda out, y: out  # noqa: E731


# ----------------------------------------------------------------------------- lambda_max
def test_hessian_quadratic_equals_eigvalsh():
    A = spd(30, 0)
    model = Quadratic(A, torch.randn(30, dtype=torch.float64))
    lam = G.hessian_eigenvalue(model, IDENTITY_LOSS, ONE_BATCH)
    assert lam == pytest.approx(torch.linalg.eigvalsh(A)[-1].item(), rel=1e-4)


def tiny_mlp_problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 3, (16,))
    batches = [(x[:10], y[:10]), (x[10:], y[10:])]  # unequal sizes: the weighting matters
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])

    def loss_of(w):  # the mean loss over all 16 images, as a function of the flat weight vector
        tensors = dict(zip(names, torch.split(w, [s.numel() for s in shapes])))
        tensors = {n: t.view(s) for (n, t), s in zip(tensors.items(), shapes)}
        return F.cross_entropy(torch.func.functional_call(model, tensors, (x,)), y)

    H = torch.autograd.functional.hessian(loss_of, flat)
    return model, batches, H


def dominant(eig):
    return eig[eig.abs().argmax()].item()


def test_hessian_tiny_mlp_equals_full_hessian():
    model, batches, H = tiny_mlp_problem()
    lam = G.hessian_eigenvalue(model, F.cross_entropy, batches, iters=1000, tol=1e-9)
    assert lam == pytest.approx(dominant(torch.linalg.eigvalsh(H)), rel=1e-4)


def test_hessian_power_iteration_step_by_step_in_float64():
    """For the off-by-one (the estimate of the iteration before): with tol=0 and iters=k, the estimate equals
    that of k steps of power iteration on the full float64 Hessian from the same seeded start vector
    (PyHessian's: randn per parameter from the seeded generator, normalised), v <- Hv / ||Hv||, v^T H v."""
    model, batches, H = tiny_mlp_problem()
    gen = torch.Generator().manual_seed(7)
    v = torch.cat([torch.randn(p.shape, generator=gen, dtype=p.dtype).flatten() for p in model.parameters()])
    v = v.double() / v.double().norm()
    want = []
    for _ in range(6):
        hv = H @ v
        want.append((v @ hv).item())
        v = hv / hv.norm()
    assert min(abs(a - b) for a, b in zip(want, want[1:])) > 1e-3 * abs(want[-1])  # each step moves it
    got = [G.hessian_eigenvalue(model, F.cross_entropy, batches, iters=k, tol=0, seed=7) for k in range(1, 7)]
    assert got == pytest.approx(want, rel=1e-9, abs=0)


def test_hessian_block_equals_block_of_full_hessian():
    model, batches, H = tiny_mlp_problem()
    n1 = sum(p.numel() for p in model[0].parameters())  # fc1 weight + bias come first in the flat vector
    lam = G.hessian_eigenvalue(model, F.cross_entropy, batches, params=model[0].parameters(), iters=1000, tol=1e-9)
    assert lam == pytest.approx(dominant(torch.linalg.eigvalsh(H[:n1, :n1])), rel=1e-4)
    assert abs(lam - dominant(torch.linalg.eigvalsh(H))) > 1e-3 * abs(lam)  # really a different matrix


def test_param_blocks_split_vit_and_mixer_sublayers():
    blocks = G.param_blocks(tiny_vit())
    assert list(blocks) == ['patch_embed', 'blocks.0.attn', 'blocks.0.mlp', 'blocks.1.attn', 'blocks.1.mlp', 'head']
    model = tiny_vit()
    assert {id(p) for p in G.param_blocks(model)['blocks.1.attn']} == {
        id(p) for m in (model.blocks[1].norm1, model.blocks[1].attn) for p in m.parameters()}
    assert list(G.param_blocks(tiny_mixer()))[1:3] == ['blocks.0.mlp_tokens', 'blocks.0.mlp_channels']


# ----------------------------------------------------------------------------- NTK
def test_ntk_linear_model_closed_forms():
    torch.manual_seed(0)
    C, d, n = 3, 6, 5
    model = nn.Sequential(nn.Flatten(), nn.Linear(d, C, bias=False))
    x = torch.randn(n, 1, 2, 3)
    X = x.flatten(1).double()
    gram = X @ X.T
    assert torch.allclose(G.empirical_ntk(model, x, 'trace'), C * gram, atol=1e-5)
    assert torch.allclose(G.empirical_ntk(model, x, 'full'), torch.kron(gram, torch.eye(C, dtype=torch.float64)),
                          atol=1e-5)
    kappa, eig = G.ntk_condition_number(model, x, 'trace')
    ref = torch.linalg.eigvalsh(C * gram)
    assert torch.allclose(eig, ref, rtol=1e-5) and kappa == pytest.approx((ref[-1] / ref[0]).item(), rel=1e-4)


def test_ntk_reductions_equal_explicit_jacobians():
    """A tiny nonlinear MLP: per-image Jacobians J_i (C x P) from torch.autograd.functional.jacobian, then
    trace: sum_c <J_ic, J_jc>; sum: <sum_c J_ic, sum_c J_jc>; full: <J_ic, J_jd> at row i*C + c."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    x = torch.randn(4, 1, 2, 3)
    names, shapes = [n for n, _ in model.named_parameters()], [p.shape for p in model.parameters()]
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])

    def logits(w, xi):
        tensors = {n: t.view(s) for n, t, s in zip(names, torch.split(w, [s.numel() for s in shapes]), shapes)}
        return torch.func.functional_call(model, tensors, (xi[None],))[0]

    J = torch.stack([torch.autograd.functional.jacobian(lambda w: logits(w, xi), flat) for xi in x]).double()  # (n, C, P)
    assert torch.allclose(G.empirical_ntk(model, x, 'trace'), torch.einsum('icp,jcp->ij', J, J), atol=1e-5)
    assert torch.allclose(G.empirical_ntk(model, x, 'sum'), J.sum(1) @ J.sum(1).T, atol=1e-5)
    assert torch.allclose(G.empirical_ntk(model, x, 'full'), J.flatten(0, 1) @ J.flatten(0, 1).T, atol=1e-5)


@pytest.mark.parametrize('reduce', ['trace', 'sum', 'full'])
def test_ntk_chunked_equals_unchunked(reduce):
    torch.manual_seed(0)
    model = tiny_vit()
    G.draw_zero_head_(model)
    x = torch.randn(7, 3, 16, 16)
    whole = G.empirical_ntk(model, x, reduce)
    assert whole.shape == ((35, 35) if reduce == 'full' else (7, 7))
    # chunks of 3 images run the fp32 Jacobian on other batch shapes (CPU-dependent rounding, ~1e-7 relative);
    # a chunk's rows misplaced or dropped would move entries by O(1)
    assert torch.allclose(G.empirical_ntk(model, x, reduce, chunk=3), whole, rtol=1e-5, atol=1e-7 * whole.abs().max())


@pytest.mark.parametrize('make', [tiny_vit, tiny_mixer])
def test_ntk_zero_head_is_feature_gram_until_drawn(make):
    """With the official zero head, only the head's Jacobian is non-zero: Theta_trace = C (Phi Phi^T + 1),
    Phi the pooled features. draw_zero_head_ draws it like the model's other dense layers."""
    torch.manual_seed(0)
    model = make().eval()
    x = torch.randn(6, 3, 16, 16)
    feats = []  # Phi: what the head reads (the pooled, normalised token), caught at its input
    handle = model.head.register_forward_hook(lambda m, inputs, out: feats.append(inputs[0]))
    with torch.no_grad():
        model(x)
    handle.remove()
    phi = feats[0].double()
    head_part = 5 * (phi @ phi.T + 1)
    assert torch.allclose(G.empirical_ntk(model, x), head_part, rtol=1e-5, atol=1e-6)
    assert G.draw_zero_head_(model, seed=1) and not G.draw_zero_head_(model)  # draws once only
    w, (fan_out, fan_in) = model.head.weight, model.head.weight.shape
    if isinstance(model, vit.VisionTransformer):  # xavier-uniform: U(-b, b), b = sqrt(6 / (fan_in + fan_out))
        bound = math.sqrt(6 / (fan_in + fan_out))
        assert w.abs().max() <= bound and w.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.3)
    else:  # LeCun normal: std 1 / sqrt(fan_in), truncated at 2 std
        assert w.std().item() == pytest.approx(fan_in ** -0.5, rel=0.3) and w.abs().max() <= 2.3 * fan_in ** -0.5
    rest = G.empirical_ntk(model, x) - head_part  # now the rest of the network contributes
    assert torch.linalg.eigvalsh(rest)[0] > -1e-6 * rest.abs().max() and rest.abs().max() > 1e-2 * head_part.abs().max()


# ----------------------------------------------------------------------------- landscape
def some_batches(n=12, size=16, classes=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 3, size, size, generator=g), torch.randint(0, classes, (n,), generator=g)
    return [(x[:7], y[:7]), (x[7:], y[7:])]


def test_landscape_origin_is_the_loss_and_points_follow_the_directions():
    torch.manual_seed(0)
    model, batches = tiny_convmixer(), some_batches()
    model.train()  # the function must switch to eval mode itself (BatchNorm) and switch back
    with torch.no_grad():
        ref = sum(F.cross_entropy(model.eval()(x), y, reduction='sum').item() for x, y in batches) / 12
    model.train()
    before = [p.detach().clone() for p in model.parameters()]
    coords, losses = G.loss_landscape(model, F.cross_entropy, batches, dims=1, steps=5, span=0.5, seed=3)
    assert model.training and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert coords.tolist() == pytest.approx([-0.5, -0.25, 0, 0.25, 0.5])
    assert losses[2].item() == pytest.approx(ref, rel=1e-6)
    d = G.filter_normalized_directions(model, torch.Generator().manual_seed(3))
    with torch.no_grad():
        for p, w, di in zip(model.parameters(), before, d):
            p.copy_(w + 0.25 * di)
        model.eval()
        moved = sum(F.cross_entropy(model(x), y, reduction='sum').item() for x, y in batches) / 12
    assert losses[3].item() == pytest.approx(moved, rel=1e-5) and abs(moved - ref) > 1e-4
    _, grid = G.loss_landscape(tiny_vit(), F.cross_entropy, batches, dims=2, steps=3)
    assert grid.shape == (3, 3)


def test_landscape_grid_origin_is_exactly_zero():
    """The default grid (21 steps over [-1, 1]; table1's 11): its middle coordinate is 0, not float32
    linspace's -1.5e-8, and the grid is symmetric."""
    model, batches = tiny_convmixer(), some_batches(n=2)
    for steps in (21, 11):
        coords, _ = G.loss_landscape(model, F.cross_entropy, batches, dims=1, steps=steps, span=1.0)
        assert coords[steps // 2].item() == 0.0 and torch.equal(coords, -coords.flip(0))
        assert coords.tolist() == pytest.approx([-1 + 2 * i / (steps - 1) for i in range(steps)], abs=1e-15)


def test_filter_normalised_directions():
    torch.manual_seed(0)
    for model in (tiny_convmixer(), tiny_vit(), tiny_mixer()):
        dirs = G.filter_normalized_directions(model, torch.Generator().manual_seed(0))
        for (name, p), d in zip(model.named_parameters(), dirs):
            if p.dim() <= 1:  # biases, LayerNorm, BatchNorm: ignore='biasbn'
                assert not d.any(), name
            else:
                assert torch.allclose(d.flatten(1).norm(dim=1), p.detach().flatten(1).norm(dim=1), rtol=1e-5), name
                assert d.any() or not p.any(), name



def test_noise_on_device_draws_with_that_devices_generator(monkeypatch):
    """--noise-on-device (issue 37): the landscape's directions and flatness' eps come from a generator on the
    given device (proc.device; a CUDA generator on a GPU), the default from the CPU's. No GPU here: a spy records
    the device each generator is made for and hands back a CPU one, so the draws still run."""
    made, Generator = [], torch.Generator

    def spy(device='cpu'):
        made.append(str(device))
        return Generator()
    model, batches = tiny_convmixer(), some_batches()
    monkeypatch.setattr(torch, 'Generator', spy)
    _, default = G.loss_landscape(model, F.cross_entropy, batches, dims=1, steps=3, seed=1)
    flat = G.average_flatness(model, F.cross_entropy, batches, 0.01, 2, seed=1)
    assert made == ['cpu', 'cpu']
    _, on_device = G.loss_landscape(model, F.cross_entropy, batches, dims=1, steps=3, seed=1, noise_device='cuda')
    assert G.average_flatness(model, F.cross_entropy, batches, 0.01, 2, seed=1, noise_device='cuda') == flat
    assert made[2:] == ['cuda', 'cuda'] and torch.equal(on_device, default)  # (a CPU generator under the spy)

# ----------------------------------------------------------------------------- flatness
def test_average_flatness_zero_sigma_and_quadratic():
    n, sigma, samples = 20, 0.1, 400
    A, w = spd(n, 1), torch.zeros(n, dtype=torch.float64)  # at the minimum: no linear term to add variance
    model = Quadratic(A, w)
    assert G.average_flatness(model, IDENTITY_LOSS, ONE_BATCH, 0.0, 5) == 0.0
    got = G.average_flatness(model, IDENTITY_LOSS, ONE_BATCH, sigma, samples)
    # L(w + e) - L(w) = w^T A e + e^T A e / 2: mean sigma^2 tr(A) / 2, variance sigma^2 w^T A^2 w + sigma^4 tr(A^2) / 2
    mean = sigma ** 2 * torch.trace(A).item() / 2
    stderr = math.sqrt((sigma ** 2 * (w @ A @ A @ w) + sigma ** 4 * torch.trace(A @ A) / 2).item() / samples)
    assert abs(got - mean) < 4 * stderr
    assert torch.equal(model.w.detach(), w)  # restored


# ----------------------------------------------------------------------------- active neurons
def set_units(linear_or_conv, k):
    """Zero weight, bias +1 on the first k units and -1 on the rest: exactly k units are positive."""
    with torch.no_grad():
        linear_or_conv.weight.zero_()
        linear_or_conv.bias.fill_(-1.0)[:k] = 1.0


def test_active_neurons_exact_fraction():
    batches = some_batches()
    model = tiny_vit()  # hidden width 64
    set_units(model.blocks[0].mlp.fc1, 16)
    set_units(model.blocks[1].mlp.fc1, 48)
    assert G.active_neurons(model, batches) == {'blocks.0.mlp': 0.25, 'blocks.1.mlp': 0.75}
    model = tiny_mixer()  # token MLP hidden 8, channel MLP hidden 32
    set_units(model.blocks[0].mlp_tokens.fc1, 2)
    set_units(model.blocks[0].mlp_channels.fc1, 24)
    got = G.active_neurons(model, batches)
    assert (got['blocks.0.mlp_tokens'], got['blocks.0.mlp_channels']) == (0.25, 0.75) and len(got) == 4
    model = tiny_convmixer()  # 8 channels
    set_units(model.blocks[1][0].fn[0], 1)
    set_units(model.blocks[1][1], 6)
    got = G.active_neurons(model, batches)
    assert (got['blocks.1.depthwise'], got['blocks.1.pointwise']) == (0.125, 0.75) and len(got) == 4


def test_active_neurons_resnet_stage_outputs():
    """resnet20 with every conv zero and every BN bias zero but the last one of stage 1 (+1 on 4 of 16 channels):
    stage 1 ends with 4 of 16 channels positive, and the option-A shortcuts carry them on: 4 of 32, 4 of 64."""
    model = models.build_model('resnet20', 5, 32, cifar=True)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                m.weight.zero_()
            elif isinstance(m, nn.BatchNorm2d):
                m.bias.zero_()
        [b for b in model.modules() if isinstance(b, BasicBlock)][2].bn2.bias.fill_(-1.0)[:4] = 1.0
    got = G.active_neurons(model, some_batches(size=32))
    assert got == {'stage1': 4 / 16, 'stage2': 4 / 32, 'stage3': 4 / 64}


def test_calibrate_batchnorm_sets_the_statistics_of_the_images():
    model, batches = tiny_convmixer(), some_batches()
    x = torch.cat([xb for xb, _ in batches])
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    seen = {}  # what each BatchNorm sees in a train-mode pass over x: its statistics are the oracle
    handles = [bn.register_forward_hook(lambda m, i, o: seen.update({m: i[0]})) for bn in bns]  # returns None
    with torch.no_grad():
        train_out = model.train()(x)
        for h in handles:
            h.remove()
        fresh_eval = model.eval()(x)  # running statistics (0, 1): BN is the identity
    assert G.calibrate_batchnorm_(model, [(x,)]) and not model.training
    for bn in bns:
        assert torch.allclose(bn.running_mean, seen[bn].mean((0, 2, 3)), atol=1e-6)
        assert torch.allclose(bn.running_var, seen[bn].var((0, 2, 3)), rtol=1e-5)  # unbiased, as BatchNorm keeps it
    with torch.no_grad():
        calibrated = model(x)
    assert (calibrated - train_out).abs().max() < 0.1 * (fresh_eval - train_out).abs().max()


# ----------------------------------------------------------------------------- attention
def uniform_vit(img_size, patch_size, depth=2, heads=2):
    """A ViT with zero query and key weights: every logit is 0, so it attends uniformly."""
    model = tiny_vit(img_size=img_size, patch_size=patch_size, depth=depth, heads=heads)
    with torch.no_grad():
        for b in model.blocks:
            b.attn.qkv.weight[:2 * 16].zero_()
            b.attn.qkv.bias[:2 * 16].zero_()
    return model


def test_attention_distance_uniform_equals_mean_pairwise_distance():
    x = torch.randn(3, 3, 8, 8)
    # 2 x 2 grid of 4-px patches: of the 16 ordered pairs 4 are 0 apart, 8 are 4 px, 4 are 4 sqrt(2) px
    got = G.attention_distance(uniform_vit(8, 4), x)
    assert got.shape == (2, 2) and torch.allclose(got, torch.full((2, 2), 4 * (2 + math.sqrt(2)) / 4), rtol=1e-5)
    # 3 x 3 grid of 4-px patches (12 px images), by brute force over the pairs of patch centres
    cells = list(itertools.product(range(3), repeat=2))
    ref = sum(4 * math.dist(a, b) for a in cells for b in cells) / len(cells) ** 2
    got = G.attention_distance(uniform_vit(12, 4), torch.randn(2, 3, 12, 12))
    assert torch.allclose(got, torch.full((2, 2), ref), rtol=1e-5)


def test_attention_maps_and_rollout_of_uniform_attention():
    model, x = uniform_vit(8, 4, depth=3), torch.randn(5, 3, 8, 8)  # N + 1 = 5 tokens, L = 3
    assert torch.allclose(G.attention_maps(model, x), torch.full((3, 5, 2, 2, 2), 1 / 5))
    # ((U + I) / 2)^L = (I + (2^L - 1) U) / 2^L for U the uniform (idempotent) matrix: off-diagonal (2^L - 1) / (2^L N')
    assert torch.allclose(G.attention_rollout(model, x), torch.full((5, 2, 2), 7 / (8 * 5)))


# ----------------------------------------------------------------------------- end to end
def test_subcommands_end_to_end(cifar10_dir, tmp_path):
    out = tmp_path / 'geo'
    common = ['--model', 'vit_s4_cifar', '--model-kw', 'dim=16', 'depth=2', 'heads=2', '--data', str(cifar10_dir),
              '--images', '20', '--batch-size', '10', '--out', str(out)]
    G.main(['hessian', *common, '--blocks', '--iters', '3'])
    G.main(['ntk', *common, '--reduce', 'trace', '--chunk', '7'])
    G.main(['landscape', *common, '--dims', '2', '--steps', '3'])
    G.main(['flatness', *common, '--sigma', '0', '0.01', '--samples', '2'])
    G.main(['neurons', *common])
    G.main(['attention', *common, '--maps', '2'])
    files = sorted(os.listdir(out))
    for name in ('hessian.json', 'ntk.json', 'landscape.json', 'landscape_contour.png', 'landscape_surface.png',
                 'flatness.json', 'neurons.json', 'attention.json', 'attention_maps.png', 'attention_distance.png'):
        assert name in files
    hess = json.loads((out / 'hessian.json').read_text())
    assert set(hess['blocks']) == {'patch_embed', 'blocks.0.attn', 'blocks.0.mlp', 'blocks.1.attn', 'blocks.1.mlp', 'head'}
    assert 'eval mode' in hess['mode'] and math.isfinite(hess['lambda_max'])
    ntk = json.loads((out / 'ntk.json').read_text())
    assert ntk['head_drawn'] and len(ntk['eigenvalues']) == 20 and ntk['kappa'] > 1
    assert json.loads((out / 'flatness.json').read_text())['results'][0]['flatness'] == 0.0
    assert json.loads((out / 'attention.json').read_text())['distance_px'][0][0] > 0
    with pytest.raises(G.UserError, match='already'):  # never overwrites silently
        G.main(['neurons', *common])


def test_bad_input_is_one_line(tmp_path):
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    r = subprocess.run([sys.executable, 'geometry.py', 'hessian', '--model', 'vit_s4_cifar', '--model-kw', 'dim=abc',
                        '--data', str(tmp_path), '--out', str(tmp_path / 'o')], cwd=REPO, env=env,
                       capture_output=True, text=True)
    assert r.returncode != 0 and 'Traceback' not in r.stderr
    assert r.stderr.strip().startswith('geometry.py: error:') and len(r.stderr.strip().splitlines()) == 1


def test_imagenet_folder_feeds_the_eval_crop_of_its_val_images(cifar10_dir, tmp_path):
    """--dataset imagenet --split test: every val image of DIR/val/<wnid>/*, resized to img_size / 0.875 and
    centre-cropped (train_imagenet's eval), (x - 0.5) / 0.5 (the .npz's norm, no run of ours), labels from the
    sorted class folders (as many outputs as folders), the model drawn with --seed: lambda_max equals the one of the same model on the same
    images read here by torchvision."""
    import torchvision
    from PIL import Image
    from torchvision.transforms import v2
    for wnid, src in (('n01', 'airplane'), ('n02', 'cat'), ('n03', 'ship')):
        (tmp_path / 'in' / 'val' / wnid).mkdir(parents=True)
        for f in sorted(os.listdir(os.path.join(cifar10_dir, 'test', src)))[:4]:  # 32 px -> 80 x 72 px JPEGs
            Image.open(os.path.join(cifar10_dir, 'test', src, f)).convert('RGB').resize((80, 72)).save(
                tmp_path / 'in' / 'val' / wnid / f.replace('.jpg', '.JPEG'))
    kw = ['depth=1', 'dim=16', 'heads=2', 'patch_size=16']
    G.main(['hessian', '--dataset', 'imagenet', '--data', str(tmp_path / 'in'), '--split', 'test', '--images', '12',
            '--model', 'vit_ti16', '--model-kw', *kw, '--img-size', '32', '--iters', '20', '--tol', '1e-4',
            '--out', str(tmp_path / 'out')])
    got = json.load(open(tmp_path / 'out' / 'hessian.json'))
    tf = v2.Compose([v2.Resize(36), v2.CenterCrop(32), v2.PILToTensor(), v2.ToDtype(torch.float32, scale=True),
                     v2.Normalize([0.5] * 3, [0.5] * 3)])  # int(32 / 0.875) = 36
    ds = torchvision.datasets.ImageFolder(tmp_path / 'in' / 'val', tf)
    x, y = torch.stack([ds[i][0] for i in range(12)]), torch.tensor(ds.targets)
    torch.manual_seed(0)
    model = vit.create('vit_ti16', num_classes=3, img_size=32, depth=1, dim=16, heads=2, patch_size=16)  # 3 folders
    want = G.hessian_spectrum(model.eval(), F.cross_entropy, [(x, y)], iters=20, tol=1e-4)['lambda_max']  # same draws
    assert got['n'] == 12 and got['dataset'] == 'imagenet' and y.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert got['lambda_max'] == pytest.approx(want, rel=1e-5)


# ----------------------------------------------------------------------------- devices and processes
VIT = ['--model', 'vit_s4_cifar', '--model-kw', 'dim=16', 'depth=2', 'heads=2']
CONVMIXER = ['--model', 'convmixer_256_8', '--model-kw', 'dim=16', 'depth=2', 'kernel_size=3', 'patch_size=4']
SHARD_FLAGS = {'hessian': VIT + ['--iters', '4', '--tol', '0', '--top-k', '2', '--trace', '4', '--density'],
               # a ViT's zero head would make the loss flat along filter-normalised directions: a ConvMixer
               'landscape': CONVMIXER + ['--dims', '2', '--steps', '3'],
               'flatness': CONVMIXER + ['--sigma', '0.01', '0.05', '--samples', '2'], 'neurons': VIT}


@pytest.mark.parametrize('command,nproc', [('hessian', 2), ('hessian', 3), ('landscape', 3), ('flatness', 2),
                                           ('neurons', 3)])
def test_torchrun_splits_the_images_and_equals_one_process(cifar10_dir, tmp_path, command, nproc, one_thread):
    """`torchrun --nproc_per_node N geometry.py CMD` (gloo, CPU) against `python geometry.py CMD` on the same 24
    images. Batch 4: each process's batches (12 or 8 images) are batches of the one-process run, so what differs
    is the order of the sums, which fp32 rounds apart by ~1e-7 relative (CPU-dependent: vector width, threads);
    so 1e-5, while one image of 24 missed or counted twice moves every figure by percents, and n counts each image
    once. (With batches cut elsewhere float32 rounding alone moves lambda_max by ~1e-6.)"""
    common = [command, '--data', str(cifar10_dir), '--images', '24', '--batch-size', '4', *SHARD_FLAGS[command]]
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'CUDA_VISIBLE_DEVICES': ''}
    p = subprocess.Popen([sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node', str(nproc),
                          '--master_port', str(free_port()), 'geometry.py', *common, '--out', str(tmp_path / 'many')],
                         cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        G.main([*common, '--out', str(tmp_path / 'one')])  # on this process's one thread, beside torchrun's start-up
    finally:
        out, err = p.communicate(timeout=300)
    r = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count(f'geometry.py {command}') == 1  # rank 0 alone prints
    one, many = (json.loads((tmp_path / d / f'{command}.json').read_text()) for d in ('one', 'many'))
    assert (one['n'], many['n'], one['processes'], many['processes']) == (24, 24, 1, nproc)
    read = {'hessian': lambda d: [*d['eigenvalues'], d['trace'], d['trace_se'], *d['density']['nodes'],
                                  *d['density']['weights']], 'landscape': lambda d: d['loss'],
            'flatness': lambda d: [r['flatness'] for r in d['results']],
            'neurons': lambda d: list(d['active'].values())}
    got, want = (torch.tensor(read[command](d), dtype=torch.float64).flatten() for d in (many, one))
    assert torch.allclose(got, want, rtol=1e-5, atol=0), (got - want) / want
    assert len(set(want.tolist())) > 1 - (command == 'hessian')
    assert 'fp32, TF32 off' in r.stdout and one['precision'] == 'fp32, TF32 off'


def test_ntk_and_attention_refuse_torchrun(monkeypatch, tmp_path):
    monkeypatch.setenv('WORLD_SIZE', '2')  # torchrun's environment, checked before any process group
    for command in ('ntk', 'attention'):
        with pytest.raises(G.UserError, match='runs in one process'):
            G.main([command, *VIT, '--data', str(tmp_path), '--out', str(tmp_path)])


def test_subcommands_put_the_model_and_the_images_on_the_process_device(cifar10_dir, tmp_path, monkeypatch):
    """utils.setup() picks the device (cuda:LOCAL_RANK on a GPU machine); here it answers 'meta', and every
    sub-command must measure there: the model and the images it hands to the measurement. (The measurements are
    stubbed: meta tensors hold no values.)"""
    meta = torch.device('meta')
    process = utils.Process(0, 0, 1, meta, 'off', None, contextlib.nullcontext(), False)
    monkeypatch.setattr(G, 'setup', lambda amp: process)
    seen = []

    def on(model, x, result):  # records where the measurement got its model and images
        seen.append((next(model.parameters()).device, x.device))
        return result
    stubs = dict(hessian_spectrum=lambda m, f, b, *a, **k: on(m, b[0][0], dict(lambda_max=1.0, products=1,
                                                                                eigenvalues=[1.0], residuals=[0.0],
                                                                                converged=True)),
                 loss_landscape=lambda m, f, b, *a, **k: on(m, b[0][0], (torch.zeros(3), torch.rand(3, 3))),
                 average_flatness=lambda m, f, b, *a, **k: on(m, b[0][0], 0.0),
                 active_neurons=lambda m, b: on(m, b[0][0], {'blocks.0.mlp': 0.5}),
                 ntk_condition_number=lambda m, x, *a, **k: on(m, x, (2.0, torch.ones(3))),
                 attention_distance=lambda m, x: on(m, x, torch.ones(2, 2)),
                 attention_maps=lambda m, x: torch.ones(2, len(x), 2, 8, 8),
                 attention_rollout=lambda m, x: torch.ones(len(x), 8, 8))
    for name, stub in stubs.items():
        monkeypatch.setattr(G, name, stub)
    common = [*VIT, '--data', str(cifar10_dir), '--images', '10', '--out', str(tmp_path)]
    for command in ('hessian', 'ntk', 'landscape', 'flatness', 'neurons', 'attention'):
        G.main([command, *common, *{'attention': ['--maps', '2'], 'landscape': ['--steps', '3']}.get(command, [])])
    assert set(seen) == {(meta, meta)} and len(seen) == 8  # (flatness: one call per default --sigma, 3)


VIT = ['--model', 'vit_ti16', '--model-kw', 'depth=1', 'dim=16', 'heads=2', 'patch_size=8', '--images', '10']


@pytest.mark.parametrize('case, argv, words', [
    ('steps-1', ['landscape', *VIT, '--steps', '1'], '--steps must be odd and >= 3'),
    ('span-nan', ['landscape', *VIT, '--span', 'nan'], '--span must be a finite number > 0, got nan'),
    ('sigma-nan', ['flatness', *VIT, '--sigma', 'nan'], '--sigma finite and >= 0'),
    ('tol-negative', ['hessian', *VIT, '--tol', '-1'], '--tol must be a finite number >= 0, got -1.0'),
    ('tol-nan', ['hessian', *VIT, '--tol', 'nan'], '--tol must be a finite number >= 0, got nan'),
    ('attention-avg-pool', ['attention', *VIT[:7], 'pool=avg', *VIT[7:]], "attention reads a ViT's class token"),
    ('out-read-only', ['neurons', *VIT, '--out', '/sys/kernel/geo'], 'is not writable'),
    ('zero-head', ['hessian', *VIT, '--checkpoint', '{zero}'], 'has an all-zero classifier: fine-tune it first'),
    ('missing-checkpoint', ['hessian', '--checkpoint', '{dir}/nope.pt', '--images', '10'], 'nope.pt: no such file'),
])
def test_bad_input_is_one_clear_error_and_nothing_is_written(case, argv, words, cifar10_dir, tmp_path):
    """A new user's mistakes (issue 25): each one UserError before anything is measured or trained."""
    import shutil
    zero = vit.create('vit_ti16', num_classes=10, img_size=32, depth=1, dim=16, heads=2, patch_size=8)
    torch.save(zero.state_dict(), tmp_path / 'zero.pt')  # the JAX init: a zero head, as a MoCo backbone's
    few = tmp_path / 'few'
    for split, n in (('train', 10), ('test', 20)):
        for c in sorted(os.listdir(cifar10_dir / split)):
            (few / split / c).mkdir(parents=True)
            for f in sorted(os.listdir(cifar10_dir / split / c))[:n]:
                shutil.copy(cifar10_dir / split / c / f, few / split / c / f)
    fill = dict(zero=tmp_path / 'zero.pt', dir=tmp_path, few=few)
    argv = [a.format(**fill) for a in argv]
    argv += [] if '--data' in argv else ['--data', str(cifar10_dir)]
    argv += [] if '--out' in argv else ['--out', str(tmp_path / 'out')]
    with pytest.raises(G.UserError) as e:
        G.main(argv)
    assert words in str(e.value), str(e.value)
    assert not (tmp_path / 'out').exists() or not any((tmp_path / 'out').iterdir())


def test_ctrl_c_is_one_line_and_exit_130(cifar10_dir, tmp_path):
    stop = ('import runpy, sys, torch; real = torch.autograd.grad\n'
            'def grad(*a, **k): raise KeyboardInterrupt\n'
            'torch.autograd.grad = grad; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name="__main__")')
    r = subprocess.run([sys.executable, '-c', stop, 'geometry.py', 'hessian', *VIT, '--data', str(cifar10_dir),
                        '--out', str(tmp_path / 'o')], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert r.returncode == 130 and 'Traceback' not in r.stderr
    assert r.stderr.strip().splitlines() == ['geometry.py: interrupted; nothing of this measurement was written']


def test_runs_with_their_own_img_size_or_classes_are_measured_on_their_inputs(cifar10_dir, tmp_path):
    """A train_cifar.py --img-size 48 or --classes 3 5 run used to be refused blaming --model/--dataset: now the
    model is built as the run stored it, its images are its classes, upsampled as train_cifar.py feeds them."""
    import train_cifar
    common = ['--data', cifar10_dir, '--train-subset', 100, '--test-subset', 20, '--batch-size', 50, '--epochs', 1,
              '--model-kw', 'dim=16', 'depth=1', 'patch_size=4', 'kernel_size=3', '--log-every', 0, '--aug', 'basic']
    for name, extra, size, classes in (('big', ['--img-size', 48], 48, None), ('two', ['--classes', 3, 5], 32, [3, 5])):
        train_cifar.main([str(a) for a in [*common, *extra, '--out', tmp_path / name]])
        G.main(['neurons', '--checkpoint', str(tmp_path / name / 'last.pt'), '--data', str(cifar10_dir), '--images',
                '20', '--out', str(tmp_path / f'geo_{name}')])
        got = json.loads((tmp_path / f'geo_{name}' / 'neurons.json').read_text())
        model, _ = models.load_model(tmp_path / name / 'last.pt')  # the oracle: the images as train_cifar feeds them
        u8, y = data.load_cifar(cifar10_dir, 'cifar10', True, 20, classes)
        stats = [torch.tensor(v['cifar10']).view(1, 3, 1, 1) for v in (data.MEAN, data.STD)]
        x = data.resize((u8.float() / 255 - stats[0]) / stats[1], size)
        want = G.active_neurons(model, [(x, y)])
        assert got['n'] == 20 and got['active'] == pytest.approx(want, rel=1e-6), name


# ----------------------------------------------------------------------------- issue 34: a new user's second round
def tiny_vit_run(path, zero_head=False, **args):  # a last.pt of ours: a 2-block ViT for 32 px, 10 classes
    model = vit.create('vit_s4_cifar', num_classes=10, img_size=32, patch_size=8, dim=16, depth=1, heads=2)
    G.draw_zero_head_(model)  # (the JAX init's head is zero: a trained one is not)
    sd = {k: torch.zeros_like(v) if zero_head and k.startswith('head.') else v for k, v in model.state_dict().items()}
    stored = dict(model='vit_s4_cifar', model_kw=['patch_size=8', 'dim=16', 'depth=1', 'heads=2'], **args)
    torch.save({'model': sd, 'optimizer': {}, 'scaler': {}, 'epoch': 1, 'step': 1, 'history': [], 'args': stored}, path)
    return path


@pytest.mark.parametrize('case, argv, words', [
    ('M01', ['landscape', '--steps', '4'], '--steps must be odd and >= 3 (a grid through 0)'),
    ('M02', ['hessian', '--img-size', '64'], "--img-size only applies to ImageNet models; {ck} is a cifar10 model, "
                                             "which sees its run's 32 px with its data set's mean/std"),
    ('img-size-0', ['hessian', '--img-size', '0'], '--img-size must be a finite number > 0 and <= 1024, got 0'),
    ('seed-huge', ['neurons', '--seed', str(10 ** 23)],
     '--seed must be a finite number >= 0 and <= 9223372036854775807'),
    ('seed-negative', ['neurons', '--seed', '-1'], '--seed must be a finite number >= 0'),
    ('G04', ['ntk', '--checkpoint', '{zero}'], 'has an all-zero classifier: fine-tune it first (train_cifar.py '
     '--pretrained), or pass --keep-zero-head to measure the collapsed kernel'),
    ('zero-landscape', ['landscape', '--checkpoint', '{zero}'], 'has an all-zero classifier'),
])
def test_issue34_bad_inputs_are_one_true_line(case, argv, words, cifar10_dir, tmp_path):
    ck, zero = tiny_vit_run(tmp_path / 'ck.pt', dataset='cifar10'), tiny_vit_run(tmp_path / 'z.pt', True)
    argv = [a.format(zero=zero) for a in argv] + (['--checkpoint', str(ck)] if '--checkpoint' not in argv else [])
    with pytest.raises(G.UserError) as e:
        G.main([*argv, '--data', str(cifar10_dir), '--images', '10', '--out', str(tmp_path / 'out')])
    assert words.format(ck=ck) in str(e.value), str(e.value)
    assert not (tmp_path / 'out').exists() or not any((tmp_path / 'out').iterdir())


def test_zero_head_backbone_draws_attention_and_neurons_and_ntk_says_it_collapsed(cifar10_dir, tmp_path):
    """O01, O02: attention and neurons do not use the classifier: a MoCo backbone's zero head is no reason to refuse.
    G04: with --keep-zero-head, ntk.json says the kernel is the collapsed one."""
    zero = str(tiny_vit_run(tmp_path / 'z.pt', True))
    common = ['--checkpoint', zero, '--data', str(cifar10_dir), '--images', '10', '--out', str(tmp_path / 'o')]
    G.main(['neurons', *common])
    G.main(['attention', *common, '--maps', '1'])
    G.main(['ntk', *common, '--keep-zero-head'])
    ntk = json.loads((tmp_path / 'o' / 'ntk.json').read_text())
    assert ntk['head_zero'] and 'the head is all zeros: a collapsed kernel' in ntk['note']
    assert set(json.loads((tmp_path / 'o' / 'neurons.json').read_text())['active']) == {'blocks.0.mlp'}


def test_hessian_that_stops_at_iters_says_it_did_not_converge(cifar10_dir, tmp_path, capsys):
    """M03: --iters 1 wrote a lambda_max 1e5 times too small without a word. hessian.json now says which value did
    not reach --tol, and the console too; one that converged says so."""
    ck = str(tiny_vit_run(tmp_path / 'ck.pt', dataset='cifar10'))
    common = ['hessian', '--checkpoint', ck, '--data', str(cifar10_dir), '--images', '10']
    G.main([*common, '--iters', '1', '--out', str(tmp_path / 'one')])
    one = json.loads((tmp_path / 'one' / 'hessian.json').read_text())
    assert one['converged'] is False and 'NOT converged (all)' in one['note']
    assert '(NOT converged: --iters 1 ended it before a residual <= --tol |lambda|; raise --iters)' in \
        capsys.readouterr().out
    G.main([*common, '--iters', '200', '--tol', '1e-2', '--out', str(tmp_path / 'many')])
    many = json.loads((tmp_path / 'many' / 'hessian.json').read_text())
    assert many['converged'] is True and 'NOT converged' not in many['note']


def test_train_imagenet_run_is_measured_at_its_size_class_count_and_preprocessing(cifar10_dir, tmp_path):
    """G05-G07 (README: 'a model of train_imagenet.py: its last.pt names model, size and preprocessing'): a 3-class
    run at 48 px with crop_pct 1.0, bicubic, ImageNet mean/std used to be built at 224 px with 1000 classes. Now
    the oracle, the model and images built here by hand from those settings, gives the same lambda_max."""
    import torchvision
    from PIL import Image
    from torchvision.transforms import v2
    for wnid, src in (('n01', 'airplane'), ('n02', 'cat'), ('n03', 'ship')):
        (tmp_path / 'in' / 'train' / wnid).mkdir(parents=True)
        for f in sorted(os.listdir(os.path.join(cifar10_dir, 'train', src)))[:3]:  # 32 px -> 60 x 50 px JPEGs
            Image.open(os.path.join(cifar10_dir, 'train', src, f)).convert('RGB').resize((60, 50)).save(
                tmp_path / 'in' / 'train' / wnid / f.replace('.jpg', '.JPEG'))
    torch.manual_seed(1)
    model = vit.create('vit_ti16', num_classes=3, img_size=48, depth=1, dim=16, heads=2, patch_size=16)
    G.draw_zero_head_(model)
    stored = dict(recipe='sam', model='vit_ti16', model_kw=['depth=1', 'dim=16', 'heads=2', 'patch_size=16'],
                  img_size=48, norm='imagenet', crop_pct=1.0, eval_interp='bicubic')
    torch.save({'model': model.state_dict(), 'optimizer': {}, 'scaler': {}, 'step': 1, 'history': [],
                'args': stored, 'steps_per_epoch': 1}, tmp_path / 'last.pt')
    for extra in ([], ['--dataset', 'imagenet'], ['--img-size', '48']):  # G06, G05, G07
        out = tmp_path / f'out{len(extra)}{extra[-1] if extra else ""}'
        G.main(['hessian', '--checkpoint', str(tmp_path / 'last.pt'), '--data', str(tmp_path / 'in'), '--images', '9',
                '--iters', '20', '--tol', '1e-4', *extra, '--out', str(out)])
        got = json.loads((out / 'hessian.json').read_text())
        assert got['n'] == 9 and got['dataset'] == 'imagenet'
    tf = v2.Compose([v2.Resize(48, v2.InterpolationMode.BICUBIC), v2.CenterCrop(48), v2.PILToTensor(),
                     v2.ToDtype(torch.float32, scale=True), v2.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    ds = torchvision.datasets.ImageFolder(tmp_path / 'in' / 'train', tf)
    x, y = torch.stack([ds[i][0] for i in range(9)]), torch.tensor(ds.targets)
    # (the largest algebraic eigenvalue, as geometry reports it: power iteration would find the largest magnitude,
    # which torch 2.11's initial weights for this seed make a negative one)
    want = hessian.hessian_spectrum(model.eval(), F.cross_entropy, [(x, y)], iters=20, tol=1e-4)['lambda_max']
    assert got['lambda_max'] == pytest.approx(want, rel=1e-5)
    with pytest.raises(G.UserError, match=r'does not fit .*; built here at 32 px \(--img-size\) for the 3 class '
                                          'folders of'):
        G.main(['hessian', '--checkpoint', str(tmp_path / 'last.pt'), '--data', str(tmp_path / 'in'), '--img-size',
                '32', '--out', str(tmp_path / 'o32')])


# ----------------------------------------------------------------------------- issue 42: a new user's third round
def hold_lock(folder):
    """Another process holding FOLDER/.lock as runs.prepare_out does (flock), until the returned Popen is killed."""
    folder.mkdir(parents=True, exist_ok=True)
    p = subprocess.Popen([sys.executable, '-c', 'import fcntl, sys, time; f = open(sys.argv[1], "a"); '
                          'fcntl.flock(f, fcntl.LOCK_EX); print("held", flush=True); time.sleep(120)',
                          str(folder / '.lock')], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == 'held'
    return p


def test_a_second_run_into_a_held_out_is_refused_before_measuring(cifar10_dir, tmp_path, monkeypatch, one_thread):
    """Issue 42 (two runs into one --out: both said done, one result lost): while another process holds OUT/.lock, a
    measurement into OUT is one UserError (one line on the command line), before any image is read or measured."""
    monkeypatch.setattr(G.data, 'measurement_images', lambda *a, **k: pytest.fail('measured into a held --out'))
    holder = hold_lock(tmp_path / 'out')
    try:
        with pytest.raises(G.UserError) as e:
            G.main(['neurons', *VIT, '--data', str(cifar10_dir), '--out', str(tmp_path / 'out')])
    finally:
        holder.kill()
        holder.wait()
    assert str(e.value) == (f'--out {tmp_path / "out"} is in use by another run now (it holds '
                            f'{tmp_path / "out" / ".lock"}); pick another --out')
    assert sorted(os.listdir(tmp_path / 'out')) == ['.lock']


def test_table1_subcommand_points_to_table1_py():
    """Issue 43: the Table 1 runner is table1.py; the old command is one line naming the new one, flags kept."""
    with pytest.raises(G.UserError) as e:
        G.main(['table1', '--data', 'data/cifar10', '--preset', 'gpu', '--out', 'my table'])
    assert str(e.value) == "table1 is a script of its own now: python table1.py --data data/cifar10 --preset gpu " \
                           "--out 'my table'"


def test_help_says_lanczos_finds_the_largest_algebraic_eigenvalue(capsys):
    """H29: the command list said 'dominant eigenvalue (power iteration)'; hessian measures Lanczos's largest
    algebraic one, which can differ from the dominant one in sign and size."""
    with pytest.raises(SystemExit):
        G.get_args(['-h'])
    out = ' '.join(capsys.readouterr().out.split())
    assert 'hessian largest (algebraic) Hessian eigenvalue of the training loss, Lanczos' in out
    assert 'power iteration' not in out


@pytest.mark.parametrize('case, argv, words', [
    ('H08', ['hessian', '--images', '20', '--repeats', '30'],
     '--repeats 30 needs --images >= 30 (an image each), got 20'),
    ('H03', ['hessian', '--top-k', '500', '--iters', '20'], '--top-k 500 needs --iters >= {p} (the {p} eigenvalues of '
                                                            'its {p} parameters: all there are)'),
    ('top-k-iters', ['hessian', '--top-k', '5', '--iters', '3'], '--top-k 5 needs --iters >= 5'),
])
def test_issue42_bad_inputs_are_refused_before_measuring(case, argv, words, cifar10_dir, tmp_path, monkeypatch,
                                                         one_thread):
    monkeypatch.setattr(G.data, 'measurement_images', lambda *a, **k: pytest.fail('measured before refusing'))
    model = ['--model', 'convmixer_256_8', '--model-kw', 'dim=4', 'depth=1', 'kernel_size=3', 'patch_size=2']
    p = sum(q.numel() for q in models.build_model('convmixer_256_8', 10, 32, dict(dim=4, depth=1, kernel_size=3,
                                                                                  patch_size=2)).parameters())  # 186
    with pytest.raises(G.UserError) as e:
        G.main([*argv, *model, '--data', str(cifar10_dir), '--out', str(tmp_path / 'out')])
    assert str(e.value) == words.format(p=p)
    assert not (tmp_path / 'out').exists()


def test_compare_checks_for_pyhessian_before_measuring(cifar10_dir, tmp_path, monkeypatch, one_thread):
    """H26: without PyHessian, --compare was refused only after the whole Lanczos measurement, its result lost."""
    monkeypatch.setitem(sys.modules, 'pyhessian', None)  # import pyhessian: ImportError
    monkeypatch.setattr(G, 'hessian_spectrum', lambda *a, **k: pytest.fail('measured before refusing'))
    with pytest.raises(G.UserError, match=re.escape('--compare pyhessian needs pyhessian==0.1: pip install '
                                                    'pyhessian==0.1')):
        G.main(['hessian', *VIT, '--compare', '--data', str(cifar10_dir), '--out', str(tmp_path / 'out')])


def test_top_k_above_the_parameters_gives_all_of_them_and_says_so(cifar10_dir, tmp_path, capsys, one_thread):
    """H07: --top-k 500 on a model of P < 500 parameters (and each --blocks block of fewer) returned P eigenvalues
    under `top_k: 500`. Now the console says so, the JSON's top_k is P, every block has its own count, and each
    equals the full Hessian's spectrum (Lanczos to its invariant subspace: exact; eigh of the jacrev Hessian)."""
    kw = dict(dim=1, depth=1, kernel_size=3, patch_size=4)  # 87 parameters (bad-inputs-3's H07: 186)
    argv = ['hessian', '--model', 'convmixer_256_8', '--model-kw', *[f'{k}={v}' for k, v in kw.items()], '--data',
            str(cifar10_dir), '--images', '4', '--top-k', '500', '--iters', '500', '--tol', '1e-6', '--blocks',
            '--out', str(tmp_path)]
    G.main(argv)
    got = json.loads((tmp_path / 'hessian.json').read_text())
    torch.manual_seed(0)
    model = models.build_model('convmixer_256_8', 10, 32, kw, cifar=True).eval()
    p = sum(q.numel() for q in model.parameters())
    assert p < 500 and got['top_k'] == p and len(got['eigenvalues']) == p and got['converged']
    assert f'--top-k 500 is more than the parameters of all ({p:,})' in capsys.readouterr().out
    assert all(len(b['eigenvalues']) == sum(q.numel() for q in G.param_blocks(model)[name])
               for name, b in got['blocks'].items())
    x, y, _, _ = data.measurement_images(str(cifar10_dir), 'cifar10', True, 4, 32)
    model.double()
    names, shapes = [k for k, _ in model.named_parameters()], [q.shape for q in model.parameters()]

    def loss_of(w):
        ws = {k: t.view(s) for k, t, s in zip(names, w.split([s.numel() for s in shapes]), shapes)}
        return F.cross_entropy(torch.func.functional_call(model, ws, (x.double(),)), y)
    H = torch.func.jacrev(torch.func.grad(loss_of))(torch.cat([q.detach().flatten() for q in model.parameters()]))
    eig = torch.linalg.eigvalsh(H).flip(0)
    assert got['eigenvalues'][:5] == pytest.approx(eig[:5].tolist(), rel=1e-4, abs=1e-6 * eig[0].item())


def test_repeats_take_their_images_in_class_order_and_say_when_classes_cannot_balance(cifar10_dir, tmp_path,
                                                                                        monkeypatch, capsys,
                                                                                        one_thread):
    """H11: repeat j takes images j, j + R, ... of the images in class order, whatever order the data set gives them
    (torchvision's CIFAR: its own; here shuffled): with 4 images of each class and --repeats 4 each repeat holds one
    of each class, its lambda_max that of those 10 images measured directly. With 2 of each class (H10) no split is
    balanced: the JSON and the console say so."""
    real = data.measurement_images

    def shuffled(*a, **k):  # the images in another order than their classes
        x, y, shown, n = real(*a, **k)
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(5))
        return x[order], y[order], shown[order], n
    monkeypatch.setattr(G.data, 'measurement_images', shuffled)
    kw = ['dim=4', 'depth=1', 'kernel_size=3', 'patch_size=8']
    common = ['hessian', '--model', 'convmixer_256_8', '--model-kw', *kw, '--data', str(cifar10_dir), '--repeats', '4',
              '--iters', '4']
    G.main([*common, '--images', '40', '--out', str(tmp_path / 'even')])
    got = json.loads((tmp_path / 'even' / 'hessian.json').read_text())
    assert 'repeats_note' not in got and [r['images'] for r in got['repeats']] == [10] * 4
    x, y, _, _ = shuffled(str(cifar10_dir), 'cifar10', True, 40, 32)
    order = y.argsort(stable=True)  # the rule written out: class order (within a class, as given), then j::R
    x2, y2 = x[order][2::4], y[order][2::4]
    assert sorted(y2.tolist()) == list(range(10))
    torch.manual_seed(0)
    model = models.build_model('convmixer_256_8', 10, 32, models.parse_model_kw(kw), cifar=True).eval()
    want = G.hessian_spectrum(model, F.cross_entropy, [(x2, y2)], iters=4, seed=2)['lambda_max']
    assert got['repeats'][2]['lambda_max'] == pytest.approx(want, rel=1e-5)
    G.main([*common, '--images', '20', '--iters', '2', '--out', str(tmp_path / 'uneven')])
    note = json.loads((tmp_path / 'uneven' / 'hessian.json').read_text())['repeats_note']
    assert note.startswith('not class-balanced: 10 classes have an image count that does not divide by --repeats 4')
    assert f'repeats: {note}' in capsys.readouterr().out


@pytest.mark.parametrize('command', ['landscape', 'flatness'])
def test_noise_json_names_the_generator_that_drew_it(command, cifar10_dir, tmp_path, monkeypatch, one_thread):
    """--noise-on-device draws with the device's generator (on a GPU other numbers than the CPU's): flatness.json and
    landscape.json now name the generator, so two JSONs of other draws no longer look alike. The default: the CPU's;
    with the flag on a device (utils.setup answers 'meta' here, the measurement stubbed): that device's."""
    extra = {'landscape': ['--dims', '1', '--steps', '3'], 'flatness': ['--sigma', '0.01', '--samples', '1']}[command]
    common = [command, *CONVMIXER, '--data', str(cifar10_dir), '--images', '10', *extra]
    G.main([*common, '--out', str(tmp_path / 'cpu')])
    assert json.loads((tmp_path / 'cpu' / f'{command}.json').read_text())['noise_generator'] == \
        "torch.Generator('cpu') seeded with --seed 0"
    meta, seen = torch.device('meta'), []
    monkeypatch.setattr(G, 'setup', lambda amp: utils.Process(0, 0, 1, meta, 'off', None, contextlib.nullcontext(),
                                                              False))
    monkeypatch.setattr(G, 'loss_landscape', lambda *a, **k: seen.append(a[7]) or (torch.zeros(3), torch.zeros(3)))
    monkeypatch.setattr(G, 'average_flatness', lambda *a, **k: seen.append(a[6]) or 0.0)
    monkeypatch.setattr(G.figures, 'landscape', lambda *a: None)
    G.main([*common, '--noise-on-device', '--out', str(tmp_path / 'dev')])
    assert seen == [meta] and json.loads((tmp_path / 'dev' / f'{command}.json').read_text())['noise_generator'] == \
        "torch.Generator('meta') seeded with --seed 0"
