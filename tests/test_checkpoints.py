"""load_checkpoint in vit.py, mixer.py and convmixer.py, against independent oracles.

Nothing can be downloaded here, so the tests write files in the released layouts at test time:
- ViT .npz: written from a random timm model by an inverse mapping kept here; timm's own .npz loader
  (VisionTransformer.load_pretrained) must read the same file and give the same logits as ours.
- Mixer .npz (timm has no loader for it): random arrays under the Flax names and shapes of
  vit_jax/models_mixer.py; oracles are timm's MlpMixer given the same arrays by a conversion kept
  here, and a numpy forward pass that follows the Flax code line by line.
- Both .npz kinds: with gelu='tanh' our logits equal that numpy (JAX-semantics, float64) forward.
- ConvMixer: a locuslab-style flat nn.Sequential built here; our logits must equal its logits and timm's.
"""
import argparse
import io
import math
import zipfile

import numpy as np
import pytest
import torch
from timm.layers import resample_abs_pos_embed
from timm.models.convmixer import ConvMixer as TimmConvMixer
from timm.models.mlp_mixer import MlpMixer as TimmMixer
from timm.models.vision_transformer import VisionTransformer as TimmViT

import convmixer
import mixer
import vit
from test_models import randomise as perturb

# Tiny models: 32 px, 8 px patches (16 tokens), width 64, depth 2.
IMG, PATCH, DIM, DEPTH, HEADS, CLASSES = 32, 8, 64, 2, 4, 10


def randomise(model, seed=0):
    """Perturb every float tensor (test_models' helper), in eval mode."""
    return perturb(model, seed, scale=0.1).eval()


def logits(model, x):
    with torch.no_grad():
        return model.eval()(x)


def close(a, b, atol=1e-5):
    assert b.abs().max() > 0.1  # never a comparison of two near-zero tensors
    torch.testing.assert_close(a, b, rtol=0, atol=atol)


@pytest.fixture
def x():
    return torch.randn(3, 3, IMG, IMG, generator=torch.Generator().manual_seed(1))


def our_vit(**kw):
    return vit.VisionTransformer(img_size=IMG, patch_size=PATCH, dim=DIM, depth=DEPTH, heads=HEADS,
                                 num_classes=CLASSES, **kw)


def timm_vit(**kw):
    return TimmViT(img_size=IMG, patch_size=PATCH, embed_dim=DIM, depth=DEPTH, num_heads=HEADS,
                   num_classes=CLASSES, **kw)


def our_mixer(**kw):
    return mixer.MlpMixer(img_size=IMG, patch_size=PATCH, dim=DIM, depth=DEPTH, num_classes=CLASSES, **kw)


# -----------------------------------------------------------------------------
# Writers for the official JAX layouts (the inverse of what the loaders do, written independently).

