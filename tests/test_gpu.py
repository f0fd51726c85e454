"""CUDA paths against the CPU and against the unfused math. Skipped where no CUDA device exists.

Run on a lent GPU machine with ``jobs/gpu/checks.sh`` (docs/benchmarks.md has the figures).
"""

from __future__ import annotations

import copy

import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

from pipeline.methods import METHODS, build_downsampler
from pipeline.models import apply_downsampling
from pipeline.models.significance import attention_significance, significance_torch
from pipeline.pooling import token_pool
from pipeline.runtime import compile_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(autouse=True)
def _exact_fp32_matmuls():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.parametrize("method", ["kmeans", "kmedoids"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clustering_matches_cpu(method, dtype):
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randn(8, 196, 64, generator=gen).to(dtype)
    scores = torch.rand(8, 196, generator=gen)
    cpu = token_pool(tokens, 49, method=method, weights=scores)
    gpu = token_pool(tokens.cuda(), 49, method=method, weights=scores.cuda())
    # Float32 distances on both devices: the assignments agree up to rare near-ties.
    assert (gpu.assign.cpu() == cpu.assign).float().mean() > 0.99
    assert gpu.tokens.dtype == dtype


@pytest.mark.parametrize("kernel", ["tiled", "fused"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("k", [147, 98, 49, 12])
def test_triton_kmedoids_matches_the_torch_iterations(k, weighted, kernel):
    """Both Triton kernels (two launches an iteration; every iteration in one program an image) against
    the one-hot torch iterations on the same (B, N, N) distances, at DeiT-S size; float32 sums in a
    different order may flip a rare near-tie, nothing more."""
    from pipeline.pooling.clustering import SWAP_RTOL, kmedoids_dense, sq_dists
    from pipeline.pooling.kmedoids_triton import kmedoids_fused_triton, kmedoids_triton

    gen = torch.Generator().manual_seed(k)
    x, w = torch.randn(64, 196, 384, generator=gen).cuda(), torch.rand(64, 196, generator=gen).cuda() + 0.1
    start, d = w.topk(k, dim=-1).indices, sq_dists(x)
    w = w / w.amax(-1, keepdim=True) if weighted else None
    med, assign = (kmedoids_triton if kernel == "tiled" else kmedoids_fused_triton)(d, w, start, 5, SWAP_RTOL)
    med_t, assign_t = kmedoids_dense(d, w, start, 5)
    assert (med == med_t).float().mean() > 0.99 and (assign == assign_t).float().mean() > 0.99
    assert (assign.gather(1, med) == torch.arange(k, device="cuda")).all()  # every medoid in its own cluster


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("k", [147, 98, 49, 12])
def test_fused_kernels_on_the_gram_matrix_match_the_torch_iterations(k, weighted):
    """What the CUDA path runs: K-Medoids' fused kernel deriving the distances from the Gram matrix, and
    K-Means' fused kernel, against the one-hot torch iterations at DeiT-S size; float32 sums in a different
    order may flip a rare near-tie, nothing more."""
    from pipeline.pooling.clustering import SWAP_RTOL, dists_from_gram, gram, kmeans_gram_iterations, kmedoids_dense
    from pipeline.pooling.kmeans_triton import kmeans_fused_triton
    from pipeline.pooling.kmedoids_triton import kmedoids_fused_triton

    gen = torch.Generator().manual_seed(k)
    x, w = torch.randn(64, 196, 384, generator=gen).cuda(), torch.rand(64, 196, generator=gen).cuda() + 0.1
    start, g = w.topk(k, dim=-1).indices, gram(x)
    w = w / w.amax(-1, keepdim=True) if weighted else None
    med, assign = kmedoids_fused_triton(g, w, start, 5, SWAP_RTOL, gram=True)
    med_t, assign_t = kmedoids_dense(dists_from_gram(g), w, start, 5)
    assert (med == med_t).float().mean() > 0.99 and (assign == assign_t).float().mean() > 0.99
    assign_k = kmeans_fused_triton(g, w, start, 5)
    assert (assign_k == kmeans_gram_iterations(g, w, start, 5)).float().mean() > 0.99


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("k", [147, 49, 1])
def test_triton_cluster_means_match_the_one_hot_product(k, weighted):
    """The merge kernel on the models' strided token slice, with an empty cluster's start token, against the
    one-hot torch product; and its gradients against the CPU path's autograd."""
    from pipeline.pooling.common import dense_segments
    from pipeline.pooling.merge import cluster_means, means_dense, pool_segments

    gen = torch.Generator().manual_seed(k)
    x = torch.randn(64, 197, 384, generator=gen).cuda()[:, 1:]
    w = torch.rand(64, 196, generator=gen).cuda() + 0.1 if weighted else None
    assign = torch.randint(0, max(k - 1, 1), (64, 196), generator=gen).cuda()
    start = torch.stack([torch.randperm(196, generator=gen)[:k] for _ in range(64)]).cuda()
    torch.testing.assert_close(cluster_means(x, w, assign, k, start), means_dense(x, w, assign, k, start),
                               rtol=1e-5, atol=1e-5)
    grads = []
    for dense in (True, False):
        xd = x.detach().clone().requires_grad_()
        with dense_segments(dense):
            (pool_segments(xd, w, None, assign, k, start)[0] * 0.5).sum().backward()
        grads.append(xd.grad)
    torch.testing.assert_close(*grads, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("carry", [False, True])
def test_one_pass_attention_with_scores_matches_the_torch_path_on_gpu(dtype, carry):
    """The joint op's CUDA kernel (attention and eq. 4 from one pass, what inference runs on the CUDA path)
    against its torch form in float32, on timm's packed q, k, v."""
    from pipeline.models.significance import attention_and_significance, attention_and_significance_torch

    gen = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(2, 197, 3, 6, 64, generator=gen).permute(2, 0, 3, 1, 4).cuda().to(dtype).unbind(0)
    sizes = torch.randint(0, 3, (2, 197), generator=gen).float().cuda()
    sizes[:, 0] = 1
    bias = sizes.log() if carry else None
    out, scores = attention_and_significance(q, k, v, 0.125, bias)
    ref_out, ref_scores = attention_and_significance_torch(q.float(), k.float(), v.float(), bias, 0.125)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.float(), ref_out, **tol)
    torch.testing.assert_close(scores, ref_scores, rtol=1e-3, atol=1e-2)
    assert out.dtype == dtype and out.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("name", ["powerbert", "random", "importance", "tome", "wkmedoids", "kmeans"])
def test_deterministic_on_gpu(name):
    tokens = torch.randn(4, 196, 32, device="cuda")
    scores = torch.rand(4, 196, device="cuda")
    step = build_downsampler(name)
    runs = [step(tokens, 49, scores=scores, metric=tokens, generator=torch.Generator("cuda").manual_seed(1))
            for _ in range(2)]
    assert torch.equal(runs[0].tokens, runs[1].tokens)
    assert torch.equal(runs[0].assign, runs[1].assign)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 6, 197, 64), (3, 6, 70, 42), (1, 6, 130, 53), (4, 3, 17, 16)])
@pytest.mark.parametrize("carry", [False, True])
def test_triton_significance_matches_the_torch_path(dtype, shape, carry):
    b, h, t, d = shape
    gen = torch.Generator().manual_seed(t)
    q, k, _ = torch.randn(b, t, 3, h, d, generator=gen).permute(2, 0, 3, 1, 4).to(dtype).unbind(0)
    sizes = torch.randint(0, 3, (b, t), generator=gen).float()
    sizes[:, 0] = 1
    bias = sizes.log() if carry else None
    want = significance_torch(q, k, bias, d ** -0.5)
    got = attention_significance(q.cuda(), k.cuda(), d ** -0.5, None if bias is None else bias.cuda())
    tol = 1e-4 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.cpu(), want, rtol=tol, atol=tol * t)
    torch.testing.assert_close(got.sum(-1).cpu(), torch.full((b,), float(h * t)), rtol=1e-4, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 2, 40, 16), (3, 6, 197, 64)])
