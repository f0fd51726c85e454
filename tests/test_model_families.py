"""Every ViT-like family of the pinned timm is pooled correctly or refused in one line (pipeline.models.families).

One model of each family is built (random weights; on the meta device where only the decision is read) and handed
to ``apply_downsampling``: it is pooled, and then a keep list changes its logits and keeping every token gives
timm's own logits, or it is refused with one line. docs/models.md holds the table this test makes
(``python -m tests.test_model_families`` writes it again).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import timm
import torch
from timm.layers import LayerScale, apply_rot_embed_cat
from timm.models._registry import _model_to_module
from timm.models.beit import Beit
from timm.models.eva import Eva
from timm.models.vision_transformer import ResPostBlock, VisionTransformer
from timm.models.vision_transformer_relpos import VisionTransformerRelPos

from pipeline.errors import InputError
from pipeline.methods import METHODS
from pipeline.models import apply_downsampling, create_model

DOC = Path(__file__).resolve().parents[1] / "docs" / "models.md"
BEGIN, END = "<!-- families: begin -->", "<!-- families: end -->"

# (what the row is, the timm model, its create_model overrides). Overrides only shrink a model the step is expected
# to run in, so that its forward is cheap; a refused model is built as timm publishes it, on the meta device.
ROWS: list[tuple[str, str, dict]] = [
    ("ViT", "vit_tiny_patch16_224", {"depth": 2}),
    ("DeiT", "deit_tiny_patch16_224", {"depth": 2}),
    ("DeiT, distilled", "deit_tiny_distilled_patch16_224", {"depth": 2}),
    ("DeiT-3 (LayerScale)", "deit3_small_patch16_224", {"depth": 2}),
    ("DINOv2 with registers", "vit_small_patch14_reg4_dinov2", {"depth": 2, "img_size": 112}),
    ("global pool, registers, no class token", "vit_medium_patch16_reg4_gap_256", {"depth": 2, "img_size": 128}),
    ("SigLIP (attention-pool head)", "vit_base_patch16_siglip_224", {"depth": 2, "img_size": 112}),
    ("CLIP (pre-norm)", "vit_base_patch16_clip_224", {"depth": 2, "img_size": 112}),
    ("FlexiViT", "flexivit_small", {"depth": 2, "img_size": 120}),
    ("hybrid (ResNet stem)", "vit_tiny_r_s16_p8_224", {"depth": 2}),
    ("ViTamin", "vitamin_small_224", {"depth": 2}),
    ("post-norm blocks (`rpn`)", "vit_base_patch16_rpn_224", {"depth": 2, "img_size": 112}),
    ("parallel blocks", "vit_small_patch16_18x2_224", {}),
    ("parallel scaling blocks", "vit_base_patch16_xp_224", {}),
    ("differential attention", "vit_dwee_patch16_reg1_gap_256", {}),
    ("differential parallel blocks", "vit_dpwee_patch16_reg1_gap_256", {}),
    ("EVA-02", "eva02_tiny_patch14_224", {"depth": 2}),
    ("EVA-01", "eva_giant_patch14_224", {"depth": 2, "img_size": 112, "embed_dim": 128, "num_heads": 2}),
    ("RoPE ViT", "vit_base_patch16_rope_224", {"depth": 2, "img_size": 112}),
    ("RoPE ViT, mixed (per-head) frequencies", "vit_base_patch16_rope_mixed_224", {"depth": 2, "img_size": 112}),
    ("DINOv3", "vit_small_patch16_dinov3", {"depth": 2, "img_size": 112}),
    ("PE (perception encoder)", "vit_pe_core_tiny_patch16_384", {"depth": 2, "img_size": 128}),
    ("BEiT", "beit_base_patch16_224", {"depth": 2, "img_size": 112}),
    ("BEiT v2", "beitv2_base_patch16_224", {"depth": 2, "img_size": 112}),
    ("ViT relative position (MLP bias)", "vit_relpos_small_patch16_224", {"depth": 2, "img_size": 112}),
    ("ViT shared relative position", "vit_srelpos_small_patch16_224", {"depth": 2, "img_size": 112}),
    ("ViT relative position, post-norm", "vit_relpos_small_patch16_rpn_224", {"depth": 2, "img_size": 112}),
    ("ViT relative position, class token", "vit_relpos_medium_patch16_cls_224", {"depth": 2, "img_size": 112}),
    ("SAM ViT", "samvit_base_patch16_224", {}),
    ("CaiT", "cait_xxs24_224", {}),
    ("ConViT", "convit_tiny", {}),
    ("XCiT", "xcit_nano_12_p16_224", {}),
    ("NaFlexViT", "naflexvit_base_patch16_gap", {}),
    ("TNT", "tnt_s_legacy_patch16_224", {}),
    ("CrossViT", "crossvit_tiny_240", {}),
    ("Twins", "twins_svt_small", {}),
    ("LeViT", "levit_128s", {}),
    ("PiT", "pit_ti_224", {}),
    ("MViT-v2", "mvitv2_tiny", {}),
    ("Hiera", "hiera_tiny_224", {}),
    ("Hiera (SAM2)", "sam2_hiera_tiny", {}),
    ("VOLO", "volo_d1_224", {}),
    ("Swin", "swin_tiny_patch4_window7_224", {}),
    ("Swin-v2", "swinv2_tiny_window8_256", {}),
    ("Swin-v2 CR", "swinv2_cr_tiny_224", {}),
    ("NesT", "nest_tiny", {}),
    ("PVT-v2", "pvt_v2_b0", {}),
    ("DaViT", "davit_tiny", {}),
    ("GC ViT", "gcvit_xxtiny", {}),
    ("CoaT", "coat_tiny", {}),
    ("TinyViT", "tiny_vit_5m_224", {}),
    ("MaxViT", "maxvit_tiny_tf_224", {}),
    ("MobileViT", "mobilevit_xxs", {}),
    ("EfficientFormer", "efficientformer_l1", {}),
    ("EfficientFormer-v2", "efficientformerv2_s0", {}),
    ("DeepSeek ViT", "deepseek_vit_412m", {}),
    ("Gemma 4 ViT", "gemma4_vit_167m", {}),
    ("Qwen3 ViT", "qwen3_vit_88m", {}),
]

# timm's model modules that are not ViTs (convolutional, MLP and hybrid-convolutional networks): no keep list means
# anything to them, and the step refuses each (it is not a VisionTransformer). Listed so that a family that a new timm
# adds fails test_every_vit_family_has_a_row until it is decided.
NOT_VIT = {
    "byoanet", "byobnet", "convmixer", "convnext", "cpubone", "csatv2", "cspnet", "cspnext", "densenet", "dla", "dpn",
    "edgenext", "efficientnet", "efficientvim", "efficientvit_mit", "efficientvit_msra", "fasternet", "fastvit",
    "focalnet", "ghostnet", "hardcorenas", "hgnet", "hrnet", "iformer", "inception_next", "inception_resnet_v2",
    "inception_v3", "inception_v4", "lcnetv2", "lowformer", "mambaout", "metaformer", "mlp_mixer", "mobilenetv3",
    "mobilenetv5", "nasnet", "nextvit", "nfnet", "pnasnet", "rdnet", "regnet", "repghost", "repvit", "res2net",
    "resnest", "resnet", "resnetv2", "rexnet", "selecsls", "senet", "sequencer", "shvit", "sknet", "starnet",
    "swiftformer", "tresnet", "vgg", "visformer", "vovnet", "xception", "xception_aligned",
}


def family_of(name: str) -> str:
    return _model_to_module[name]


def decide(name: str, overrides: dict) -> tuple[str, str]:
    """("pooled", adapter name) or ("refused", the one-line error) for ``name`` built on the meta device."""
    with torch.device("meta"):
        model = timm.create_model(name, **overrides)
    try:
        pooled = apply_downsampling(model, "powerbert")
    except InputError as err:
        return "refused", str(err)
    methods = "every method of `pipeline methods`"
    if pooled.blocks.adapter.rotary and getattr(pooled, "rope", None) is not None:
        kept = sorted(m for m, spec in METHODS.items() if spec.keeps_positions and spec.downsamples)
        methods = f"the methods whose tokens keep a position ({', '.join(kept)}; the others refused)"
    return "pooled", f"{pooled.blocks.adapter.name} blocks (`models.families.ADAPTERS`); {methods}"


def table(decisions: dict[str, tuple[str, str]]) -> str:
    """The markdown table of docs/models.md from each row's decision."""
    lines = ["| family (timm module) | what | example | decision | why |", "|---|---|---|---|---|"]
    for what, name, _ in ROWS:
        verdict, detail = decisions[name]
        if verdict == "pooled":
            why = detail
        else:
            why = detail.split(" cannot be pooled: ", 1)[1].split(". Token Pooling needs", 1)[0]
            why = why.removesuffix(" (docs/models.md)").replace("|", "\\|")
        lines.append(f"| `{family_of(name)}` | {what} | `{name}` | {verdict} | {why} |")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def decisions() -> dict[str, tuple[str, str]]:
    return {name: decide(name, overrides) for _, name, overrides in ROWS}