def vit_npz_arrays(sd, layout='vit_jax', prefix=''):
    """A timm ViT state_dict -> {name: array} as google-research/vision_transformer saves it
    (layout 'vit_jax': encoderblock_{i}/{LayerNorm_0, MultiHeadDotProductAttention_1, LayerNorm_2,
    MlpBlock_3}) or as big_vision does ('big_vision': per-type numbering, blocks stacked along a
    leading depth axis under encoderblock/, a pos_embedding without the class-token entry)."""
    f = lambda t: t.detach().numpy().astype(np.float32)
    dim = sd['cls_token'].shape[-1]
    heads, dh = HEADS, dim // HEADS
    w = {'embedding/kernel': f(sd['patch_embed.proj.weight'].permute(2, 3, 1, 0)),  # OIHW -> HWIO
         'embedding/bias': f(sd['patch_embed.proj.bias']), 'cls': f(sd['cls_token']),
         'Transformer/encoder_norm/scale': f(sd['norm.weight']),
         'Transformer/encoder_norm/bias': f(sd['norm.bias']),
         'head/kernel': f(sd['head.weight'].T), 'head/bias': f(sd['head.bias'])}
    names = (('LayerNorm_0', 'MultiHeadDotProductAttention_1', 'LayerNorm_2', 'MlpBlock_3')
             if layout == 'vit_jax' else ('LayerNorm_0', 'MultiHeadDotProductAttention_0', 'LayerNorm_1', 'MlpBlock_0'))
    blocks = []
    for i in range(DEPTH):
        t = f'blocks.{i}.'
        ln1, att, ln2, mlp = names
        b = {f'{ln1}/scale': sd[t + 'norm1.weight'], f'{ln1}/bias': sd[t + 'norm1.bias'],
             f'{ln2}/scale': sd[t + 'norm2.weight'], f'{ln2}/bias': sd[t + 'norm2.bias'],
             f'{att}/out/kernel': sd[t + 'attn.proj.weight'].T.reshape(heads, dh, dim),
             f'{att}/out/bias': sd[t + 'attn.proj.bias']}
        for name, wq, bq in zip(('query', 'key', 'value'), sd[t + 'attn.qkv.weight'].chunk(3),
                                sd[t + 'attn.qkv.bias'].chunk(3)):
            b[f'{att}/{name}/kernel'] = wq.T.reshape(dim, heads, dh)  # (D, H, D_h)
            b[f'{att}/{name}/bias'] = bq.reshape(heads, dh)
        for j in (0, 1):
            b[f'{mlp}/Dense_{j}/kernel'] = sd[t + f'mlp.fc{j + 1}.weight'].T
            b[f'{mlp}/Dense_{j}/bias'] = sd[t + f'mlp.fc{j + 1}.bias']
        blocks.append({k: f(v) for k, v in b.items()})
    if layout == 'vit_jax':
        w['Transformer/posembed_input/pos_embedding'] = f(sd['pos_embed'])
        for i, b in enumerate(blocks):
            w.update({f'Transformer/encoderblock_{i}/{k}': v for k, v in b.items()})
    else:
        w['pos_embedding'] = f(sd['pos_embed'])  # timm's no_embed_class model: patches only
        w.update({f'Transformer/encoderblock/{k}': np.stack([b[k] for b in blocks]) for k in blocks[0]})
    return {prefix + k: v for k, v in w.items()}


def mixer_npz_arrays(seed=0, prefix=''):
    """Random arrays under the names and shapes of vit_jax/models_mixer.py: nn.Conv 'stem' (HWIO
    kernel), MixerBlock_{i} with auto-named LayerNorm_0 / LayerNorm_1 (params 'scale', 'bias') and
    MlpBlock 'token_mixing' / 'channel_mixing' (Dense_0, Dense_1: kernels (in, out)), then
    'pre_head_layer_norm' and the Dense 'head'."""
    rng = np.random.default_rng(seed)
    r = lambda *shape: rng.normal(0, 0.2, shape).astype(np.float32)
    tokens, d_s, d_c = (IMG // PATCH) ** 2, DIM // 2, 4 * DIM
    w = {'stem/kernel': r(PATCH, PATCH, 3, DIM), 'stem/bias': r(DIM),
         'pre_head_layer_norm/scale': 1 + r(DIM), 'pre_head_layer_norm/bias': r(DIM),
         'head/kernel': r(DIM, CLASSES), 'head/bias': r(CLASSES)}
    for i in range(DEPTH):
        b = f'MixerBlock_{i}/'
        for ln in ('LayerNorm_0', 'LayerNorm_1'):
            w[b + ln + '/scale'], w[b + ln + '/bias'] = 1 + r(DIM), r(DIM)
        for name, n_in, hidden in (('token_mixing', tokens, d_s), ('channel_mixing', DIM, d_c)):
            w[b + name + '/Dense_0/kernel'], w[b + name + '/Dense_0/bias'] = r(n_in, hidden), r(hidden)
            w[b + name + '/Dense_1/kernel'], w[b + name + '/Dense_1/bias'] = r(hidden, n_in), r(n_in)
    return {prefix + k: v for k, v in w.items()}


# -----------------------------------------------------------------------------
# The Flax forward passes, in numpy float64, for JAX numerics (nn.gelu = tanh approximation).

def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def layer_norm(x, w, name):  # Flax nn.LayerNorm, epsilon 1e-6
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + 1e-6) * w[name + '/scale'] + w[name + '/bias']


