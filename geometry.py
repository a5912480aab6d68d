"""Loss geometry: the measurements behind Chen, Hsieh & Gong, "When Vision Transformers Outperform
ResNets without Pretraining or Strong Data Augmentations" (ICLR 2022), Sec. 3-4 and Table 1.

The paper's case is a measurement: ViTs and MLP-Mixers trained from scratch sit in sharp minima
(dominant Hessian eigenvalue ~10x ResNet's), their NTK at initialisation is badly conditioned, and
SAM flattens the minimum while making the first layers' neurons sparser. Each number is one call:

    hessian_eigenvalue(model, loss_fn, batches)    lambda_max of the training-loss Hessian (blocks too)
    ntk_condition_number(model, x)                  kappa = lambda_max / lambda_min of Theta = J J^T
    loss_landscape(model, loss_fn, batches)         1-D / 2-D slice along filter-normalised directions
    average_flatness(model, loss_fn, batches, ...)  E_eps L(w + eps) - L(w), eps ~ N(0, sigma^2 I)
    active_neurons(model, batches)                  fraction of positive hidden units per MLP layer
    attention_maps / attention_rollout / attention_distance   for ViTs

and a script, one sub-command each, plus `table1`, the paper's Table 1 in miniature on CIFAR-10:

    python geometry.py hessian --model vit_s4_cifar --checkpoint runs/x/last.pt --data DIR --out geo/ --blocks
    python geometry.py table1 --data DIR --out table1/        # trains 6 models, ~45 min on 2 CPU cores

Conventions (each is stated again in the JSON each sub-command writes):
  - Hessian, landscape, flatness, neurons, NTK and attention run in eval mode: BatchNorm uses its
    running statistics, dropout and drop-path are off (as PyHessian and loss-landscape do).
  - Batches are weighted by their size, so the result is that of the mean loss over all images.
  - Attention runs on PyTorch's composite ("math") SDPA kernel: the fused CPU kernel has no double
    backward and no vmap rule; the math kernel computes the same softmax(q k^T / sqrt(d)) v.
"""
import argparse
import contextlib
import functools
import itertools
import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, jacrev, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

from torchvision.models.resnet import BasicBlock, Bottleneck

import augment
import convmixer
import mixer
import train_cifar
import train_imagenet
import vit

EVAL_NOTE = 'eval mode: BatchNorm uses its running statistics; dropout and drop-path are off'


@contextlib.contextmanager
def evaluating(model):
    """model.eval() and the math attention kernel for the duration; the previous mode comes back after."""
    was_training = model.training
    model.eval()
    try:
        with sdpa_kernel(SDPBackend.MATH):  # double backward and vmap need the composite kernel
            yield model
    finally:
        model.train(was_training)


def mean_loss(model, loss_fn, batches):
    """The mean of loss_fn over every image: each batch's (mean) loss weighted by its size."""
    total, n = 0.0, 0
    with torch.no_grad():
        for x, y in batches:
            total += loss_fn(model(x), y).item() * len(x)
            n += len(x)
    return total / n


# -----------------------------------------------------------------------------
# 1. Dominant Hessian eigenvalue (paper Table 1, Fig. 1; PyHessian's power iteration)
def param_blocks(model):
    """{name: [parameters]}: the blocks whose sub-diagonal Hessian `hessian --blocks` reports.

    ViT: patch_embed (with cls_token and pos_embed), blocks.i.attn (with its norm1), blocks.i.mlp
    (with norm2), head (with the final norm). Mixer: stem, blocks.i.mlp_tokens (token-mixing MLP with
    norm1), blocks.i.mlp_channels (with norm2), head. Other models (ResNet, ConvMixer): each element
    of a top-level container named `blocks` or `layerN`, and every other top-level module on its own.
    """
    sublayer = ({'norm1': 'attn', 'norm2': 'mlp'} if isinstance(model, vit.VisionTransformer) else
                {'norm1': 'mlp_tokens', 'norm2': 'mlp_channels'} if isinstance(model, mixer.MlpMixer) else None)
    groups = {}
    for name, p in model.named_parameters():
        parts = name.split('.')
        if sublayer is not None:
            if parts[0] == 'blocks':  # blocks.i.{norm1,attn,norm2,mlp,...}.*
                key = f'blocks.{parts[1]}.{sublayer.get(parts[2], parts[2])}'
            elif parts[0] in ('cls_token', 'pos_embed', 'patch_embed', 'stem'):
                key = 'stem' if parts[0] == 'stem' else 'patch_embed'
            else:  # norm, fc_norm, pre_logits, head
                key = 'head'
        else:
            top = getattr(model, parts[0])
            split = isinstance(top, (nn.Sequential, nn.ModuleList)) and (
                parts[0] == 'blocks' or parts[0].startswith('layer'))
            key = '.'.join(parts[:2]) if split and len(parts) > 2 else parts[0]
        groups.setdefault(key, []).append(p)
    return groups


def _unit(vs):
    norm = torch.sqrt(sum((v * v).sum() for v in vs))
    return [v / norm for v in vs]


def hessian_eigenvalue(model, loss_fn, batches, params=None, iters=100, tol=1e-4, seed=0, *, progress=None):
    """The dominant eigenvalue of the Hessian of the mean training loss over `batches`.

    batches: a re-iterable of (x, y); loss_fn(model(x), y) is a batch mean, and batches are weighted
      by their size, as PyHessian does over a data loader.
    params: None (all trainable parameters) or an iterable of parameters: then it is the dominant
      eigenvalue of that diagonal block of the Hessian, e.g. one block's attention (param_blocks()).
    Power iteration (PyHessian, pyhessian/hessian.py): v <- Hv / ||Hv|| with Hessian-vector products
    by double backward, the Rayleigh quotient v^T H v as the estimate, stopping when it changes by
    less than `tol` relative (PyHessian's tol is 1e-3) or after `iters` products. Like every power
    iteration it finds the eigenvalue of largest magnitude (the sign is kept). Runs in eval mode.
    progress: optional callable taking one line of text per iteration.
    """
    params = [p for p in model.parameters() if p.requires_grad] if params is None else list(params)
    batches = list(batches)
    n = sum(len(x) for x, _ in batches)

    def hvp(v):  # H v = d/dw <grad L(w), v>, accumulated over batches weighted by size
        out = [torch.zeros_like(p) for p in params]
        for x, y in batches:
            grads = torch.autograd.grad(loss_fn(model(x), y), params, create_graph=True, allow_unused=True)
            live = [(g, u) for g, u in zip(grads, v) if g is not None and g.requires_grad]
            if live:  # a gradient that does not depend on the weights contributes nothing
                hv = torch.autograd.grad([g for g, _ in live], params, grad_outputs=[u for _, u in live],
                                         allow_unused=True)
                for o, h in zip(out, hv):
                    if h is not None:
                        o.add_(h, alpha=len(x) / n)
        return out

    gen = torch.Generator().manual_seed(seed)
    v = _unit([torch.randn(p.shape, generator=gen, dtype=p.dtype).to(p.device) for p in params])
    eig, start = None, time.time()
    with evaluating(model):
        for i in range(iters):
            hv = hvp(v)
            new = sum((h * u).sum() for h, u in zip(hv, v)).item()  # Rayleigh quotient, ||v|| = 1
            change = abs(new - eig) / (abs(eig) + 1e-6) if eig is not None else float('inf')
            if not any(h.any() for h in hv):  # H v = 0 for a random v: this (block of the) Hessian is 0,
                return 0.0                    # e.g. every block but the head's behind a zero head
            eig, v = new, _unit(hv)
            if progress:
                progress(f'power iteration {i + 1}/{iters} | lambda {eig:.6g} | rel. change {change:.1e} '
                         f'| {time.time() - start:.1f} s')
            if change < tol:
                break
    return eig


