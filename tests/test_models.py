"""Models with a downsampling step in every block, against the unpatched timm model."""

from __future__ import annotations

import copy
import math

import pytest
import timm
import torch
from timm.models.deit import VisionTransformerDistilled
from timm.models.vision_transformer import VisionTransformer

from pipeline.errors import InputError
from pipeline.methods import METHODS
from pipeline.models import apply_downsampling, attend, create_model, effective_keep, parse_keep

METHODS_ALL = sorted(METHODS)
# 64 tokens on an 8x8 grid, 4 blocks: small enough for every method, forward and backward.
KEEP = [60, 40, 16, 9]
CONV_KEEP = [64, 16, 16, 4]


def tiny(cls: type = VisionTransformer, **kwargs) -> VisionTransformer:
    torch.manual_seed(0)
    args = dict(img_size=64, patch_size=8, embed_dim=48, depth=4, num_heads=3, num_classes=10) | kwargs
    return cls(**args).eval()


def images(n: int = 2, size: int = 64) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("method", METHODS_ALL)
@pytest.mark.parametrize("carry", [False, True])
def test_keep_all_equals_timm(method, carry):
    reference = tiny()
    pooled = apply_downsampling(copy.deepcopy(reference), method, [64] * 4, carry=carry)
    with torch.no_grad():
        torch.testing.assert_close(pooled(images()), reference(images()))


@pytest.mark.parametrize("method", METHODS_ALL)
def test_keep_all_equals_timm_deit_small(method):
    reference = timm.create_model("deit_small_patch16_224", num_classes=5).eval()
    pooled = apply_downsampling(copy.deepcopy(reference), method)
    x = images(1, 224)
    with torch.no_grad():
        torch.testing.assert_close(pooled(x), reference(x))


@pytest.mark.parametrize("method", METHODS_ALL)
@pytest.mark.parametrize("carry", [False, True])
def test_forward_and_backward_with_a_keep_list(method, carry):
    model = apply_downsampling(tiny(), method, CONV_KEEP if method == "conv" else KEEP, carry=carry).train()
    logits = model(images())
    assert logits.shape == (2, 10) and torch.isfinite(logits).all()
    logits.sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model.patch_embed.proj.weight.grad.abs().sum() > 0


def _tokens_after_each_block(model, x):
    counts = []
    hooks = [block.mlp.register_forward_hook(lambda m, i, o: counts.append(o.shape[1])) for block in model.blocks]
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    return counts


def test_mlp_sees_the_kept_tokens_plus_prefix():
    model = apply_downsampling(tiny(), "wkmedoids", KEEP)
    assert _tokens_after_each_block(model, images()) == [k + 1 for k in KEEP]


def test_zero_keeps_only_the_prefix():
    model = apply_downsampling(tiny(), "powerbert", [50, 20, 0, 0])
    assert _tokens_after_each_block(model, images()) == [51, 21, 1, 1]


def test_keep_values_above_what_is_left_mean_keep_all():
    # The paper's DeiT-e252 level 4 ends "..., 36, 5, 7, 2, 0".
    assert effective_keep([196, 194, 181, 147, 111, 75, 48, 36, 5, 7, 2, 0], depth=12, num_tokens=196) == [
        196, 194, 181, 147, 111, 75, 48, 36, 5, 5, 2, 0]
    model = apply_downsampling(tiny(), "tome", [40, 50, 16, 20])
    assert model.blocks.config.keep == [40, 40, 16, 16]
    assert _tokens_after_each_block(model, images()) == [41, 41, 17, 17]


@pytest.mark.parametrize(
    "keep,message",
    [
        ([64, 32, 16], r"keep has 3 entries but the model has 4 blocks"),
        ([64, 65, 16, 8], r"keep\[1\] \(block 2\) is 65, above the model's 64 patch tokens"),
        ([64, 32, -1, 8], r"keep\[2\] \(block 3\) is -1: a number of tokens cannot be negative"),
        ([64, 32, 16.5, 8], r"keep\[2\] \(block 3\) must be an integer, got 16.5"),
        ("64,32", r"keep must be a list of 4 integers"),
    ],
)
def test_bad_keep_lists(keep, message):
    with pytest.raises(ValueError, match=message):
        apply_downsampling(tiny(), "kmedoids", keep)


