"""Attention dropout (``dropout_p``): what it does to the probabilities, its expectation,
its repeatability under a seed, who may serve it, and the refusals.

On the CPU ``torch_sdpa`` (dense) and ``reference`` declare it; on CUDA ``fa2`` too. The
others are rejected with "no attention dropout", by the policy and when forced."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import attnhub
import attnhub.errors
import attnhub.plugin
from attnhub import Hub
from attnhub.errors import ArgumentError
from attnhub.core.reference import reference_attention
from attnhub.core.spec import AttentionSpec, AttnParams, MaskSpec
from attnhub.nn import Attention


@pytest.fixture(scope="module")
def cpu_hub() -> Hub:
    return Hub(hardware="cpu")


def _qkv(b: int, sq: int, sk: int, hq: int, hkv: int, d: int, dtype=torch.float32,
         grad: bool = False) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(sq * 31 + sk)
    return tuple(torch.randn(b, s, h, d, generator=g, dtype=dtype).requires_grad_(grad)
                 for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))


def test_dropout_zeroes_probabilities_and_scales_the_rest(cpu_hub: Hub) -> None:
    """With v the identity (one value column per key) the output row is the dropped
    probability row itself: each entry is 0 or P / (1 - p), and about p of them are 0."""
    p, sk, sq = 0.3, 64, 48
    q, k, _ = _qkv(2, sq, sk, 4, 4, sk)
    v = torch.eye(sk).expand(2, 4, sk, sk).transpose(1, 2).contiguous()  # (B, Sk, H, Sk)
    probs = cpu_hub.attention(q, k, v, causal=True)  # exact: the probability rows
    out = cpu_hub.attention(q, k, v, causal=True, dropout_p=p)
    kept = out != 0
    visible = probs > 0
    assert not (kept & ~visible).any()  # nothing appears where the mask hides a key
    torch.testing.assert_close(out[kept], probs[kept] / (1 - p), rtol=1e-5, atol=0)
    n = int(visible.sum())
    frac = float((~kept & visible).sum()) / n
    assert abs(frac - p) < 6 * (p * (1 - p) / n) ** 0.5, (frac, n)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_is_unbiased(cpu_hub: Hub, p: float) -> None:
    """The mean of many draws is the exact output, within 6 standard errors per element;
    the same bound refuses the mean without the 1/(1 - p) scale (the test can fail)."""
    q, k, v = _qkv(1, 8, 12, 4, 2, 16)
    exact = cpu_hub.attention(q, k, v, window=(4, 2))
    n = 600
    draws = torch.stack([cpu_hub.attention(q, k, v, window=(4, 2), dropout_p=p)
                         for _ in range(n)]).double()
    mean, se = draws.mean(0), draws.std(0) / n ** 0.5
    assert ((mean - exact.double()).abs() <= 6 * se + 1e-6).all()
    unscaled = mean * (1 - p)
    assert not ((unscaled - exact.double()).abs() <= 6 * se + 1e-6).all()


CASES = {  # name: (b, sq, sk, hq, hkv, d, call arguments)
    "full": (2, 16, 16, 4, 4, 32, {}),
    "causal-gqa": (2, 16, 24, 8, 2, 32, {"causal": True}),
    "window": (1, 20, 20, 4, 4, 16, {"window": (5, 0), "causal": True}),
    "alibi": (2, 9, 13, 4, 4, 16, {"alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625])}),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_a_seed_repeats_the_draw_as_sdpa_draws_it(cpu_hub: Hub, case: str,
                                                  dtype: torch.dtype) -> None:
    """Under one seed the hub's output and gradients are SDPA's with the same dropout, the
    same mask as a boolean tensor: one draw from torch's generator, nothing redrawn."""
    b, sq, sk, hq, hkv, d, kw = CASES[case]
    q, k, v = _qkv(b, sq, sk, hq, hkv, d, dtype, grad=True)
    params = AttnParams(scale=d ** -0.5, alignment="bottom_right",
                        **{n: kw[n] for n in ("causal", "window", "alibi_slopes") if n in kw})
    from attnhub.core.masking import alibi_bias, allowed_mask

    mask = allowed_mask(params, b, hq, sq, sk, q.device)
    if "alibi_slopes" in kw:
        mask = alibi_bias(params.alibi_slopes, sq, sk, "bottom_right", q.device).to(dtype)
    torch.manual_seed(11)
    ours = cpu_hub.attention(q, k, v, dropout_p=0.25, **kw)
    torch.manual_seed(11)
    ref = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
        dropout_p=0.25, enable_gqa=hq != hkv).transpose(1, 2)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ours, ref, **tol)
    assert not torch.allclose(ours.float(), cpu_hub.attention(q, k, v, **kw).float(),
                              rtol=1e-2, atol=1e-2)
    dout = torch.randn_like(ours)
    g1 = torch.autograd.grad(ours, (q, k, v), dout)
    g2 = torch.autograd.grad(ref, (q, k, v), dout)
    for a, r in zip(g1, g2):
        torch.testing.assert_close(a.float(), r.float(), **tol)