# -----------------------------------------------------------------------------
# 2. NTK condition number at initialisation (paper Table 1; Xiao et al. 2020)
def empirical_ntk(model, x, reduce='trace', chunk=None, *, progress=None):
    """The empirical NTK Theta = J J^T of model on the images x (n, 3, H, W), float64, in eval mode.

    reduce='trace': (n, n), Theta_ij = sum_c <df_c(x_i)/dtheta, df_c(x_j)/dtheta>;
    reduce='sum':   (n, n), the Jacobian of sum_c f_c (TE-NAS / AsViT lib/procedures/ntk.py);
    reduce='full':  (nC, nC), row i*C + c, so that a linear model gives X X^T (x) I.
    All trainable parameters count (AsViT keeps only 'weight' tensors). BatchNorm is in eval mode
    (running statistics), so each image's Jacobian is its own: this is what makes chunking exact.
    chunk: None computes every per-image Jacobian at once (n x C x P floats); an integer computes
      them `chunk` images at a time and forms Theta block by block, holding two chunks (2 x chunk x C
      x P floats; 'sum': C = 1) at the cost of recomputing chunks: k(k+1)/2 chunk Jacobians for k chunks.
    """
    if reduce not in ('trace', 'sum', 'full'):
        raise ValueError(f"reduce must be 'trace', 'sum' or 'full', got {reduce!r}")
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    buffers = dict(model.named_buffers())

    def f(p, xi):  # one image (3, H, W) -> its logits (C,), or their sum for 'sum'
        out = functional_call(model, (p, buffers), (xi[None],))[0]
        return out.sum() if reduce == 'sum' else out

    jacobian = vmap(jacrev(f), in_dims=(None, 0))  # {name: (m, C, *shape)} ('sum': (m, *shape))

    def gram(ja, jb):  # sum over parameters of <J_a, J_b>, in float64 (kappa can reach 1e6+)
        out = 0
        for name in ja:
            a = ja[name].flatten(1 if reduce == 'sum' else 2).double()  # (m, P) or (m, C, P)
            b = jb[name].flatten(1 if reduce == 'sum' else 2).double()
            out = out + (a @ b.T if reduce == 'sum' else torch.einsum('icp,jcp->ij', a, b)
                         if reduce == 'trace' else torch.einsum('icp,jdp->icjd', a, b).flatten(2).flatten(0, 1))
        return out

    chunks = x.split(chunk or len(x))
    pairs, done, start = len(chunks) * (len(chunks) + 1) // 2, 0, time.time()
    with evaluating(model):
        rows = []
        for a, xa in enumerate(chunks):
            ja = jacobian(params, xa)
            row = [None] * len(chunks)
            for b in range(a, len(chunks)):
                row[b] = gram(ja, ja if b == a else jacobian(params, chunks[b]))
                done += 1
                if progress and len(chunks) > 1:
                    progress(f'NTK block {done}/{pairs} | {time.time() - start:.1f} s')
            rows.append(row)
    # fill the lower triangle from the upper one: Theta is symmetric
    theta = torch.cat([torch.cat([rows[a][b] if b >= a else rows[b][a].T for b in range(len(chunks))], 1)
                       for a in range(len(chunks))], 0)
    return (theta + theta.T) / 2


def ntk_condition_number(model, x, reduce='trace', chunk=None, *, progress=None):
    """kappa = lambda_max / lambda_min of the empirical NTK (see empirical_ntk), and its eigenvalues
    (float64, ascending). kappa is inf when lambda_min <= 0 (a rank-deficient kernel, e.g. n > P).

    The paper measures kappa at initialisation. The official JAX init zeroes the ViT and Mixer heads,
    and then every Jacobian row but the head's is zero: Theta collapses to the Gram matrix of the
    head's input features. draw_zero_head_() redraws such a head before measuring (the script does).
    """
    eig = torch.linalg.eigvalsh(empirical_ntk(model, x, reduce, chunk, progress=progress))
    kappa = (eig[-1] / eig[0]).item() if eig[0] > 0 else float('inf')
    return kappa, eig


@torch.no_grad()
def calibrate_batchnorm_(model, batches):
    """Set every BatchNorm's running statistics to those of the images in `batches` (train-mode
    forwards with momentum=None: a cumulative average, each batch weighing the same; pass one batch for
    exactly its statistics), so that eval mode normalises as training does at this point. A freshly
    built model's statistics are (0, 1), which makes eval-mode BN the identity: resnet20's kappa at
    init measured so was ~20,000 here, against ~800 with the statistics of the same 100 images."""
    bns = [m for m in model.modules() if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d))]
    was_training, momenta = model.training, [bn.momentum for bn in bns]
    model.eval()  # only the BatchNorms in train mode: no dropout or drop-path in these passes
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None
        bn.train()
    for x, *_ in batches:
        model(x)
    for bn, momentum in zip(bns, momenta):
        bn.momentum = momentum
    model.train(was_training)
    return len(bns) > 0


@torch.no_grad()
def draw_zero_head_(model, seed=0):
    """If the classifier head's weight is all zero (the official JAX init of ViT and Mixer), draw it
    like the model's other dense layers: xavier-uniform for ViT (models_vit.py), LeCun-normal
    (Flax's Dense default) for Mixer; the bias stays zero. Returns whether it drew."""
    head = getattr(model, 'head', None)
    if not isinstance(head, nn.Linear) or head.weight.any():
        return False
    gen = torch.Generator().manual_seed(seed)
    w = torch.empty(head.weight.shape)
    if isinstance(model, mixer.MlpMixer):  # LeCun normal: truncated at 2 std, variance 1 / fan_in
        std = head.in_features ** -0.5 / .87962566103423978  # the std of N(0,1) truncated to +-2
        nn.init.trunc_normal_(w, std=std, a=-2 * std, b=2 * std, generator=gen)
    else:
        nn.init.xavier_uniform_(w, generator=gen)
    head.weight.copy_(w)
    return True


# -----------------------------------------------------------------------------
# 3. Loss landscape (Li et al. 2018; the paper's Fig. 1)
def filter_normalized_directions(model, generator):
    """One random direction, a tensor per parameter (Li et al. 2018, Sec. 4): Gaussian, then each
    filter (each slice along dim 0) scaled to the norm of the matching filter of the weights. Every
    1-D parameter (biases, LayerNorm, BatchNorm) gets a zero direction: loss-landscape's ignore='biasbn'."""
    dirs = []
    for p in model.parameters():
        if p.dim() <= 1:
            dirs.append(torch.zeros_like(p))
            continue
        d = torch.randn(p.shape, generator=generator, dtype=p.dtype).to(p.device)
        scale = p.detach().flatten(1).norm(dim=1) / (d.flatten(1).norm(dim=1) + 1e-10)  # per filter
        dirs.append(d * scale.view(-1, *[1] * (p.dim() - 1)))
    return dirs


def loss_landscape(model, loss_fn, batches, dims=1, steps=21, span=1.0, seed=0, *, progress=None):
    """The loss at w + a d1 (+ b d2) on a grid of `steps` points per axis from -span to +span, along
    filter-normalised random directions drawn from `seed` (the same seed gives the same draw on two
    models of one architecture; each is normalised to its own weights). Eval mode, weights restored.
    Returns (coords (steps,), losses (steps,) or (steps, steps) indexed [a, b])."""
    if dims not in (1, 2):
        raise ValueError(f'dims must be 1 or 2, got {dims}')
    gen = torch.Generator().manual_seed(seed)
    dirs = [filter_normalized_directions(model, gen) for _ in range(dims)]
    coords = torch.linspace(-span, span, steps)
    params = list(model.parameters())
    w0 = [p.detach().clone() for p in params]
    losses = torch.empty((steps,) * dims)
    start = time.time()
    try:
        with evaluating(model), torch.no_grad():
            for k, idx in enumerate(itertools.product(range(steps), repeat=dims)):
                for j, (p, w) in enumerate(zip(params, w0)):
                    p.copy_(w + sum(coords[i] * d[j] for i, d in zip(idx, dirs)))
                losses[idx] = mean_loss(model, loss_fn, batches)
                if progress and (k + 1) % steps == 0:
                    progress(f'landscape {k + 1}/{steps ** dims} points | {time.time() - start:.1f} s')
    finally:
        with torch.no_grad():
            for p, w in zip(params, w0):
                p.copy_(w)
    return coords, losses