@pytest.mark.parametrize("carry", [False, True])
def test_significance_backward_on_gpu_matches_cpu(dtype, shape, carry):
    """The Triton backward (CUDA) against the torch backward (CPU), on the same inputs."""
    b, h, t, d = shape
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, b, h, t, d, generator=gen).to(dtype).unbind(0)  # (B, H, T, D) each
    g = torch.randn(b, t, generator=gen)
    sizes = torch.randint(0, 3, (b, t), generator=gen).float()
    sizes[:, 0] = 1
    bias = sizes.log() if carry else None
    grads = []
    for device in ("cpu", "cuda"):
        # detach() first: q.to("cpu") is q itself, which would make the CUDA copies non-leaves (no .grad)
        leaves = [q.detach().to(device).requires_grad_(), k.detach().to(device).requires_grad_()]
        if carry:
            leaves.append(bias.detach().to(device).requires_grad_())
        scores = attention_significance(leaves[0], leaves[1], 0.25, leaves[2] if carry else None)
        (scores * g.to(device)).sum().backward()
        grads.append([leaf.grad.float().cpu() for leaf in leaves])
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(grads[0], grads[1], **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_lse_significance_matches_the_sdpa_path_on_gpu(dtype):
    """The fused kernel's row log-sum-exps (cuDNN's on an H100 or H200, flash attention's on an A100)
    feed the scores: the output, the scores and the gradients of both equal SDPA's output and the
    scores computed from scratch. A bias (carried sizes) or float32 has no such path."""
    from pipeline.models.attention import fused_attention_lse

    b, h, t, d = 4, 6, 197, 64
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(b, t, 3, h, d, generator=gen).permute(2, 0, 3, 1, 4).to(dtype).cuda()
    g_out, g_s = torch.randn(b, h, t, d, generator=gen).cuda(), torch.randn(b, t, generator=gen).cuda()
    assert fused_attention_lse(*qkv.unbind(0), 0.125, torch.zeros(b, 1, 1, t, device="cuda", dtype=dtype), 0.0) is None
    assert fused_attention_lse(*qkv.float().unbind(0), 0.125, None, 0.0) is None
    results = []
    for flash in (True, False):
        q, k, v = (x.detach().requires_grad_() for x in qkv.unbind(0))
        if flash:
            out, lse = fused_attention_lse(q, k, v, 0.125, None, 0.0)
            assert lse.shape == (b, h, t) and lse.dtype == torch.float32
            want = (q.detach().float() @ k.detach().float().transpose(-2, -1) * 0.125).logsumexp(-1)
            torch.testing.assert_close(lse, want, rtol=1e-3, atol=1e-3)  # natural log, the scale included
            scores = attention_significance(q, k, 0.125, lse=lse)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.125)
            scores = attention_significance(q, k, 0.125)
        ((out.float() * g_out).sum() + (scores * g_s).sum()).backward()
        results.append([out.float(), scores, q.grad.float(), k.grad.float(), v.grad.float()])
    torch.testing.assert_close(results[0], results[1], rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(results[0][1].sum(-1), torch.full((b,), float(h * t), device="cuda"), rtol=1e-3,
                               atol=0.5)


def _tiny() -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(img_size=64, patch_size=8, embed_dim=48, depth=4, num_heads=3, num_classes=10).eval()


DETERMINISTIC = [m for m in METHODS if m not in ("random", "importance")]


@pytest.mark.parametrize("method", DETERMINISTIC)
@pytest.mark.parametrize("carry", [False, True])
def test_models_on_gpu_match_cpu(method, carry):
    keep = [64, 16, 16, 4] if method == "conv" else [60, 40, 16, 9]
    model = apply_downsampling(_tiny(), method, keep, carry=carry)
    x = torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cpu = model(x)
        gpu = copy.deepcopy(model).cuda()(x.cuda()).cpu()
    torch.testing.assert_close(gpu, cpu, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("method", ["wkmedoids"])  # every method compiles in bench throughput and on the CPU
def test_inductor_fullgraph_on_gpu(method):
    model = apply_downsampling(_tiny(), method, [60, 40, 16, 9], carry=True).cuda().train()
    _compiled_bf16_step(model, torch.randn(4, 3, 64, 64, device="cuda"))


def _compiled_bf16_step(model: torch.nn.Module, x: torch.Tensor) -> None:
    """``model`` compiled with inductor (fullgraph), one bf16 forward and backward: finite logits, and
    every parameter gets a gradient."""
    compiled = compile_model(model, "default", "cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = compiled(x)
    logits.float().sum().backward()
    assert torch.isfinite(logits).all()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_significance_from_the_attention_lse_under_inductor_on_gpu(monkeypatch):
    """In bf16 without carried sizes, every pooling block hands its scores the fused attention's row
    log-sum-exps (a spy sees it in eager), and the model compiles with inductor, fullgraph, forward
    and backward."""
    from pipeline.models import attention

    used = []
    real = attention.fused_attention_lse

    def spy(*args):
        result = real(*args)
        used.append(result is not None)
        return result

    model = apply_downsampling(_tiny(), "wkmedoids", [60, 40, 16, 9]).cuda().train()
    x = torch.randn(4, 3, 64, 64, device="cuda")
    with monkeypatch.context() as patch, torch.autocast("cuda", dtype=torch.bfloat16):
        patch.setattr(attention, "fused_attention_lse", spy)
        model(x)
    assert used == [True] * 4, used
    _compiled_bf16_step(model, x)


def test_cls_significance_on_gpu_eager_and_under_inductor():
    """The class token's scores (``significance: cls``) on CUDA in bf16, eager and compiled by inductor,
    against the class row of the explicit softmax in float64 on the CPU; then a cls model compiles
    (fullgraph, bf16, forward and backward)."""
    from pipeline.models.significance import cls_significance

    gen = torch.Generator().manual_seed(3)
    q, k, _ = torch.randn(4, 197, 3, 6, 64, generator=gen).permute(2, 0, 3, 1, 4).bfloat16().unbind(0)
    bias = torch.rand(4, 197, generator=gen).log()
    logits = (q.double() * 0.125) @ k.double().transpose(-2, -1) + bias.double()[:, None, None, :]
    want = logits.softmax(-1)[:, :, 0].sum(1)
    eager = cls_significance(q.cuda(), k.cuda(), 0.125, bias.cuda())
    compiled = torch.compile(cls_significance, fullgraph=True)(q.cuda(), k.cuda(), 0.125, bias.cuda())
    for got in (eager, compiled):
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-4, atol=1e-5)
    model = apply_downsampling(_tiny(), "wkmedoids", [60, 40, 16, 9], significance="cls").cuda().train()
    _compiled_bf16_step(model, torch.randn(4, 3, 64, 64, device="cuda"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_patch_matmul_matches_the_convolution_on_gpu(dtype, monkeypatch):
    """``patch_embed: matmul`` on CUDA against timm's convolution (the same parameters), fp32 and bf16 autocast."""
    import timm

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # an exact fp32 convolution to compare with
    from pipeline.models.patch_embed import use_patch_embed

    torch.manual_seed(0)
    ref = timm.create_model("deit_small_patch16_224").patch_embed.cuda().eval()
    fast = copy.deepcopy(ref)
    holder = torch.nn.Module()
    holder.patch_embed = fast
    use_patch_embed(holder, "matmul")
    x = torch.randn(8, 3, 224, 224, device="cuda")
    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        out, expected = fast(x), ref(x)
    assert out.shape == expected.shape == (8, 196, 384)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)
