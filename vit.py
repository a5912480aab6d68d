"""Vision Transformer (Dosovitskiy et al. 2021), as trained with SAM in Chen, Hsieh & Gong,
"When Vision Transformers Outperform ResNets without Pretraining or Strong Data Augmentations"
(ICLR 2022).

    z_0 = [x_class; x_p^1 E; ...; x_p^N E] + E_pos           # patch + position embedding, ViT eq. (1)
    z_l' = MSA(LN(z_{l-1})) + z_{l-1}                        # pre-norm attention, ViT eq. (2)
    z_l  = MLP(LN(z_l')) + z_l'                              # pre-norm MLP, ViT eq. (3)
    y    = head(LN(z_L^0))                                   # class token (or mean of tokens), ViT eq. (4)

State-dict keys equal timm's `VisionTransformer` (patch_embed.proj, cls_token, pos_embed,
blocks.i.{norm1,attn.qkv,attn.proj,norm2,mlp.fc1,mlp.fc2}, norm, fc_norm, head), so
`model.load_state_dict(timm_model.state_dict())` works with strict=True and gives the same logits.

Self-contained: imports only torch and einops (and the standard library, to read checkpoints).
`python vit.py` prints every config's parameter count. `load_checkpoint(model, path)` loads the
official JAX .npz, timm state_dicts and our training checkpoints (see "Checkpoints" below).
"""
import argparse
import ast
import math
import os
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

# -----------------------------------------------------------------------------
# Named configs (ViT paper Table 1; Ti from DeiT). `vit_s16` = ViT-S/16: patch 16, width 384, ...
configs = {
    'vit_ti16': dict(patch_size=16, dim=192, depth=12, heads=3),
    'vit_s32': dict(patch_size=32, dim=384, depth=12, heads=6),
    'vit_s16': dict(patch_size=16, dim=384, depth=12, heads=6),
    'vit_s8': dict(patch_size=8, dim=384, depth=12, heads=6),
    'vit_b32': dict(patch_size=32, dim=768, depth=12, heads=12),
    'vit_b16': dict(patch_size=16, dim=768, depth=12, heads=12),
    'vit_b8': dict(patch_size=8, dim=768, depth=12, heads=12),
    'vit_l32': dict(patch_size=32, dim=1024, depth=24, heads=16),
    'vit_l16': dict(patch_size=16, dim=1024, depth=24, heads=16),
    # CIFAR: ViT-S width at 32 px with 4x4 patches (64 tokens), half the depth; not a paper model.
    'vit_s4_cifar': dict(img_size=32, patch_size=4, dim=384, depth=6, heads=6, num_classes=10),
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


def resample_pos_embed(pos_embed, new_grid, num_prefix_tokens=1):
    """Bicubically resize the (1, prefix + h*w, D) position embedding to a new (h', w') grid,
    keeping the class-token entry (ViT paper Sec. 3.2, "Fine-tuning and higher resolution")."""
    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    old = int(math.sqrt(grid.shape[1]))
    if (old, old) == tuple(new_grid):
        return pos_embed
    grid = rearrange(grid, 'b (h w) d -> b d h w', h=old)
    # antialias matters only when shrinking; on, as in timm's resample_abs_pos_embed
    grid = F.interpolate(grid.float(), size=tuple(new_grid), mode='bicubic', antialias=True)
    grid = rearrange(grid, 'b d h w -> b (h w) d').to(pos_embed.dtype)
    return torch.cat([prefix, grid], dim=1)


class PatchEmbed(nn.Module):
    """Split the image into p x p patches and project each linearly: a conv with stride p."""

    def __init__(self, patch_size, in_chans, dim):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x):  # (B, 3, H, W) -> (B, N, D), grid (H/p, W/p)
        x = self.proj(x)
        return rearrange(x, 'b d h w -> b (h w) d'), x.shape[-2:]


