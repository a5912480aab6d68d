"""Vision Transformer (Dosovitskiy et al. 2021), as trained with SAM in Chen, Hsieh & Gong,
"When Vision Transformers Outperform ResNets without Pretraining or Strong Data Augmentations" (ICLR 2022).

    z_0 = [x_class; x_p^1 E; ...; x_p^N E] + E_pos           # patch + position embedding, ViT eq. (1)
    z_l' = MSA(LN(z_{l-1})) + z_{l-1}                        # pre-norm attention, ViT eq. (2)
    z_l  = MLP(LN(z_l')) + z_l'                              # pre-norm MLP, ViT eq. (3)
    y    = head(LN(z_L^0))                                   # class token (or mean of tokens), ViT eq. (4)

State-dict keys equal timm's `VisionTransformer`, so a timm state_dict (or our checkpoint's
'model') loads with plain `model.load_state_dict(sd)` and gives the same logits; `load_npz(path)`
converts the official JAX .npz. `python vit.py` prints every config's parameter count.
"""
import math
import numbers

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
    """Bicubically resize the (1, prefix + h*h, D) position embedding to a new (h', w') grid,
    keeping the class-token entry (ViT paper Sec. 3.2, "Fine-tuning and higher resolution")."""
    if len(new_grid) != 2 or not all(isinstance(n, (int, torch.SymInt)) and n >= 1 for n in new_grid):
        raise ValueError(f'new_grid must be (rows, cols) of positive integers, got {tuple(new_grid)}')
    prefix, grid = pos_embed[:, :num_prefix_tokens], pos_embed[:, num_prefix_tokens:]
    old = math.isqrt(grid.shape[1])
    if old * old != grid.shape[1]:
        raise ValueError(f'pos_embed has {grid.shape[1]} patch positions, not a square grid')
    if (old, old) == tuple(new_grid):
        return pos_embed
    grid = rearrange(grid, 'b (h w) d -> b d h w', h=old)
    # antialias matters only when shrinking; on, as in timm's resample_abs_pos_embed
    grid = F.interpolate(grid.float(), size=tuple(new_grid), mode='bicubic', antialias=True)
    grid = rearrange(grid, 'b d h w -> b (h w) d').to(pos_embed.dtype)
    return torch.cat([prefix, grid], dim=1)


def sincos_pos_embed(grid, dim, prefix):
    """MoCo v3's fixed 2-D position embedding (its vits.py build_2d_sincos_position_embedding): [sin, cos](row * w),
    [sin, cos](col * w) with w = 1 / 10000^(i / (dim/4)); zeros for the class token. (1, prefix + h*w, dim)."""
    rows, cols = torch.meshgrid(torch.arange(grid[0], dtype=torch.float32),
                                torch.arange(grid[1], dtype=torch.float32), indexing='ij')
    omega = 1.0 / 10000.0 ** (torch.arange(dim // 4, dtype=torch.float32) / (dim // 4))
    a, b = rows.flatten()[:, None] * omega, cols.flatten()[:, None] * omega
    return torch.cat([torch.zeros(prefix, dim), torch.cat([a.sin(), a.cos(), b.sin(), b.cos()], 1)])[None]


class PatchEmbed(nn.Module):
    """Split the image into p x p patches and project each linearly: a conv with stride p."""

    def __init__(self, patch_size, in_chans, dim):
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_chans, dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x):  # (B, 3, H, W) -> (B, N, D), grid (H/p, W/p)
        if x.ndim != 4 or x.shape[1] != self.proj.in_channels:  # (a shape: no host sync)
            raise ValueError(f'expected a batch of images (B, {self.proj.in_channels}, H, W), got shape '
                             f'{tuple(x.shape)}')
        if x.shape[-2] % self.patch_size or x.shape[-1] % self.patch_size:
            raise ValueError(f'input of {x.shape[-2]}x{x.shape[-1]} px does not divide into {self.patch_size} '
                             'px patches: the patch embedding would drop the image border')
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

    def forward(self, x, return_attn=False):  # (B, N, D) -> (B, N, D), (B, H, N, N) or None
        q, k, v = rearrange(self.qkv(x), 'b n (three h d) -> three b h n d', three=3, h=self.heads)
        if return_attn:
            # Materialises softmax(q k^T / sqrt(D_h)), for the paper's attention-map analysis
            # (Sec. 4.4); mathematically the same as the fused kernel below.
            attn = ((q * self.scale) @ k.transpose(-2, -1)).softmax(dim=-1)
            out = self.attn_drop(attn) @ v
        else:
            # How attention is written in PyTorch: the fused kernel never stores the N x N map (GPU memory)
            attn = None
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        out = self.proj_drop(self.proj(rearrange(out, 'b h n d -> b n (h d)')))
        return out, attn


class Mlp(nn.Module):
    """Two dense layers with a GELU between them, hidden width mlp_ratio * D (ViT eq. (3))."""

    def __init__(self, dim, hidden, dropout, gelu):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.act = nn.GELU(approximate='tanh' if gelu == 'tanh' else 'none')
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.drop(self.fc2(self.drop(self.act(self.fc1(x)))))


class Block(nn.Module):
    def __init__(self, dim, heads, mlp_ratio, qkv_bias, dropout, attn_dropout, drop_path, gelu):
        super().__init__()
        # LayerNorm eps 1e-6 as in the official JAX code (PyTorch's default is 1e-5).
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads, qkv_bias, attn_dropout, dropout)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), dropout, gelu)
        self.drop_path = drop_path

    def forward(self, x, return_attn=False):  # (B, N, D) -> (B, N, D)
        y, attn = self.attn(self.norm1(x), return_attn)
        x = x + drop_path(y, self.drop_path, self.training)  # eq. (2)
        x = x + drop_path(self.mlp(self.norm2(x)), self.drop_path, self.training)  # eq. (3)
        return x, attn