def test_bhsd_and_the_hot_path_draw_too(cpu_hub: Hub) -> None:
    """The second call of a shape takes the hot path: it draws with its own probability,
    and a call without dropout of the same shape is never served by the dropout binding."""
    q, k, v = _qkv(1, 10, 10, 2, 2, 8)
    exact = cpu_hub.attention(q, k, v)
    for p in (0.2, 0.6, 0.2):
        torch.manual_seed(3)
        got = cpu_hub.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                layout="bhsd", dropout_p=p).transpose(1, 2)
        torch.manual_seed(3)
        want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2), dropout_p=p).transpose(1, 2)
        torch.testing.assert_close(got, want)
        for zero in (0.0, 0):
            torch.testing.assert_close(cpu_hub.attention(q, k, v, dropout_p=zero), exact,
                                       rtol=0, atol=0)


@pytest.mark.parametrize("bad", [1.0, 1, -0.1, float("nan"), float("inf"), True, "0.1",
                                 torch.tensor(0.1)])
def test_a_bad_probability_is_refused_on_both_paths(cpu_hub: Hub, bad: object) -> None:
    q, k, v = _qkv(1, 4, 4, 2, 2, 8)
    for warm in (0.0, 0.5):  # the shape's binding cached (hot path) or not
        cpu_hub.attention(q, k, v, dropout_p=warm)
        with pytest.raises(ArgumentError, match=r"dropout_p=.*\[0, 1\)"):
            cpu_hub.attention(q, k, v, dropout_p=bad)


def test_backends_without_dropout_are_rejected_with_the_reason(cpu_hub: Hub) -> None:
    spec = AttentionSpec(phase="train", dtype="fp32", head_dim=32, num_q_heads=4,
                         num_kv_heads=4, mask=MaskSpec(causal=True), max_seqlen_q=64,
                         max_seqlen_k=64, needs_grad=True, dropout=True)
    d = cpu_hub.decide(spec)
    assert d.backend == "torch_sdpa"
    assert d.rejected and all("no attention dropout" in " ".join(r.reasons)
                              for r in d.rejected)
    assert "dropout" in spec.describe()
    q, k, v = _qkv(1, 8, 8, 2, 2, 8)
    with pytest.raises(attnhub.BackendUnavailableError, match="no attention dropout"):
        cpu_hub.attention(q, k, v, dropout_p=0.1, backend="torch_flash_cpu")


@pytest.mark.parametrize("hardware", ["h100", "a100"])
@pytest.mark.parametrize("policy", ["policies/default.yaml", "policies/h100-training.yaml",
                                    "policies/a100-training.yaml"])
