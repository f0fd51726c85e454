"""The patch embedding as one matmul (``patch_embed: matmul``), against timm's own convolution."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.errors import InputError
from pipeline.models import create_model
from pipeline.models.patch_embed import PatchMatmul, use_patch_embed
from pipeline.train.build import build_model


def _images(n: int, size: int) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("size", [32, 37])  # 37: the last 5 rows and columns are no whole patch
def test_patch_matmul_equals_the_convolution(size):
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 24, 8, stride=8)
    matmul = PatchMatmul(3, 24, 8, stride=8)
    matmul.load_state_dict(conv.state_dict())
    x = _images(2, size)
    ref = F.conv2d(x, conv.weight, conv.bias, stride=8)
    out = matmul(x)
    assert out.shape == ref.shape == (2, 24, size // 8, size // 8)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # the view timm takes next (flatten(2).transpose(1, 2)) is the same tokens
    torch.testing.assert_close(out.flatten(2).transpose(1, 2), ref.flatten(2).transpose(1, 2), rtol=1e-5, atol=1e-5)


def test_matmul_model_equals_the_unpatched_timm_model_forward_and_backward():
    torch.manual_seed(0)
    ref = timm.create_model("deit_tiny_patch16_224", img_size=64, depth=2, num_classes=10).eval()
    model = copy.deepcopy(ref)
    use_patch_embed(model, "matmul")
    assert isinstance(model.patch_embed.proj, PatchMatmul)
    assert model.state_dict().keys() == ref.state_dict().keys()
    x = _images(2, 64)
    out, expected = model(x), ref(x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    out.square().sum().backward()
    expected.square().sum().backward()
    torch.testing.assert_close(model.patch_embed.proj.weight.grad, ref.patch_embed.proj.weight.grad,
                               rtol=1e-3, atol=1e-4)


def test_matmul_model_under_bf16_autocast_stays_close_to_the_fp32_model():
    torch.manual_seed(0)
    model = create_model("deit_tiny_patch16_224", img_size=64, depth=2, num_classes=10, patch_embed="matmul").eval()
    x = _images(2, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = model.patch_embed(x)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), model.patch_embed(x), rtol=0.05, atol=0.05)


def test_a_conv_checkpoint_loads_into_the_matmul_model(tmp_path):
    torch.manual_seed(0)
    conv_model = create_model("deit_tiny_patch16_224", img_size=64, depth=2, num_classes=10)
    path = tmp_path / "weights.pt"
    torch.save(conv_model.state_dict(), path)
    model = create_model("deit_tiny_patch16_224", img_size=64, depth=2, num_classes=10, weights=path,
                         patch_embed="matmul")
    torch.testing.assert_close(model.patch_embed.proj.weight, conv_model.patch_embed.proj.weight)
    x = _images(1, 64)
    torch.testing.assert_close(model.eval()(x), conv_model.eval()(x), rtol=1e-4, atol=1e-4)


@pytest.mark.compile
def test_the_matmul_model_compiles_fullgraph_with_downsampling():
    model = create_model("deit_tiny_patch16_224", img_size=64, depth=4, num_classes=10, method="wkmedoids",
                         keep=[12, 8, 4, 2], patch_embed="matmul")
    x = _images(2, 64)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(x)
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
    out.sum().backward()
    assert model.patch_embed.proj.weight.grad is not None


def test_model_config_patch_embed_reaches_the_trained_model():
    from pipeline.config import CONFIG_DIR, load_config

    config = load_config(CONFIG_DIR / "train" / "tiny_synthetic.yaml", ["model.patch_embed=matmul"])
    assert isinstance(build_model(config).patch_embed.proj, PatchMatmul)
    assert type(build_model(load_config(CONFIG_DIR / "train" / "tiny_synthetic.yaml")).patch_embed.proj) \
        is nn.Conv2d


def test_bad_patch_embed_choices_are_refused():
    from pipeline.config import CONFIG_DIR, ConfigError, load_config

    with pytest.raises((ConfigError, ValueError), match="patch_embed"):
        load_config(CONFIG_DIR / "train" / "tiny_synthetic.yaml", ["model.patch_embed=unfold"])
    model = timm.create_model("deit_tiny_patch16_224", img_size=64, depth=1)
    with pytest.raises(InputError, match="one of"):
        use_patch_embed(model, "fft")
    model.patch_embed.proj = nn.Conv2d(3, 192, 16, stride=8)  # overlapping patches: not one matmul
    with pytest.raises(InputError, match="non-overlapping patches"):
        use_patch_embed(model, "matmul")
