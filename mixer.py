"""MLP-Mixer (Tolstikhin et al. 2021), as trained with SAM in Chen, Hsieh & Gong,
"When Vision Transformers Outperform ResNets without Pretraining or Strong Data Augmentations"
(ICLR 2022): SAM lifts Mixer-B/16 from 66.4 to 77.4 ImageNet top-1.

Input: S non-overlapping patches, each projected to C channels: X in R^{S x C}. Each block
(Mixer paper eq. (1)):

    U = X + W2 GELU(W1 LN(X)^T)^T        # token-mixing MLP: mixes across the S patches, hidden D_S
    Y = U + W4 GELU(W3 LN(U))            # channel-mixing MLP: mixes across the C channels, hidden D_C

then LayerNorm, global average pooling over tokens and a linear head. D_S = C/2 and D_C = 4C
for every paper model (Mixer paper Table 1); lucidrains' mlp-mixer-pytorch swaps the two
expansion factors by default, we do not.

State-dict keys equal timm's `MlpMixer` (stem.proj, blocks.i.{norm1,mlp_tokens.fc1/fc2,norm2,
mlp_channels.fc1/fc2}, norm, head), so timm weights load with strict=True.

Self-contained: imports only torch and einops (and the standard library, to read checkpoints).
`python mixer.py` prints every config's parameter count. `load_checkpoint(model, path)` loads the
official JAX .npz, timm state_dicts and our training checkpoints (see "Checkpoints" below).
"""
import argparse
import ast
import math
import os
import warnings
import zipfile
from collections.abc import Mapping

import torch
import torch.nn as nn
from einops import rearrange

# -----------------------------------------------------------------------------
# Named configs (Mixer paper Table 1): patch p, hidden C, blocks, D_S (token MLP), D_C (channel MLP).
configs = {
    'mixer_s32': dict(patch_size=32, dim=512, depth=8, tokens_mlp_dim=256, channels_mlp_dim=2048),
    'mixer_s16': dict(patch_size=16, dim=512, depth=8, tokens_mlp_dim=256, channels_mlp_dim=2048),
    'mixer_s8': dict(patch_size=8, dim=512, depth=8, tokens_mlp_dim=256, channels_mlp_dim=2048),
    'mixer_b32': dict(patch_size=32, dim=768, depth=12, tokens_mlp_dim=384, channels_mlp_dim=3072),
    'mixer_b16': dict(patch_size=16, dim=768, depth=12, tokens_mlp_dim=384, channels_mlp_dim=3072),
    'mixer_l32': dict(patch_size=32, dim=1024, depth=24, tokens_mlp_dim=512, channels_mlp_dim=4096),
    'mixer_l16': dict(patch_size=16, dim=1024, depth=24, tokens_mlp_dim=512, channels_mlp_dim=4096),
    # CIFAR: Mixer-S width at 32 px with 4x4 patches (64 tokens); not a paper model.
    'mixer_s4_cifar': dict(img_size=32, patch_size=4, dim=512, depth=8, tokens_mlp_dim=256,
                           channels_mlp_dim=2048, num_classes=10),
}


def lecun_normal_(weight):
    """Flax's default kernel init: truncated normal (+-2 std) with variance 1/fan_in."""
    fan_in = weight[0].numel()  # in_features, or in_chans * kh * kw for a conv
    std = math.sqrt(1.0 / fan_in) / .87962566103423978  # undo the variance lost to truncation
    nn.init.trunc_normal_(weight, std=std, a=-2 * std, b=2 * std)


def drop_path(x, p, training):
    """Stochastic depth (Huang et al. 2016): drop the whole residual branch per sample."""
    if p == 0.0 or not training:
        return x
    keep = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(1 - p)
    return x * keep / (1 - p)