def mlp_block(x, w, name):  # Dense_0, gelu, Dense_1
    h = gelu_tanh(x @ w[name + '/Dense_0/kernel'] + w[name + '/Dense_0/bias'])
    return h @ w[name + '/Dense_1/kernel'] + w[name + '/Dense_1/bias']


def conv_patches(x, kernel, bias):  # nn.Conv(kernel p, stride p, VALID) on NHWC x -> (B, h*w, D)
    b, hgt, wid, c = x.shape
    p = kernel.shape[0]
    x = x.reshape(b, hgt // p, p, wid // p, p, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, -1, p * p * c) @ kernel.reshape(p * p * c, -1) + bias


def jax_vit(w, x):
    w = {k: v.astype(np.float64) for k, v in w.items()}
    h = conv_patches(x, w['embedding/kernel'], w['embedding/bias'])
    h = np.concatenate([np.broadcast_to(w['cls'], (h.shape[0], 1, h.shape[2])), h], axis=1)
    h = h + w['Transformer/posembed_input/pos_embedding']
    for i in range(DEPTH):
        b = f'Transformer/encoderblock_{i}/'
        a = b + 'MultiHeadDotProductAttention_1/'
        y = layer_norm(h, w, b + 'LayerNorm_0')
        q, k, v = (np.einsum('bnd,dhk->bnhk', y, w[a + n + '/kernel']) + w[a + n + '/bias']
                   for n in ('query', 'key', 'value'))
        att = np.einsum('bqhk,bshk->bhqs', q / math.sqrt(q.shape[-1]), k)
        att = np.exp(att - att.max(-1, keepdims=True))
        att = att / att.sum(-1, keepdims=True)
        out = np.einsum('bhqs,bshk->bqhk', att, v)
        h = h + np.einsum('bqhk,hkd->bqd', out, w[a + 'out/kernel']) + w[a + 'out/bias']
        h = h + mlp_block(layer_norm(h, w, b + 'LayerNorm_2'), w, b + 'MlpBlock_3')
    h = layer_norm(h, w, 'Transformer/encoder_norm')[:, 0]
    if 'pre_logits/kernel' in w:
        h = np.tanh(h @ w['pre_logits/kernel'] + w['pre_logits/bias'])
    return h @ w['head/kernel'] + w['head/bias']


def jax_mixer(w, x):
    w = {k: v.astype(np.float64) for k, v in w.items()}
    h = conv_patches(x, w['stem/kernel'], w['stem/bias'])  # (B, S, C)
    for i in range(DEPTH):
        b = f'MixerBlock_{i}/'
        y = layer_norm(h, w, b + 'LayerNorm_0').swapaxes(1, 2)  # (B, C, S)
        h = h + mlp_block(y, w, b + 'token_mixing').swapaxes(1, 2)
        h = h + mlp_block(layer_norm(h, w, b + 'LayerNorm_1'), w, b + 'channel_mixing')
    h = layer_norm(h, w, 'pre_head_layer_norm').mean(axis=1)
    return h @ w['head/kernel'] + w['head/bias']


def nhwc(x):
    return x.permute(0, 2, 3, 1).double().numpy()


# -----------------------------------------------------------------------------
# ViT .npz

@pytest.mark.parametrize('layout,prefix,compressed', [
    ('vit_jax', '', False), ('vit_jax', 'opt/target/', False), ('big_vision', 'params/', True)])
def test_vit_npz_loads_like_timms_own_npz_loader(tmp_path, x, layout, prefix, compressed):
    no_embed_class = layout == 'big_vision'
    torch.manual_seed(0)
    source = randomise(timm_vit(no_embed_class=no_embed_class))
    arrays = vit_npz_arrays(source.state_dict(), layout, prefix)
    if prefix == 'opt/target/':
        arrays['opt/state/step'] = np.array(7)  # optimizer state beside the weights: ignored
    path = tmp_path / 'ViT.npz'
    (np.savez_compressed if compressed else np.savez)(path, **arrays)

    theirs = timm_vit(no_embed_class=no_embed_class)
    theirs.load_pretrained(str(path))  # timm's independent reading of the same file
    ours = vit.load_checkpoint(our_vit(), path)
    close(logits(ours, x), logits(theirs, x))
    close(logits(ours, x), logits(source, x))


def test_vit_npz_with_tanh_gelu_matches_jax_numerics(tmp_path, x):
    """The numpy Flax forward is the oracle; exact GELU is the documented ~1e-3 away from it."""
    torch.manual_seed(0)
    arrays = vit_npz_arrays(randomise(timm_vit()).state_dict())
    np.savez(tmp_path / 'ViT.npz', **arrays)
    ref = torch.from_numpy(jax_vit(arrays, nhwc(x))).float()
    tanh = vit.load_checkpoint(our_vit(gelu='tanh'), tmp_path / 'ViT.npz')
    exact = vit.load_checkpoint(our_vit(), tmp_path / 'ViT.npz')
    close(logits(tanh, x), ref)
    gap = (logits(exact, x) - ref).abs().max()
    assert 1e-5 < gap < 1e-2 * ref.abs().max()


def test_vit_npz_pre_logits_needs_representation_size(tmp_path, x):
    torch.manual_seed(0)
    source = randomise(our_vit(representation_size=48))
    arrays = vit_npz_arrays(source.state_dict())
    arrays['pre_logits/kernel'] = source.pre_logits.fc.weight.detach().T.numpy()
    arrays['pre_logits/bias'] = source.pre_logits.fc.bias.detach().numpy()
    np.savez(tmp_path / 'ViT.npz', **arrays)
    ours = vit.load_checkpoint(our_vit(gelu='tanh', representation_size=48), tmp_path / 'ViT.npz')
    close(logits(ours, x), torch.from_numpy(jax_vit(arrays, nhwc(x))).float())
    with pytest.raises(ValueError, match='representation_size=48'):
        vit.load_checkpoint(our_vit(), tmp_path / 'ViT.npz')


def test_vit_npz_resamples_pos_embed_and_keeps_own_head(tmp_path):
    torch.manual_seed(0)
    source = randomise(timm_vit())  # 4 x 4 grid, 10 classes
    np.savez(tmp_path / 'ViT.npz', **vit_npz_arrays(source.state_dict()))
    model = vit.VisionTransformer(img_size=2 * IMG, patch_size=PATCH, dim=DIM, depth=DEPTH, heads=HEADS,
                                  num_classes=5)
    for p in model.head.parameters():
        torch.nn.init.normal_(p)  # not the zero init, which a zeroed head would also equal
    head = [p.detach().clone() for p in model.head.parameters()]
    with pytest.warns(UserWarning, match='10 classes'):
        vit.load_checkpoint(model, tmp_path / 'ViT.npz')
    expected = resample_abs_pos_embed(source.pos_embed.detach(), (8, 8), num_prefix_tokens=1,
                                      interpolation='bicubic', antialias=True)
    torch.testing.assert_close(model.pos_embed.detach(), expected)
    assert all(torch.equal(p, q) for p, q in zip(model.head.parameters(), head))  # untouched
    torch.testing.assert_close(model.blocks[1].attn.qkv.weight, source.blocks[1].attn.qkv.weight)


# -----------------------------------------------------------------------------
# Mixer .npz

def timm_mixer_from_arrays(w):
    """The test's own conversion of the Flax arrays into timm's MlpMixer."""
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))
    model = TimmMixer(img_size=IMG, patch_size=PATCH, num_blocks=DEPTH, embed_dim=DIM, num_classes=CLASSES)
    with torch.no_grad():
        model.stem.proj.weight.copy_(t(w['stem/kernel'].transpose(3, 2, 0, 1)))
        model.stem.proj.bias.copy_(t(w['stem/bias']))
        for i, block in enumerate(model.blocks):
            b = f'MixerBlock_{i}/'
            for norm, name in ((block.norm1, 'LayerNorm_0'), (block.norm2, 'LayerNorm_1')):
                norm.weight.copy_(t(w[b + name + '/scale'])), norm.bias.copy_(t(w[b + name + '/bias']))
            for mlp, name in ((block.mlp_tokens, 'token_mixing'), (block.mlp_channels, 'channel_mixing')):
                for fc, dense in ((mlp.fc1, 'Dense_0'), (mlp.fc2, 'Dense_1')):
                    fc.weight.copy_(t(w[f'{b}{name}/{dense}/kernel'].T)), fc.bias.copy_(t(w[f'{b}{name}/{dense}/bias']))
        model.norm.weight.copy_(t(w['pre_head_layer_norm/scale']))
        model.norm.bias.copy_(t(w['pre_head_layer_norm/bias']))
        model.head.weight.copy_(t(w['head/kernel'].T)), model.head.bias.copy_(t(w['head/bias']))
    return model.eval()