# -----------------------------------------------------------------------------
# 4. Average flatness (the paper's contrast of SAM's worst-case sharpness with augmentation, Sec. 4.2)
def perturbed_losses(model, loss_fn, batches, sigma, samples, seed=0, *, progress=None):
    """(L(w), tensor of `samples` values L(w + eps)), eps ~ N(0, sigma^2 I) over every parameter
    (1-D ones included: the definition perturbs all of w). Eval mode; the weights are restored."""
    gen = torch.Generator().manual_seed(seed)
    params = list(model.parameters())
    w0 = [p.detach().clone() for p in params]
    out, start = [], time.time()
    try:
        with evaluating(model), torch.no_grad():
            base = mean_loss(model, loss_fn, batches)
            for s in range(samples):
                for p, w in zip(params, w0):
                    p.copy_(w + sigma * torch.randn(p.shape, generator=gen, dtype=p.dtype).to(p.device))
                out.append(mean_loss(model, loss_fn, batches))
                if progress:
                    progress(f'sigma {sigma:g}: sample {s + 1}/{samples} | {time.time() - start:.1f} s')
    finally:
        with torch.no_grad():
            for p, w in zip(params, w0):
                p.copy_(w)
    return base, torch.tensor(out, dtype=torch.float64)


def average_flatness(model, loss_fn, batches, sigma, samples, seed=0, *, progress=None):
    """E_eps[L(w + eps)] - L(w) with eps ~ N(0, sigma^2 I), estimated from `samples` draws."""
    base, losses = perturbed_losses(model, loss_fn, batches, sigma, samples, seed, progress=progress)
    return (losses - base).mean().item()  # each difference first: sigma = 0 gives exactly 0


# -----------------------------------------------------------------------------
# 5. Active neurons (paper Sec. 4.3: SAM leaves fewer active neurons in the first layers)
def activation_sites(model):
    """{name: (module, where)}: the hidden layers active_neurons counts, found on the model's own
    modules. where='input' counts z > 0 at the activation's input: GELU(z) > 0 and ReLU(z) > 0
    exactly when z > 0 (and the input is never underflowed to 0 as a tiny GELU output can be).
    where='output' counts a ResNet stage's output, the output of its last ReLU."""
    if isinstance(model, vit.VisionTransformer):
        return {f'blocks.{i}.mlp': (b.mlp.act, 'input') for i, b in enumerate(model.blocks)}
    if isinstance(model, mixer.MlpMixer):
        return {f'blocks.{i}.{part}': (getattr(b, part).act, 'input')
                for i, b in enumerate(model.blocks) for part in ('mlp_tokens', 'mlp_channels')}
    if isinstance(model, convmixer.ConvMixer):  # blocks.i.0.fn.{0 conv, 1 act, 2 BN}, blocks.i.{1 conv, 2 act, 3 BN}
        return {f'blocks.{i}.{part}': (m, 'input') for i, b in enumerate(model.blocks)
                for part, m in (('depthwise', b[0].fn[1]), ('pointwise', b[2]))}
    # ResNet: a stage is a run of residual blocks, a new one starting at each block with a downsampling
    # shortcut; count the output of its last block, i.e. after the stage's final ReLU.
    blocks = [m for m in model.modules() if isinstance(m, (BasicBlock, Bottleneck))]
    if not blocks:
        raise ValueError(f'active_neurons knows ViT, MLP-Mixer, ConvMixer and ResNets (torchvision residual '
                         f'blocks); {type(model).__name__} is none of them')
    ends = [b for b, after in zip(blocks, blocks[1:] + [None]) if after is None or after.downsample is not None]
    return {f'stage{i + 1}': (b, 'output') for i, b in enumerate(ends)}


def active_neurons(model, batches):
    """{layer: fraction of hidden units > 0}, over every unit, token/position and image in `batches`
    (each counted once), in eval mode. Layers as in activation_sites(): ViT one per block (the MLP's
    hidden layer), Mixer the token- and the channel-mixing MLP of each block, ResNet each stage's
    output after its ReLU, ConvMixer each block's depthwise and pointwise activation."""
    counts = {}

    def hook(name, where):
        def count(module, inputs, output):
            z = inputs[0] if where == 'input' else output
            pos, tot = counts.get(name, (0, 0))
            counts[name] = (pos + (z > 0).sum().item(), tot + z.numel())
        return count

    handles = [m.register_forward_hook(hook(name, where)) for name, (m, where) in activation_sites(model).items()]
    try:
        with evaluating(model), torch.no_grad():
            for x, _ in batches:
                model(x)
    finally:
        for h in handles:
            h.remove()
    return {name: pos / tot for name, (pos, tot) in counts.items()}


# -----------------------------------------------------------------------------
# 6. Attention (paper Sec. 4.4 and Fig. 3; ViT paper App. D.7 and Fig. 7)
def _attention(model, x, batch=32):
    """(L, B, heads, N, N) softmax maps of a ViT, computed `batch` images at a time."""
    if not isinstance(model, vit.VisionTransformer):
        raise ValueError(f'attention needs a ViT; {type(model).__name__} has no attention maps')
    with evaluating(model), torch.no_grad():
        return torch.cat([torch.stack(model.get_attention_maps(xb)) for xb in x.split(batch)], dim=1)


def _grid(model, x):
    p = model.patch_embed.proj.stride[0]
    return x.shape[-2] // p, x.shape[-1] // p, p


def attention_maps(model, x):
    """The class token's attention to each patch, per layer and head: (L, B, heads, H/p, W/p), the raw
    softmax weights (the class token's weight on itself is left out, not renormalised away)."""
    if model.num_prefix_tokens != 1:
        raise ValueError("attention maps read the class token's row; this ViT has pool='avg' and none")
    gh, gw, _ = _grid(model, x)
    a = _attention(model, x)
    return a[:, :, :, 0, 1:].reshape(*a.shape[:3], gh, gw)


def attention_rollout(model, x):
    """Attention rollout (Abnar & Zuidema 2020): average the heads, add the residual as (A + I) / 2,
    renormalise the rows, multiply across layers (rollout_l = A_l rollout_{l-1}); returns the class
    token's row over the patches, (B, H/p, W/p). Batched (vit-explain takes one image at a time)."""
    if model.num_prefix_tokens != 1:
        raise ValueError("rollout reads the class token's row; this ViT has pool='avg' and none")
    gh, gw, _ = _grid(model, x)
    a = _attention(model, x).mean(dim=2)  # (L, B, N, N): heads averaged
    a = (a + torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)) / 2
    a = a / a.sum(dim=-1, keepdim=True)
    rollout = a[0]
    for layer in a[1:]:
        rollout = layer @ rollout
    return rollout[:, 0, 1:].reshape(len(x), gh, gw)


def attention_distance(model, x):
    """Mean attention distance in pixels, (layers, heads), as ViT paper App. D.7 defines it: for each
    query patch the attention-weighted mean distance between patch centres, averaged over queries and
    images. The class token's row and column are dropped and each row renormalised to sum to 1."""
    gh, gw, p = _grid(model, x)
    a = _attention(model, x)[..., model.num_prefix_tokens:, model.num_prefix_tokens:]  # (L, B, H, N, N)
    a = a / a.sum(dim=-1, keepdim=True)
    rows, cols = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing='ij')
    centres = torch.stack([rows.flatten(), cols.flatten()], dim=1).double() * p + p / 2  # (N, 2) pixels
    dist = torch.cdist(centres, centres).to(a.dtype)  # (N, N)
    return (a * dist).sum(dim=-1).mean(dim=(1, 3))  # sum over keys, mean over images and queries