def test_gpu_dropout_training_binds_flash_attention_2_then_sdpa(hardware: str,
                                                                 policy: str) -> None:
    """On CUDA only FA2 and SDPA draw dropout: FA2 first (every mask it has, packed
    documents too), SDPA as the dense fallback; FA3, cuDNN and Triton are never tried one
    by one, and the training overlays do not shadow the rule."""
    hub = Hub(hardware=hardware, policy=policy)
    spec = AttentionSpec(phase="train", dtype="bf16", head_dim=128, num_q_heads=8,
                         num_kv_heads=2, mask=MaskSpec(causal=True), max_seqlen_q=1024,
                         max_seqlen_k=1024, needs_grad=True, dropout=True)
    dense = hub.decide(spec)
    assert (dense.backend, dense.rule) == ("fa2", "gpu-dropout"), dense.explain()
    assert "torch_sdpa" in dense.explain()
    packed = hub.decide(spec.with_(layout="thd", mask=MaskSpec(causal=True, document=True)))
    assert packed.backend == "fa2", packed.explain()
    assert "dropout only for dense bshd" in packed.explain()
    capped = hub.decide(spec.with_(mask=MaskSpec(causal=True, softcap=True)))
    assert capped.backend == "reference" and "softcap with dropout" in capped.explain()


def test_dropout_on_packed_documents_binds_the_reference(cpu_hub: Hub) -> None:
    """SDPA draws dropout for dense tensors only (one call); packed documents go to the
    reference, which draws per document."""
    q, k, v = _qkv(1, 6, 6, 2, 2, 8)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    kw = dict(layout="thd", cu_seqlens_q=cu, cu_seqlens_k=cu)
    with pytest.raises(attnhub.errors.AttnhubError, match="dropout only for dense bshd"):
        cpu_hub.attention(q[0], k[0], v[0], dropout_p=0.1, backend="torch_sdpa", **kw)
    exact = cpu_hub.attention(q[0], k[0], v[0], **kw)
    dropped = cpu_hub.attention(q[0], k[0], v[0], dropout_p=0.5, **kw)
    assert dropped.shape == exact.shape and not torch.allclose(dropped, exact)


def test_the_layer_drops_in_training_only() -> None:
    """``nn.Attention(dropout=p)``: dropped in train mode, exact in eval mode and with a KV
    cache; a bad p is refused when the layer is built."""
    layer = Attention(2, 2, 8, dropout=0.4)
    q, k, v = _qkv(1, 12, 12, 2, 2, 8)
    exact, _ = reference_attention(q.double(), k.double(), v.double(),
                                AttnParams(scale=8 ** -0.5, causal=True))
    torch.testing.assert_close(layer.eval()(q, k, v).double(), exact, rtol=1e-5, atol=1e-6)
    dropped = layer.train()(q, k, v)
    assert (dropped == 0).any() and not torch.allclose(dropped.double(), exact)
    assert layer.spec("train", batch=1, seqlen_q=12, seqlen_k=12,
                      dtype=torch.float32).dropout
    assert not layer.eval().spec("train", batch=1, seqlen_q=12, seqlen_k=12,
                                 dtype=torch.float32).dropout
    with pytest.raises(ValueError, match=r"Attention: dropout=1.5; it must be in"):
        Attention(2, 2, 8, dropout=1.5)


class _Dropping(attnhub.plugin.Backend):
    """SDPA with dropout, bshd, as a third party would wrap it; subclasses break the law."""

    name, plugin = "dropping", "test"
    capabilities = attnhub.plugin.Capabilities(gqa=True, dropout=True)

    def _p(self, params: AttnParams) -> float:
        return params.dropout_p

    def _out(self, q, k, v, spec, params):  # type: ignore[no-untyped-def]
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=params.scale,
            dropout_p=self._p(params), enable_gqa=True).transpose(1, 2)

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        return attnhub.plugin.AttentionOutput(self._out(q, k, v, spec, params).contiguous())


class _Ignores(_Dropping):
    def _p(self, params: AttnParams) -> float:
        return 0.0


class _Unscaled(_Dropping):
    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        out = self._out(q, k, v, spec, params) * (1 - params.dropout_p)
        return attnhub.plugin.AttentionOutput(out)


