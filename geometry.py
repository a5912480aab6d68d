"""Loss geometry: the measurements behind Chen, Hsieh & Gong (ICLR 2022), Sec. 3-4 and Table 1: ViTs and Mixers
trained from scratch sit in sharp minima, their NTK at init is badly conditioned, SAM flattens the minimum and
sparsifies the first layers' neurons. One importable function per number (hessian_eigenvalue ntk_condition_number
loss_landscape average_flatness active_neurons attention_maps attention_rollout attention_distance), one
sub-command each; table1.py runs them on the models it trains. In eval mode (BatchNorm running statistics,
no dropout / drop-path; as PyHessian and loss-landscape), batches weighted by size: the mean loss over all images;
on the training scripts' device in fp32 (TF32 off); under torchrun the images are split over the processes."""
import argparse
import itertools
import math
import os
import shlex
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, jacrev, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel
from torchvision.datasets.folder import find_classes
from torchvision.models.resnet import BasicBlock, Bottleneck

import anchors
import convmixer
import data
import figures
import hessian
import mixer
import vit
from flags import check_ranges, check_shared_ranges
from hessian import hessian_eigenvalue, hessian_spectrum  # noqa: F401 (importable from here, as before)
from models import imagenet_only, load_model, parse_model_kw, run_dataset, zero_head
from runs import discard_new_dirs, prepare_out, save_atomic, stored_args
from utils import (UserError, first_set, fit, fmt_time, free_memory, init_group, leave, one_line, progress_printer,
                   saved_bytes, setup)

EVAL_NOTE = 'eval mode: BatchNorm uses its running statistics; dropout and drop-path are off'
PRECISION = 'fp32, TF32 off'
SHARDED = ('hessian', 'landscape', 'flatness', 'neurons')  # split the images over torchrun's processes


# model.eval() for the duration, then each module's own mode back; t summed over torchrun's processes (in place)
evaluating, all_sum = hessian.eval_mode, hessian.all_sum


@torch.no_grad()
def mean_loss(model, loss_fn, batches, weights=None):
    """The mean of loss_fn over every image (each batch's mean weighted by its size; under torchrun over every
    process's images), at `weights` ({name: tensor}, through torch.func.functional_call) or at the model's own
    weights. Summed on the device in float64, read once."""
    sums = torch.zeros(2, dtype=torch.float64, device=next(model.parameters()).device)
    for x, y in batches:
        out = functional_call(model, weights, (x,)) if weights else model(x)
        sums[0] += loss_fn(out, y).double() * len(x)
        sums[1] += len(x)
    total, n = all_sum(sums).tolist()
    return total / n


# ----------------------------------------------------------------------------- 1. Hessian lambda_max
def param_blocks(model):
    """{name: [parameters]}: `hessian --blocks`'s diagonal blocks. ViT: patch_embed (+ cls_token, pos_embed),
    blocks.i.attn (+ norm1), blocks.i.mlp (+ norm2), head (+ the final norm). Mixer: stem, blocks.i.mlp_tokens /
    mlp_channels (+ norms), head. Others: each element of a top-level Sequential / ModuleList, else each module."""
    sublayer = ({'norm1': 'attn', 'norm2': 'mlp'} if isinstance(model, vit.VisionTransformer) else
                {'norm1': 'mlp_tokens', 'norm2': 'mlp_channels'} if isinstance(model, mixer.MlpMixer) else None)
    groups = {}
    for name, p in model.named_parameters():
        parts = name.split('.')
        if sublayer is None:
            top = model if isinstance(model, nn.Sequential) else getattr(model, parts[0])
            key = '.'.join(parts[:2]) if isinstance(top, (nn.Sequential, nn.ModuleList)) and top is not model \
                else parts[0]
        elif parts[0] == 'blocks':  # blocks.i.{norm1, attn, norm2, mlp, ...}
            key = f'blocks.{parts[1]}.{sublayer.get(parts[2], parts[2])}'
        else:
            key = {'cls_token': 'patch_embed', 'pos_embed': 'patch_embed', 'patch_embed': 'patch_embed',
                   'stem': 'stem'}.get(parts[0], 'head')  # norm, fc_norm, head
        groups.setdefault(key, []).append(p)
    return groups