# =============================================================================
# The script: one sub-command per measurement, and `table1`.
NUM_CLASSES = {'cifar10': 10, 'cifar100': 100, 'imagenet': 1000}
OUTPUT = {'hessian': 'hessian.json', 'ntk': 'ntk.json', 'landscape': 'landscape.json', 'flatness': 'flatness.json',
          'neurons': 'neurons.json', 'attention': 'attention.json', 'table1': 'table1.json'}


class UserError(Exception):
    """A mistake in the command line or its files: one line on stderr, exit 1, no traceback."""


def get_args(argv=None):
    p = argparse.ArgumentParser(
        prog='geometry.py', formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description='Loss-geometry measurements of Chen, Hsieh & Gong (ICLR 2022) on any checkpoint of this '
                    'repo: Hessian lambda_max, NTK condition number, loss landscape, average flatness, active '
                    'neurons, attention; and `table1`, the paper\'s Table 1 in miniature on CIFAR-10.')
    sub = p.add_subparsers(dest='command', required=True, metavar='SUBCOMMAND')

    def command(name, n, help):  # one sub-command with the flags every measurement shares
        s = sub.add_parser(name, help=help, description=help, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        s.add_argument('--model', default=None,
                       help='a config of vit.py, mixer.py or convmixer.py, or a ResNet of the training '
                            "scripts (resnet20, ...); default: the one our --checkpoint stored")
        s.add_argument('--model-kw', nargs='+', action='extend', default=[], metavar='KEY=VALUE',
                       help='constructor overrides, e.g. dim=128 depth=4 (Python literals, else strings); '
                            'default: those our --checkpoint stored')
        s.add_argument('--checkpoint', default=None, metavar='PATH',
                       help="weights to measure: ours (last.pt), timm's, the official JAX .npz, locuslab's; "
                            'none = the freshly initialised model (seed --seed)')
        s.add_argument('--data', required=True, metavar='DIR',
                       help='CIFAR: what train_cifar.py --data takes; ImageNet: DIR/train and DIR/val, <wnid>/*.JPEG')
        s.add_argument('--dataset', default=None, choices=sorted(NUM_CLASSES),
                       help='default: the one our --checkpoint stored, else cifar10')
        s.add_argument('--img-size', type=int, default=224, help='ImageNet input size in pixels (CIFAR: 32)')
        s.add_argument('--norm', default=None, choices=sorted(train_imagenet.MEANS),
                       help='ImageNet input normalisation; default: what our --checkpoint stored, else jax (the .npz)')
        s.add_argument('--split', default='train', choices=['train', 'test'],
                       help='which images (ImageNet: test = DIR/val)')
        s.add_argument('--n', type=int, default=n, help='number of images, class-balanced')
        s.add_argument('--batch-size', type=int, default=250,
                       help='images per forward pass (memory only: every result is over all --n images)')
        s.add_argument('--seed', type=int, default=0,
                       help='seeds the initialisation (no --checkpoint) and every random draw here')
        s.add_argument('--out', required=True, metavar='DIR', help=f'receives {OUTPUT[name]} and the figures')
        s.add_argument('--overwrite', action='store_true', help=f'replace an existing {OUTPUT[name]} in --out')
        return s

    s = command('hessian', 2000, 'dominant Hessian eigenvalue of the training loss (power iteration, PyHessian)')
    s.add_argument('--blocks', action='store_true',
                   help="also one lambda_max per block (ViT: patch embedding, each block's attention and MLP, "
                        'head; Mixer: token- and channel-mixing MLPs; others: each block)')
    s.add_argument('--iters', type=int, default=100, help='most Hessian-vector products per eigenvalue')
    s.add_argument('--tol', type=float, default=1e-4, help='stop when lambda changes by less than this, relative')
    s = command('ntk', 200, 'condition number kappa of the empirical NTK (at initialisation without --checkpoint)')
    s.add_argument('--reduce', default='trace', choices=['trace', 'sum', 'full'],
                   help='trace: sum over classes of per-class kernels (n x n); sum: kernel of the summed logits '
                        '(TE-NAS / AsViT); full: the (nC x nC) kernel')
    s.add_argument('--chunk', type=int, default=0,
                   help='images per Jacobian chunk (memory ~ 2 x chunk x classes x params x 4 bytes; sum: '
                        'classes = 1); 0 = as many as keep that under 4 GB')
    s.add_argument('--keep-zero-head', action='store_true',
                   help='measure an all-zero head as it is (then Theta is the Gram matrix of the head\'s '
                        'features); default: draw it like the other dense layers first')
    s = command('landscape', 1000, 'loss along filter-normalised random directions (Li et al. 2018; paper Fig. 1)')
    s.add_argument('--dims', type=int, default=2, choices=[1, 2], help='1: a curve; 2: a surface')
    s.add_argument('--steps', type=int, default=21, help='grid points per direction')
    s.add_argument('--span', type=float, default=1.0, help='coordinates from -span to +span (units of the '
                                                           'filter-normalised direction)')
    s = command('flatness', 1000, 'average flatness E L(w + eps) - L(w), eps ~ N(0, sigma^2 I)')
    s.add_argument('--sigma', type=float, nargs='+', default=[0.01, 0.02, 0.05], help='noise std (weight units)')
    s.add_argument('--samples', type=int, default=20, help='Monte-Carlo draws per sigma')
    command('neurons', 5000, 'fraction of active (> 0) hidden units per MLP layer / stage')
    s = command('attention', 128, 'ViT attention maps, rollout and mean attention distance (ViT App. D.7)')
    s.add_argument('--images', type=int, default=8, help='images drawn with their attention maps')
    s = sub.add_parser('table1', formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       help="the paper's Table 1 in miniature: trains 6 models on CIFAR-10 and measures them",
                       description=TABLE1_HELP)
    s.add_argument('--data', required=True, metavar='DIR', help='the CIFAR-10 copy (what train_cifar.py --data takes)')
    s.add_argument('--out', required=True, metavar='DIR', help='runs/, table1.json, table1.md and the figures')
    s.add_argument('--jobs', type=int, default=2, help='training runs at a time (each with one CPU thread)')
    s.add_argument('--no-corruption', action='store_true',
                   help='leave out the accuracy under corruption even when robustness.py is importable')
    args = p.parse_args(argv)

    for name in ('n', 'batch_size', 'iters', 'steps', 'samples', 'images', 'jobs'):
        if getattr(args, name, 1) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(args, name)}")
    if getattr(args, 'chunk', 0) < 0 or getattr(args, 'span', 1) <= 0 or getattr(args, 'tol', 1) < 0:
        raise UserError('--chunk must be >= 0, --span > 0 and --tol >= 0')
    if any(s < 0 for s in getattr(args, 'sigma', [])):
        raise UserError(f'--sigma must be >= 0, got {args.sigma}')
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UserError(f'--out {args.out} is a file; pass a folder')
    return args


def progress_printer(prefix, every=5.0):
    """A progress callable that prints at most one line every `every` seconds (and never a first one
    before that: measurements shorter than a few seconds stay quiet)."""
    last = [time.time()]

    def log(msg):
        if time.time() - last[0] >= every:
            print(f'  {prefix} | {msg}', flush=True)
            last[0] = time.time()
    return log


def write_json(path, obj):
    """Atomically: PATH.tmp, then os.replace. Non-finite numbers are written as null."""
    clean = lambda v: ({k: clean(u) for k, u in v.items()} if isinstance(v, dict) else  # noqa: E731
                       [clean(u) for u in v] if isinstance(v, (list, tuple)) else
                       None if isinstance(v, float) and not math.isfinite(v) else v)
    tmp = path + '.tmp'
    try:
        with open(tmp, 'w') as f:
            json.dump(clean(obj), f, indent=1, allow_nan=False)
        os.replace(tmp, path)
    except OSError as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise UserError(f'could not write {path}: {e.strerror or e}') from None