class VisionTransformer(nn.Module):
    def __init__(self, *, img_size=224, patch_size=16, in_chans=3, num_classes=1000, dim=768,
                 depth=12, heads=12, mlp_ratio=4.0, qkv_bias=True, pool='token', dropout=0.0,
                 attn_dropout=0.0, drop_path=0.0, gelu='exact'):
        """dim = D (hidden size), depth = L (layers), heads = number of attention heads.

        pool: 'token' reads the class token (the paper's ViTs); 'avg' averages the patch tokens
          and has no class token (then, as in timm, the final LayerNorm is applied after pooling,
          under the name fc_norm).
        dropout / attn_dropout / drop_path: dropout after the embedding, MLP and projection; on
          the attention weights; stochastic-depth rate, rising linearly to `drop_path` at the
          last block. The SAM paper trains ViTs with none of them (Sec. 3).
        gelu: 'exact' (timm, PyTorch) or 'tanh', the approximation Flax's nn.gelu uses, for
          bit-faithful numerics with the official JAX checkpoints.
        Impossible shapes raise ValueError rather than build a smaller model than asked.
        """
        super().__init__()
        # bool is an int, numpy's floats are numbers.Real: a type check, then the value's own
        if isinstance(mlp_ratio, bool) or not isinstance(mlp_ratio, numbers.Real) or not 0 < mlp_ratio < math.inf:
            raise ValueError(f'mlp_ratio must be a finite number > 0, got {mlp_ratio!r}')
        if not isinstance(qkv_bias, bool):  # the string 'no' would be truthy: keep the bias
            raise ValueError(f'qkv_bias must be True or False, got {qkv_bias!r}')
        sizes = dict(img_size=img_size, patch_size=patch_size, in_chans=in_chans, dim=dim, depth=depth,
                     heads=heads, mlp_hidden=int(dim * mlp_ratio) if isinstance(dim, int) else dim)
        for name, value in sizes.items():
            if not isinstance(value, int) or value < 1:
                raise ValueError(f'{name} must be a positive integer, got {value!r}')
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 0:
            # 0 is the documented headless model; a negative count used to build one silently
            raise ValueError(f'num_classes must be an integer >= 0 (0: no head), got {num_classes!r}')
        if dim % heads:
            raise ValueError(f'heads={heads} does not divide dim={dim} (each head gets dim/heads channels)')
        if img_size % patch_size:
            raise ValueError(f'img_size={img_size} is not divisible by patch_size={patch_size}: the patch '
                             f'embedding drops the image border ({img_size % patch_size} px)')
        for name, value in (('dropout', dropout), ('attn_dropout', attn_dropout), ('drop_path', drop_path)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f'{name} must be a number (a probability in [0, 1)), got {type(value).__name__} '
                                 f'{value!r}')
            if not 0 <= value < 1:  # keep probabilities 1 - p > 0
                raise ValueError(f'{name} must be a probability in [0, 1), got {value!r}')
        dropout, attn_dropout, drop_path = float(dropout), float(attn_dropout), float(drop_path)  # numpy's too
        for name, value, valid in (('pool', pool, ('token', 'avg')), ('gelu', gelu, ('exact', 'tanh'))):
            if value not in valid:
                raise ValueError(f'{name} must be one of {valid}, got {value!r}')
        self.pool, self.num_classes = pool, num_classes
        self.grid = (img_size // patch_size, img_size // patch_size)
        self.num_prefix_tokens = 1 if pool == 'token' else 0
        num_tokens = self.grid[0] * self.grid[1] + self.num_prefix_tokens  # N + 1
        self.patch_embed = PatchEmbed(patch_size, in_chans, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if pool == 'token' else None  # x_class
        self.pos_embed = nn.Parameter(torch.zeros(1, num_tokens, dim))  # E_pos: learned 1-D, (1, N+1, D)
        self.pos_drop = nn.Dropout(dropout)
        rates = [drop_path * i / max(depth - 1, 1) for i in range(depth)]  # linear decay rule
        self.blocks = nn.ModuleList([
            Block(dim, heads, mlp_ratio, qkv_bias, dropout, attn_dropout, rates[i], gelu)
            for i in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6) if pool == 'token' else nn.Identity()
        self.fc_norm = nn.LayerNorm(dim, eps=1e-6) if pool == 'avg' else nn.Identity()
        self.head_drop = nn.Dropout(dropout)
        self.head = nn.Linear(dim, num_classes) if num_classes > 0 else nn.Identity()
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """The official JAX initialisation (google-research/vision_transformer, models_vit.py)."""
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):  # the head is zero: initial logits are all 0
                nn.init.zeros_(m.weight) if name == 'head' else nn.init.xavier_uniform_(m.weight)
                # MLP biases ~ N(0, 1e-6), the rest zero (MlpBlock's bias_init)
                nn.init.normal_(m.bias, std=1e-6) if '.mlp.' in name else nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                m.reset_parameters()  # scale 1, bias 0
        # xavier_uniform_ on the fused (3D, D) qkv weight would use fan_out = 3D; JAX initialises
        # q, k and v as three separate (D, D) kernels, so do each third on its own.
        for block in self.blocks:
            for w in block.attn.qkv.weight.chunk(3, dim=0):
                nn.init.xavier_uniform_(w)
        lecun_normal_(self.patch_embed.proj.weight)  # Flax nn.Conv default
        nn.init.zeros_(self.patch_embed.proj.bias)
        # The official code uses normal(0.02). trunc_normal_'s bounds are +-2 absolute (100 std), so
        # nothing is truncated: this is normal(0.02), in timm's words.
        nn.init.trunc_normal_(self.pos_embed, std=0.02)  # (cls_token: zeros, as built)

    def forward_features(self, x, return_attn=False):
        """(B, 3, H, W) -> tokens (B, N(+1), D); with return_attn also the per-block attention maps."""
        x, grid = self.patch_embed(x)  # (B, N, D)
        pos_embed = self.pos_embed
        if tuple(grid) != self.grid:  # other input size: resample the position grid to fit (Sec. 3.2)
            pos_embed = resample_pos_embed(pos_embed, grid, self.num_prefix_tokens)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # (B, N+1, D)
        x = self.pos_drop(x + pos_embed)  # eq. (1)
        attns = []
        for block in self.blocks:
            x, attn = block(x, return_attn)
            attns.append(attn)
        return (self.norm(x), attns) if return_attn else self.norm(x)

    def forward_head(self, x):  # (B, N(+1), D) -> (B, num_classes), eq. (4)
        x = x[:, 0] if self.pool == 'token' else x.mean(dim=1)
        return self.head(self.head_drop(self.fc_norm(x)))

    def forward(self, x):
        return self.forward_head(self.forward_features(x))

    def get_attention_maps(self, x):
        """A list of L softmax attention maps, each (B, heads, N(+1), N(+1))."""
        return self.forward_features(x, return_attn=True)[1]


def create(name, **overrides):
    """Build a named config with overrides, e.g. create('vit_s16', num_classes=10, img_size=32, patch_size=4)."""
    if name not in configs:
        raise ValueError(f"unknown ViT config {name!r}; valid names: {', '.join(configs)}")
    return VisionTransformer(**{**configs[name], **overrides})


def load_npz(path):
    """An official JAX .npz (google-research/vision_transformer; the SAM ones, gs://vit_models/sam/*.npz,
    have no pre-logits) -> float32 state_dict under our (timm's) keys. An 'opt/target/' prefix is
    stripped; a missing or malformed array raises ValueError naming its key. Build the model with
    gelu='tanh' (Flax's nn.gelu) to match JAX to ~1e-6 (exact GELU: ~1e-3 away; tests/test_checkpoints.py).
    Inputs: (x - 0.5) / 0.5 on RGB in [0, 1]."""
    import numpy as np  # only here: the model itself needs nothing but torch and einops

    import os
    import zipfile
    if os.path.isfile(path) and not zipfile.is_zipfile(path):  # else np.load tries it as a pickle and suggests
        raise ValueError(f'{path} is not an .npz (a zip archive of .npy arrays), so it has no array '  # allow_pickle
                         "'embedding/kernel': not an official ViT .npz")
    with np.load(path) as npz:
        prefix = 'opt/target/' if 'opt/target/embedding/kernel' in npz.files else ''

        def get(name, ndim):  # one array as a float32 tensor, checked
            key = prefix + name
            if key not in npz.files:
                raise ValueError(f'{path}: no array {key!r}; not an official ViT .npz?')
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
        if prefix + 'pre_logits/kernel' in npz.files:
            raise ValueError(f'{path} has a pre_logits layer (an ImageNet-21k pre-training model); '
                             'this ViT has none, as no released SAM checkpoint does')
        sd = {'patch_embed.proj.weight': get('embedding/kernel', 4).permute(3, 2, 0, 1),  # HWIO -> OIHW
              'patch_embed.proj.bias': get('embedding/bias', 1), 'cls_token': get('cls', 3),
              'pos_embed': get('Transformer/posembed_input/pos_embedding', 3)}
        i, qkv = 0, ('query', 'key', 'value')
        while prefix + f'Transformer/encoderblock_{i}/LayerNorm_0/scale' in npz.files:
            b, o = f'Transformer/encoderblock_{i}/', f'blocks.{i}.'  # the file's names, ours
            a = b + 'MultiHeadDotProductAttention_1/'  # heads kept apart: q/k/v (D, H, D_h), out (H, D_h, D)
            sd[o + 'norm1.weight'], sd[o + 'norm1.bias'] = norm(b + 'LayerNorm_0')
            # 3 x (D, H, D_h) -> fused (3D, D); 3 x (H, D_h) -> (3D,)
            sd[o + 'attn.qkv.weight'] = torch.cat([get(a + n + '/kernel', 3).flatten(1).T for n in qkv])
            sd[o + 'attn.qkv.bias'] = torch.cat([get(a + n + '/bias', 2).flatten() for n in qkv])
            sd[o + 'attn.proj.weight'] = get(a + 'out/kernel', 3).flatten(0, 1).T  # (H, D_h, D) -> (D, D)
            sd[o + 'attn.proj.bias'] = get(a + 'out/bias', 1)
            sd[o + 'norm2.weight'], sd[o + 'norm2.bias'] = norm(b + 'LayerNorm_2')
            sd[o + 'mlp.fc1.weight'], sd[o + 'mlp.fc1.bias'] = dense(b + 'MlpBlock_3/Dense_0')
            sd[o + 'mlp.fc2.weight'], sd[o + 'mlp.fc2.bias'] = dense(b + 'MlpBlock_3/Dense_1')
            i += 1
        sd['norm.weight'], sd['norm.bias'] = norm('Transformer/encoder_norm')
        if prefix + 'head/kernel' in npz.files:  # a headless (feature-extractor) file has none
            sd['head.weight'], sd['head.bias'] = dense('head')
    return {k: v.contiguous() for k, v in sd.items()}


if __name__ == '__main__':
    for name in configs:
        with torch.device('meta'):  # counts without allocating or initialising
            model = create(name)
        print(f'{name:16s} {sum(p.numel() for p in model.parameters()):>13,d} params ({model.num_classes} classes)')
