"""Defaults that depend on the device (issue 33): channels_last on for the convolutional models on CUDA only, with
--channels-last / --no-channels-last winning; --max-micro-batch derived from the GPU's memory with 256 as its floor
and CPU value; bench's ConvMixer rows in both layouts on CUDA. No GPU here: CUDA is faked at the API the code reads
(torch.cuda.is_available, get_device_properties) and the expected figures are the data sheets' memory sizes."""
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


@pytest.mark.parametrize('mib, want', [(None, 256), (24 * 1024, 256), (40960, 256), (81559, 512), (81920, 512),
                                       (143771, 768)])  # CPU, 24 GB, A100 40GB, H100 80GB, A100 80GB, H200 (MiB)
def test_max_micro_batch_follows_the_gpu_memory(mib, want, monkeypatch):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: mib is not None)
    monkeypatch.setattr(torch.cuda, 'current_device', lambda: 0)
    monkeypatch.setattr(torch.cuda, 'get_device_properties', lambda d: types.SimpleNamespace(total_memory=mib << 20))
    assert utils.micro_batch_cap() == want


def test_bench_rows_each_layout_for_convmixer_on_cuda():
    cuda, cpu = torch.device('cuda'), torch.device('cpu')
    args = lambda flag, device: types.SimpleNamespace(channels_last=flag, device=device)  # noqa: E731
    assert bench.layouts('convmixer_768_32', args(None, cuda)) == [False, True]
    assert bench.layouts('vit_b16', args(None, cuda)) == [False]
    assert bench.layouts('convmixer_768_32', args(None, cpu)) == [False]
    assert bench.layouts('convmixer_768_32', args(True, cuda)) == [True]
    assert bench.layouts('vit_b16', args(False, cpu)) == [False]