def pyplot():
    """matplotlib, imported only where a figure is drawn."""
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError('figures need matplotlib (pip install matplotlib); the numbers were written to the '
                        'JSON file already') from None
    return plt


def save_figure(fig, path):
    fig.savefig(path + '.tmp', format='png', dpi=110, bbox_inches='tight')
    os.replace(path + '.tmp', path)
    pyplot().close(fig)


def stored_run_args(path):
    """model / model_kw / dataset as our training scripts store them in last.pt; {} for any other file."""
    try:
        ckpt = torch.load(path, map_location='cpu', weights_only=True)
    except Exception:  # not ours (an .npz, ...) or unreadable: load_weights names the problem
        return {}
    return ckpt['args'] if isinstance(ckpt, dict) and isinstance(ckpt.get('args'), dict) else {}


def load_model(args, device):
    """The model of --model/--model-kw (defaults from our checkpoint), initialised from --seed, then
    --checkpoint loaded through the training script's one loader. Returns (model, info for the JSON)."""
    stored = stored_run_args(args.checkpoint) if args.checkpoint and os.path.isfile(args.checkpoint) else {}
    args.model = args.model or stored.get('model')
    args.dataset = args.dataset or stored.get('dataset') or 'cifar10'
    if not args.model:
        raise UserError('--model is required (no --checkpoint of ours says which model it holds)')
    kw = train_cifar.parse_model_kw(args.model_kw) if args.model_kw else stored.get('model_kw') or {}
    if isinstance(kw, list):  # stored as the command line's KEY=VALUE strings
        kw = train_cifar.parse_model_kw(kw)
    script = train_imagenet if args.dataset == 'imagenet' else train_cifar
    torch.manual_seed(args.seed)
    try:
        if args.dataset == 'imagenet':
            model = train_imagenet.build_model(args.model, 1000, args.img_size, kw)
        else:
            model = train_cifar.build_model(args.model, NUM_CLASSES[args.dataset], kw, img_size=32)
        if args.checkpoint:
            script.load_weights(model, args.checkpoint)
    except script.UserError as e:
        raise UserError(str(e)) from None
    info = dict(model=args.model, model_kw=kw, checkpoint=args.checkpoint, dataset=args.dataset,
                init_seed=None if args.checkpoint else args.seed,
                params=sum(p.numel() for p in model.parameters()), mode=EVAL_NOTE)
    return model.to(device), info


def load_images(args, device):
    """(uint8 images (n, 3, H, W), labels (n,), normalised batches [(x, y), ...]) on `device`."""
    if args.dataset == 'imagenet':  # the checkpoint's own preprocessing (our runs store it), else the JAX one
        stored = (train_imagenet.stored_args(args.checkpoint) if args.checkpoint else None) or {}
        transform = train_imagenet.eval_transform(args.img_size, stored.get('crop_pct', 0.875),
                                                  stored.get('eval_interp', 'bilinear'),
                                                  args.norm or stored.get('norm', 'jax'))
        try:
            folder = train_imagenet.image_folder(args.data, 'train' if args.split == 'train' else 'val', transform,
                                                 args.img_size)
        except train_imagenet.UserError as e:
            raise UserError(str(e)) from None
        picks = torch.linspace(0, len(folder) - 1, min(args.n, len(folder))).long()  # evenly over the sorted classes
        x, y = (torch.stack(t).to(device) for t in zip(*[(folder[i][0], torch.tensor(folder[i][1])) for i in picks]))
        images = None  # already normalised by the eval transform
    else:
        try:
            images, y = train_cifar.load_cifar(args.data, args.dataset, train=args.split == 'train', subset=args.n)
        except train_cifar.UserError as e:
            raise UserError(str(e)) from None
        images, y = images.to(device), y.to(device)
        mean, std = (torch.tensor(v, device=device).view(1, 3, 1, 1) for v in
                     (train_cifar.MEAN[args.dataset], train_cifar.STD[args.dataset]))
        x = augment.normalize(images, mean, std)
    batches = list(zip(x.split(args.batch_size), y.split(args.batch_size)))
    return images, y, batches


def main(argv=None):
    args = get_args(argv)
    if args.command == 'table1':
        return table1(args)
    path = os.path.join(args.out, OUTPUT[args.command])
    if os.path.exists(path) and not args.overwrite:
        raise UserError(f'--out {args.out} already holds {OUTPUT[args.command]}; pick another --out or pass '
                        '--overwrite')
    os.makedirs(args.out, exist_ok=True)
    device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')
    model, info = load_model(args, device)
    if args.command == 'attention' and not isinstance(model, vit.VisionTransformer):
        raise UserError(f'attention needs a ViT; {args.model} is a {type(model).__name__}')
    images, labels, batches = load_images(args, device)
    info.update(split=args.split, n=len(labels))
    what = f"{args.model} ({args.checkpoint or f'init, seed {args.seed}'}) | {len(labels):,} {args.split} images"
    print(f'geometry.py {args.command} | {what} | {EVAL_NOTE}', flush=True)
    start, log = time.time(), progress_printer(args.command)
    COMMANDS[args.command](args, model, images, batches, info, path, log)
    print(f'  wrote {path} ({train_cifar.fmt_time(time.time() - start)} wall)')


def cmd_hessian(args, model, images, batches, info, path, log):
    lam = hessian_eigenvalue(model, F.cross_entropy, batches, None, args.iters, args.tol, args.seed, progress=log)
    print(f'  lambda_max (whole model) {lam:.6g}')
    blocks = {}
    for name, params in (param_blocks(model).items() if args.blocks else []):
        blocks[name] = hessian_eigenvalue(model, F.cross_entropy, batches, params, args.iters, args.tol, args.seed,
                                          progress=log)
        print(f'  lambda_max {name:24s} {blocks[name]:.6g}', flush=True)
    write_json(path, {**info, 'lambda_max': lam, 'blocks': blocks, 'iters': args.iters, 'tol': args.tol,
                      'note': 'dominant eigenvalue (largest |lambda|, sign kept) of the Hessian of the mean '
                              'cross-entropy; blocks: the diagonal block of that block\'s parameters'})


def cmd_ntk(args, model, images, batches, info, path, log):
    drawn = draw_zero_head_(model, args.seed) if not (args.checkpoint or args.keep_zero_head) else False
    x = torch.cat([xb for xb, _ in batches])
    calibrated = calibrate_batchnorm_(model, [(x,)]) if not args.checkpoint else False
    outputs = 1 if args.reduce == 'sum' else NUM_CLASSES[args.dataset]
    chunk = args.chunk or max(1, int(4e9 / (2 * 4 * outputs * info['params'])))
    kappa, eig = ntk_condition_number(model, x, args.reduce, chunk if chunk < len(x) else None, progress=log)
    note = (f"reduce={args.reduce}: " + {'trace': 'Theta_ij = sum_c <df_c(x_i), df_c(x_j)>',
                                         'sum': 'Theta_ij = <d sum_c f_c(x_i), d sum_c f_c(x_j)> (TE-NAS / AsViT)',
                                         'full': 'the (nC x nC) kernel'}[args.reduce]
            + '; all trainable parameters; BatchNorm in eval mode'
            + (' with running statistics set to those of these images (init)' if calibrated else '')
            + ('; the all-zero head of the official init was drawn like the other dense layers' if drawn else ''))
    write_json(path, {**info, 'kappa': kappa, 'reduce': args.reduce, 'chunk': min(chunk, len(x)), 'head_drawn': drawn,
                      'bn_calibrated': calibrated,
                      'lambda_max': eig[-1].item(), 'lambda_min': eig[0].item(), 'eigenvalues': eig.tolist(),
                      'note': note})
    print(f'  NTK kappa {kappa:.6g} (lambda {eig[-1].item():.4g} / {eig[0].item():.4g}) | {note}')


