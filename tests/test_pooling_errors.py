"""Bad input to the operators raises a ValueError that names the offending argument."""

from __future__ import annotations

import pytest
import torch

from pipeline.errors import InputError
from pipeline.methods import build_downsampler
from pipeline.pooling import select_importance, select_topk, significance, token_pool, tome_merge

TOKENS = torch.randn(2, 10, 4)
SCORES = torch.rand(2, 10)


@pytest.mark.parametrize("k", [0, -3])
def test_k_below_one(k):
    with pytest.raises(ValueError, match=r"k must be a positive integer \(>= 1\)"):
        token_pool(TOKENS, k, weights=SCORES)


@pytest.mark.parametrize("k", [2.5, "3", True, None])
def test_k_not_an_integer(k):
    with pytest.raises(ValueError, match="k must be a positive integer"):
        token_pool(TOKENS, k, weights=SCORES)


@pytest.mark.parametrize("name", ["tome", "powerbert", "random", "importance", "kmedoids", "none"])
def test_k_checked_by_every_method(name):
    with pytest.raises(ValueError, match="k must be a positive integer"):
        build_downsampler(name)(TOKENS, 0, scores=SCORES)


@pytest.mark.parametrize(
    "kwargs,argument",
    [
        ({"tokens": torch.randn(10, 4)}, "tokens"),
        ({"weights": torch.rand(2, 9)}, "weights"),
        ({"init_scores": torch.rand(3, 10)}, "init_scores"),
        ({"sizes": torch.ones(2, 11)}, "sizes"),
        ({"metric": torch.randn(2, 9, 3)}, "metric"),
        ({"tokens": torch.randint(0, 5, (2, 10, 4))}, "tokens"),
    ],
)
def test_shape_and_type_mismatches(kwargs, argument):
    call = {"tokens": TOKENS, "weights": SCORES} | kwargs
    tokens = call.pop("tokens")
    with pytest.raises(ValueError, match=argument):
        token_pool(tokens, 3, **call)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_tokens(bad):
    tokens = TOKENS.clone()
    tokens[1, 3, 2] = bad
    with pytest.raises(ValueError, match="tokens contains NaN or inf"):
        token_pool(tokens, 3, weights=SCORES)
    with pytest.raises(ValueError, match="tokens contains NaN or inf"):
        tome_merge(tokens, 3)


def test_non_finite_weights():
    weights = SCORES.clone()
    weights[0, 0] = float("nan")
    with pytest.raises(ValueError, match="weights contains NaN"):
        token_pool(TOKENS, 3, weights=weights)


def test_negative_weights():
    with pytest.raises(ValueError, match="weights must be non-negative"):
        token_pool(TOKENS, 3, weights=SCORES - 0.5)
    with pytest.raises(ValueError, match="scores must be non-negative"):
        select_importance(TOKENS, 3, scores=SCORES - 0.5)


def test_unknown_method():
    with pytest.raises(ValueError, match="method must be one of"):
        token_pool(TOKENS, 3, method="kmodes", weights=SCORES)
    with pytest.raises(ValueError, match=r"unknown downsampling method 'kmodes'; choose one of \["):
        build_downsampler("kmodes")


def test_topk_init_without_scores():
    with pytest.raises(ValueError, match="init='topk' needs init_scores or weights"):
        token_pool(TOKENS, 3)


def test_score_methods_need_scores():
    with pytest.raises(ValueError, match="powerbert needs scores"):
        select_topk(TOKENS, 3)
    with pytest.raises(ValueError, match="wkmedoids needs scores"):
        build_downsampler("wkmedoids", init="random")(TOKENS, 3)


def test_bad_options():
    with pytest.raises(ValueError, match="pooling.options.kmeans.init is one of 'topk', 'random', got 'kmeans[+][+]'"):
        build_downsampler("kmeans", init="kmeans++")
    with pytest.raises(ValueError, match="iters must be a positive integer"):
        token_pool(TOKENS, 3, weights=SCORES, iters=0)
    with pytest.raises(ValueError, match="method 'powerbert' has no option 'iters'; it takes: significance"):
        build_downsampler("powerbert", iters=3)
    with pytest.raises(ValueError, match="needs dim"):
        build_downsampler("conv")


def test_significance_shape():
    with pytest.raises(ValueError, match=r"attn must have shape \(B, H, N, N\)"):
        significance(torch.rand(2, 3, 4, 5))


def test_validate_false_skips_value_checks_only():
    # Value checks need a host sync, so a hot path may skip them; shape and type checks remain.
    out = token_pool(TOKENS, 3, weights=SCORES - 2.0, validate=False)
    assert out.tokens.shape == (2, 3, 4)
    with pytest.raises(ValueError, match="k must be"):
        token_pool(TOKENS, 0, weights=SCORES, validate=False)
    with pytest.raises(ValueError, match="weights must have shape"):
        token_pool(TOKENS, 3, weights=SCORES[:, :5], validate=False)