class _OwnGenerator(_Dropping):
    _gen = torch.Generator().manual_seed(0)

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        with torch.random.fork_rng():
            torch.manual_seed(int(torch.randint(0, 2**31, (), generator=self._gen)))
            return super().forward(q, k, v, spec, params)


class _OnOutput(_Dropping):
    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        exact = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=params.scale,
            enable_gqa=True).transpose(1, 2)
        return attnhub.plugin.AttentionOutput(F.dropout(exact, params.dropout_p).contiguous())


class _WrongRate(_Dropping):
    def _p(self, params: AttnParams) -> float:
        return params.dropout_p / 5


class _NoneInTraining(_Dropping):
    capabilities = attnhub.plugin.Capabilities(gqa=True, dropout=True, backward=True)

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        if q.requires_grad:
            params = AttnParams(scale=params.scale)
        return super().forward(q, k, v, spec, params)


class _RedrawsInBackward(_Dropping):
    capabilities = attnhub.plugin.Capabilities(gqa=True, dropout=True, backward=True)

    def forward(self, q, k, v, spec, params):  # type: ignore[no-untyped-def, override]
        outer = self
        with torch.no_grad():
            out = self._out(q, k, v, spec, params)

        class Redraw(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v):  # type: ignore[no-untyped-def, override]
                ctx.save_for_backward(q, k, v)
                return out.clone()

            @staticmethod
            def backward(ctx, g):  # type: ignore[no-untyped-def, override]
                xs = [x.detach().requires_grad_(True) for x in ctx.saved_tensors]
                with torch.enable_grad():  # a second draw: not the forward's mask
                    o = outer._out(*xs, spec, params)
                return torch.autograd.grad(o, xs, g)

        return attnhub.plugin.AttentionOutput(Redraw.apply(q, k, v).contiguous())


@pytest.mark.parametrize("cls, verdict", [
    (_Dropping, "mean of 200 draws"), (_Ignores, "no dropout applied"),
    (_Unscaled, "scale kept probabilities by 1/"),
    (_OwnGenerator, "under one torch.manual_seed differ"),
    (_OnOutput, "not to the output"), (_WrongRate, "dropped (0) or scaled by 1/(1 - 0.25)"),
    (_NoneInTraining, "in training"), (_RedrawsInBackward, "replay the forward's")])
def test_the_kit_judges_declared_dropout_by_its_law(cls: type, verdict: str) -> None:
    from attnhub.conformance.kit import run_kit

    hub = Hub(hardware="cpu")
    (res,) = [r for r in run_kit(cls(), hub.device).results if r.case.dropout_p]
    assert res.status == ("pass" if cls is _Dropping else "fail"), res
    assert verdict in res.detail, res.detail
    assert not [r for r in run_kit(cls(), hub.device, quick=True).results
                if r.status == "fail" and not r.case.dropout_p]


def test_softcap_and_dropout_train_as_eager_through_the_reference() -> None:
    """Gemma 2 trains with a logit softcap, which SDPA has not: with attention dropout no
    backend served it (a bare "no backend"); the reference now draws its dropout as eager
    does, so one seed gives eager's loss and gradients."""
    pytest.importorskip("transformers")
    from attnhub.integrations.transformers import register
    from attnhub.integrations.transformers.testing import tiny_config, twin_models

    register()
    cfg = tiny_config("gemma2")
    cfg.attention_dropout = 0.2
    ours, eager = (m.train() for m in twin_models(cfg))
    ids = torch.randint(3, 99, (2, 8), generator=torch.Generator().manual_seed(1))
    losses, grads = [], []
    for model in (ours, eager):
        torch.manual_seed(4)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=0)
    top = max(g.abs().max().item() for g in grads[1].values())
    for n, g in grads[0].items():
        torch.testing.assert_close(g, grads[1][n], rtol=1e-4, atol=1e-5 * top, msg=n)
    torch.manual_seed(5)
    assert not torch.allclose(ours(input_ids=ids, labels=ids).loss.detach(), losses[0])