@pytest.mark.parametrize('prefix', ['', 'opt/target/'])
def test_mixer_npz_logits_equal_timm_and_jax(tmp_path, x, prefix):
    arrays = mixer_npz_arrays(prefix=prefix)
    np.savez(tmp_path / 'Mixer.npz', **arrays)
    exact = mixer.load_checkpoint(our_mixer(), tmp_path / 'Mixer.npz')
    close(logits(exact, x), logits(timm_mixer_from_arrays(mixer_npz_arrays()), x))
    tanh = mixer.load_checkpoint(our_mixer(gelu='tanh'), tmp_path / 'Mixer.npz')
    ref = torch.from_numpy(jax_mixer(mixer_npz_arrays(), nhwc(x))).float()
    close(logits(tanh, x), ref)
    gap = (logits(exact, x) - ref).abs().max()
    assert 1e-5 < gap < 1e-2 * ref.abs().max()


def test_npz_reader_matches_numpy(tmp_path):
    """Our numpy-free reader against np.load: dtypes, 0-d, empty and Fortran-order arrays, .npy
    format 1.0 and 2.0, stored and deflated zip members."""
    rng = np.random.default_rng(0)
    arrays = {'a/f4': rng.normal(size=(2, 3, 4)).astype('<f4'), 'b/f2': rng.normal(size=(5,)).astype('<f2'),
              'c/f8': rng.normal(size=(3, 1)), 'd/i8': np.arange(6).reshape(2, 3), 'e/scalar': np.array(3.5, '<f4'),
              'f/empty': np.zeros((0, 4), '<f4'), 'g/fortran': rng.normal(size=(2, 3, 5)).astype('<f4').T}
    path = tmp_path / 'mixed.npz'
    with zipfile.ZipFile(path, 'w') as zf:
        for i, (name, a) in enumerate(arrays.items()):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, a, version=(1, 0) if i % 2 else (2, 0))
            zf.writestr(name + '.npy', buf.getvalue(), zipfile.ZIP_DEFLATED if i % 3 else zipfile.ZIP_STORED)
    ref = np.load(path)
    for module in (vit, mixer):
        got = module._read_npz(path)
        assert sorted(got) == sorted(ref.files)
        for name in ref.files:
            assert got[name].shape == ref[name].shape
            np.testing.assert_array_equal(got[name].numpy(), ref[name])