class MlpBlock(nn.Module):
    """Dense -> GELU -> Dense (Mixer paper eq. (1)), applied along one axis of a (B, S, C) input.

    axis='channels' mixes the C channels of each token: an ordinary Linear on the last axis.
    axis='tokens' mixes the S tokens of each channel. Rather than transposing to (B, C, S) and
    back (timm does; each transpose costs a copy of the activation), it left-multiplies by the
    weight: (D_S, S) @ (B, S, C) -> (B, D_S, C), the same sums as (W1 LN(X)^T)^T with X left
    where it is in memory. Measured here on CPU, fwd+bwd of this MLP is ~15% faster that way.
    The weights keep nn.Linear's (out, in) layout, so the keys and shapes equal timm's.
    """

    def __init__(self, dim, hidden, axis, dropout, gelu):
        super().__init__()
        assert axis in ('tokens', 'channels')
        self.axis = axis
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate='tanh' if gelu == 'tanh' else 'none')
        self.drop1 = nn.Dropout(dropout)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop2 = nn.Dropout(dropout)

    def forward(self, x):  # (B, S, C) -> (B, S, C)
        if self.axis == 'channels':
            return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))
        # baddbmm fuses the bias add into the batched matmul; expand() is a view, not a copy
        w1, w2 = self.fc1.weight.expand(x.shape[0], -1, -1), self.fc2.weight.expand(x.shape[0], -1, -1)
        h = self.drop1(self.act(torch.baddbmm(self.fc1.bias[:, None], w1, x)))  # (B, D_S, C)
        return self.drop2(torch.baddbmm(self.fc2.bias[:, None], w2, h))  # (B, S, C)


class MixerBlock(nn.Module):
    def __init__(self, num_tokens, dim, tokens_mlp_dim, channels_mlp_dim, dropout, drop_path, gelu):
        super().__init__()
        # LayerNorm eps 1e-6 as in the official JAX code (PyTorch's default is 1e-5).
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp_tokens = MlpBlock(num_tokens, tokens_mlp_dim, 'tokens', dropout, gelu)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp_channels = MlpBlock(dim, channels_mlp_dim, 'channels', dropout, gelu)
        self.drop_path = drop_path

    def forward(self, x):  # (B, S, C) -> (B, S, C)
        x = x + drop_path(self.mlp_tokens(self.norm1(x)), self.drop_path, self.training)  # token-mixing
        x = x + drop_path(self.mlp_channels(self.norm2(x)), self.drop_path, self.training)  # channel-mixing
        return x


class PatchEmbed(nn.Module):
    """The "per-patch fully-connected" stem: a p x p conv with stride p, no norm after it."""

    def __init__(self, patch_size, in_chans, dim):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x):  # (B, 3, H, W) -> (B, S, C)
        return rearrange(self.proj(x), 'b c h w -> b (h w) c')