class Attention(nn.Module):
    """Multi-head self-attention with a fused qkv projection (bias on, as in the paper)."""

    def __init__(self, dim, heads, qkv_bias, attn_dropout, dropout):
        super().__init__()
        self.heads = heads
        self.scale = (dim // heads) ** -0.5  # 1/sqrt(D_h), Vaswani et al. eq. (1)
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_dropout)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(dropout)

    def forward(self, x, return_attn=False, cls_only=False):  # (B, N, D) -> (B, N, D), or (B, 1, D)
        q, k, v = rearrange(self.qkv(x), 'b n (three h d) -> three b h n d', three=3, h=self.heads)
        if cls_only:  # only the class token's output is wanted: its query alone, over all keys
            q = q[:, :, :1]
        if return_attn:
            # Slow path that materialises the (B, H, N, N) attention map, for the paper's
            # attention-map analysis (Sec. 4.4); mathematically the same as the fused kernel.
            attn = (q * self.scale) @ k.transpose(-2, -1)
            attn = attn.softmax(dim=-1)
            out = self.attn_drop(attn) @ v
        else:
            attn = None
            out = F.scaled_dot_product_attention(  # fused kernel, never stores the N x N map
                q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        out = self.proj_drop(self.proj(rearrange(out, 'b h n d -> b n (h d)')))
        return out, attn


class Mlp(nn.Module):
    """Two dense layers with a GELU between them, hidden width mlp_ratio * D (ViT eq. (3))."""

    def __init__(self, dim, hidden, dropout, gelu):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate='tanh' if gelu == 'tanh' else 'none')
        self.drop1 = nn.Dropout(dropout)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop2 = nn.Dropout(dropout)

    def forward(self, x):
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class Block(nn.Module):
    def __init__(self, dim, heads, mlp_ratio, qkv_bias, dropout, attn_dropout, drop_path, gelu):
        super().__init__()
        # LayerNorm eps 1e-6 as in the official JAX code (PyTorch's default is 1e-5).
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads, qkv_bias, attn_dropout, dropout)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), dropout, gelu)
        self.drop_path = drop_path

    def forward(self, x, return_attn=False, cls_only=False):  # (B, N, D) -> (B, N, D), or (B, 1, D)
        y, attn = self.attn(self.norm1(x), return_attn, cls_only)
        if cls_only:
            x = x[:, :1]
        x = x + drop_path(y, self.drop_path, self.training)
        x = x + drop_path(self.mlp(self.norm2(x)), self.drop_path, self.training)
        return x, attn