# -----------------------------------------------------------------------------
# ConvMixer: locuslab's flat nn.Sequential (built here after locuslab/convmixer's convmixer.py)

class LocuslabResidual(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x) + x


def locuslab_convmixer(dim, depth, kernel_size, patch_size, n_classes):
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, dim, kernel_size=patch_size, stride=patch_size), nn.GELU(), nn.BatchNorm2d(dim),
        *[nn.Sequential(
            LocuslabResidual(nn.Sequential(nn.Conv2d(dim, dim, kernel_size, groups=dim, padding='same'),
                                           nn.GELU(), nn.BatchNorm2d(dim))),
            nn.Conv2d(dim, dim, kernel_size=1), nn.GELU(), nn.BatchNorm2d(dim)) for _ in range(depth)],
        nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten(), nn.Linear(dim, n_classes))


CM = dict(dim=32, depth=3, kernel_size=5, patch_size=4)


@pytest.mark.parametrize('wrapped', [True, False])
def test_convmixer_locuslab_file_round_trips_and_equals_timm(tmp_path, x, wrapped):
    torch.manual_seed(0)
    theirs = randomise(locuslab_convmixer(**CM, n_classes=CLASSES))
    sd = theirs.state_dict()
    if wrapped:  # as timm's train.py saves it (locuslab trained with timm), from a DDP model
        ckpt = {'state_dict': {'module.' + k: v for k, v in sd.items()}, 'epoch': 149, 'arch': 'convmixer_1536_20',
                'args': argparse.Namespace(model='convmixer_1536_20', lr=0.01)}
    else:  # bare, from an older PyTorch without BN's num_batches_tracked
        ckpt = {k: v for k, v in sd.items() if not k.endswith('num_batches_tracked')}
    torch.save(ckpt, tmp_path / 'convmixer.pth.tar')
    ours = convmixer.load_checkpoint(convmixer.ConvMixer(**CM, num_classes=CLASSES), tmp_path / 'convmixer.pth.tar')
    close(logits(ours, x), logits(theirs, x))
    timm_model = TimmConvMixer(**CM, num_classes=CLASSES)
    timm_model.load_state_dict(ours.state_dict())
    close(logits(ours, x), logits(timm_model, x))
    # back into the flat layout: parameters and buffers sit in the same order, so it is a zip
    back = locuslab_convmixer(**CM, n_classes=CLASSES)
    back.load_state_dict(dict(zip(back.state_dict(), ours.state_dict().values())))
    for k, v in back.state_dict().items():
        if not k.endswith('num_batches_tracked'):
            torch.testing.assert_close(v, sd[k], rtol=0, atol=0)