# ----------------------------------------------------------------------------- 2. NTK condition number
def empirical_ntk(model, x, reduce='trace', chunk=None, *, progress=None):
    """The empirical NTK Theta = J J^T on the images x (n, 3, H, W), float64, eval mode (Xiao et al. 2020).
    reduce='trace': (n, n), Theta_ij = sum_c <df_c(x_i)/dtheta, df_c(x_j)/dtheta>;
    reduce='sum':   (n, n), the Jacobian of sum_c f_c (TE-NAS / AsViT lib/procedures/ntk.py);
    reduce='full':  (nC, nC), row i*C + c: a linear model gives X X^T (x) I.
    All trainable parameters (AsViT keeps only 'weight' tensors). Eval-mode BatchNorm makes each image's
    Jacobian its own, so chunking is exact. chunk: per-image Jacobians of `chunk` images at a time, two chunks
    held (2 x chunk x C x P float64; one chunk: one), at the cost of recomputing: k(k+1)/2 chunk Jacobians for k
    chunks; each built straight into its float64 buffer, chunk / 8 images' float32 Jacobians at a time."""
    if reduce not in ('trace', 'sum', 'full'):
        raise ValueError(f"reduce must be 'trace', 'sum' or 'full', got {reduce!r}")
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    buffers = dict(model.named_buffers())

    def f(p, xi):  # one image (3, H, W) -> its logits (C,), or their sum
        out = functional_call(model, (p, buffers), (xi[None],))[0]
        return out.sum() if reduce == 'sum' else out

    def jac(xs, out):  # out[:len(xs)] = the (m, C, P) Jacobian ('sum': (m, 1, P)) in float64 (kappa reaches 1e6)
        for i in range(0, len(xs), sub):  # `sub` images' float32 Jacobian at a time, copied into the one buffer
            with sdpa_kernel(SDPBackend.MATH):  # vmap of the fused attention kernels' backward is not implemented
                j = vmap(jacrev(f), in_dims=(None, 0))(params, xs[i:i + sub])
            o = 0
            for t in j.values():
                t = t.reshape(len(t), out.shape[1], -1)
                out[i:i + len(t), :, o:o + t.shape[2]] = t
                o += t.shape[2]
        return out[:len(xs)]

    chunks, P = x.split(chunk or len(x)), sum(p.numel() for p in params.values())
    start, sub = [0, *itertools.accumulate(map(len, chunks))], max(1, len(chunks[0]) // 8)
    with evaluating(model), torch.no_grad():
        c = 1 if reduce == 'sum' else model(x[:1]).shape[1]
    bufs = [torch.empty(len(chunks[0]), c, P, dtype=torch.float64, device=x.device) for _ in chunks[:2]]
    c = c if reduce == 'full' else 1
    theta = torch.empty(len(x) * c, len(x) * c, dtype=torch.float64, device=x.device)
    with evaluating(model):
        for a, xa in enumerate(chunks):
            ja = jac(xa, bufs[0])
            for b in range(a, len(chunks)):
                jb = ja if b == a else jac(chunks[b], bufs[1])
                block = (torch.einsum('icp,jcp->ij', ja, jb) if reduce != 'full'
                         else torch.einsum('icp,jdp->icjd', ja, jb).flatten(2).flatten(0, 1))
                ia, ib = slice(start[a] * c, start[a + 1] * c), slice(start[b] * c, start[b + 1] * c)
                theta[ia, ib], theta[ib, ia] = block, block.T  # Theta is symmetric: each pair once
                if progress and len(chunks) > 1:
                    progress(f'NTK block ({a + 1}, {b + 1}) of {len(chunks)} x {len(chunks)}')
    return (theta + theta.T) / 2


def ntk_condition_number(model, x, reduce='trace', chunk=None, *, progress=None):
    """(kappa = lambda_max / lambda_min of empirical_ntk (inf when lambda_min <= 0), its eigenvalues ascending,
    float64). At initialisation the official JAX init's zero ViT / Mixer head leaves only the head's Jacobian rows:
    Theta is the Gram matrix of its features; draw_zero_head_() draws such a head first (the script does)."""
    eig = torch.linalg.eigvalsh(empirical_ntk(model, x, reduce, chunk, progress=progress))
    return (eig[-1] / eig[0]).item() if eig[0] > 0 else float('inf'), eig


@torch.no_grad()
def draw_zero_head_(model, seed=0):
    """If the head's weight is all zero (the official JAX init), draw it like the model's other dense
    layers: xavier-uniform for ViT (models_vit.py), LeCun-normal (Flax's Dense default) for Mixer; the bias
    stays zero. Returns whether it drew."""
    head = getattr(model, 'head', None)
    if not isinstance(head, nn.Linear) or head.weight.any():
        return False
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        mixer.lecun_normal_(head.weight) if isinstance(model, mixer.MlpMixer) else nn.init.xavier_uniform_(head.weight)
    return True


@torch.no_grad()
def calibrate_batchnorm_(model, batches):
    """Every BatchNorm's running statistics set to those of `batches` (train-mode forwards, momentum=None): eval mode
    then normalises as training would (a fresh model's (0, 1) statistics make it the identity)."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    momenta = [bn.momentum for bn in bns]
    with evaluating(model):  # only the BatchNorms in train mode (no dropout or drop-path); every mode back after
        for bn in bns:
            bn.reset_running_stats()
            bn.momentum = None
            bn.train()
        for x, *_ in batches:
            model(x)
    for bn, momentum in zip(bns, momenta):
        bn.momentum = momentum
    return len(bns) > 0


# ----------------------------------------------------------------------------- 3. Landscape, 4. flatness
def filter_normalized_directions(model, generator):
    """A random direction, a tensor per parameter (Li et al. 2018, Sec. 4): Gaussian, each filter (slice along dim 0)
    scaled to the norm of the weights' filter; 1-D parameters get zero, as loss-landscape's ignore='biasbn'."""
    dirs = []
    for p in model.parameters():
        if p.dim() <= 1:
            dirs.append(torch.zeros_like(p))
            continue
        d = torch.randn(p.shape, generator=generator, dtype=p.dtype, device=generator.device).to(p.device)
        scale = p.detach().flatten(1).norm(dim=1) / (d.flatten(1).norm(dim=1) + 1e-10)  # per filter
        dirs.append(d * scale.view(-1, *[1] * (p.dim() - 1)))
    return dirs


def loss_landscape(model, loss_fn, batches, dims=1, steps=21, span=1.0, seed=0, noise_device='cpu', directions=None,
                   *, progress=None):
    """The loss at w + a d1 (+ b d2) on `steps` points per axis in [-span, span], filter-normalised
    directions from `seed` (the same seed draws the same Gaussians for two models of one architecture).
    Eval mode; the model's weights are never touched (functional_call). Returns (coords (steps,),
    losses (steps,) or (steps, steps) indexed [a, b]). noise_device: where the Gaussians are drawn (a CUDA
    generator: the same distribution, other numbers than the CPU's; the CPU default draws the same on every device).
    directions: `dims` given directions instead (a tensor per parameter each: hessian_directions)."""
    if dims not in (1, 2):
        raise ValueError(f'dims must be 1 or 2, got {dims}')
    gen = torch.Generator(noise_device).manual_seed(seed)
    dirs = directions or [filter_normalized_directions(model, gen) for _ in range(dims)]
    # span * (2i - (steps - 1)) / (steps - 1) in float64: the middle point is exactly 0 (float32 linspace gave
    # -1.5e-8 there), and the grid is symmetric
    coords = torch.arange(steps, dtype=torch.float64).mul(2).sub(steps - 1).div(max(steps - 1, 1)).mul(span)
    names = [k for k, _ in model.named_parameters()]
    w0 = [p.detach() for p in model.parameters()]
    losses, start = torch.empty((steps,) * dims), time.time()
    with evaluating(model):
        for k, idx in enumerate(itertools.product(range(steps), repeat=dims)):
            w = {n: w + sum(float(coords[i]) * d[j] for i, d in zip(idx, dirs))
                 for j, (n, w) in enumerate(zip(names, w0))}
            losses[idx] = mean_loss(model, loss_fn, batches, w)
            if progress and (k + 1) % steps == 0:
                progress(f'landscape {k + 1}/{steps ** dims} points | {time.time() - start:.0f} s')
    return coords, losses


def hessian_directions(model, path, dims):
    """The first `dims` eigenvectors of `hessian --save-vectors` (PATH/hessian_vectors.pt, unit vectors over the
    trainable parameters: the top of the spectrum first), a tensor per parameter each (zero where not measured)."""
    try:
        saved = torch.load(path, map_location='cpu', weights_only=True)
    except (OSError, RuntimeError) as e:
        raise UserError(f'--directions {path}: {one_line(e)}; pass the hessian_vectors.pt of hessian --save-vectors')
    named = dict(model.named_parameters())
    if set(saved['names']) - set(named) or len(saved['vectors']) < dims:
        raise UserError(f'--directions {path}: its {len(saved["vectors"])} eigenvectors are not of this model\'s '
                        f'parameters or fewer than --dims {dims} (hessian --top-k {dims} --save-vectors on it)')
    sizes = [named[k].numel() for k in saved['names']]
    return [[dict(zip(saved['names'], v.split(sizes))).get(k, torch.zeros(p.numel())).view_as(p).to(p)
             for k, p in named.items()] for v in saved['vectors'][:dims]]


def average_flatness(model, loss_fn, batches, sigma, samples, seed=0, noise_device='cpu', *, progress=None):
    """E_eps[L(w + eps)] - L(w), eps ~ N(0, sigma^2 I) over every parameter (1-D ones too), from `samples`
    draws: the "average flatness" the paper contrasts with SAM's worst-case sharpness (Sec. 4.2). Eval mode.
    noise_device: where eps is drawn, as loss_landscape's."""
    gen = torch.Generator(noise_device).manual_seed(seed)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    with evaluating(model):
        base, out = mean_loss(model, loss_fn, batches), []
        for s in range(samples):
            w = {n: p + sigma * torch.randn(p.shape, generator=gen, dtype=p.dtype, device=gen.device).to(p.device)
                 for n, p in named}
            out.append(mean_loss(model, loss_fn, batches, w) - base)  # sigma = 0 gives exactly 0
            if progress:
                progress(f'sigma {sigma:g}: sample {s + 1}/{samples}')
    return sum(out) / samples


# ----------------------------------------------------------------------------- 5. Active neurons
def activation_sites(model):
    """{name: (module, where)}: the hidden layers active_neurons counts. 'input': z > 0 at the activation's
    input (GELU(z) > 0 and ReLU(z) > 0 exactly when z > 0); 'output': a ResNet stage's output, after its ReLU."""
    if isinstance(model, vit.VisionTransformer):
        return {f'blocks.{i}.mlp': (b.mlp.act, 'input') for i, b in enumerate(model.blocks)}
    if isinstance(model, mixer.MlpMixer):
        return {f'blocks.{i}.{part}': (getattr(b, part).act, 'input')
                for i, b in enumerate(model.blocks) for part in ('mlp_tokens', 'mlp_channels')}
    if isinstance(model, convmixer.ConvMixer):  # blocks.i.0.fn.{0 conv, 1 act, 2 BN}, blocks.i.{1 conv, 2 act, 3 BN}
        return {f'blocks.{i}.{part}': (m, 'input') for i, b in enumerate(model.blocks)
                for part, m in (('depthwise', b[0].fn[1]), ('pointwise', b[2]))}
    # ResNet: a stage starts at each block with a downsampling shortcut; count its last block's output
    blocks = [m for m in model.modules() if isinstance(m, (BasicBlock, Bottleneck))]
    if not blocks:
        raise ValueError(f'active_neurons knows ViT, MLP-Mixer, ConvMixer and torchvision-block ResNets, '
                         f'not {type(model).__name__}')
    ends = [b for b, nxt in zip(blocks, blocks[1:] + [None]) if nxt is None or nxt.downsample is not None]
    return {f'stage{i + 1}': (b, 'output') for i, b in enumerate(ends)}


def active_neurons(model, batches):
    """{layer: fraction of hidden units > 0} over every unit, token and image in `batches`, eval mode. Layers:
    ViT each block's MLP; Mixer each block's token and channel MLP; ResNet each stage; ConvMixer each block's
    depthwise and pointwise activation (paper Sec. 4.3: SAM leaves fewer active neurons in the first layers).
    Exact integer counts on the device, summed over torchrun's processes, read once."""
    sites = activation_sites(model)
    counts = torch.zeros(len(sites), 2, dtype=torch.int64, device=next(model.parameters()).device)  # (> 0, all)

    def hook(i, where):
        def count(module, inputs, output):
            z = inputs[0] if where == 'input' else output
            counts[i, 0] += (z > 0).sum()
            counts[i, 1] += z.numel()
        return count

    handles = [m.register_forward_hook(hook(i, where)) for i, (m, where) in enumerate(sites.values())]
    try:
        with evaluating(model), torch.no_grad():
            for x, _ in batches:
                model(x)
    finally:
        for h in handles:
            h.remove()
    return {name: pos / tot for name, (pos, tot) in zip(sites, all_sum(counts).tolist())}


# ----------------------------------------------------------------------------- 6. Attention (ViT)
def all_attention(model, x, batch=32, cls=False):
    """(L, B, heads, N, N) softmax maps of a ViT, `batch` images at a time; cls: it must have a class token."""
    if not isinstance(model, vit.VisionTransformer):
        raise ValueError(f'attention needs a ViT; {type(model).__name__} has no attention maps')
    if cls and model.num_prefix_tokens != 1:
        raise ValueError("this reads the class token's row; this ViT has pool='avg' and none")
    with evaluating(model), torch.no_grad():
        return torch.cat([torch.stack(model.get_attention_maps(xb)) for xb in x.split(batch)], dim=1)


def attention_maps(model, x):
    """The class token's attention to each patch: (L, B, heads, H/p, W/p), the raw softmax weights."""
    p, a = model.patch_embed.proj.stride[0], all_attention(model, x, cls=True)
    return a[:, :, :, 0, 1:].reshape(*a.shape[:3], x.shape[-2] // p, x.shape[-1] // p)


def attention_rollout(model, x):
    """Attention rollout (Abnar & Zuidema 2020): heads averaged, residual added as (A + I) / 2, rows
    renormalised, multiplied across layers; the class token's row over the patches, (B, H/p, W/p). Batched."""
    p, a = model.patch_embed.proj.stride[0], all_attention(model, x, cls=True).mean(dim=2)  # (L, B, N, N)
    a = (a + torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)) / 2
    a = a / a.sum(dim=-1, keepdim=True)
    rollout = a[0]
    for layer in a[1:]:
        rollout = layer @ rollout
    return rollout[:, 0, 1:].reshape(len(x), x.shape[-2] // p, x.shape[-1] // p)


def attention_distance(model, x):
    """Mean attention distance in px, (layers, heads) (ViT paper App. D.7): per query patch the attention-weighted
    mean distance to the key patches' centres, over queries and images; class token dropped, rows renormalised."""
    p, k = model.patch_embed.proj.stride[0], model.num_prefix_tokens
    a = all_attention(model, x)[..., k:, k:]  # (L, B, heads, N, N)
    a = a / a.sum(dim=-1, keepdim=True)
    rows, cols = torch.meshgrid(torch.arange(x.shape[-2] // p), torch.arange(x.shape[-1] // p), indexing='ij')
    centres = torch.stack([rows.flatten(), cols.flatten()], dim=1).double() * p + p / 2  # (N, 2) pixels
    return (a * torch.cdist(centres, centres).to(a)).sum(-1).mean(dim=(1, 3))  # keys; images, queries


# ----------------------------------------------------------------------------- Memory: defaults that fit the device
def ntk_chunk(model, x, reduce, chunk, free):
    """ntk's --chunk: as given, or the most images whose float64 Jacobian fits `free` bytes beside Theta (one chunk
    of all: one buffer; else two chunks); what cannot fit is refused in one line naming what would, before any work.
    An image's working set: its float32 Jacobian and c backward passes through its graph (saved_bytes)."""
    n, p = len(x), sum(p.numel() for p in model.parameters() if p.requires_grad)
    with evaluating(model), torch.no_grad():
        classes = model(x[:1]).shape[1]
    c, per_c = (1 if reduce == 'sum' else classes), (classes if reduce == 'full' else 1)
    with evaluating(model):
        work = c * (4 * p + saved_bytes(x[:2], lambda xs: model(xs).sum()))
    theta, per = (n * per_c) ** 2 * 8, lambda bufs: bufs * c * p * 8 + work / 8  # bytes per image of a chunk
    one = int((0.8 * free - theta - work) // per(1))  # images that fit as one chunk
    what = f'ntk --reduce {reduce} on {n} images ({per(1) / 2 ** 30:.2f} GiB per image)'
    hint = (f': --images {min(one, n)} fits as one chunk' if one >= 1 else '') + \
        (f'; try --reduce sum ({p * 8 / 2 ** 30:.2f} GiB per image)' if reduce != 'sum' else '')
    k = n if one >= n else fit(per(2), theta + work, free, n, what, hint)
    if chunk > k:
        raise UserError(f'{what}: --chunk {chunk} needs {(theta + work + per(2) * chunk) / 0.8 / 2 ** 30:.1f} GiB, '
                        f'{free / 2 ** 30:.1f} GiB free: --chunk {k} fits')
    return chunk or k


# ============================================================================= The script
NUM_CLASSES = {'cifar10': 10, 'cifar100': 100, 'imagenet': 1000}
N_DEFAULT = dict(hessian=2000, ntk=200, landscape=1000, flatness=1000, neurons=5000, attention=128)


def get_args(argv=None):
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    if argv[:1] == ['table1']:  # (issue 43: the Table 1 runner is a script of its own)
        raise UserError(f'table1 is a script of its own now: python table1.py {shlex.join(argv[1:])}')
    p = argparse.ArgumentParser(prog='geometry.py', description="Loss-geometry measurements of Chen, Hsieh & Gong "
                                "(ICLR 2022) on any checkpoint of this repo (the paper's Table 1 in miniature: "
                                'table1.py).', formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest='command', required=True, metavar='SUBCOMMAND')
    subs = {}
    for name, help in [('hessian', 'largest (algebraic) Hessian eigenvalue of the training loss, Lanczos'),
                       ('ntk', 'condition number of the empirical NTK (at initialisation without --checkpoint)'),
                       ('landscape', 'loss along filter-normalised random directions (Li et al. 2018; Fig. 1)'),
                       ('flatness', 'average flatness E L(w + eps) - L(w), eps ~ N(0, sigma^2 I)'),
                       ('neurons', 'fraction of active (> 0) hidden units per MLP layer / ResNet stage'),
                       ('attention', 'ViT attention maps, rollout and mean attention distance (ViT App. D.7)')]:
        s = subs[name] = sub.add_parser(name, help=help, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        s.add_argument('--model', help='a config of vit/mixer/convmixer.py or resnet20/18; default: our checkpoint\'s')
        s.add_argument('--model-kw', nargs='+', action='extend', default=[], metavar='KEY=VALUE', help='constructor '
                       "overrides (Python literals); default: what our --checkpoint stored")
        s.add_argument('--checkpoint', metavar='PATH', help="ours (last.pt), timm's, the official .npz, locuslab's; "
                       'none = the freshly initialised model (--seed)')
        s.add_argument('--data', required=True, metavar='DIR', help='what the training script takes as --data')
        s.add_argument('--dataset', choices=sorted(NUM_CLASSES), help='default: our checkpoint\'s, else cifar10')
        s.add_argument('--img-size', type=int, help="ImageNet models' input px (default: our last.pt's, else 224); "
                       "CIFAR models see their run's own")
        s.add_argument('--split', default='train', choices=['train', 'test'], help='which images (ImageNet: val)')
        s.add_argument('--images', type=int, default=N_DEFAULT[name], help='images (CIFAR: class-balanced)')
        s.add_argument('--batch-size', type=int, default=0 if name == 'hessian' else 250, help='images per forward '
                       '(memory only)' + '; 0 = as many as fit the free memory' * (name == 'hessian'))
        s.add_argument('--seed', type=int, default=0, help='the initialisation without --checkpoint, every draw')
        s.add_argument('--out', required=True, metavar='DIR', help=f'receives {name}.json and the figures')
        s.add_argument('--overwrite', action='store_true', help=f'replace an existing {name}.json')
    h = subs['hessian']
    h.add_argument('--top-k', type=int, default=1, help='largest algebraic eigenvalues, by Lanczos; the first is the '
                   "paper's lambda_max")
    h.add_argument('--trace', type=int, nargs='?', const=100, default=0, metavar='PRODUCTS', help='also tr H from '
                   'PRODUCTS Hessian-vector products (PyHessian: 100) by --trace-estimator, with its standard error')
    h.add_argument('--trace-estimator', default='xtrace', choices=['xtrace', 'hutchinson', 'hutchpp'], help='xtrace: '
                   'Epperly, Tropp & Webber 2024, a smaller error than Hutchinson at equal products (docs/geometry.md)')
    h.add_argument('--bottom-k', type=int, default=0, help='also the K smallest algebraic eigenvalues (lambda_min, '
                   'and |lambda_min| / lambda_max), by a second Lanczos run')
    h.add_argument('--curvature', default='hessian', choices=['hessian', 'ggn'], help='ggn: the Gauss-Newton matrix '
                   'of the cross-entropy, J^T H_out J (positive semi-definite) instead of the Hessian')
    h.add_argument('--save-vectors', action='store_true', help='also write the eigenvectors of --top-k (and '
                   '--bottom-k) to OUT/hessian_vectors.pt (the first repeat, all parameters): landscape --directions')
    h.add_argument('--vectors-per-call', type=int, default=1, metavar='K', help='--trace and --density multiply K '
                   'vectors per call, through one (vmapped) backward: more memory, fewer passes')
    h.add_argument('--density', type=int, nargs='?', const=1, default=0, metavar='PROBES', help='also the spectral '
                   'density by stochastic Lanczos quadrature, PROBES runs of --iters steps (PyHessian: 1 of 100)')
    h.add_argument('--blocks', action='store_true', help='each of these for each block too (param_blocks)')
    h.add_argument('--repeats', type=int, default=1, help='split --images into this many disjoint subsets (probe '
                   'seed --seed + i): each measured, then mean and std')
    h.add_argument('--iters', type=int, default=100, help='most Hessian-vector products per Lanczos run')
    h.add_argument('--tol', type=float, default=1e-4, help='stop at residual ||Hv - lambda v|| <= tol |lambda|')
    h.add_argument('--hvp', default='auto', choices=['auto', 'reverse', 'cached', 'forward'], help='hessian.'
                   "hvp_operator's mode; auto: cached for one batch, else reverse (README: measured)")
    h.add_argument('--compare', nargs='*', choices=['pyhessian', 'curvlinops', 'eigenthings'], metavar='LIBRARY',
                   help='HVPs and seconds to lambda_max within 1e-4: Lanczos, power iteration and PyHessian 0.1 '
                   '(these two converge to the largest-magnitude eigenvalue, which may be another); with LIBRARY '
                   'names each side by side (anchors.py); the first repeat\'s images as one batch')
    subs['ntk'].add_argument('--reduce', default='trace', choices=['trace', 'sum', 'full'], help='trace: sum of '
                             'per-class kernels; sum: of the summed logits (TE-NAS, AsViT); full: (nC x nC)')
    subs['ntk'].add_argument('--chunk', type=int, default=0, help='images per Jacobian chunk; 0 = as many as fit the '
                             'free memory (all: one chunk)')
    subs['ntk'].add_argument('--keep-zero-head', action='store_true', help='at init: do not draw an all-zero head; '
                             'a --checkpoint with one: measure it (refused without)')
    subs['landscape'].add_argument('--dims', type=int, default=2, choices=[1, 2])
    subs['landscape'].add_argument('--steps', type=int, default=21, help='grid points per direction')
    subs['landscape'].add_argument('--span', type=float, default=1.0, help='coordinates in [-span, span]')
    subs['landscape'].add_argument('--directions', metavar='PATH', help="hessian --save-vectors' hessian_vectors.pt: "
                                   'along the top --dims eigenvectors (unit, in weight units) instead of random ones')
    subs['flatness'].add_argument('--sigma', type=float, nargs='+', default=[0.01, 0.02, 0.05], help='noise std')
    subs['flatness'].add_argument('--samples', type=int, default=20, help='Monte-Carlo draws per sigma')
    for name in ('landscape', 'flatness'):
        subs[name].add_argument('--noise-on-device', action='store_true', help="draw the random directions / noise "
                                "with the device's generator (faster on a GPU; other numbers than the default CPU's)")
    subs['attention'].add_argument('--maps', type=int, default=8, help='images drawn with their maps')
    args = p.parse_args(argv)
    has = lambda *keys: [k for k in keys if hasattr(args, k)]  # noqa: E731  (each sub-command has some of them)
    sized = ['batch_size'] if args.command == 'hessian' else []  # (0: sized from the free memory)
    check_ranges(args, has('images', 'iters', 'top_k', 'repeats', 'samples', 'maps', 'span', 'vectors_per_call',
                           *{'batch_size'} - set(sized)),
                 has('chunk', 'tol', 'trace', 'density', 'bottom_k', *sized), {})
    check_shared_ranges(args, 'img_size', 'seed')
    if getattr(args, 'steps', 3) < 3 or getattr(args, 'steps', 3) % 2 == 0 or not all(
            math.isfinite(v) and v >= 0 for v in getattr(args, 'sigma', [])):  # (an even grid has no point at 0)
        raise UserError('--steps must be odd and >= 3 (a grid through 0) and --sigma finite and >= 0')
    least = dict(xtrace=4, hutchpp=6).get(getattr(args, 'trace_estimator', ''), 1)  # 2 test vectors / probes each
    if 0 < getattr(args, 'trace', 0) < least:
        raise UserError(f'--trace {args.trace}: --trace-estimator {args.trace_estimator} needs >= {least} products')
    if getattr(args, 'repeats', 1) > args.images:  # H08: refused before any measurement, not at the first empty one
        raise UserError(f'--repeats {args.repeats} needs --images >= {args.repeats} (an image each), got {args.images}')
    args.flags = {k: v for k, v in vars(args).items() if k not in ('out', 'overwrite')}  # as asked, into the JSON
    return args


def write_json(path, obj):  # atomically (runs.save_atomic); inf / nan are written as null
    clean = lambda v: ({k: clean(u) for k, u in v.items()} if isinstance(v, dict) else  # noqa: E731
                       [clean(u) for u in v] if isinstance(v, (list, tuple)) else
                       None if isinstance(v, float) and not math.isfinite(v) else v)
    save_atomic(path, clean(obj))


def get_model(args):
    """models.load_model (--model, --model-kw: default what our --checkpoint stored) with --seed. -> (model, info)"""
    torch.manual_seed(args.seed)
    stored = (stored_args(args.checkpoint, '--checkpoint') if args.checkpoint else None) or {}
    dataset = run_dataset(stored, args.dataset)
    imagenet_only(dataset, args.checkpoint or f'--model {args.model}', stored, img_size=args.img_size)
    count = None  # ImageNet: the labels index the split's sorted class folders, the model has as many outputs
    if dataset == 'imagenet':
        folder = os.path.join(args.data, 'train' if args.split == 'train' else 'val')
        try:  # (none, a file, no class folders)
            count = len(find_classes(folder)[0])
        except (FileNotFoundError, NotADirectoryError) as e:
            raise UserError(f'--data {args.data}: {one_line(e)}; {data.LAYOUT}')
    try:
        model, info = load_model(args.checkpoint, args.model, args.model_kw or None, dataset, count, args.img_size)
    except UserError as e:  # e.g. a head of another class count than the folders
        raise UserError(f'{e}; built here at {first_set(args.img_size, stored.get("img_size"), 224)} px (--img-size) '
                        f'for the {count} class folders of {folder}' if count else str(e)) from None
    args.model, args.dataset, args.size = info['name'], info['dataset'], info['img_size']
    # ImageNet: the preprocessing our run used (train_imagenet.py stores it), else the .npz's
    args.norm, args.crop_pct, args.interp = (first_set(stored.get(k), d) for k, d in (
        ('norm', 'jax'), ('crop_pct', 0.875), ('eval_interp', 'bilinear')))
    args.classes = info['stored'].get('classes')  # a train_cifar run on some classes only
    return model, dict(model=args.model, model_kw=parse_model_kw(info['model_kw']), checkpoint=args.checkpoint,
                       dataset=args.dataset, init_seed=None if args.checkpoint else args.seed, mode=EVAL_NOTE,
                       params=sum(p.numel() for p in model.parameters()))


def main(argv=None):
    args = get_args(argv)
    proc = setup('off')  # the training scripts' device: cuda:LOCAL_RANK where there is CUDA; never autocast
    # setup() turns TF32 on for training; these are measurements (kappa reaches 1e6): full fp32 matmuls and convs
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    if proc.ddp and args.command not in SHARDED:
        raise UserError(f'{args.command} runs in one process (python geometry.py {args.command} ...); under '
                        f'torchrun only {", ".join(SHARDED)} split their images')
    if getattr(args, 'compare', None) is not None:  # H26: checked before any measurement, not after it
        anchors.require(*args.compare or ['pyhessian'], world=proc.world)
    if proc.world > args.images:
        raise UserError(f'--images {args.images} < {proc.world} processes: give each process an image at least')
    path = os.path.join(args.out, f'{args.command}.json')
    if os.path.exists(path) and not args.overwrite:
        raise UserError(f'--out {args.out} already holds {args.command}.json; pick another --out or pass --overwrite')
    model, info = get_model(args)
    if args.command == 'attention' and getattr(model, 'num_prefix_tokens', 0) != 1:
        raise UserError(f'attention reads a ViT\'s class token; {args.model} is a {type(model).__name__} without one')
    # a MoCo backbone's zero head: a flat loss log(C), an NTK of the head's rows only; attention, neurons do not use it
    loss = args.command in ('hessian', 'landscape', 'flatness') or args.command == 'ntk' and not args.keep_zero_head
    if (zero := bool(args.checkpoint) and zero_head(model)) and loss:
        raise UserError(f'{args.checkpoint} has an all-zero classifier: fine-tune it first (train_cifar.py '
                        '--pretrained)' + ', or pass --keep-zero-head to measure the collapsed kernel' * (
                            args.command == 'ntk'))
    k = min(getattr(args, 'top_k', 1), sum(p.numel() for p in model.parameters() if p.requires_grad))  # H03, H07
    if args.command == 'hessian' and args.iters < k:  # (Lanczos: an eigenvalue a product, as many as parameters)
        raise UserError(f'--top-k {args.top_k} needs --iters >= {k}' + f' (the {k} eigenvalues of its {k} parameters:'
                        ' all there are)' * (k < args.top_k))
    # writable, and locked (rank 0) as the training scripts lock theirs: a second run into this --out is refused
    prepare_out(argparse.Namespace(out=args.out, overwrite=True, resume=None), lock=proc.master)
    # the official zero head is drawn on the CPU, before the move: the same draw on every device
    drawn = args.command == 'ntk' and not (args.checkpoint or args.keep_zero_head) and draw_zero_head_(model, args.seed)
    init_group(proc)
    info.update(head_zero=zero, flags=args.flags)
    try:
        measure(args, proc, model.to(proc.device), info, path, drawn)
    finally:
        leave(proc.ddp)


def mean_std(reps):  # {k_mean, k_std} over repeats (std with n - 1) of lambda_max, the trace and each eigenvalue
    out, k = {}, min(len(r['eigenvalues']) for r in reps)
    for key, vals in [('lambda_max', [r['lambda_max'] for r in reps]), ('eigenvalues', [r['eigenvalues'][:k] for r in
                      reps]), *[(key, [r[key] for r in reps]) for key in ('trace', 'lambda_min', 'lambda_min_over_max')
                                if key in reps[0]]]:
        t = torch.tensor(vals, dtype=torch.float64)
        out.update({f'{key}_mean': t.mean(0).tolist(), f'{key}_std': t.std(0).tolist()})
    return out


def measure_hessian(args, proc, model, loads, n, size, log):
    """hessian's JSON: per repeat (its images; probes from --seed + j) the spectrum of the whole Hessian and of each
    block (--blocks); with --repeats > 1 the repeats under `repeats` and the mean and std over them."""
    blocks, reps = [('all', None), *(param_blocks(model).items() if args.blocks else [])], []
    count = {name: sum(p.numel() for p in (model.parameters() if ps is None else ps) if p.requires_grad)
             for name, ps in blocks}  # H07: a block has as many eigenvalues as parameters, no more
    top_k = min(args.top_k, count['all'])
    if capped := [f'{name} ({count[name]:,})' for name, _ in blocks if count[name] < args.top_k]:
        proc.log(f'  --top-k {args.top_k} is more than the parameters of {", ".join(capped)}: all their eigenvalues')
    for j, (x, y) in enumerate(loads):
        batches = [(xb.to(proc.device), yb.to(proc.device)) for xb, yb in zip(x.split(size), y.split(size))]
        hvp = ('cached' if len(batches) == 1 else 'reverse') if args.hvp == 'auto' else args.hvp
        rep = dict(images=len(range(j, n, len(loads))), seed=args.seed + j, hvp=hvp)  # images j, j + R, ... of n
        for name, params in blocks:
            try:  # (a checkpoint whose loss is not finite, say)
                r = hessian_spectrum(model, F.cross_entropy, batches, params, min(top_k, count[name]), args.iters,
                                     args.tol, args.trace, args.density, args.seed + j, hvp, bottom_k=args.bottom_k,
                                     curvature=args.curvature, vectors=args.save_vectors and name == 'all' and j == 0,
                                     batch=args.vectors_per_call, trace_estimator=args.trace_estimator, progress=log)
            except ValueError as e:  # hessian.py's arguments are checked here: what it refuses is in the model or data
                raise UserError(f'hessian ({name}): {e}')
            vectors = {k: r.pop(k).float().cpu() for k in ('vectors', 'bottom_vectors') if k in r}  # (unit rows)
            if vectors and proc.master:  # the first repeat's, for landscape --directions
                save_atomic(os.path.join(args.out, 'hessian_vectors.pt'), dict(
                    vectors, names=[k for k, p in model.named_parameters() if p.requires_grad],
                    curvature=args.curvature, eigenvalues=r['eigenvalues'],
                    bottom_eigenvalues=r.get('bottom_eigenvalues')))
            rep.update(r) if name == 'all' else rep.setdefault('blocks', {}).update({name: r})
            # M03 (issue 34): a value --iters ended before its residual reached --tol |lambda| says so (converged: the
            # residual rule, or all count[name] products: then Lanczos is exact and more --iters cannot help)
            proc.log(f"  repeat {j + 1}/{len(loads)} | {name:24s} lambda_max {r['lambda_max']:.6g} ({r['products']} "
                     'HVPs)' + (f" | lambda_min {r['lambda_min']:.6g}, |lambda_min| / lambda_max "
                                f"{r['lambda_min_over_max']:.3g}" if args.bottom_k else '')
                     + (f" | trace {r['trace']:.6g} +- {r['trace_se']:.2g} (s.e., {args.trace_estimator})"
                        if args.trace else '')
                     + f' (NOT converged: --iters {args.iters} ended it before a residual <= --tol |lambda|; raise '
                     '--iters)' * (not r['converged']))
        reps.append(rep)
    out = dict(reps[0]) if len(reps) == 1 else dict(repeats=reps, **mean_std(reps), blocks={
        name: mean_std([r['blocks'][name] for r in reps]) for name, _ in blocks[1:]})
    if len(reps) > 1:
        proc.log(f"  lambda_max {out['lambda_max_mean']:.6g} +- {out['lambda_max_std']:.2g} (std over {len(reps)} "
                 'repeats)' + (f" | trace {out['trace_mean']:.6g} +- {out['trace_std']:.2g}" if args.trace else ''))
    if args.density and proc.master:
        figures.spectral_density([(torch.tensor(r['density']['nodes']), torch.tensor(r['density']['weights']))
                                  for r in reps], os.path.join(args.out, 'hessian_density.png'))
    if args.compare is not None:  # (bare: PyHessian's power iteration and per-product time; named: anchors.py)
        xy = [t.to(proc.device) for t in loads[0]]
        out['compare'] = (anchors.compare(model, *xy, args.compare, args.seed, max(args.trace, 100), say=proc.log)
                          if args.compare else anchors.to_lambda_max(model, *xy, args.seed, proc.log, args.iters))
    stopped = sorted({name for r in reps for name, b in [('all', r), *r.get('blocks', {}).items()]
                      if not b['converged']})
    return dict(out, top_k=top_k, iters=args.iters, tol=args.tol, note=f'{args.curvature}: eigenvalues: the '
                '--top-k largest algebraic (Lanczos, full reorthogonalisation; lambda_max the first)' + f' (--top-k '
                f'{args.top_k}: all there are)' * (top_k < args.top_k) + '; bottom_: the --bottom-k smallest; trace: '
                f'{args.trace_estimator}, trace_se its standard error; density: SLQ nodes and weights; repeats: '
                'disjoint image subsets' + f'; NOT converged ({", ".join(stopped)}): --iters came before --tol'
                * bool(stopped))


def measure(args, proc, model, info, path, drawn):
    """One sub-command on this process's device and images; rank 0 prints and writes."""
    say, size = proc.log, args.batch_size  # this process's images, all on the device (n: of every process)
    parts = args.repeats if args.command == 'hessian' else 1  # > 1: every process reads all images, then
    x, y, shown, n = data.measurement_images(args.data, args.dataset, args.split == 'train', args.images, args.size,
                                             args.norm, args.classes, *(proc.rank, proc.world) * (parts == 1),
                                             crop_pct=args.crop_pct, interp=args.interp)
    mine = lambda t: t[len(t) * proc.rank // proc.world:len(t) * (proc.rank + 1) // proc.world]  # noqa: E731
    if parts > n:  # (H08; an ImageNet folder may hold fewer images than --images)
        raise UserError(f'--repeats {parts} needs --images >= {parts} (an image each); --data holds {n}')
    if parts > 1:  # H11: repeat j takes images j, j + R, ... in class order, so each class's images are spread evenly
        order = y.argsort(stable=True)  # over the repeats: alike in every repeat when its count divides by R
        x, y, counts = x[order], y[order], y.bincount()
        if (uneven := int((counts % parts).count_nonzero())):
            info['repeats_note'] = (f'not class-balanced: {uneven} classes have an image count that does not divide '
                                    f'by --repeats {parts}: the repeats differ in their classes, and so does their std')
    loads = [(x, y)] if parts == 1 else [(mine(x[j::parts]), mine(y[j::parts])) for j in range(parts)]  # this process's
    if not size:  # hessian: each image's two graphs (x 2: the second backward's temporaries) beside the Lanczos basis
        grad = lambda xs: torch.autograd.grad(F.cross_entropy(model(xs), y[:len(xs)].to(proc.device)),  # noqa: E731
                                              [p for p in model.parameters() if p.requires_grad], create_graph=True)
        with evaluating(model):
            per_image = 2 * saved_bytes(x[:2].to(proc.device), grad)
        p = sum(p.numel() * p.element_size() for p in model.parameters())
        size = fit(per_image, (args.iters + 8) * p + 8 * 2 * p, free_memory(proc.device), len(loads[0][0]),
                   f'hessian (--iters {args.iters} Lanczos vectors, {per_image / 2 ** 30:.2f} GiB per image)')
    batches = [(xb.to(proc.device), yb.to(proc.device)) for xb, yb in zip(x.split(size), y.split(size))
               if args.command != 'hessian']  # (hessian: per repeat, measure_hessian)
    x = x.to(proc.device) if args.command in ('ntk', 'attention') else None
    info.update(split=args.split, n=n, device=str(proc.device), processes=proc.world, precision=PRECISION)
    say(f"geometry.py {args.command} | {args.model} ({args.checkpoint or f'init, seed {args.seed}'}) | {n:,} "
        f'{args.split} images | {proc.device} x {proc.world} | {PRECISION} | {EVAL_NOTE}'
        + (f"\n  repeats: {info['repeats_note']}" if 'repeats_note' in info else ''))
    start, log = time.time(), progress_printer(args.command) if proc.master else None
    noise = proc.device if getattr(args, 'noise_on_device', False) else torch.device('cpu')  # (on a GPU its numbers
    if args.command in ('landscape', 'flatness'):  # are not the CPU's: the JSON names the generator that drew them)
        info['noise_generator'] = f'torch.Generator({str(noise)!r}) seeded with --seed {args.seed}'
    if args.command == 'hessian':
        with evaluating(model):  # (eval mode, as PyHessian)
            info.update(measure_hessian(args, proc, model, loads, n, size, log), batch_size=size)
    elif args.command == 'ntk':
        calibrated = not args.checkpoint and calibrate_batchnorm_(model, [(x,)])
        chunk = ntk_chunk(model, x, args.reduce, args.chunk, free_memory(proc.device))  # before any Jacobian
        kappa, eig = ntk_condition_number(model, x, args.reduce, chunk, progress=log)
        zero = info['head_zero']  # (--keep-zero-head): Theta is only the head's rows, the Gram of its features
        info.update(kappa=kappa, reduce=args.reduce, chunk=chunk, head_drawn=drawn, bn_calibrated=calibrated,
                    eigenvalues=eig.tolist(), note='all trainable parameters, eval mode' + '; BatchNorm statistics '
                    'of these images' * calibrated + "; the official init's zero head drawn like the other dense "
                    'layers' * drawn + '; the head is all zeros: a collapsed kernel, the Gram of its features' * zero)
        say(f'  NTK kappa ({args.reduce}) {kappa:.6g} = {eig[-1]:.4g} / {eig[0]:.4g} | {info["note"]}')
    elif args.command == 'landscape':
        dirs = hessian_directions(model, args.directions, args.dims) if args.directions else None
        coords, losses = loss_landscape(model, F.cross_entropy, batches, args.dims, args.steps, args.span, args.seed,
                                        noise, dirs, progress=log)
        info.update(dims=args.dims, coords=coords.tolist(), loss=losses.tolist(), directions=args.directions,
                    note=f'the top {args.dims} eigenvectors of {args.directions} (unit vectors)' if dirs else
                    "filter-normalised Gaussian directions (Li et al. 2018), 1-D parameters not moved "
                    "(ignore='biasbn')")
        say(f'  loss at the origin {losses[(args.steps // 2,) * args.dims]:.4f}, largest {losses.max():.4f}')
        if proc.master:
            figures.landscape(args.model, coords, losses, args.out)
    elif args.command == 'flatness':
        info['results'] = []
        for sigma in args.sigma:
            flat = average_flatness(model, F.cross_entropy, batches, sigma, args.samples, args.seed, noise,
                                    progress=log)
            info['results'].append(dict(sigma=sigma, flatness=flat))
            say(f'  sigma {sigma:g}: E L(w + eps) - L(w) = {flat:.5g} ({args.samples} draws)')
    elif args.command == 'neurons':
        info['active'] = active_neurons(model, batches)
        for name, f in info['active'].items():
            say(f'  {name:24s} {100 * f:6.2f}% active')
    else:  # attention
        dpx, k = attention_distance(model, x).cpu(), min(args.maps, len(x))
        info.update(distance_px=dpx.tolist(), note='mean attention distance (ViT App. D.7), px, [layer][head]')
        say('  mean attention distance per layer (px): ' + ' '.join(f'{d:.1f}' for d in dpx.mean(1).tolist()))
        figures.save_figure(figures.attention_distances([(args.model, dpx)], x.shape[-1]),
                            os.path.join(args.out, 'attention_distance.png'))
        figures.attention_maps(shown[:k], attention_maps(model, x[:k])[-1].mean(dim=1).cpu(),
                               attention_rollout(model, x[:k]).cpu(), os.path.join(args.out, 'attention_maps.png'))
    if proc.master:
        write_json(path, info)
    say(f'  wrote {path} ({fmt_time(time.time() - start)} wall)')


if __name__ == '__main__':
    try:
        main()
    except UserError as e:
        sys.exit(discard_new_dirs() or f'geometry.py: error: {e}')  # (and no empty --out left behind)
    except KeyboardInterrupt:  # the JSON of a finished measurement is written (table1.py reuses it)
        sys.exit(print(discard_new_dirs() or 'geometry.py: interrupted; nothing of this measurement was written',
                       file=sys.stderr) or 130)