def test_parse_keep():
    assert parse_keep("64, 32,16,8") == [64, 32, 16, 8]
    assert parse_keep("none") is None  # keep all
    with pytest.raises(ValueError, match="comma-separated integers"):
        parse_keep("64,x,16,8")


def test_conv_keep_must_follow_the_grid():
    with pytest.raises(ValueError, match=r"keep\[1\] is 20, but conv downsampling of a 8x8 grid gives 16"):
        apply_downsampling(tiny(), "conv", [64, 20, 20, 20])


def test_bad_model_and_method():
    with pytest.raises(ValueError, match="needs a timm VisionTransformer"):
        apply_downsampling(torch.nn.Linear(3, 3), "kmedoids")
    with pytest.raises(ValueError, match="unknown downsampling method"):
        apply_downsampling(tiny(), "kmodes")
    model = apply_downsampling(tiny(), "tome")
    with pytest.raises(ValueError, match="already downsamples"):
        apply_downsampling(model, "tome")


def test_state_dict_keys_unchanged_and_round_trip(tmp_path):
    reference = tiny()
    pooled = apply_downsampling(tiny(), "wkmedoids", KEEP)
    assert list(pooled.state_dict()) == list(reference.state_dict())
    path = tmp_path / "timm.pth"
    torch.save({"model": reference.state_dict()}, path)
    fresh = apply_downsampling(tiny(embed_dim=48), "wkmedoids", KEEP)
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)  # make sure the load, not the seed, brings the weights
    from pipeline.models import load_weights

    load_weights(fresh, path)
    with torch.no_grad():
        torch.testing.assert_close(fresh(images()), pooled(images()))


def test_load_weights_errors(tmp_path):
    from pipeline.models import load_weights

    with pytest.raises(FileNotFoundError, match="weights file not found"):
        load_weights(tiny(), tmp_path / "nope.pth")
    path = tmp_path / "other.pth"
    torch.save(tiny(embed_dim=24).state_dict(), path)
    with pytest.raises(InputError, match=r"other.pth: weights of another architecture \(size mismatch for cls_token"):
        load_weights(tiny(), path)


def test_registered_widths():
    for name, dim in [("deit_e252_patch16_224", 252), ("deit_e318_patch16_224", 318)]:
        model = timm.create_model(name)
        assert model.embed_dim == dim and model.blocks[0].attn.num_heads == 6 and len(model.blocks) == 12
        assert timm.data.resolve_model_data_config(model)["crop_pct"] == 0.875
    model = create_model("deit_small_patch16_224", embed_dim=192, num_heads=3, method="tome")
    assert model.embed_dim == 192
    # One builder for every architecture field: a custom width, depth and patch size together.
    model = create_model("deit_tiny_patch16_224", embed_dim=96, depth=3, patch_size=8, img_size=64, num_classes=7)
    assert (model.embed_dim, len(model.blocks), model.patch_embed.patch_size, model.num_classes) == (96, 3, (8, 8), 7)
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 7)
    with pytest.raises(ValueError, match="embed_dim 250 does not split into the model.s heads"):
        create_model("deit_small_patch16_224", embed_dim=250)
    with pytest.raises(ValueError, match="no published weights exist for deit_e252_patch16_224"):
        timm.create_model("deit_e252_patch16_224", pretrained=True)  # refused before any download


# ---- off-the-shelf use on the three kinds of timm ViT -------------------------------------------

OFF_THE_SHELF = {
    "layerscale": lambda: tiny(init_values=0.1),
    "registers": lambda: tiny(reg_tokens=4),
    "distilled": lambda: tiny(VisionTransformerDistilled),
}