# -----------------------------------------------------------------------------
# timm state_dicts and our own training checkpoints, for all three families

FAMILIES = {
    'vit': (vit, our_vit, timm_vit),
    'mixer': (mixer, our_mixer,
              lambda: TimmMixer(img_size=IMG, patch_size=PATCH, num_blocks=DEPTH, embed_dim=DIM, num_classes=CLASSES)),
    'convmixer': (convmixer, lambda: convmixer.ConvMixer(**CM, num_classes=CLASSES),
                  lambda: TimmConvMixer(**CM, num_classes=CLASSES)),
}


@pytest.mark.parametrize('family', list(FAMILIES))
@pytest.mark.parametrize('kind', ['timm_bare', 'timm_train_ddp', 'ours', 'ours_compiled_ddp'])
def test_timm_state_dicts_and_our_training_checkpoints(tmp_path, x, family, kind):
    module, ours_fn, timm_fn = FAMILIES[family]
    torch.manual_seed(0)
    theirs = randomise(timm_fn())
    sd = theirs.state_dict()
    ckpt = {
        'timm_bare': sd,
        'timm_train_ddp': {'state_dict': {'module.' + k: v for k, v in sd.items()}, 'epoch': 3,
                           'args': argparse.Namespace(model='x')},
        'ours': {'model': sd, 'optimizer': {'state': {}, 'param_groups': [{'lr': 0.1}]}, 'epoch': 3, 'step': 30,
                 'args': {'model': 'x', 'lr': 0.1}},
        # a state_dict taken from DDP(torch.compile(model)) without unwrapping
        'ours_compiled_ddp': {'model': {'module._orig_mod.' + k: v for k, v in sd.items()}},
    }[kind]
    torch.save(ckpt, tmp_path / 'ckpt.pt')
    ours = module.load_checkpoint(ours_fn(), tmp_path / 'ckpt.pt')
    close(logits(ours, x), logits(theirs, x))


# -----------------------------------------------------------------------------
# Mismatches: a clear ValueError naming the first key and both shapes, never a deep traceback