def cmd_landscape(args, model, images, batches, info, path, log):
    coords, losses = loss_landscape(model, F.cross_entropy, batches, args.dims, args.steps, args.span, args.seed,
                                    progress=log)
    write_json(path, {**info, 'dims': args.dims, 'directions_seed': args.seed, 'coords': coords.tolist(),
                      'loss': losses.tolist(), 'note': 'filter-normalised Gaussian directions (Li et al. 2018), '
                                                       "1-D parameters not moved (ignore='biasbn')"})
    mid = args.steps // 2
    print(f'  loss at the origin {losses[(mid,) * args.dims].item():.4f}, largest {losses.max().item():.4f} '
          f'(span +-{args.span:g})')
    plt = pyplot()
    if args.dims == 1:
        fig, ax = plt.subplots(figsize=(4, 3))
        ax.plot(coords.numpy(), losses.numpy())
        ax.set(xlabel='alpha', ylabel='training loss', title=args.model)
        save_figure(fig, os.path.join(args.out, 'landscape_curve.png'))
        return
    fig, ax = plt.subplots(figsize=(4, 3.5))
    cs = ax.contour(coords.numpy(), coords.numpy(), losses.T.numpy(), levels=20)  # losses[a, b]: a along x, b along y
    ax.clabel(cs, fontsize=6)
    ax.set(xlabel='direction 1', ylabel='direction 2', title=f'{args.model}: training loss')
    save_figure(fig, os.path.join(args.out, 'landscape_contour.png'))
    save_figure(surface_figure([(args.model, coords, losses)]), os.path.join(args.out, 'landscape_surface.png'))


def surface_figure(panels):
    """3-D surfaces side by side, one per (title, coords, losses), on one z scale (paper Fig. 1)."""
    plt = pyplot()
    fig = plt.figure(figsize=(4.2 * len(panels), 3.6))
    top = max(l.max().item() for _, _, l in panels)
    for i, (title, coords, losses) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1, projection='3d')
        a, b = torch.meshgrid(coords, coords, indexing='ij')
        ax.plot_surface(a.numpy(), b.numpy(), losses.numpy(), cmap='viridis', linewidth=0)
        ax.set(zlim=(0, top), title=title, zlabel='loss')
    return fig


def cmd_flatness(args, model, images, batches, info, path, log):
    results = []
    for sigma in args.sigma:
        base, losses = perturbed_losses(model, F.cross_entropy, batches, sigma, args.samples, args.seed, progress=log)
        flat = (losses - base).mean().item()
        stderr = (losses.std().item() / math.sqrt(args.samples)) if args.samples > 1 else float('nan')
        results.append(dict(sigma=sigma, flatness=flat, stderr=stderr, loss=base))
        print(f'  sigma {sigma:g}: E L(w + eps) - L(w) = {flat:.5g} +- {stderr:.2g} (loss {base:.4f})', flush=True)
    write_json(path, {**info, 'samples': args.samples, 'results': results,
                      'note': 'eps ~ N(0, sigma^2 I) over every parameter; +- is the Monte-Carlo standard error'})


def cmd_neurons(args, model, images, batches, info, path, log):
    fractions = active_neurons(model, batches)
    write_json(path, {**info, 'active': fractions, 'note': 'fraction of hidden units > 0 (GELU(z) > 0 iff z > 0), '
                                                           'over all units, tokens and images'})
    for name, f in fractions.items():
        print(f'  {name:24s} {100 * f:6.2f}% active')


def cmd_attention(args, model, images, batches, info, path, log):
    x = torch.cat([xb for xb, _ in batches])
    dist = attention_distance(model, x)  # (L, heads)
    k = min(args.images, len(x))
    rollout, last = attention_rollout(model, x[:k]), attention_maps(model, x[:k])[-1].mean(dim=1)
    write_json(path, {**info, 'distance_px': dist.tolist(), 'mean_distance_px_per_layer': dist.mean(1).tolist(),
                      'note': 'mean attention distance (ViT paper App. D.7) in pixels, [layer][head]; class '
                              'token dropped and rows renormalised'})
    print('  mean attention distance per layer (px): ' + ' '.join(f'{d:.1f}' for d in dist.mean(1).tolist()))
    plt = pyplot()
    fig = distance_figure([(args.model, dist)], x.shape[-1])
    save_figure(fig, os.path.join(args.out, 'attention_distance.png'))
    if images is None:  # ImageNet: the eval transform normalised them; show the network's input instead
        shown = (x[:k] - x[:k].amin(dim=(1, 2, 3), keepdim=True))
        shown = shown / shown.amax(dim=(1, 2, 3), keepdim=True)
    else:
        shown = images[:k].float() / 255
    fig, axes = plt.subplots(k, 3, figsize=(6, 2 * k), squeeze=False)
    for i in range(k):
        panels = (('image', None), ('class token, last layer', last[i]), ('rollout', rollout[i]))
        for j, (title, m) in enumerate(panels):
            ax = axes[i, j]
            ax.imshow(shown[i].permute(1, 2, 0).cpu().numpy())
            if m is not None:  # upsample the patch grid to the image, overlay
                up = F.interpolate(m[None, None], size=shown.shape[-2:], mode='nearest')[0, 0]
                ax.imshow((up / up.max()).cpu().numpy(), cmap='jet', alpha=0.5)
            ax.set_axis_off()
            if i == 0:
                ax.set_title(title, fontsize=8)
    save_figure(fig, os.path.join(args.out, 'attention_maps.png'))