# ---- every family decided, and the docs' table is what the code decides --------------------------------------

def test_every_vit_family_has_a_row():
    families = set(_model_to_module.values())
    covered = {family_of(name) for _, name, _ in ROWS}
    assert families - covered - NOT_VIT == set(), "a timm family no row decides"
    assert covered & NOT_VIT == set()


@pytest.mark.slow
def test_the_docs_table_is_what_the_code_decides(decisions):
    text = DOC.read_text()
    assert BEGIN in text and END in text
    found = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert found == table(decisions), "docs/models.md is stale: python -m tests.test_model_families writes it"


@pytest.mark.slow
def test_every_refusal_is_one_line_naming_the_model_and_family(decisions):
    refused = {name: detail for name, (verdict, detail) in decisions.items() if verdict == "refused"}
    assert len(refused) >= 30
    for name, detail in refused.items():
        assert "\n" not in detail
        assert detail.startswith(f"{name} ({family_of(name)}) cannot be pooled: ")


# ---- what is pooled is pooled correctly --------------------------------------------------------------------

POOLED = [(name, overrides) for _, name, overrides in ROWS if name in {
    "vit_tiny_patch16_224", "deit_tiny_distilled_patch16_224", "deit3_small_patch16_224",
    "vit_small_patch14_reg4_dinov2", "vit_medium_patch16_reg4_gap_256", "vit_base_patch16_siglip_224",
    "vit_base_patch16_clip_224", "flexivit_small", "vit_tiny_r_s16_p8_224", "vitamin_small_224",
    "vit_base_patch16_rpn_224", "deit_tiny_patch16_224", "vit_relpos_small_patch16_224",
    "vit_srelpos_small_patch16_224", "vit_relpos_small_patch16_rpn_224", "vit_relpos_medium_patch16_cls_224",
    "beit_base_patch16_224", "beitv2_base_patch16_224", "eva02_tiny_patch14_224", "eva_giant_patch14_224",
    "vit_base_patch16_rope_224", "vit_base_patch16_rope_mixed_224", "vit_small_patch16_dinov3",
    "vit_pe_core_tiny_patch16_384"}]


