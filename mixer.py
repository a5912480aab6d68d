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
mlp_channels.fc1/fc2}, norm, head), so a timm state_dict (or our checkpoint's 'model') loads with
plain `model.load_state_dict(sd)`; `load_npz(path)` converts the official JAX .npz.
`python mixer.py` prints every config's parameter count.
"""
import math
import numbers

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
    """Dense -> GELU -> Dense over the last axis (Mixer paper eq. (1)): the channel MLP as is, the
    token MLP on the transposed input."""

    def __init__(self, dim, hidden, dropout, gelu):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.act = nn.GELU(approximate='tanh' if gelu == 'tanh' else 'none')
        self.drop = nn.Dropout(dropout)

    def forward(self, x):  # (..., dim) -> (..., dim)
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class MixerBlock(nn.Module):
    def __init__(self, num_tokens, dim, tokens_mlp_dim, channels_mlp_dim, dropout, drop_path, gelu):
        super().__init__()
        # LayerNorm eps 1e-6 as in the official JAX code (PyTorch's default is 1e-5).
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp_tokens = MlpBlock(num_tokens, tokens_mlp_dim, dropout, gelu)  # W1 (D_S, S), W2 (S, D_S)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp_channels = MlpBlock(dim, channels_mlp_dim, dropout, gelu)  # W3 (D_C, C), W4 (C, D_C)
        self.drop_path = drop_path

    def forward(self, x):  # (B, S, C) -> (B, S, C)
        # token-mixing: U = X + (W2 GELU(W1 LN(X)^T))^T, one MLP per channel, shared across channels
        y = self.mlp_tokens(rearrange(self.norm1(x), 'b s c -> b c s'))
        x = x + drop_path(rearrange(y, 'b c s -> b s c'), self.drop_path, self.training)
        # channel-mixing: Y = U + W4 GELU(W3 LN(U)), one MLP per token, shared across tokens
        return x + drop_path(self.mlp_channels(self.norm2(x)), self.drop_path, self.training)


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
        Impossible shapes raise ValueError rather than build a smaller model than asked.
        """
        super().__init__()
        if isinstance(dim, int):  # None means the paper's ratio; an explicit 0 is an error below
            tokens_mlp_dim = int(0.5 * dim) if tokens_mlp_dim is None else tokens_mlp_dim
            channels_mlp_dim = int(4 * dim) if channels_mlp_dim is None else channels_mlp_dim
        sizes = dict(img_size=img_size, patch_size=patch_size, in_chans=in_chans, dim=dim, depth=depth,
                     tokens_mlp_dim=tokens_mlp_dim, channels_mlp_dim=channels_mlp_dim)
        for name, value in sizes.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f'{name} must be a positive integer, got {value!r}')
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 0:
            # 0 is the documented headless model; a negative count used to build one silently
            raise ValueError(f'num_classes must be an integer >= 0 (0: no head), got {num_classes!r}')
        if img_size % patch_size:
            raise ValueError(f'img_size={img_size} is not divisible by patch_size={patch_size}: the patch '
                             f'embedding drops the image border ({img_size % patch_size} px)')
        if gelu not in ('exact', 'tanh'):
            raise ValueError(f"gelu must be one of ('exact', 'tanh'), got {gelu!r}")
        for name, value in (('dropout', dropout), ('drop_path', drop_path)):  # keep probabilities 1 - p > 0
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f'{name} must be a number (a probability in [0, 1)), got {type(value).__name__} '
                                 f'{value!r}')
            if not 0 <= value < 1:
                raise ValueError(f'{name} must be a probability in [0, 1), got {value!r}')
        dropout, drop_path = float(dropout), float(drop_path)  # (numpy's floats too)
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
                m.reset_parameters()  # scale 1, bias 0

    def forward_features(self, x):  # (B, 3, H, W) -> (B, S, C)
        if x.ndim != 4 or x.shape[1] != self.stem.proj.in_channels:  # (a shape: no host sync)
            raise ValueError(f'expected a batch of images (B, {self.stem.proj.in_channels}, H, W), got shape '
                             f'{tuple(x.shape)}')
        if x.shape[-1] != self.img_size or x.shape[-2] != self.img_size:
            raise ValueError(f'this Mixer was built for {self.img_size} px input (its token-mixing '
                             f'MLP has a fixed number of tokens); got {tuple(x.shape[-2:])}')
        return self.norm(self.blocks(self.stem(x)))

    def forward(self, x):
        x = self.forward_features(x).mean(dim=1)  # global average pool over tokens: (B, C)
        return self.head(self.head_drop(x))


