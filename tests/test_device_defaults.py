"""Defaults that depend on the device (issue 33): channels_last on for the convolutional models on CUDA only, with
--channels-last / --no-channels-last winning; --max-micro-batch derived from the GPU's memory, the model and its
image size (issue 45), 256 on the CPU; bench's ConvMixer rows in both layouts on CUDA. No GPU here: CUDA is faked
at the API the code reads (torch.cuda.is_available, get_device_properties), with the data sheets' memory sizes."""
import types

import pytest
import torch

import bench
import models
import utils


@pytest.mark.parametrize('name, flag, device, want', [
    ('convmixer_256_8', None, 'cuda', True), ('convmixer_1536_20', None, 'cuda:1', True),
    ('resnet50', None, 'cuda', True), ('resnet20', None, 'cuda', True), ('vit_b16', None, 'cuda', False),
    ('mixer_b16', None, 'cuda', False),
    ('convmixer_256_8', None, 'cpu', False), ('convmixer_256_8', False, 'cuda', False), ('vit_b16', True, 'cpu', True)])
def test_channels_last_default(name, flag, device, want):
    assert models.channels_last(flag, name, torch.device(device)) is want


def fake_gpu(monkeypatch, mib):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'current_device', lambda: 0)
    monkeypatch.setattr(torch.cuda, 'get_device_properties', lambda d: types.SimpleNamespace(total_memory=mib << 20))


def vit_activation_bytes(layers, tokens, dim, heads):
    """An image's activations in a ViT trained in 16 bits, closed form: Korthikanti et al. 2022 (Reducing Activation
    Recomputation in Large Transformer Models, Sec. 4.1), s*h*(34 + 5*a*s/h) bytes a layer, the attention scores
    and softmax kept; the paper's configs (Dosovitskiy et al. Table 1)."""
    return layers * tokens * dim * (34 + 5 * heads * tokens / dim)


# (model, px): (layers, tokens incl. the class token, dim, heads): ViT-B/16, ViT-L/16 at 224 px, ViT-B/8 at 224 px,
# the 384 px fine-tune of ViT-B/16
VITS = {('vit_b16', 224): (12, 197, 768, 12), ('vit_l16', 224): (24, 197, 1024, 16),
        ('vit_b8', 224): (12, 785, 768, 12), ('vit_b16', 384): (12, 577, 768, 12)}


@pytest.mark.parametrize('name, px', list(VITS))
def test_the_default_micro_batch_fits_the_model_at_its_image_size(name, px, monkeypatch):
    """The default --max-micro-batch on an H100 80GB (81,559 MiB): its activations by the closed form fit in the
    card, and use a fair share of it (a cap that errs far low wastes the GPU). It was 256 per 40 GB whatever the
    model: 512 images of ViT-L/16 are ~114 GiB by the closed form, of ViT-B/8 ~329 GiB."""
    import models
    total = 81559 << 20
    fake_gpu(monkeypatch, 81559)
    cap = utils.micro_batch_cap(lambda: models.build_model(name, 1000, px), px, half=True)
    need = cap * vit_activation_bytes(*VITS[name, px])
    assert 0.3 * total <= need <= 0.8 * total, (cap, need / 2 ** 30)


def test_max_micro_batch_on_the_cpu_and_a_model_too_large_for_the_gpu(monkeypatch):
    import models
    assert utils.micro_batch_cap(lambda: models.build_model('vit_l16', 1000, 224), 224) == 256  # CPU (the suite)
    fake_gpu(monkeypatch, 4096)  # a 4 GB card: ViT-B/8 at 1024 px holds 16,385 tokens, ~6 GiB of scores a layer
    with pytest.raises(utils.UserError, match=r'--max-micro-batch: this model at 1024 px needs .* GiB at one image'):
        utils.micro_batch_cap(lambda: models.build_model('vit_b8', 1000, 1024), 1024)


def test_train_imagenet_splits_the_global_batch_into_micro_batches_that_fit(monkeypatch):
    """ViT-L/16 at the sam recipe's batch of 4096 on 8 H100s: 512 images a process, in micro-batches that fit."""
    import train_imagenet as ti
    fake_gpu(monkeypatch, 81559)
    args = ti.get_args(['--synthetic', '--model', 'vit_l16', '--batch-size', '4096'])
    per_step, k, _ = ti.split_batch(args, 8)
    assert per_step == 512 and k > 1 and per_step // k <= args.max_micro_batch
    assert per_step // k * vit_activation_bytes(*VITS['vit_l16', 224]) <= 0.8 * (81559 << 20)


def test_bench_rows_each_layout_for_convmixer_on_cuda():
    cuda, cpu = torch.device('cuda'), torch.device('cpu')
    args = lambda flag, device: types.SimpleNamespace(channels_last=flag, device=device)  # noqa: E731
    assert bench.layouts('convmixer_768_32', args(None, cuda)) == [False, True]
    assert bench.layouts('vit_b16', args(None, cuda)) == [False]
    assert bench.layouts('convmixer_768_32', args(None, cpu)) == [False]
    assert bench.layouts('convmixer_768_32', args(True, cuda)) == [True]
    assert bench.layouts('vit_b16', args(False, cpu)) == [False]