def distance_figure(panels, img_size):
    """Mean attention distance of every head against depth (ViT paper Fig. 7), one panel per (title, dist)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3), squeeze=False, sharey=True)
    for ax, (title, dist) in zip(axes[0], panels):
        layers = torch.arange(1, dist.shape[0] + 1)[:, None].expand_as(dist)
        ax.scatter(layers.flatten().numpy(), dist.flatten().cpu().numpy(), s=12)
        ax.set(xlabel='network depth (layer)', title=title, ylim=(0, img_size), xticks=layers[:, 0].tolist())
    axes[0, 0].set_ylabel('mean attention distance (px)')
    return fig


COMMANDS = dict(hessian=cmd_hessian, ntk=cmd_ntk, landscape=cmd_landscape, flatness=cmd_flatness,
                neurons=cmd_neurons, attention=cmd_attention)


# =============================================================================
# Table 1 in miniature (paper Table 1: ResNet-152, ViT-B/16 and Mixer-B/16, each with and without SAM)
TABLE1_HELP = """The paper's Table 1 in miniature, from scratch: three families of ~0.3M parameters (resnet20, a
small ViT, a small Mixer) on a class-balanced 10,000-image subset of CIFAR-10 with crop + flip only (--aug basic,
the paper's setting), each trained with AdamW and with SAM for the same epochs (train_cifar.py, --jobs runs at a
time, one thread each), then measured: params, NTK kappa at initialisation (200 training images), Hessian
lambda_max (2,000 training images), training error (the 10,000, eval mode, no augmentation), test accuracy (all
10,000), active neurons in the first and last block (the 10,000), and accuracy under corruption
(robustness.corruption_accuracy on 500 test images, when robustness.py is importable). Finished runs in OUT/runs
are reused and unfinished ones resumed, so an interrupted table continues where it stopped."""
# Three families of ~0.3M parameters. The ViT and the Mixer cut 32 px images into 8 px patches (16 tokens): at
# 4 px (64 tokens) they cost 4x more per image, more than this budget holds. On 2 CPU cores resnet20 costs
# ~5x the other two per epoch, and converges faster: it gets fewer epochs (the same for AdamW and SAM in a
# family). rho: SAM's CIFAR default for the ResNet; for ViT and Mixer the best of 0.05, 0.1, 0.2, 0.5 on
# held-out training images (README, "Loss geometry").
TABLE1 = {
    'resnet20': dict(model='resnet20', model_kw=[], epochs=10, lr=2e-3, rho=0.05),
    'vit': dict(model='vit_s4_cifar', model_kw=['patch_size=8', 'dim=80', 'depth=4', 'heads=4'], epochs=20,
                lr=1e-3, rho=0.1),
    'mixer': dict(model='mixer_s4_cifar', model_kw=['patch_size=8', 'dim=96', 'depth=4', 'tokens_mlp_dim=48',
                                                    'channels_mlp_dim=384'], epochs=20, lr=1e-3, rho=0.1),
}
TABLE1_TRAIN = ['--dataset', 'cifar10', '--train-subset', '10000', '--test-subset', '1000', '--aug', 'basic',
                '--batch-size', '128', '--wd', '0.05', '--seed', '0', '--log-every', '0']
TABLE1_N = dict(train=10_000, hessian=2_000, ntk=200, landscape=500, attention=128, corruption=500)


def table1_runs(out):
    """{run: (folder, train_cifar.py argv)}, the SAM runs first: they take twice as long."""
    runs = {}
    for opt in ('sam', 'adamw'):
        for name, c in TABLE1.items():
            argv = ['--model', c['model'], *(['--model-kw', *c['model_kw']] if c['model_kw'] else []),
                    '--epochs', str(c['epochs']), '--lr', str(c['lr']), *TABLE1_TRAIN]
            runs[f'{name}_{opt}'] = (os.path.join(out, 'runs', f'{name}_{opt}'),
                                     argv + (['--sam', '--rho', str(c['rho'])] if opt == 'sam' else []))
    return runs


def run_state(folder, argv):
    """'done', 'resume' or 'new' for a run folder, after checking that a run there is this run."""
    last = os.path.join(folder, 'last.pt')
    if not os.path.exists(last):
        return 'new'
    have = torch.load(last, map_location='cpu', weights_only=True)
    want = vars(train_cifar.get_args(argv))
    differ = [k for k in ('model', 'model_kw', 'epochs', 'lr', 'wd', 'sam', 'rho', 'aug', 'batch_size',
                          'train_subset', 'seed') if have['args'].get(k) != want[k]]
    if differ:
        raise UserError(f'{folder} holds another run (' + ', '.join(f'{k}={have["args"].get(k)}' for k in differ)
                        + '; table1 wants ' + ', '.join(f'{k}={want[k]}' for k in differ)
                        + '); move it away or pick another --out')
    return 'done' if have['epoch'] >= want['epochs'] else 'resume'


def train_table1_runs(args, runs):
    """Train every run as a train_cifar.py subprocess, --jobs at a time with one OpenMP thread each,
    echoing their epoch lines; logs in OUT/logs/<run>.log."""
    import subprocess
    os.makedirs(os.path.join(args.out, 'logs'), exist_ok=True)
    todo = []
    for name, (folder, argv) in runs.items():
        state = run_state(folder, argv)
        if state == 'done':
            print(f'  {name}: finished run in {folder}, reused')
        else:
            todo.append((name, argv + (['--resume', os.path.join(folder, 'last.pt')] if state == 'resume'
                                       else ['--out', folder])))
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'train_cifar.py')
    env = {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1'}
    def echo(line):  # the epoch lines, and the first and last ones
        return line.startswith(('done', 'resumed')) or line.startswith('ep ') and '| train loss' in line

    active = {}  # name: (process, log file, lines echoed)
    try:
        while todo or active:
            while todo and len(active) < args.jobs:
                name, argv = todo.pop(0)
                log = open(os.path.join(args.out, 'logs', f'{name}.log'), 'a')
                print(f'  {name}: train_cifar.py {" ".join(argv)}', flush=True)
                proc = subprocess.Popen([sys.executable, script, '--data', args.data, *argv], stdout=log,
                                        stderr=subprocess.STDOUT, env=env)
                active[name] = (proc, log, 0)
            time.sleep(5)
            for name, (proc, log, shown) in list(active.items()):
                with open(log.name) as f:
                    lines = [line.rstrip() for line in f if echo(line)]
                for line in lines[shown:]:
                    print(f'  {name}: {line}', flush=True)
                active[name] = (proc, log, len(lines))
                if proc.poll() is not None:
                    log.close()
                    del active[name]
                    if proc.returncode:
                        raise UserError(f'training {name} failed (exit {proc.returncode}); see {log.name}')
    finally:
        for proc, log, _ in active.values():  # an error or Ctrl-C here: stop the other runs too
            proc.terminate()
            log.close()


@functools.lru_cache(maxsize=1)  # once per worker process
def table1_data(data, n):
    """The images table1 measures on (n: TABLE1_N's items): the 10,000 training images (and inside them,
    since balanced_subset takes the first images of each class, the 2,000 and the 200), the test set."""
    n = dict(n)
    try:
        train_u8, train_y = train_cifar.load_cifar(data, 'cifar10', True, n['train'])
        test_u8, test_y = train_cifar.load_cifar(data, 'cifar10', False)
    except train_cifar.UserError as e:
        raise UserError(str(e)) from None
    mean, std = (torch.tensor(v).view(1, 3, 1, 1) for v in (train_cifar.MEAN['cifar10'], train_cifar.STD['cifar10']))
    pick = lambda y, k: train_cifar.balanced_subset(y, n[k], 10)  # noqa: E731
    batches = lambda i: list(zip(augment.normalize(train_u8[i], mean, std).split(500), train_y[i].split(500)))  # noqa
    h, c = pick(train_y, 'hessian'), pick(test_y, 'corruption')
    return dict(train_u8=train_u8, train_y=train_y, test_u8=test_u8, test_y=test_y, mean=mean, std=std,
                all=batches(slice(None)), hessian=batches(h), landscape=batches(h[::n['hessian'] // n['landscape']]),
                ntk=augment.normalize(train_u8[pick(train_y, 'ntk')], mean, std), corrupt=(test_u8[c], test_y[c]),
                attention=augment.normalize(test_u8[pick(test_y, 'attention')], mean, std))


def table1_model(out, cfg, run=None):
    """A TABLE1 entry's model with the initial weights of its runs (train_cifar.main seeds like this before
    it builds), or with a run's trained weights."""
    torch.manual_seed(0)
    model = train_cifar.build_model(cfg['model'], 10, train_cifar.parse_model_kw(cfg['model_kw']))
    if run:
        train_cifar.load_weights(model, os.path.join(out, 'runs', run, 'last.pt'))
    return model


def first_last(fractions):
    """The active fraction of the first and the last block: ViT MLPs, Mixer channel MLPs, ResNet stages."""
    names = [n for n in fractions if not n.endswith(('mlp_tokens', 'depthwise'))]
    return fractions[names[0]], fractions[names[-1]]