@pytest.mark.parametrize("kind", sorted(OFF_THE_SHELF))
def test_off_the_shelf(kind):
    reference = OFF_THE_SHELF[kind]()
    prefix = reference.num_prefix_tokens
    assert prefix == {"layerscale": 1, "registers": 5, "distilled": 2}[kind]
    with torch.no_grad():
        n = reference.patch_embed.num_patches
        same = apply_downsampling(copy.deepcopy(reference), "wkmedoids", [n] * 4)
        torch.testing.assert_close(same(images()), reference(images()))
        pooled = apply_downsampling(copy.deepcopy(reference), "wkmedoids", [n // 2, n // 4, n // 4, 2], carry=True)
        assert _tokens_after_each_block(pooled, images()) == [k + prefix for k in [n // 2, n // 4, n // 4, 2]]
        assert torch.isfinite(pooled(images())).all()


# ---- attention variants --------------------------------------------------------------------------

def test_carry_equals_attention_over_duplicated_tokens():
    # Proportional attention (log size on the logits) is exactly attention over a set in which a
    # token of size s appears s times: an independent reference for Appendix E.
    attn = tiny().blocks[0].attn
    x = torch.randn(1, 5, 48)
    sizes = torch.tensor([[1.0, 3.0, 1.0, 2.0, 1.0]])
    with torch.no_grad():
        out, _ = attend(attn, x, num_prefix=1, log_sizes=sizes.log())
        repeats = sizes[0].long()
        expanded = torch.repeat_interleave(x, repeats, dim=1)  # (1, 8, 48)
        full, _ = attend(attn, expanded, num_prefix=1)
        first = torch.cumsum(repeats, 0) - repeats  # the first copy of each token
        torch.testing.assert_close(out, full[:, first])


def test_size_zero_tokens_are_ignored():
    attn = tiny().blocks[0].attn
    x = torch.randn(1, 4, 48)
    with torch.no_grad():
        out, _ = attend(attn, x, num_prefix=1, log_sizes=torch.tensor([[1.0, 1.0, 0.0, 1.0]]).log())
        kept, _ = attend(attn, x[:, [0, 1, 3]], num_prefix=1)
    torch.testing.assert_close(out[:, [0, 1, 3]], kept)


def test_stats_are_significance_and_mean_keys():
    attn = tiny().blocks[0].attn
    x = torch.randn(2, 7, 48)
    with torch.no_grad():
        out, stats = attend(attn, x, num_prefix=1, scores=True, keys=True)
        fused, _ = attend(attn, x, num_prefix=1)
        q, k, v = attn.qkv(x).reshape(2, 7, 3, 3, 16).permute(2, 0, 3, 1, 4)
        probs = ((q @ k.transpose(-2, -1)) / 4.0).softmax(-1)  # head_dim 16
    torch.testing.assert_close(out, fused)
    torch.testing.assert_close(stats.scores, probs.sum((1, 2))[:, 1:])
    torch.testing.assert_close(stats.keys, k.mean(1)[:, 1:])


def test_normalised_queries_and_keys():
    model = apply_downsampling(tiny(), "none", qk_norm="fixed", alpha=5.0)
    attn, block = model.blocks[0].attn, model.blocks[0]
    assert not block.qk_alpha.requires_grad
    x = torch.randn(1, 6, 48)
    with torch.no_grad():
        out, _ = attend(attn, x, num_prefix=1, qk_alpha=block.qk_alpha)
        q, k, v = attn.qkv(x).reshape(1, 6, 3, 3, 16).permute(2, 0, 3, 1, 4)
        q = q / q.norm(dim=-1, keepdim=True)
        k = k / k.norm(dim=-1, keepdim=True)
        expected = attn.proj(((5.0 * q @ k.transpose(-2, -1)).softmax(-1) @ v).transpose(1, 2).reshape(1, 6, 48))
    torch.testing.assert_close(out, expected)
    learned = apply_downsampling(tiny(), "tome", KEEP, qk_norm="learned", alpha=math.sqrt(16))
    learned(images()).sum().backward()
    assert all(block.qk_alpha.grad is not None for block in learned.blocks)
    assert "blocks.0.qk_alpha" in learned.state_dict()


def test_grad_checkpointing_is_refused():
    model = tiny()
    model.set_grad_checkpointing(True)
    with pytest.raises(ValueError, match="gradient checkpointing"):
        apply_downsampling(model, "tome")


# ---- PoWER-BERT soft-extract (the K search) ------------------------------------------------------

def test_soft_extract_starts_as_the_timm_model():
    reference = tiny()
    searched = apply_downsampling(copy.deepcopy(reference), "none", soft_extract=True)
    with torch.no_grad():
        torch.testing.assert_close(searched(images()), reference(images()))


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.compile)])
def test_soft_extract_scales_by_significance_rank(compiled):
    from pipeline.models import soft_extract
    from pipeline.pooling import select_topk

    tokens = torch.randn(2, 10, 4)
    scores = torch.rand(2, 10)
    retention = torch.tensor([1.0] * 4 + [0.0] * 6)  # keep the 4 most significant tokens
    if compiled:  # the graph torch.compile traces ranks by comparisons, not by sorting
        torch._dynamo.reset()
        soft_extract = torch.compile(soft_extract, backend="eager", fullgraph=True, dynamic=False)
    out = soft_extract(tokens, scores, retention)
    kept = select_topk(tokens, 4, scores=scores)
    for s in range(2):
        nonzero = out[s].abs().sum(-1) > 0
        assert torch.equal(nonzero.nonzero().squeeze(-1), kept.index[s])
    half = soft_extract(tokens, scores, torch.full((10,), 0.5))
    torch.testing.assert_close(half, tokens * 0.5)
    torch.testing.assert_close(soft_extract(tokens, scores, torch.full((10,), 3.0)), tokens)  # clamped to 1


def test_retention_penalty_and_keep_list():
    from pipeline.models import retention_keep, retention_penalty

    model = apply_downsampling(tiny(), "none", soft_extract=True)
    masses = [60.0, 62.0, 30.0, 10.4]  # block 2 asks for more than block 1 kept: clamped
    with torch.no_grad():
        for block, mass in zip(model.blocks, masses):
            block.retention.copy_(torch.full((64,), mass / 64))
    assert retention_keep(model) == [60, 60, 30, 10]
    expected = 0.01 * sum((layer + 1) * mass for layer, mass in enumerate(masses))
    assert retention_penalty(model, 0.01).item() == pytest.approx(expected, rel=1e-5)
    loss = model(images()).sum() + retention_penalty(model, 0.01)
    loss.backward()
    assert all(block.retention.grad is not None and block.retention.grad.abs().sum() > 0 for block in model.blocks)


def test_retention_moves_from_its_initial_value_of_one():
    from pipeline.models import project_retention, retention_penalty

    model = apply_downsampling(tiny(), "none", soft_extract=True)  # every retention weight is exactly 1
    retention_penalty(model, 0.01).backward()
    grads = [block.retention.grad for block in model.blocks]
    assert all(g is not None and (g > 0).all() for g in grads)  # a plain clamp would give 0 at the bound
    with torch.no_grad():
        model.blocks[0].retention.sub_(2.0)
        model.blocks[1].retention.add_(0.5)
    project_retention(model)
    assert (model.blocks[0].retention == 0).all() and (model.blocks[1].retention == 1).all()


def test_soft_extract_needs_the_plain_model():
    with pytest.raises(ValueError, match="soft_extract is the K search"):
        apply_downsampling(tiny(), "kmedoids", soft_extract=True)
    from pipeline.models import retention_keep

    with pytest.raises(ValueError, match="no soft-extract layers"):
        retention_keep(apply_downsampling(tiny(), "none"))


# ---- K = 0 and the model's head --------------------------------------------------------------

@pytest.mark.parametrize("kwargs,refused", [
    (dict(global_pool="token"), False),  # DeiT: the head reads the class token, which is always kept
    (dict(global_pool="map", pool_include_prefix=True), False),  # attention pooling over the prefix tokens
    (dict(global_pool="map"), True),  # attention pooling over the patch tokens only: none left
    (dict(global_pool="avg"), True),  # averages the patch tokens: none left would be NaN
    (dict(global_pool="avg", class_token=False), True),
    (dict(global_pool="max", reg_tokens=2), True),
    (dict(global_pool="map", class_token=False), True),  # no prefix token: nothing of the image left
])
def test_keep_zero_against_the_head(kwargs, refused):
    model = tiny(**kwargs)
    if refused:
        with pytest.raises(ValueError, match=r"keep\[3\] \(block 4\) is 0, but this model"):
            apply_downsampling(model, "tome", [40, 20, 8, 0])
        pooled = apply_downsampling(tiny(**kwargs), "tome", [40, 20, 8, 1])  # one token left works
    else:
        pooled = apply_downsampling(model, "tome", [40, 20, 8, 0])
    with torch.no_grad():
        features = pooled.forward_head(pooled.forward_features(images()), pre_logits=True)
    assert torch.isfinite(features).all()
    assert not torch.allclose(features[0], features[1]), "what the head sees depends on the image"


def test_a_conv_placements_checkpoint_gives_its_evaluation_a_reference_without_its_layers(tmp_path):
    """The evaluate stage times a model against the same weights without downsampling (``plain=True``); a conv
    placement's checkpoint holds its layers' own weights (``blocks.N.downsample``), which that reference leaves out
    instead of refusing them, and every weight they share is the checkpoint's."""
    from pathlib import Path

    from pipeline.config import load_config
    from pipeline.train.build import build_model
    from pipeline.train.checkpoint import model_from_checkpoint, save_checkpoint

    root = Path(__file__).resolve().parents[1]
    config = load_config(root / "configs" / "experiments" / "demo.yaml",
                         ["train.mode=finetune", "pooling.method=conv", "pooling.keep=[16, 4, 4, 4]",
                          "model.embed_dim=32"])
    torch.manual_seed(0)
    trained = build_model(config)
    save_checkpoint(tmp_path, {"model": trained.state_dict(), "config": config.model_dump(mode="json")}, {})
    own = {k for k in trained.state_dict() if ".downsample." in k}
    assert own == {f"blocks.{b}.downsample.conv.{p}" for b in (0, 1) for p in ("weight", "bias")}
    reference, _, _ = model_from_checkpoint(tmp_path, plain=True)
    shared = reference.state_dict()
    assert set(shared) == set(trained.state_dict()) - own
    assert all(torch.equal(shared[k], trained.state_dict()[k]) for k in shared)
    model, _, _ = model_from_checkpoint(tmp_path)  # and the model itself keeps them
    assert all(torch.equal(model.state_dict()[k], trained.state_dict()[k]) for k in own)


def test_a_conv_placements_layers_are_refused_by_another_placement():
    """The layers of a conv placement load without complaint only into a model with no layers of its own; a model
    with its own (another placement) that finds them in the wrong blocks is told so."""
    from pipeline.models.weights import load_state

    placed = create_model("deit_tiny_patch16_224", img_size=16, patch_size=4, depth=2, method="conv", keep=[4, 4])
    other = create_model("deit_tiny_patch16_224", img_size=16, patch_size=4, depth=2, method="conv", keep=[16, 4])
    plain = create_model("deit_tiny_patch16_224", img_size=16, patch_size=4, depth=2)
    load_state(plain, placed.state_dict(), "placed")
    with pytest.raises(InputError, match=r"^placed: state dict does not match the model: missing \[\], unexpected "
                                         r"\['blocks.0.downsample.conv.weight', 'blocks.0.downsample.conv.bias'\]"):
        load_state(other, placed.state_dict(), "placed")