def test_wrong_width_names_key_and_both_shapes(tmp_path):
    torch.manual_seed(0)
    np.savez(tmp_path / 'ViT.npz', **vit_npz_arrays(timm_vit().state_dict()))
    narrow = vit.VisionTransformer(img_size=IMG, patch_size=PATCH, dim=32, depth=DEPTH, heads=HEADS,
                                   num_classes=CLASSES)
    with pytest.raises(ValueError) as err:
        vit.load_checkpoint(narrow, tmp_path / 'ViT.npz')
    assert "'cls_token' (from 'cls') has shape (1, 1, 64) in the file but (1, 1, 32) in the model" in str(err.value)

    np.savez(tmp_path / 'Mixer.npz', **mixer_npz_arrays())
    other_res = mixer.MlpMixer(img_size=2 * IMG, patch_size=PATCH, dim=DIM, depth=DEPTH, num_classes=CLASSES)
    with pytest.raises(ValueError, match=r"'blocks.0.mlp_tokens.fc1.weight' \(from 'MixerBlock_0/token_mixing/"
                                         r"Dense_0/kernel'\) has shape \(32, 16\) in the file but \(32, 64\)"):
        mixer.load_checkpoint(other_res, tmp_path / 'Mixer.npz')


def test_wrong_depth_names_the_first_extra_or_missing_key(tmp_path):
    torch.manual_seed(0)
    sd = locuslab_convmixer(**CM, n_classes=CLASSES).state_dict()  # depth 3
    torch.save(sd, tmp_path / 'cm.pth')
    shallow = convmixer.ConvMixer(**{**CM, 'depth': 2}, num_classes=CLASSES)
    with pytest.raises(ValueError, match=r"'blocks.2.0.fn.0.weight' \(from '5.0.fn.0.weight'\) \(32, 1, 5, 5\)"):
        convmixer.load_checkpoint(shallow, tmp_path / 'cm.pth')
    deep = convmixer.ConvMixer(**{**CM, 'depth': 4}, num_classes=CLASSES)
    with pytest.raises(ValueError, match=r"the model has 'blocks.3.0.fn.0.weight' \(32, 1, 5, 5\) but the file"):
        convmixer.load_checkpoint(deep, tmp_path / 'cm.pth')


def test_files_of_another_kind_are_refused_clearly(tmp_path):
    np.savez(tmp_path / 'Mixer.npz', **mixer_npz_arrays())
    with pytest.raises(ValueError, match="not an official ViT .npz.*'stem/kernel'"):
        vit.load_checkpoint(our_vit(), tmp_path / 'Mixer.npz')
    np.savez(tmp_path / 'ViT.npz', **vit_npz_arrays(timm_vit().state_dict()))
    with pytest.raises(ValueError, match='not an official MLP-Mixer .npz'):
        mixer.load_checkpoint(our_mixer(), tmp_path / 'ViT.npz')
    with pytest.raises(ValueError, match='JAX .npz'):
        convmixer.load_checkpoint(convmixer.ConvMixer(**CM), tmp_path / 'ViT.npz')
    torch.save(our_mixer().state_dict(), tmp_path / 'mixer.pt')
    with pytest.raises(ValueError, match=r"not a checkpoint for this VisionTransformer: 20 of its 32 keys "
                                         r"are not in the file, the first 'cls_token'"):
        vit.load_checkpoint(our_vit(), tmp_path / 'mixer.pt')

    (tmp_path / 'notes.txt').write_text('not a checkpoint\n')
    with zipfile.ZipFile(tmp_path / 'other.zip', 'w') as zf:
        zf.writestr('readme.md', 'hello')
    torch.save({'model': {'w': torch.ones(1)}, 'extra': zipfile.ZipInfo('x')}, tmp_path / 'pickled.pt')
    for module, model in ((vit, our_vit()), (mixer, our_mixer()), (convmixer, convmixer.ConvMixer(**CM))):
        for name in ('notes.txt', 'other.zip'):
            with pytest.raises(ValueError, match='torch.load reads'):
                module.load_checkpoint(model, tmp_path / name)
        with pytest.raises(ValueError, match='weights_only=False'):  # arbitrary pickled objects: refused
            module.load_checkpoint(model, tmp_path / 'pickled.pt')
        with pytest.raises(FileNotFoundError):
            module.load_checkpoint(model, tmp_path / 'missing.pt')
        with pytest.raises(ValueError, match="'epoch' is a int, not a tensor"):
            module.load_checkpoint(model, {'epoch': 3})