@pytest.mark.parametrize("kernel,choices", [("kmeans", "auto, torch"), ("kmedoids", "auto, tiled, torch"),
                                            ("merge", "auto, torch"), ("attention", "auto, sdpa, torch"),
                                            ("native", "auto, torch")])
def test_a_misspelt_kernel_choice_is_refused_by_name(kernel, choices):
    """The kernel choices take their listed values only, in the config and in the ops' plain value: a typo
    would otherwise run the default kernel silently and a GPU comparison would time the same kernel twice."""
    from pipeline.config import ConfigError, load_config
    from pipeline.runtime import KernelChoice

    with pytest.raises(InputError, match=f"kernels.{kernel} must be one of {choices}, got 'tiledd'"):
        KernelChoice(**{kernel: "tiledd"})
    with pytest.raises(ConfigError, match=f"kernels.{kernel}"):
        load_config(None, [f"kernels.{kernel}=tiledd"])
    assert getattr(load_config(None, [f"kernels.{kernel}={choices.split(', ')[-1]}"]).kernels.choice(), kernel) \
        == choices.split(", ")[-1]


def test_the_shared_checks_name_the_argument_and_the_value_in_full():
    """pipeline/pooling/common.py's checks, which every operator calls: each message in full, their defaults (values
    checked, finite required, negative values allowed) and the edges they accept (one token; norms that fit float32
    even where a sum over the wrong axis would not)."""
    from pipeline.pooling.common import check_k, check_metric, check_per_token, check_tokens

    assert check_k(3) == 3 and type(check_k(torch.tensor(3).item())) is int
    with pytest.raises(InputError, match=r"^k must be a positive integer, got '3' of type str$"):
        check_k("3")
    with pytest.raises(InputError, match=r"^k must be a positive integer \(>= 1\), got 0$"):
        check_k(0)
    with pytest.raises(InputError, match=r"^tokens must be a torch.Tensor of shape \(B, N, M\), got list$"):
        check_tokens([[1.0]])
    with pytest.raises(InputError, match=r"^x must have shape \(B, N, M\), got shape \(2, 3\)$"):
        check_tokens(torch.zeros(2, 3), name="x")
    with pytest.raises(InputError, match=r"^tokens must be a floating-point tensor, got dtype torch.int64$"):
        check_tokens(torch.zeros(2, 3, 4, dtype=torch.long))
    with pytest.raises(InputError, match=r"^tokens must hold at least one token, got shape \(2, 0, 4\)$"):
        check_tokens(torch.zeros(2, 0, 4))
    check_tokens(torch.zeros(2, 1, 4))  # one token is enough
    nan = torch.zeros(1, 3, 2)
    nan[0, 1, 0] = float("nan")
    with pytest.raises(InputError, match=r"^tokens contains NaN or inf values; check the upstream layer"):
        check_tokens(nan)  # finite by default
    check_tokens(nan, finite=False)
    big = torch.zeros(1, 4, 3)
    big[0, :, 0] = 1.5e19  # each token's squared norm 2.25e38 fits float32 (3.4e38); their sum over N would not
    check_tokens(big)
    big[0, 2, 1] = 1.5e19  # token 2: 4.5e38
    with pytest.raises(InputError, match=r"^tokens are too large: their squared norms overflow float32 \(largest "
                                         r"\|value\| 1.5e\+19\); scale them down, as a normalisation layer would$"):
        check_tokens(big)
    tokens = torch.zeros(2, 5, 6)
    check_per_token(None, tokens, name="sizes")
    with pytest.raises(InputError, match=r"^sizes must be a torch.Tensor of shape \(B, N\), got list$"):
        check_per_token([1.0] * 5, tokens, name="sizes")
    with pytest.raises(InputError, match=r"^sizes must have shape \(B, N\) = \(2, 5\) to match tokens, got \(2, 4\)$"):
        check_per_token(torch.ones(2, 4), tokens, name="sizes")
    negative = -torch.ones(2, 5)
    check_per_token(negative, tokens, name="scores")  # negative values pass unless asked
    with pytest.raises(InputError, match=r"^weights must be non-negative; got a minimum of -1$"):
        check_per_token(negative, tokens, name="weights", nonnegative=True)
    with pytest.raises(InputError, match=r"^scores contains NaN or inf values$"):
        check_per_token(torch.full((2, 5), float("inf")), tokens, name="scores")  # values checked by default
    check_per_token(torch.full((2, 5), float("inf")), tokens, name="scores", values=False)
    check_metric(None, tokens)
    with pytest.raises(InputError, match=r"^metric must have shape \(B, N, M\), got shape \(2, 5\)$"):
        check_metric(torch.zeros(2, 5), tokens)
    with pytest.raises(InputError, match=r"^metric must have shape \(B, N, D\) with \(B, N\) = \(2, 5\) to match "
                                         r"tokens, got \(2, 4, 3\)$"):
        check_metric(torch.zeros(2, 4, 3), tokens)
    with pytest.raises(InputError, match=r"^metric contains NaN or inf values"):
        check_metric(torch.full((2, 5, 3), float("nan")), tokens)  # finite by default
    check_metric(torch.full((2, 5, 3), float("nan")), tokens, finite=False)