class MlpMixer(nn.Module):
    def __init__(self, *, img_size=224, patch_size=16, in_chans=3, num_classes=1000, dim=768,
                 depth=12, tokens_mlp_dim=None, channels_mlp_dim=None, dropout=0.0, drop_path=0.0,
                 gelu='exact'):
        """dim = C (hidden size), depth = number of Mixer layers, tokens_mlp_dim = D_S
        (default C/2), channels_mlp_dim = D_C (default 4C).

        The token-mixing MLP has weights of size S = (img_size / patch_size)^2, so unlike ViT
        and ConvMixer a Mixer runs only at the resolution it was built for.
        dropout / drop_path: dropout inside the MLPs and before the head; stochastic-depth rate,
          rising linearly to `drop_path` at the last block. The SAM paper uses neither.
        gelu: 'exact' (timm, PyTorch) or 'tanh', the approximation Flax's nn.gelu uses.
        """
        super().__init__()
        assert gelu in ('exact', 'tanh'), f"gelu must be 'exact' or 'tanh', got {gelu!r}"
        tokens_mlp_dim = tokens_mlp_dim or int(0.5 * dim)
        channels_mlp_dim = channels_mlp_dim or int(4 * dim)
        self.num_classes, self.img_size = num_classes, img_size
        num_tokens = (img_size // patch_size) ** 2  # S

        self.stem = PatchEmbed(patch_size, in_chans, dim)
        rates = [drop_path * i / max(depth - 1, 1) for i in range(depth)]  # linear decay rule
        self.blocks = nn.Sequential(*[
            MixerBlock(num_tokens, dim, tokens_mlp_dim, channels_mlp_dim, dropout, rates[i], gelu)
            for i in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)  # pre_head_layer_norm in the JAX code
        self.head_drop = nn.Dropout(dropout)
        self.head = nn.Linear(dim, num_classes) if num_classes > 0 else nn.Identity()
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """The official JAX initialisation (vit_jax/models_mixer.py): every nn.Dense and the stem
        nn.Conv use Flax's default lecun-normal kernel and zero bias; the head kernel is zero.
        (timm's Mixer uses xavier-uniform for the MLPs instead; both are fine, this one is the paper's.)"""
        for name, m in self.named_modules():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                nn.init.zeros_(m.weight) if name == 'head' else lecun_normal_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward_features(self, x):  # (B, 3, H, W) -> (B, S, C)
        if x.shape[-1] != self.img_size or x.shape[-2] != self.img_size:
            raise ValueError(f'this Mixer was built for {self.img_size} px input (its token-mixing '
                             f'MLP has a fixed number of tokens); got {tuple(x.shape[-2:])}')
        return self.norm(self.blocks(self.stem(x)))

    def forward(self, x):
        x = self.forward_features(x).mean(dim=1)  # global average pool over tokens: (B, C)
        return self.head(self.head_drop(x))


# -----------------------------------------------------------------------------
# ---- Checkpoints ----
# load_checkpoint(model, path) loads, in place, whichever of these `path` holds:
#   1. the official JAX .npz (google-research/vision_transformer, vit_jax/models_mixer.py; e.g.
#      gs://mixer_models/sam/Mixer-B_16.npz): stem/ (an HWIO conv), MixerBlock_{i}/{LayerNorm_0,
#      token_mixing/Dense_{0,1}, LayerNorm_1, channel_mixing/Dense_{0,1}}, pre_head_layer_norm/ and
#      head/, with or without an 'opt/target/' or 'params/' prefix. Nothing else in PyTorch reads
#      these files: timm ships its own converted copies of other Mixer weights.
#   2. a timm state_dict (our keys are timm's), bare or inside timm's train checkpoint ('state_dict');
#   3. our training checkpoint (a dict whose 'model' is the state_dict);
#   with 'module.' (DDP) and '_orig_mod.' (torch.compile) prefixes stripped.
# A head for another number of classes is skipped with a warning, leaving the model's own head.
# Anything else (including another resolution or patch size: the token-mixing MLP is sized by the
# number of patches) is a ValueError that names the first key that does not fit and both shapes.
#
# Numerics: Flax's nn.gelu is the tanh approximation, so build the model with gelu='tanh' to match
# the JAX numerics: then the logits equal Flax's to float32 rounding (max |difference| ~1e-6 on tiny
# random models, measured against Flax itself), where the default exact GELU leaves 2-4e-4 of the
# largest logit (tests/test_checkpoints.py checks both against a float64 replica of the Flax code).
# Preprocessing: the JAX checkpoints expect RGB in [0, 1] mapped to [-1, 1], i.e. (x - 0.5) / 0.5
# (mean = std = 0.5 per channel), not ImageNet's mean/std.

_NPY_DTYPES = {'<f4': torch.float32, '<f2': torch.float16, '<f8': torch.float64,
               '<i4': torch.int32, '<i8': torch.int64}


def _read_npz(path):
    """{name: tensor} from an .npz, without numpy. An .npz is a zip of .npy files; an .npy is the
    magic b'\\x93NUMPY', a version (1, 0) or (2, 0), the header length (2 or 4 bytes, little-endian),
    a Python-literal header {'descr', 'fortran_order', 'shape'}, then the raw array."""
    arrays = {}
    with zipfile.ZipFile(path) as zf:
        for name in zf.namelist():
            raw = zf.read(name)
            n = 2 if raw[6] == 1 else 4
            start = 8 + n + int.from_bytes(raw[8:8 + n], 'little')
            header = ast.literal_eval(raw[8 + n:start].decode('latin1'))
            dtype, shape = _NPY_DTYPES.get(header['descr']), tuple(header['shape'])
            if dtype is None:
                raise ValueError(f"{path}: array {name!r} has dtype {header['descr']!r}; this reader "
                                 f"takes {', '.join(_NPY_DTYPES)}")
            data = bytearray(raw[start:])  # writable copy: torch.frombuffer shares its memory
            flat = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
            if header['fortran_order']:  # column-major (numpy writes a transposed array this way)
                array = flat.reshape(shape[::-1]).permute(*reversed(range(len(shape))))
            else:
                array = flat.reshape(shape)
            arrays[name[:-len('.npy')]] = array
    return arrays


def _read_checkpoint(path):
    """(tensors, 'npz') for a zip of .npy arrays, else (what torch.load returns, 'torch')."""
    if isinstance(path, Mapping):  # an already-loaded checkpoint or state_dict
        return dict(path), 'torch'
    if not os.path.isfile(path):
        raise FileNotFoundError(f'no checkpoint file at {path}')
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
        if names and all(name.endswith('.npy') for name in names):
            return _read_npz(path), 'npz'
    try:  # weights_only: tensors and plain containers, never arbitrary code (timm adds an argparse.Namespace)
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(path, map_location='cpu', weights_only=True), 'torch'
    except Exception as e:
        unsafe = [line for line in str(e).splitlines() if 'Unsupported global: ' in line]
        if unsafe:
            name = unsafe[0].split('Unsupported global: ')[1].split(' was not')[0]
            raise ValueError(f'{path} holds Python objects besides tensors ({name}), which '
                             'torch.load(weights_only=True) refuses. If you trust the file: '
                             'load_checkpoint(model, torch.load(path, weights_only=False))') from None
        reason = 'not a pickle' if 'Weights only load failed' in str(e) else str(e).splitlines()[0]
        raise ValueError(f'{path} is neither an .npz nor a file torch.load reads '
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


def _mixer_from_npz(w, what):
    """Official JAX names and layouts -> our (timm's) state_dict. Flax Dense kernels are (in, out) and
    convs HWIO. In token_mixing, "in" is the number of patches S: Dense_0 is (S, D_S)."""
    prefix = next((p for p in ('', 'opt/target/', 'params/') if p + 'stem/kernel' in w), None)
    if prefix is None:
        raise ValueError(f"{what}: not an official MLP-Mixer .npz: it has no 'stem/kernel' "
                         f'(its first keys are {list(w)[:3]})')
    w = {k[len(prefix):]: v for k, v in w.items() if k.startswith(prefix)}
    sd, origin = {}, {}

    def put(key, src, fn=lambda t: t):
        if src not in w:
            raise ValueError(f'{what}: the .npz has no {prefix + src!r} (needed for {key!r})')
        sd[key], origin[key] = fn(w[src]), prefix + src

    dense = lambda t: t.t()  # (in, out) -> (out, in)
    put('stem.proj.weight', 'stem/kernel', fn=lambda t: t.permute(3, 2, 0, 1))  # HWIO -> OIHW
    put('stem.proj.bias', 'stem/bias')
    i = 0
    while any(k.startswith(f'MixerBlock_{i}/') for k in w):
        b, o = f'MixerBlock_{i}/', f'blocks.{i}.'  # the file's prefix, ours
        for src, dst in (('LayerNorm_0', 'norm1'), ('LayerNorm_1', 'norm2')):
            put(o + dst + '.weight', b + src + '/scale')
            put(o + dst + '.bias', b + src + '/bias')
        for src, dst in (('token_mixing', 'mlp_tokens'), ('channel_mixing', 'mlp_channels')):
            for j in (0, 1):
                put(o + f'{dst}.fc{j + 1}.weight', b + f'{src}/Dense_{j}/kernel', fn=dense)
                put(o + f'{dst}.fc{j + 1}.bias', b + f'{src}/Dense_{j}/bias')
        i += 1
    put('norm.weight', 'pre_head_layer_norm/scale')
    put('norm.bias', 'pre_head_layer_norm/bias')
    if 'head/kernel' in w:
        put('head.weight', 'head/kernel', fn=dense)
        put('head.bias', 'head/bias')
    return sd, origin


@torch.no_grad()
def load_checkpoint(model, path):
    """Load the checkpoint at `path` (or an already-loaded checkpoint dict) into the MlpMixer
    `model`, in place, and return the model. See the comment above for the layouts it recognises;
    anything else raises ValueError naming the first mismatch."""
    what = f'mixer.load_checkpoint({path if not isinstance(path, Mapping) else "<dict>"})'
    ckpt, kind = _read_checkpoint(path)
    if kind == 'npz':
        sd, origin = _mixer_from_npz(ckpt, what + ' [JAX .npz]')
    else:
        sd, origin = _state_dict_of(ckpt, what), {}
    _keep_own_head(model, sd, what)
    _load_exactly(model, sd, what, origin)
    return model


def create(name, **overrides):
    """Build a named config with overrides, e.g. create('mixer_s16', num_classes=10, img_size=32, patch_size=4)."""
    if name not in configs:
        raise ValueError(f"unknown MLP-Mixer config {name!r}; valid names: {', '.join(configs)}")
    return MlpMixer(**{**configs[name], **overrides})


if __name__ == '__main__':
    for name in configs:
        with torch.device('meta'):  # counts without allocating or initialising
            model = create(name)
        print(f"{name:16s} {sum(p.numel() for p in model.parameters()):>13,d} params"
              f"  ({model.num_classes} classes)")
