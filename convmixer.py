"""ConvMixer, from "Patches Are All You Need?" (Trockman & Kolter, TMLR 2023).

ConvMixer-h/d is a patch embedding followed by d identical blocks that keep the resolution
fixed (paper Fig. 2):

    z_0     = BN(act(Conv_{c->h, kernel p, stride p}(X)))          # patch embedding, eq. (1)
    z_l'    = BN(act(DepthwiseConv_k(z_{l-1}))) + z_{l-1}           # spatial mixing, eq. (2)
    z_l     = BN(act(PointwiseConv(z_l')))                          # channel mixing, eq. (3)
    logits  = Linear(GlobalAvgPool(z_d))

Order is conv -> activation -> BatchNorm everywhere, and only the depthwise conv has a residual.
State-dict keys equal timm's `ConvMixer` (stem.{0,2}, blocks.i.0.fn.{0,2}, blocks.i.{1,3}, head),
so timm weights load with strict=True. Being fully convolutional, the model takes any input
size (paper Sec. 2).

Self-contained: imports only torch (and the standard library, to read checkpoints).
`python convmixer.py` prints every config's parameter count. `load_checkpoint(model, path)` loads
locuslab's released files, timm state_dicts and our training checkpoints (see "Checkpoints" below).
"""
import argparse
import os
import warnings
import zipfile
from collections.abc import Mapping

import torch
import torch.nn as nn

# -----------------------------------------------------------------------------
# Named configs. ImageNet ones are the paper's Table 1; CIFAR ones default to 10 classes.
configs = {
    # ImageNet-1k (paper Table 1 / locuslab/convmixer README): top-1 81.37, 80.16, 76.94
    'convmixer_1536_20': dict(dim=1536, depth=20, kernel_size=9, patch_size=7),
    'convmixer_768_32': dict(dim=768, depth=32, kernel_size=7, patch_size=7, activation='relu'),
    'convmixer_1024_20': dict(dim=1024, depth=20, kernel_size=9, patch_size=14),
    # CIFAR-10: the locuslab/convmixer-cifar10 script's default model (594,186 params) ...
    'convmixer_256_8': dict(dim=256, depth=8, kernel_size=5, patch_size=2, num_classes=10),
    # ... and the paper's ~0.7M-parameter CIFAR-10 model (Sec. 3, 706,570 params)
    'convmixer_256_8_k9_p1': dict(dim=256, depth=8, kernel_size=9, patch_size=1, num_classes=10),
}