def table1_job(job):
    """One measurement in a worker process: (kind, family, run, TABLE1 entry, TABLE1_N items, out, data) ->
    dict. The job carries its constants: a spawned worker re-imports this file."""
    kind, family, run, cfg, n, out, data = job
    d, t = table1_data(data, n), time.time()
    model = table1_model(out, cfg, run if kind != 'ntk' else None)
    log = progress_printer(f'{run or family} {kind}', every=30)
    if kind == 'ntk':  # at initialisation: the zero head drawn, BatchNorm statistics of these images
        drawn, _ = draw_zero_head_(model), calibrate_batchnorm_(model, [(d['ntk'],)])
        r = dict(head_drawn=drawn, **{f'kappa_{red}': ntk_condition_number(model, d['ntk'], red, 50, progress=log)[0]
                                       for red in ('trace', 'sum')})
    elif kind == 'hessian':  # PyHessian's tol: 1e-3 relative
        r = dict(lambda_max=hessian_eigenvalue(model, F.cross_entropy, d['hessian'], tol=1e-3, progress=log))
    elif kind == 'eval':
        acc = lambda x, y: train_cifar.evaluate(model, x, y, d['mean'], d['std'], 500)['top1']  # noqa: E731
        active = active_neurons(model, d['all'])
        r = dict(train_error=100 - acc(d['train_u8'], d['train_y']), test_acc=acc(d['test_u8'], d['test_y']),
                 active=active, active_first=first_last(active)[0], active_last=first_last(active)[1])
        if isinstance(model, vit.VisionTransformer):
            r['attention_distance_px'] = attention_distance(model, d['attention']).tolist()
    elif kind == 'landscape':  # the same directions seed for every run
        coords, losses = loss_landscape(model, F.cross_entropy, d['landscape'], 2, 13, 1.0, seed=0, progress=log)
        r = dict(coords=coords.tolist(), loss=losses.tolist())
    else:  # corruption: robustness.py (issue 14); the corrupted set is cached in OUT, made by the first call
        import robustness
        c = robustness.corruption_accuracy(model, *d['corrupt'], train_cifar.MEAN['cifar10'],
                                           train_cifar.STD['cifar10'], seed=0, batch_size=500,
                                           cache_dir=os.path.join(out, f'cifar10c-{len(d["corrupt"][1])}'))
        r = dict(corruption_acc=c['mean_acc'], corruption_clean_acc=c['clean']['acc'], corruption_note=c['note'])
    numbers = ' | '.join(f'{k} {v:.4g}' for k, v in r.items() if isinstance(v, float))
    print(f'  {run or family}: {kind} | {numbers} | {train_cifar.fmt_time(time.time() - t)}', flush=True)
    return r


def run_jobs(jobs, workers):
    """[job, ...] -> [result, ...] in `workers` spawned processes of one thread each: on 2 shared cores,
    OpenMP threads spinning at barriers while a neighbour holds a core make 2-thread runs several times slower."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    with ProcessPoolExecutor(workers, multiprocessing.get_context('spawn'), initializer=torch.set_num_threads,
                             initargs=(1,)) as pool:
        return list(pool.map(table1_job, jobs))


def table1(args):
    t0 = time.time()
    for name in ('table1.json', 'table1.md'):
        if os.path.exists(os.path.join(args.out, name)):
            raise UserError(f'--out {args.out} already holds {name}; move it away or pick another --out '
                            '(finished training runs in OUT/runs are reused)')
    corruption = False  # robustness.py (issue 14) adds the corrupted-accuracy column when it is importable
    if not args.no_corruption:
        try:
            import robustness
            corruption = callable(robustness.corruption_accuracy)
        except (ImportError, AttributeError) as e:
            print(f'  no corruption column: robustness.corruption_accuracy is not importable ({e})')
    print(f'geometry.py table1 | {len(TABLE1) * 2} runs on CIFAR-10 ({TABLE1_N["train"]:,} training images, '
          f'aug basic) | {EVAL_NOTE}', flush=True)

    # --- 1. training: train_cifar.py subprocesses ------------------------------------------------------------
    runs = table1_runs(args.out)
    train_table1_runs(args, runs)
    t_train = time.time() - t0
    print(f'  training done | {train_cifar.fmt_time(t_train)} wall', flush=True)
    n = tuple(TABLE1_N.items())
    table1_data(args.data, n)  # a data error stops here, with its message, before any worker starts

    # --- 2. the columns and the figures' numbers, the longest jobs first; the corrupted set is made once ------
    pairs = [(f, r) for r in runs for f in TABLE1 if r.startswith(f + '_')]
    job = lambda kind, f, r: (kind, f, r, TABLE1[f], n, args.out, args.data)  # noqa: E731
    jobs = ([job('hessian', f, r) for f, r in pairs] + [job('corruption', *pairs[0])] * corruption
            + [job('ntk', f, None) for f in TABLE1] + [job('landscape', 'vit', r) for r in ('vit_adamw', 'vit_sam')]
            + [job('eval', f, r) for f, r in pairs])
    results = {(j[0], j[2] or j[1]): r for j, r in zip(jobs, run_jobs(jobs, args.jobs))}
    later = [job('corruption', f, r) for f, r in pairs[1:]] if corruption else []  # read the cached set
    results.update({(j[0], j[2]): r for j, r in zip(later, run_jobs(later, args.jobs) if later else [])})
    rows = []
    for family, c in TABLE1.items():
        for opt in ('adamw', 'sam'):
            run = f'{family}_{opt}'
            rows.append(dict(run=run, family=family, sam=opt == 'sam', rho=c['rho'] if opt == 'sam' else None,
                             model=c['model'], model_kw=c['model_kw'], epochs=c['epochs'], lr=c['lr'],
                             params=sum(p.numel() for p in table1_model(args.out, c).parameters()),
                             **results[('ntk', family)], **results[('hessian', run)], **results[('eval', run)],
                             **results.get(('corruption', run), {})))

    # --- 3. figures: ViT with and without SAM (the landscape: the same directions seed) ----------------------
    vits = [(f'ViT{" + SAM" * r.endswith("sam")}', r) for r in ('vit_adamw', 'vit_sam')]
    grids = [(t, *(torch.tensor(results[('landscape', r)][k]) for k in ('coords', 'loss'))) for t, r in vits]
    save_figure(surface_figure(grids), os.path.join(args.out, 'landscape_vit.png'))
    dists = [(t, torch.tensor(results[('eval', r)]['attention_distance_px'])) for t, r in vits]
    save_figure(distance_figure(dists, 32), os.path.join(args.out, 'attention_distance_vit.png'))

    # --- 4. the table --------------------------------------------------------------------------------------------
    wall = time.time() - t0
    hardware = f'{os.cpu_count()} CPU cores, torch {torch.__version__}, {args.jobs} single-thread processes'
    write_json(os.path.join(args.out, 'table1.json'), dict(
        rows=rows, wall_s=wall, train_wall_s=t_train, n=TABLE1_N, train_flags=TABLE1_TRAIN, hardware=hardware,
        landscape={r: results[('landscape', r)] for _, r in vits}, conventions=[
            EVAL_NOTE, "kappa: the empirical NTK at initialisation on 200 training images, all parameters, the "
            "official init's zero ViT/Mixer head drawn like the other dense layers, BatchNorm statistics of those "
            "images", 'lambda_max: power iteration to a relative change of 1e-3 (PyHessian), 2,000 training images',
            'training error: the 10,000 training images, eval mode, no augmentation; test accuracy: all 10,000']))
    md = table1_markdown(rows, corruption) + (f'\n\nWall time {train_cifar.fmt_time(wall)} (training '
                                              f'{train_cifar.fmt_time(t_train)}); {hardware}.\n')
    with open(os.path.join(args.out, 'table1.md'), 'w') as f:
        f.write(md)
    print(md)
    print(f'done | table1 | {train_cifar.fmt_time(wall)} wall | {os.path.join(args.out, "table1.md")}')


def table1_markdown(rows, with_corruption):
    head = ['model', 'params', 'NTK kappa (trace)', 'NTK kappa (sum)', 'Hessian lambda_max', 'train error %',
            'test acc %', 'active first %', 'active last %'] + ['corrupted acc %'] * with_corruption
    lines = ['| ' + ' | '.join(head) + ' |', '|' + '---|' * len(head)]
    for r in rows:
        name = r['run'].replace('_adamw', ' (AdamW)').replace('_sam', f' + SAM (rho {r["rho"]})')
        cells = [name, f'{r["params"]:,}', f'{r["kappa_trace"]:.4g}', f'{r["kappa_sum"]:.4g}', f'{r["lambda_max"]:.4g}',
                 f'{r["train_error"]:.2f}', f'{r["test_acc"]:.2f}', f'{100 * r["active_first"]:.1f}',
                 f'{100 * r["active_last"]:.1f}'] + [f'{r.get("corruption_acc", float("nan")):.2f}'] * with_corruption
        lines.append('| ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


if __name__ == '__main__':
    try:
        main()
    except UserError as e:
        sys.exit(f'geometry.py: error: {e}')