def create(name, **overrides):
    """Build a named config with overrides, e.g. create('mixer_s16', num_classes=10, img_size=32, patch_size=4)."""
    if name not in configs:
        raise ValueError(f"unknown MLP-Mixer config {name!r}; valid names: {', '.join(configs)}")
    return MlpMixer(**{**configs[name], **overrides})


def load_npz(path):
    """An official JAX .npz (google-research/vision_transformer, vit_jax/models_mixer.py; the SAM ones
    are gs://mixer_models/sam/Mixer-B_{16,32}.npz) -> float32 state_dict under our (timm's) keys.
    An 'opt/target/' prefix is stripped; a missing or malformed array raises ValueError naming its
    key. Flax Dense kernels are (in, out), so token_mixing/Dense_0 is (S, D_S); the stem is HWIO.
    Build the model with gelu='tanh' (Flax's nn.gelu) to match JAX to ~1e-6 (exact GELU: ~1e-3
    away; tests/test_checkpoints.py). Inputs: (x - 0.5) / 0.5 on RGB in [0, 1]."""
    import numpy as np  # only here: the model itself needs nothing but torch and einops

    import os
    import zipfile
    if os.path.isfile(path) and not zipfile.is_zipfile(path):  # else np.load tries it as a pickle and suggests
        raise ValueError(f'{path} is not an .npz (a zip archive of .npy arrays), so it has no array '  # allow_pickle
                         "'stem/kernel': not an official MLP-Mixer .npz")
    with np.load(path) as npz:
        prefix = 'opt/target/' if 'opt/target/stem/kernel' in npz.files else ''

        def get(name, ndim):  # one array as a float32 tensor, checked
            key = prefix + name
            if key not in npz.files:
                raise ValueError(f'{path}: no array {key!r}; not an official MLP-Mixer .npz?')
            try:  # zip, zlib or .npy errors: name the array, keep numpy's reason
                a = npz[key]
            except Exception as e:
                raise ValueError(f'{path}: cannot read array {key!r} ({type(e).__name__}: {e})') from e
            if not isinstance(a, np.ndarray) or a.dtype.kind != 'f' or a.ndim != ndim:
                got = f'{a.ndim}-d {a.dtype}' if isinstance(a, np.ndarray) else 'raw bytes, not an .npy'
                raise ValueError(f'{path}: array {key!r} should be a {ndim}-d float array, got {got}')
            return torch.from_numpy(a.astype(np.float32))

        norm = lambda name: (get(name + '/scale', 1), get(name + '/bias', 1))
        dense = lambda name: (get(name + '/kernel', 2).T, get(name + '/bias', 1))  # (in, out) -> (out, in)
        sd = {'stem.proj.weight': get('stem/kernel', 4).permute(3, 2, 0, 1),  # HWIO -> OIHW
              'stem.proj.bias': get('stem/bias', 1)}
        i = 0
        while prefix + f'MixerBlock_{i}/LayerNorm_0/scale' in npz.files:
            b, o = f'MixerBlock_{i}/', f'blocks.{i}.'  # the file's names, ours
            sd[o + 'norm1.weight'], sd[o + 'norm1.bias'] = norm(b + 'LayerNorm_0')
            sd[o + 'mlp_tokens.fc1.weight'], sd[o + 'mlp_tokens.fc1.bias'] = dense(b + 'token_mixing/Dense_0')
            sd[o + 'mlp_tokens.fc2.weight'], sd[o + 'mlp_tokens.fc2.bias'] = dense(b + 'token_mixing/Dense_1')
            sd[o + 'norm2.weight'], sd[o + 'norm2.bias'] = norm(b + 'LayerNorm_1')
            sd[o + 'mlp_channels.fc1.weight'], sd[o + 'mlp_channels.fc1.bias'] = dense(b + 'channel_mixing/Dense_0')
            sd[o + 'mlp_channels.fc2.weight'], sd[o + 'mlp_channels.fc2.bias'] = dense(b + 'channel_mixing/Dense_1')
            i += 1
        sd['norm.weight'], sd['norm.bias'] = norm('pre_head_layer_norm')
        if prefix + 'head/kernel' in npz.files:  # a headless (feature-extractor) file has none
            sd['head.weight'], sd['head.bias'] = dense('head')
    return {k: v.contiguous() for k, v in sd.items()}


if __name__ == '__main__':
    for name in configs:
        with torch.device('meta'):  # counts without allocating or initialising
            model = create(name)
        print(f'{name:16s} {sum(p.numel() for p in model.parameters()):>13,d} params ({model.num_classes} classes)')