class Residual(nn.Module):
    """fn(x) + x. Its own module so that state-dict keys read blocks.i.0.fn.* as in timm."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        # In place on fn's fresh output, which BatchNorm's backward does not need (autograd would
        # raise if it did): one activation-sized tensor fewer per block, 2-6% faster on CPU.
        return self.fn(x).add_(x)


class ConvMixer(nn.Module):
    def __init__(self, *, dim, depth, kernel_size=9, patch_size=7, in_chans=3, num_classes=1000,
                 activation='gelu', dropout=0.0):
        """dim = h (channels), depth = d (blocks), kernel_size = k (depthwise), patch_size = p.

        activation: 'gelu' (paper default) or 'relu' (ConvMixer-768/32). dropout is applied to
        the pooled features before the head (timm's head_drop); the paper uses none.
        """
        super().__init__()
        act = {'gelu': nn.GELU, 'relu': nn.ReLU}[activation]
        self.num_classes = num_classes
        # patch embedding, eq. (1): a p x p conv with stride p is a per-patch linear map
        self.stem = nn.Sequential(
            nn.Conv2d(in_chans, dim, kernel_size=patch_size, stride=patch_size),
            act(),
            nn.BatchNorm2d(dim),
        )
        self.blocks = nn.Sequential(*[
            nn.Sequential(
                # spatial (token) mixing, eq. (2): depthwise conv, residual around it only
                Residual(nn.Sequential(
                    nn.Conv2d(dim, dim, kernel_size, groups=dim, padding='same'),
                    act(),
                    nn.BatchNorm2d(dim),
                )),
                # channel mixing, eq. (3): pointwise conv, no residual
                nn.Conv2d(dim, dim, kernel_size=1),
                act(),
                nn.BatchNorm2d(dim),
            ) for _ in range(depth)
        ])
        self.head_drop = nn.Dropout(dropout)
        self.head = nn.Linear(dim, num_classes) if num_classes > 0 else nn.Identity()
        # Initialisation: PyTorch defaults, as in the official code (locuslab/convmixer), which
        # sets no init of its own.

    def forward_features(self, x):  # (B, 3, H, W) -> (B, h, H/p, W/p)
        return self.blocks(self.stem(x))

    def forward(self, x):
        x = self.forward_features(x)
        x = x.mean(dim=(2, 3))  # global average pool: (B, h, H/p, W/p) -> (B, h)
        return self.head(self.head_drop(x))


# -----------------------------------------------------------------------------
# ---- Checkpoints ----
# load_checkpoint(model, path) loads, in place, whichever of these `path` holds:
#   1. the .pth.tar files the locuslab/convmixer README links (github.com/tmp-iclr/convmixer,
#      release v1.0): the flat nn.Sequential of their convmixer.py. 0.* = stem conv, 2.* = stem BN,
#      {3+i}.0.fn.{0,2}.* = block i's depthwise conv and BN, {3+i}.{1,3}.* = its pointwise conv and
#      BN, {depth+5}.* = head (depth+3 and depth+4 are the parameter-free pool and flatten); bare or
#      under 'state_dict';
#   2. a timm state_dict (our keys are timm's, as in the timm-v1.0 re-release), bare or inside
#      timm's train checkpoint ('state_dict');
#   3. our training checkpoint (a dict whose 'model' is the state_dict);
#   with 'module.' (DDP) and '_orig_mod.' (torch.compile) prefixes stripped.
# A head for another number of classes is skipped with a warning, leaving the model's own head.
# Anything else is a ValueError that names the first key that does not fit and both shapes.
# Preprocessing: the released models expect ImageNet's mean/std, (x - (0.485, 0.456, 0.406)) /
# (0.229, 0.224, 0.225) on RGB in [0, 1] (timm's defaults, with which they were trained); their
# timm config evaluates at 224 px after a resize to 224 / 0.96 = 233 px (crop_pct 0.96, bicubic).


def _read_checkpoint(path):
    """What torch.load returns for `path` (tensors and plain containers only)."""
    if isinstance(path, Mapping):  # an already-loaded checkpoint or state_dict
        return dict(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f'no checkpoint file at {path}')
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
        if names and all(name.endswith('.npy') for name in names):
            raise ValueError(f'{path} is a JAX .npz; ConvMixer was released as PyTorch files only')
    try:  # weights_only: tensors and plain containers, never arbitrary code (timm adds an argparse.Namespace)
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(path, map_location='cpu', weights_only=True)
    except Exception as e:
        unsafe = [line for line in str(e).splitlines() if 'Unsupported global: ' in line]
        if unsafe:
            name = unsafe[0].split('Unsupported global: ')[1].split(' was not')[0]
            raise ValueError(f'{path} holds Python objects besides tensors ({name}), which '
                             'torch.load(weights_only=True) refuses. If you trust the file: '
                             'load_checkpoint(model, torch.load(path, weights_only=False))') from None
        reason = 'not a pickle' if 'Weights only load failed' in str(e) else str(e).splitlines()[0]
        raise ValueError(f'{path} is not a file torch.load reads '
                         f'({type(e).__name__}: {reason})') from None


def _state_dict_of(ckpt, what):
    """The state_dict inside a torch checkpoint: ours keeps it under 'model', timm's train.py and
    locuslab's under 'state_dict'. Strips the prefixes DDP ('module.') and torch.compile ('_orig_mod.') add."""
    for key in ('model', 'state_dict'):
        if isinstance(ckpt.get(key), Mapping):
            ckpt = ckpt[key]
            break
    sd = {}
    for k, v in ckpt.items():
        if not isinstance(v, torch.Tensor):
            raise ValueError(f'{what}: {k!r} is a {type(v).__name__}, not a tensor: this is not a state_dict, '
                             "nor a checkpoint holding one under 'model' or 'state_dict'")
        parts = [p for p in k.split('.') if p != '_orig_mod']
        while parts and parts[0] == 'module':
            parts = parts[1:]
        sd['.'.join(parts)] = v
    return sd


def _load_exactly(model, sd, what, origin):
    """model.load_state_dict(sd) with strict=True, after finding the first key that does not fit and
    saying so plainly (origin maps a converted key to the file's own name for it)."""
    own = model.state_dict()
    missing = [k for k in own if k not in sd]
    if len(missing) >= len(own) / 2:  # most of it missing: another kind of model altogether
        raise ValueError(f'{what}: not a checkpoint for this {type(model).__name__}: {len(missing)} of its '
                         f'{len(own)} keys are not in the file, the first {missing[0]!r}; the file has '
                         f'{list(sd)[:3]}...')
    name = lambda k: repr(k) + (f' (from {origin[k]!r})' if k in origin else '')
    for k, v in own.items():
        if k not in sd:
            raise ValueError(f'{what}: the model has {k!r} {tuple(v.shape)} but the file does not')
        if sd[k].shape != v.shape:
            raise ValueError(f'{what}: {name(k)} has shape {tuple(sd[k].shape)} in the file but '
                             f'{tuple(v.shape)} in the model')
    extra = [k for k in sd if k not in own]
    if extra:
        raise ValueError(f'{what}: the file has {name(extra[0])} {tuple(sd[extra[0]].shape)}, which the '
                         f'model does not ({len(extra)} such keys)')
    model.load_state_dict(sd)


def _keep_own_head(model, sd, what):
    """A file trained for another number of classes (or a headless model): keep the model's head."""
    w = sd.get('head.weight')
    head = model.head
    if w is None or (isinstance(head, nn.Linear) and w.shape == head.weight.shape):
        return
    if isinstance(head, nn.Linear) and w.shape[1:] != head.weight.shape[1:]:
        return  # a different width is a real mismatch: let _load_exactly name it
    warnings.warn(f'{what}: the file\'s head has {w.shape[0]} classes and the model {model.num_classes}; '
                  'the head was not loaded (the model keeps its own)')
    for key in ('head.weight', 'head.bias'):
        sd.pop(key, None)
        if isinstance(head, nn.Linear):
            sd[key] = getattr(head, key.split('.')[1]).detach()


def _from_locuslab(sd):
    """locuslab's nn.Sequential indices -> our (timm's) names; the head is the last index."""
    last = max(int(k.split('.')[0]) for k in sd)
    depth = last - 5  # stem conv, act, BN, the blocks, pool, flatten, head
    out, origin = {}, {}
    for k, v in sd.items():
        index, rest = k.split('.', 1)
        index = int(index)
        if index in (0, 2):
            name = f'stem.{index}.{rest}'
        elif 3 <= index < 3 + depth:
            name = f'blocks.{index - 3}.{rest}'
        elif index == last:
            name = f'head.{rest}'
        else:
            name = k  # no such parameters in locuslab's model: reported as unexpected below
        out[name], origin[name] = v, k
    return out, origin


@torch.no_grad()
def load_checkpoint(model, path):
    """Load the checkpoint at `path` (or an already-loaded checkpoint dict) into the ConvMixer
    `model`, in place, and return the model. See the comment above for the layouts it recognises;
    anything else raises ValueError naming the first mismatch."""
    what = f'convmixer.load_checkpoint({path if not isinstance(path, Mapping) else "<dict>"})'
    sd, origin = _state_dict_of(_read_checkpoint(path), what), {}
    if sd and all(k.split('.')[0].isdigit() for k in sd):
        sd, origin = _from_locuslab(sd)
        what += ' [locuslab nn.Sequential]'
    for k, v in model.state_dict().items():  # older files may lack BN's step counter; it is unused
        if k.endswith('num_batches_tracked') and k not in sd:
            sd[k] = v
    _keep_own_head(model, sd, what)
    _load_exactly(model, sd, what, origin)
    return model


def create(name, **overrides):
    """Build a named config, e.g. create('convmixer_256_8', num_classes=100)."""
    if name not in configs:
        raise ValueError(f"unknown ConvMixer config {name!r}; valid names: {', '.join(configs)}")
    return ConvMixer(**{**configs[name], **overrides})


if __name__ == '__main__':
    for name in configs:
        with torch.device('meta'):  # counts without allocating or initialising
            model = create(name)
        print(f"{name:24s} {sum(p.numel() for p in model.parameters()):>13,d} params"
              f"  ({model.num_classes} classes)")