@pytest.mark.slow
@pytest.mark.parametrize("name, overrides", POOLED, ids=[name for name, _ in POOLED])
def test_a_pooled_family_moves_its_logits_and_keeps_timms_at_k_equal_n(name, overrides, decisions):
    assert decisions[name][0] == "pooled"
    torch.manual_seed(0)
    reference = timm.create_model(name, num_classes=5, **overrides).eval()
    for module in reference.modules():  # LayerScale starts at 1e-5 or 1e-6: blocks that barely move the logits
        if isinstance(module, LayerScale):
            module.gamma.data.fill_(1.0)
    for name, param in reference.named_parameters():  # BEiT's LayerScale (gamma_1/2) likewise
        if name.endswith(("gamma_1", "gamma_2")):
            param.data.fill_(1.0)
    n, depth = reference.patch_embed.num_patches, len(reference.blocks)
    x = torch.randn(2, 3, *reference.patch_embed.img_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(x)
        same = apply_downsampling(copy.deepcopy(reference), "wkmedoids", [n] * depth)(x)
        pooled = apply_downsampling(copy.deepcopy(reference), "wkmedoids", [n // 2, n // 4][:depth])(x)
    # The step's attention is the project's own (attend: SDPA and the significance of eq. 4), not timm's module,
    # so the same logits are equal to float32 rounding (assert_close's defaults), not bit for bit.
    torch.testing.assert_close(same, expected)
    assert (pooled - expected).abs().max() > 0.01 * expected.abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("name, overrides", POOLED, ids=[name for name, _ in POOLED])
def test_a_pooled_familys_closed_form_gflops_equal_fvcores_or_are_refused(name, overrides):
    from pipeline.flops import count_flops, gflops_cost_model

    model = timm.create_model(name, **overrides).eval()
    n, depth = model.patch_embed.num_patches, len(model.blocks)
    keep = [max(8, n // 2 // 8 * 8), max(8, n // 4 // 8 * 8)][:depth]  # on the closed form's grid of 8 tokens
    try:
        predicted = gflops_cost_model(model, "powerbert").predict(keep)
    except InputError as err:
        assert str(err).startswith("no closed-form GFLOPs count of ") and "\n" not in str(err)
        return
    assert predicted == pytest.approx(count_flops(apply_downsampling(model, "powerbert", keep)).total, rel=1e-12)


def tiny_post_norm(**kwargs) -> VisionTransformer:
    torch.manual_seed(0)
    args = dict(class_token=False, global_pool="avg") | kwargs  # as timm's vit_*_rpn
    return VisionTransformer(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=3, num_classes=4,
                             block_fn=ResPostBlock, **args).eval()


def post_norm_reference(model: VisionTransformer, x: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """PoWER-BERT on a post-norm ViT written out from timm's parts: attention on the raw tokens, the post-norm of
    its output added, the k tokens of highest eq. 4 significance kept in their order, then the MLP half."""
    t = model._pos_embed(model.patch_embed(x))
    for block, k in zip(model.blocks, keep):
        attn = block.attn
        b, n, _ = t.shape
        q, key, v = attn.qkv(t).reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
        probs = (q @ key.transpose(-2, -1) * attn.scale).softmax(-1)  # (B, H, N, N)
        out = attn.proj((probs @ v).transpose(1, 2).reshape(b, n, -1))
        t = t + block.norm1(out)
        if k < n:
            scores = probs.sum(dim=(1, 2))  # eq. 4: attention each token receives, over heads and queries
            kept = scores.topk(k, dim=1).indices.sort(dim=1).values
            t = t.gather(1, kept[..., None].expand(-1, -1, t.shape[-1]))
        t = t + block.norm2(block.mlp(t))
    return model.forward_head(model.norm(t))


def test_post_norm_pooling_against_a_reference_from_timms_parts():
    model = tiny_post_norm()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    keep = [12, 7, 3]
    with torch.no_grad():
        expected = post_norm_reference(model, x, keep)
        found = apply_downsampling(copy.deepcopy(model), "powerbert", keep)(x)
        unpooled = model(x)
    torch.testing.assert_close(found, expected, atol=1e-5, rtol=1e-5)
    assert (found - unpooled).abs().max() > 1e-3


@pytest.mark.parametrize("method", sorted(METHODS))
def test_post_norm_keep_all_equals_timm(method):
    reference = tiny_post_norm()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    pooled = apply_downsampling(copy.deepcopy(reference), method, [16] * 3, carry=True)
    with torch.no_grad():
        torch.testing.assert_close(pooled(x), reference(x))


# ---- the guard: a model that would skip the step is refused, and so is every call that would ------------------

class LoopsItself(VisionTransformer):
    """A planted regression: a ViT whose forward loops over its blocks (as EVA, BEiT and XCiT do)."""

    def forward_features(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        x = self.norm_pre(self._pos_embed(self.patch_embed(x)))
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class NeverCallsBlocks(VisionTransformer):
    def forward_features(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.norm(self._pos_embed(self.patch_embed(x)))


def small(cls: type = VisionTransformer, **kwargs) -> VisionTransformer:
    return cls(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3, num_classes=4, **kwargs).eval()


@pytest.mark.parametrize("cls, why", [(LoopsItself, "calls its blocks one by one itself"),
                                      (NeverCallsBlocks, "never calls model.blocks")])
def test_a_vit_that_bypasses_its_blocks_is_refused_before_it_changes(cls, why):
    model = small(cls)
    blocks = model.blocks
    refusal = f"{cls.__name__} \\(test_model_families\\) cannot be pooled: its forward {why}"
    with pytest.raises(InputError, match=refusal):
        apply_downsampling(model, "powerbert", [8, 4])
    assert model.blocks is blocks and not any(b._forward_pre_hooks for b in blocks)  # nothing changed


def test_the_probe_keeps_the_mode_and_the_random_state():
    model = small().train()
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    apply_downsampling(model, "random", [8, 4])
    assert model.training and torch.equal(torch.rand(3), expected)


def test_once_pooled_a_block_called_by_itself_raises():
    model = apply_downsampling(small(), "powerbert", [8, 4])
    x = torch.randn(1, 3, 32, 32)
    with pytest.raises(InputError, match="called by itself"):
        model.forward_intermediates(x)
    with pytest.raises(InputError, match="called by itself"):
        model.forward_features(x, attn_mask=torch.zeros(17, 17, dtype=torch.bool))
    model.set_grad_checkpointing(True)
    with pytest.raises(InputError, match="called by itself"):
        model.train()(x)
    assert small().forward_intermediates(x) is not None  # an unpooled model's are timm's own


def test_another_image_size_is_refused_not_pooled_by_the_wrong_list():
    model = apply_downsampling(small(dynamic_img_size=True), "powerbert", [16, 8])
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 4)
    for size in (24, 48):  # 9 and 36 tokens arrive where the keep list was made for 16
        with pytest.raises(InputError, match=f"made for 16 tokens an image, but {(size // 8) ** 2} arrive"):
            model(torch.randn(1, 3, size, size))


def test_create_model_refuses_an_unsupported_family_even_unmodified():
    with pytest.raises(InputError, match=r"^cait_xxs24_224 \(cait\) cannot be pooled: .*talking-heads"):
        create_model("cait_xxs24_224")




def test_post_norm_gflops_drop_with_pooling_as_the_closed_form_counts():
    from pipeline.flops import count_flops, gflops_cost_model

    # With a class token and its final norm over every token (as the closed form counts the last norm; a global-pool
    # head's fc_norm over one pooled token is not, so the closed form of a gap model is 5 (K_L + P - 1) M above).
    keep = [12, 7, 3]
    pooled = apply_downsampling(tiny_post_norm(class_token=True, global_pool="token"), "wkmedoids", keep)
    unpooled = count_flops(tiny_post_norm(class_token=True, global_pool="token")).total
    counted = count_flops(pooled).total
    assert counted < 0.8 * unpooled
    assert gflops_cost_model(pooled, "wkmedoids").predict(keep) == pytest.approx(counted, rel=1e-12)
    assert gflops_cost_model(pooled, "wkmedoids").unmodified() == pytest.approx(unpooled, rel=1e-12)


# ---- every entry point refuses an unsupported family in one line, writing nothing ----------------------------

ROOT = Path(__file__).resolve().parents[1]


def _one_line_refusal(capsys, *args: str) -> str:
    from pipeline.cli import main

    assert main(list(args)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    return err


def test_run_plan_refuses_an_experiment_of_an_unsupported_family(capsys):
    err = _one_line_refusal(capsys, "run", str(ROOT / "configs" / "experiments" / "demo.yaml"), "--plan",
                            "--set", "model.name=cait_xxs24_224")
    assert err.startswith("error: model: cait_xxs24_224 (cait) cannot be pooled: ")


def test_flops_and_evaluate_refuse_an_unsupported_family_and_write_nothing(capsys, tmp_path):
    err = _one_line_refusal(capsys, "flops", "--model", "xcit_nano_12_p16_224")
    assert err.startswith("error: xcit_nano_12_p16_224 (xcit) cannot be pooled: ")
    out = tmp_path / "out"
    err = _one_line_refusal(capsys, "evaluate", "--model", "cait_xxs24_224", "--out", str(out),
                            "--data", str(tmp_path / "val.beton"), "--method", "powerbert", "--keep", "4,4")
    assert err.startswith("error: cait_xxs24_224 (cait) cannot be pooled: ")
    assert not out.exists()


# ---- relative position bias: the bias travels with the tokens ---------------------------------------------------

def tiny_relpos(**kwargs) -> VisionTransformerRelPos:
    torch.manual_seed(0)
    args = dict(class_token=True, global_pool="token", rel_pos_type="bias", init_values=None) | kwargs
    model = VisionTransformerRelPos(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=3, num_classes=4,
                                    **args).eval()
    for name, param in model.named_parameters():  # timm starts the bias tables at 0: give them values to carry
        if "relative_position_bias_table" in name:
            param.data.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(7))
    return model


def bias_reference(model, x: torch.Tensor, keep: list[int], *, embed, table, qkv, scale) -> torch.Tensor:
    """PoWER-BERT on a ViT with a relative position bias, from timm's parts, the bias of every pair of kept tokens
    looked up token by token from the original tokens they are: attention with the bias, the k tokens of highest
    eq. 4 significance kept in their order, then the MLP half. ``embed(x)`` the tokens, ``table(block)`` the
    block's bias (H, T0, T0), ``qkv(attn, h)`` the packed (B, T, 3 H D), ``scale(block, half, y)`` its LayerScale."""
    t = embed(x)
    p, b = model.num_prefix_tokens, t.shape[0]
    ids = [list(range(t.shape[1])) for _ in range(b)]  # the original token behind each token, per image
    for block, k in zip(model.blocks, keep):
        bias_table, n, attn = table(block), t.shape[1], block.attn
        bias = torch.stack([torch.stack([torch.stack([bias_table[:, ids[i][r], ids[i][c]] for c in range(n)], -1)
                                         for r in range(n)], -2) for i in range(b)])  # (B, H, n, n)
        q, key, v = qkv(attn, block.norm1(t)).reshape(b, n, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
        probs = (q @ key.transpose(-2, -1) * attn.scale + bias).softmax(-1)
        t = t + scale(block, 1, attn.proj((probs @ v).transpose(1, 2).reshape(b, n, -1)))
        if k < n - p:
            scores = probs.sum(dim=(1, 2))[:, p:]
            kept = scores.topk(k, dim=1).indices.sort(dim=1).values
            t = torch.cat([t[:, :p], t[:, p:].gather(1, kept[..., None].expand(-1, -1, t.shape[-1]))], dim=1)
            ids = [ids[i][:p] + [ids[i][p + j] for j in kept[i].tolist()] for i in range(b)]
        t = t + scale(block, 2, block.mlp(block.norm2(t)))
    return model.forward_head(model.norm(t))


def relpos_reference(model, x: torch.Tensor, keep: list[int]) -> torch.Tensor:
    shared = model.shared_rel_pos.get_bias() if model.shared_rel_pos is not None else None
    return bias_reference(
        model, x, keep,
        embed=lambda x: torch.cat((model.cls_token.expand(x.shape[0], -1, -1), model.patch_embed(x)), dim=1),
        table=lambda block: (block.attn.rel_pos.get_bias() if block.attn.rel_pos is not None else shared)[0],
        qkv=lambda attn, h: attn.qkv(h), scale=lambda block, half, y: getattr(block, f"ls{half}")(y))


def beit_reference(model, x: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """``bias_reference`` on BEiT: its absolute position embedding, q and v biases, gamma LayerScale, and each
    block's table (plus the shared one) read by timm's index."""
    shared = model.rel_pos_bias() if model.rel_pos_bias is not None else 0.0

    def table(block):
        own = block.attn._get_rel_pos_bias()[0] if block.attn.relative_position_bias_table is not None else 0.0
        return own + shared

    def qkv(attn, h):
        return h @ attn.qkv.weight.T + torch.cat((attn.q_bias, torch.zeros_like(attn.q_bias), attn.v_bias))

    return bias_reference(
        model, x, keep,
        embed=lambda x: torch.cat((model.cls_token.expand(x.shape[0], -1, -1), model.patch_embed(x)), 1)
        + model.pos_embed,
        table=table, qkv=qkv, scale=lambda block, half, y: getattr(block, f"gamma_{half}") * y)


def tiny_beit(**kwargs) -> Beit:
    torch.manual_seed(0)
    model = Beit(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=3, num_classes=4, init_values=0.5,
                 head_init_scale=1.0,
                 **kwargs).eval()
    for name, param in model.named_parameters():  # timm starts the tables and the q/v biases at 0
        if "relative_position_bias_table" in name or name.endswith(("q_bias", "v_bias")):
            param.data.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(8))
    return model


@pytest.mark.parametrize("kwargs", [{"use_rel_pos_bias": True}, {"use_shared_rel_pos_bias": True},
                                    {"use_rel_pos_bias": True, "use_shared_rel_pos_bias": True}],
                         ids=["own", "shared", "both"])
def test_beit_selection_against_a_token_by_token_reference(kwargs):
    model = tiny_beit(**kwargs)
    assert_selection_matches(model, beit_reference)


def assert_selection_matches(model, reference) -> None:
    """PoWER-BERT at [12, 7, 3] on ``model`` (a tiny 16-token one) equals ``reference(model, x, keep)`` to 1e-5, moves
    the logits, and keeps timm's at K = N."""
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    keep = [12, 7, 3]
    with torch.no_grad():
        expected = reference(model, x, keep)
        found = apply_downsampling(copy.deepcopy(model), "powerbert", keep)(x)
        unpooled = model(x)
        same = apply_downsampling(copy.deepcopy(model), "powerbert", [16] * 3)(x)
    torch.testing.assert_close(found, expected, atol=1e-5, rtol=1e-5)
    assert (found - unpooled).abs().max() > 0.01 * unpooled.abs().max()
    torch.testing.assert_close(same, unpooled)


@pytest.mark.parametrize("shared", [False, True])
def test_relpos_selection_against_a_token_by_token_reference(shared):
    model = tiny_relpos(shared_rel_pos=shared)
    assert_selection_matches(model, relpos_reference)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_method_keeps_a_relative_bias_families_logits_at_k_equal_n(method):
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(6))
    for model in (tiny_relpos(), tiny_beit(use_rel_pos_bias=True, use_shared_rel_pos_bias=True)):
        pooled = apply_downsampling(copy.deepcopy(model), method, [16] * 3, carry=True)
        with torch.no_grad():
            torch.testing.assert_close(pooled(x), model(x))


def test_a_merged_tokens_bias_is_the_size_weighted_mean_over_both_members():
    from pipeline.models.downsampling import pooled_bias, pooled_positions

    g = torch.Generator().manual_seed(5)
    p, n0, h = 1, 6, 2
    bias = torch.randn(1, h, p + n0, p + n0, generator=g)
    assign = torch.tensor([[0, 2, 1, 2, -1, 0], [1, 1, 1, 0, 0, 2]])  # two steps' worth of clusters, one dropped
    sizes = torch.rand(2, n0, generator=g) + 0.5
    positions = pooled_positions(None, assign, sizes, p, 3, p + n0)
    found = pooled_bias(bias, positions)  # (B, H, P+3, P+3)
    for i in range(2):  # brute force: the members of each output, weighted by size
        members = [[0]] + [[p + a for a in range(n0) if assign[i, a] == c] for c in range(3)]
        weight = [[1.0]] + [[float(sizes[i, a - p]) for a in m] for m in members[1:]]
        for r in range(p + 3):
            for c in range(p + 3):
                total = sum(wa * wb * bias[0, :, a, b2] for a, wa in zip(members[r], weight[r])
                            for b2, wb in zip(members[c], weight[c]))
                torch.testing.assert_close(found[i, :, r, c], total / (sum(weight[r]) * sum(weight[c])))
    # A second step composes: the weights of a token over the original ones still add up to 1.
    again = pooled_positions(positions, torch.tensor([[1, 0, -1], [0, 0, 1]]), None, p, 2, p + n0)
    torch.testing.assert_close(again.sum(-1), torch.ones(2, p + 2))


# ---- rotary embeddings: a pooled token rotates as the input token behind it ----------------------------------

def tiny_eva(**kwargs) -> Eva:
    torch.manual_seed(0)
    model = Eva(img_size=32, patch_size=8, embed_dim=48, depth=3, num_heads=3, num_classes=4, init_values=0.5,
                use_rot_pos_emb=True, ref_feat_shape=(4, 4), **kwargs).eval()
    for name, param in model.named_parameters():  # timm starts the q and v biases at 0
        if name.endswith(("q_bias", "v_bias")):
            param.data.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(9))
    return model


def eva_reference(model: Eva, x: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """PoWER-BERT on an Eva from timm's parts, each kept patch token's queries and keys rotated one token at a time
    by the rotary embedding of the patch it is (the class token not rotated), then the k tokens of highest eq. 4
    significance kept in their order."""
    t, rope = model._pos_embed(model.patch_embed(x))
    t = model.norm_pre(t)
    p, b = model.num_prefix_tokens, t.shape[0]
    ids = [list(range(t.shape[1] - p)) for _ in range(b)]  # the patch behind each non-prefix token, per image
    for block, k in zip(model.blocks, keep):
        attn, n = block.attn, t.shape[1]
        bias = torch.cat((attn.q_bias, torch.zeros_like(attn.q_bias), attn.v_bias))
        q, key, v = (block.norm1(t) @ attn.qkv.weight.T + bias).reshape(b, n, 3, attn.num_heads, -1).permute(
            2, 0, 3, 1, 4)
        rotated = [[torch.cat([y[i, :, :p]] + [apply_rot_embed_cat(y[i, :, p + j], rope[ids[i][j]])[:, None]
                                               for j in range(n - p)], dim=1) for i in range(b)] for y in (q, key)]
        q, key = (torch.stack(y) for y in rotated)
        probs = (q @ key.transpose(-2, -1) * attn.scale).softmax(-1)
        t = t + block.gamma_1 * attn.proj((probs @ v).transpose(1, 2).reshape(b, n, -1))
        if k < n - p:
            kept = probs.sum(dim=(1, 2))[:, p:].topk(k, dim=1).indices.sort(dim=1).values
            t = torch.cat([t[:, :p], t[:, p:].gather(1, kept[..., None].expand(-1, -1, t.shape[-1]))], dim=1)
            ids = [[ids[i][j] for j in kept[i].tolist()] for i in range(b)]
        t = t + block.gamma_2 * block.mlp(block.norm2(t))
    return model.forward_head(model.norm(t))


def test_eva_selection_against_a_token_by_token_rotary_reference():
    model = tiny_eva()
    assert_selection_matches(model, eva_reference)


@pytest.mark.parametrize("method", sorted(m for m, spec in METHODS.items() if not spec.keeps_positions))
def test_a_method_of_new_tokens_is_refused_for_a_rotary_family_in_one_line(method):
    model = tiny_eva()
    with pytest.raises(InputError, match=f"method '{method}' outputs new tokens .* rotates each token by its position"):
        apply_downsampling(model, method, [12, 7, 3])
    assert type(model) is Eva and not any(b._forward_pre_hooks for b in model.blocks)


@pytest.mark.parametrize("method", sorted(m for m, spec in METHODS.items() if spec.keeps_positions))
def test_every_method_it_runs_keeps_a_rotary_familys_logits_at_k_equal_n(method):
    model = tiny_eva()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(apply_downsampling(copy.deepcopy(model), method, [16] * 3, carry=True)(x), model(x))


def test_k_medoids_pools_a_rotary_family_and_moves_its_logits():
    model = tiny_eva()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        unpooled = model(x)
        pooled = apply_downsampling(copy.deepcopy(model), "wkmedoids", [12, 7, 3], carry=True)(x)
    assert torch.isfinite(pooled).all() and (pooled - unpooled).abs().max() > 0.01 * unpooled.abs().max()


def test_run_plan_refuses_a_method_a_rotary_family_cannot_honour(capsys):
    err = _one_line_refusal(capsys, "run", str(ROOT / "configs" / "experiments" / "demo.yaml"), "--plan",
                            "--set", "model.name=vit_small_patch16_dinov3", "--set", "model.img_size=32",
                            "--set", "model.patch_size=16", "--set", "experiment.methods=[powerbert, wkmeans]")
    assert err.startswith("error: experiment.methods: method 'wkmeans' outputs new tokens with no input token behind")


# ---- the position-term families through the CLI: evaluate and flops ---------------------------------------------

POSITION_FAMILIES = [("vit_relpos", "test_vit_relpos"), ("BEiT", "beit_base_patch16_224"),
                     ("EVA-02", "eva02_tiny_patch14_224")]


def shape_of(name: str) -> tuple[int, int]:
    """(blocks, patch tokens) of timm's ``name``, read on the meta device."""
    with torch.device("meta"):
        model = timm.create_model(name)
    return len(model.blocks), model.patch_embed.num_patches


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for _, name in POSITION_FAMILIES], ids=[f for f, _ in POSITION_FAMILIES])
def test_flops_of_a_position_family_drops_with_its_keep_list(name, capsys):
    from pipeline.cli import main

    def total(*args: str) -> float:
        assert main(["flops", "--model", name, "--json", *args]) == 0
        return json.loads(capsys.readouterr().out)["gflops"]

    depth, n = shape_of(name)
    full = total()
    pooled = total("--method", "powerbert", "--keep", ",".join(str(n // 4) for _ in range(depth)))
    assert pooled < 0.8 * full  # a quarter of the tokens after the first block


@pytest.mark.beton
@pytest.mark.slow
@pytest.mark.parametrize("name", [name for _, name in POSITION_FAMILIES], ids=[f for f, _ in POSITION_FAMILIES])
def test_evaluate_runs_a_position_family_with_random_weights(name, synthetic_data, tmp_path, capsys):
    from pipeline.cli import main

    depth, n = shape_of(name)
    out = tmp_path / "out"
    keep = ",".join(str(max(n - n // 8 * (layer + 1), 4)) for layer in range(depth))
    assert main(["evaluate", "--model", name, "--out", str(out), "--data", str(synthetic_data(8, 8) / "val.beton"),
                 "--method", "powerbert,wkmedoids", "--keep", keep, "--carry", "off", "--batch-size", "4"]) == 0
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("| powerbert") or line.startswith("| wkmedoids")]
    assert len(rows) == 2 and (out / "offshelf.csv").exists()


if __name__ == "__main__":  # writes docs/models.md's table
    found = {name: decide(name, overrides) for _, name, overrides in ROWS}
    text = DOC.read_text()
    head, rest = text.split(BEGIN, 1)
    DOC.write_text(f"{head}{BEGIN}\n{table(found)}\n{END}{rest.split(END, 1)[1]}")
    sys.exit(0)