class VisionTransformer(nn.Module):
    def __init__(self, *, img_size=224, patch_size=16, in_chans=3, num_classes=1000, dim=768,
                 depth=12, heads=12, mlp_ratio=4.0, qkv_bias=True, pool='token', dropout=0.0,
                 attn_dropout=0.0, drop_path=0.0, gelu='exact', representation_size=None):
        """dim = D (hidden size), depth = L (layers), heads = number of attention heads.

        pool: 'token' reads the class token (the paper's ViTs); 'avg' averages the patch tokens
          and has no class token (then, as in timm, the final LayerNorm is applied after pooling,
          under the name fc_norm).
        dropout / attn_dropout / drop_path: dropout after the embedding, MLP and projection; on
          the attention weights; stochastic-depth rate, rising linearly to `drop_path` at the
          last block. The SAM paper trains ViTs with none of them (Sec. 3).
        gelu: 'exact' (timm, PyTorch) or 'tanh', the approximation Flax's nn.gelu uses, for
          bit-faithful numerics with the official JAX checkpoints.
        representation_size: None (the paper's ImageNet models; timm's layout) or the width of the
          optional "pre-logits" layer, Dense + tanh between the pooled token and the head, that the
          official code inserts when a config sets it (ViT paper Sec. 3.1; used for the ImageNet-21k
          pre-training runs). Only needed to load an .npz that has `pre_logits/`.
        """
        super().__init__()
        assert pool in ('token', 'avg'), f"pool must be 'token' or 'avg', got {pool!r}"
        assert gelu in ('exact', 'tanh'), f"gelu must be 'exact' or 'tanh', got {gelu!r}"
        self.pool, self.num_classes = pool, num_classes
        self.grid = (img_size // patch_size, img_size // patch_size)
        self.num_prefix_tokens = 1 if pool == 'token' else 0
        num_tokens = self.grid[0] * self.grid[1] + self.num_prefix_tokens

        self.patch_embed = PatchEmbed(patch_size, in_chans, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if pool == 'token' else None
        self.pos_embed = nn.Parameter(torch.zeros(1, num_tokens, dim))  # learned 1-D, (1, N+1, D)
        self.pos_drop = nn.Dropout(dropout)
        rates = [drop_path * i / max(depth - 1, 1) for i in range(depth)]  # linear decay rule
        self.blocks = nn.ModuleList([
            Block(dim, heads, mlp_ratio, qkv_bias, dropout, attn_dropout, rates[i], gelu)
            for i in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6) if pool == 'token' else nn.Identity()
        self.fc_norm = nn.LayerNorm(dim, eps=1e-6) if pool == 'avg' else nn.Identity()
        self.pre_logits = nn.Sequential(OrderedDict(  # keys pre_logits.fc.*; Identity: timm's keys
            fc=nn.Linear(dim, representation_size), act=nn.Tanh())) if representation_size else nn.Identity()
        self.head_drop = nn.Dropout(dropout)
        self.head = nn.Linear(representation_size or dim, num_classes) if num_classes > 0 else nn.Identity()
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """The official JAX initialisation (google-research/vision_transformer, models_vit.py)."""
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                if name == 'head':
                    nn.init.zeros_(m.weight)  # zero head: initial logits are all 0
                    nn.init.zeros_(m.bias)
                else:
                    nn.init.xavier_uniform_(m.weight)
                    # MLP biases ~ N(0, 1e-6), the rest zero (MlpBlock's bias_init)
                    nn.init.normal_(m.bias, std=1e-6) if '.mlp.' in name else nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        # xavier_uniform_ on the fused (3D, D) qkv weight would use fan_out = 3D; JAX initialises
        # q, k and v as three separate (D, D) kernels, so do each third on its own.
        for block in self.blocks:
            for w in block.attn.qkv.weight.chunk(3, dim=0):
                nn.init.xavier_uniform_(w)
        lecun_normal_(self.patch_embed.proj.weight)  # Flax nn.Conv default
        if isinstance(self.pre_logits, nn.Sequential):
            lecun_normal_(self.pre_logits.fc.weight)  # Flax nn.Dense default (bias stays zero)
        nn.init.zeros_(self.patch_embed.proj.bias)
        # The official code uses normal(0.02). trunc_normal_'s bounds are +-2 absolute (100 std), so
        # nothing is truncated: this is normal(0.02), in timm's words.
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.zeros_(self.cls_token)

    def forward_features(self, x, return_attn=False, cls_only=False):
        """(B, 3, H, W) -> tokens (B, N(+1), D), and the per-block attention maps if asked.

        cls_only: the last block updates the class token alone, giving (B, 1, D). forward() uses it.
        """
        x, grid = self.patch_embed(x)  # (B, N, D)
        pos_embed = self.pos_embed
        if tuple(grid) != self.grid:  # other input size: resample the position grid to fit
            pos_embed = resample_pos_embed(pos_embed, grid, self.num_prefix_tokens)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # (B, N+1, D)
        x = self.pos_drop(x + pos_embed)
        attns = []
        for i, block in enumerate(self.blocks):
            x, attn = block(x, return_attn, cls_only and i == len(self.blocks) - 1)
            attns.append(attn)
        return self.norm(x), attns

    def forward_head(self, x):  # (B, N(+1), D) -> (B, num_classes)
        x = x[:, 0] if self.pool == 'token' else x.mean(dim=1)
        return self.head(self.head_drop(self.pre_logits(self.fc_norm(x))))

    def forward(self, x):
        # The class-token head reads only token 0 (eq. (4)), so the last block updates only that
        # token (its query still attends to every token): the same logits with 6.3% fewer FLOPs
        # for ViT-S/16 and ViT-B/16 at 224 px. An 'avg' ViT needs every token.
        return self.forward_head(self.forward_features(x, cls_only=self.pool == 'token')[0])

    def get_attention_maps(self, x):
        """A list of L softmax attention maps, each (B, heads, N(+1), N(+1))."""
        return self.forward_features(x, return_attn=True)[1]


# -----------------------------------------------------------------------------
# ---- Checkpoints ----
# load_checkpoint(model, path) loads, in place, whichever of these `path` holds:
#   1. the official JAX .npz (google-research/vision_transformer, e.g. gs://vit_models/sam/ViT-B_16.npz):
#      embedding/, cls, Transformer/posembed_input/pos_embedding, Transformer/encoderblock_{i}/
#      {LayerNorm_0, MultiHeadDotProductAttention_1, LayerNorm_2, MlpBlock_3/Dense_{0,1}},
#      Transformer/encoder_norm, optional pre_logits/, head/; with or without an 'opt/target/' or
#      'params/' prefix. Also big_vision's names (MultiHeadDotProductAttention_0, LayerNorm_1,
#      MlpBlock_0, or no suffix numbers; a top-level pos_embedding that leaves out the class token;
#      blocks stacked along a leading depth axis under Transformer/encoderblock/).
#   2. a timm state_dict (our keys are timm's), bare or inside timm's train checkpoint ('state_dict');
#   3. our training checkpoint (a dict whose 'model' is the state_dict);
#   with 'module.' (DDP) and '_orig_mod.' (torch.compile) prefixes stripped.
# A position embedding for another grid is resampled (bicubic, as the model does at run time); a
# head for another number of classes is skipped with a warning, leaving the model's own head.
# Anything else is a ValueError that names the first key that does not fit and both shapes.
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


def _vit_from_npz(w, what):
    """Official JAX names and layouts -> our (timm's) state_dict. Flax Dense kernels are (in, out) and
    convs HWIO; attention kernels keep the heads apart: q/k/v (D, H, D_h), out (H, D_h, D)."""
    prefix = next((p for p in ('', 'opt/target/', 'params/') if p + 'embedding/kernel' in w), None)
    if prefix is None:
        raise ValueError(f"{what}: not an official ViT .npz: it has no 'embedding/kernel' "
                         f'(its first keys are {list(w)[:3]})')
    w = {k[len(prefix):]: v for k, v in w.items() if k.startswith(prefix)}
    for k in [k for k in w if k.startswith('Transformer/encoderblock/')]:  # scanned: (depth, ...) stacks
        stack = w.pop(k)
        for i in range(stack.shape[0]):
            w[k.replace('encoderblock/', f'encoderblock_{i}/')] = stack[i]
    if 'cls' not in w:
        raise ValueError(f"{what}: the .npz has no class token ('cls'): a global-average-pool ViT, whose "
                         'JAX code applies the final LayerNorm before pooling; our pool=\'avg\' (timm\'s '
                         'layout) applies it after, so these weights do not fit either pool')
    sd, origin = {}, {}

    def put(key, *src, fn=lambda t: t):
        missing = [s for s in src if s not in w]
        if missing:
            raise ValueError(f'{what}: the .npz has no {prefix + missing[0]!r} (needed for {key!r})')
        sd[key], origin[key] = fn(*[w[s] for s in src]), prefix + src[0]

    dense = lambda t: t.t()  # (in, out) -> (out, in)
    qkv_weight = lambda q, k, v: torch.cat([t.flatten(1).t() for t in (q, k, v)])  # 3 x (D, H*Dh) -> (3D, D)
    qkv_bias = lambda q, k, v: torch.cat([t.flatten() for t in (q, k, v)])  # 3 x (H, Dh) -> (3D,)
    put('patch_embed.proj.weight', 'embedding/kernel', fn=lambda t: t.permute(3, 2, 0, 1))  # HWIO -> OIHW
    put('patch_embed.proj.bias', 'embedding/bias')
    put('cls_token', 'cls')
    pos = 'Transformer/posembed_input/pos_embedding'
    put('pos_embed', pos if pos in w else 'pos_embedding')
    n = sd['pos_embed'].shape[1]
    if int(math.isqrt(n)) ** 2 == n:  # big_vision adds positions before prepending cls: cls gets none
        sd['pos_embed'] = torch.cat([torch.zeros_like(sd['pos_embed'][:, :1]), sd['pos_embed']], dim=1)
    i = 0
    while any(k.startswith(f'Transformer/encoderblock_{i}/') for k in w):
        b, o = f'Transformer/encoderblock_{i}/', f'blocks.{i}.'  # the file's prefix, ours
        subs = {k[len(b):].split('/')[0] for k in w if k.startswith(b)}
        find = lambda kind: sorted((s for s in subs if s.split('_')[0] == kind),  # LayerNorm_0 < LayerNorm_2
                                   key=lambda s: int(s.split('_')[1]) if '_' in s else -1)
        ln, att, mlp = find('LayerNorm'), find('MultiHeadDotProductAttention'), find('MlpBlock')
        if (len(ln), len(att), len(mlp)) != (2, 1, 1):
            raise ValueError(f'{what}: {prefix + b!r} holds {sorted(subs)}; expected two LayerNorms, one '
                             'MultiHeadDotProductAttention and one MlpBlock')
        a = b + att[0] + '/'
        put(o + 'norm1.weight', b + ln[0] + '/scale')
        put(o + 'norm1.bias', b + ln[0] + '/bias')
        put(o + 'attn.qkv.weight', *[a + f'{x}/kernel' for x in ('query', 'key', 'value')], fn=qkv_weight)
        put(o + 'attn.qkv.bias', *[a + f'{x}/bias' for x in ('query', 'key', 'value')], fn=qkv_bias)
        put(o + 'attn.proj.weight', a + 'out/kernel', fn=lambda x: x.flatten(0, 1).t())  # (H, Dh, D) -> (D, D)
        put(o + 'attn.proj.bias', a + 'out/bias')
        put(o + 'norm2.weight', b + ln[1] + '/scale')
        put(o + 'norm2.bias', b + ln[1] + '/bias')
        for j in (0, 1):
            put(o + f'mlp.fc{j + 1}.weight', b + mlp[0] + f'/Dense_{j}/kernel', fn=dense)
            put(o + f'mlp.fc{j + 1}.bias', b + mlp[0] + f'/Dense_{j}/bias')
        i += 1
    put('norm.weight', 'Transformer/encoder_norm/scale')
    put('norm.bias', 'Transformer/encoder_norm/bias')
    for src, dst in (('pre_logits', 'pre_logits.fc'), ('head', 'head')):
        if src + '/kernel' in w:
            put(dst + '.weight', src + '/kernel', fn=dense)
            put(dst + '.bias', src + '/bias')
    return sd, origin


@torch.no_grad()
def load_checkpoint(model, path):
    """Load the checkpoint at `path` (or an already-loaded checkpoint dict) into the
    VisionTransformer `model`, in place, and return the model. See the comment above for the
    layouts it recognises; anything else raises ValueError naming the first mismatch."""
    what = f'vit.load_checkpoint({path if not isinstance(path, Mapping) else "<dict>"})'
    ckpt, kind = _read_checkpoint(path)
    if kind == 'npz':
        sd, origin = _vit_from_npz(ckpt, what + ' [JAX .npz]')
    else:
        sd, origin = _state_dict_of(ckpt, what), {}
    if 'pre_logits.fc.weight' in sd and not isinstance(model.pre_logits, nn.Sequential):
        rep = sd['pre_logits.fc.weight'].shape[0]
        raise ValueError(f'{what}: the file has a {rep}-unit pre-logits layer (Dense + tanh before the head); '
                         f'build the model with representation_size={rep}, e.g. '
                         f"vit.create('vit_b16', representation_size={rep})")
    pos = sd.get('pos_embed')
    if pos is not None and pos.shape != model.pos_embed.shape and pos.shape[-1] == model.pos_embed.shape[-1]:
        n = pos.shape[1] - model.num_prefix_tokens
        if n > 0 and int(math.isqrt(n)) ** 2 == n:  # a square grid of another size: resample it
            sd['pos_embed'] = resample_pos_embed(pos, model.grid, model.num_prefix_tokens)
    _keep_own_head(model, sd, what)
    _load_exactly(model, sd, what, origin)
    return model


def create(name, **overrides):
    """Build a named config with overrides, e.g. create('vit_s16', num_classes=10, img_size=32, patch_size=4)."""
    if name not in configs:
        raise ValueError(f"unknown ViT config {name!r}; valid names: {', '.join(configs)}")
    return VisionTransformer(**{**configs[name], **overrides})


if __name__ == '__main__':
    for name in configs:
        with torch.device('meta'):  # counts without allocating or initialising
            model = create(name)
        print(f"{name:16s} {sum(p.numel() for p in model.parameters()):>13,d} params"
              f"  ({model.num_classes} classes)")
