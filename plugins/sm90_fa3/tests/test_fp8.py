"""FP8 operands (per-(batch, KV head) scales, K smoothing) and the kernel model, on the CPU;
and ``attnhub fp8-check --emulate`` end to end with its accuracy record."""

from __future__ import annotations

import json

import pytest
import torch
from attnhub_sm90_fa3.fa3_fp8 import ENV_RECIPE, Fa3Fp8Backend
from attnhub_sm90_fa3.fp8 import (
    E4M3,
    dequantize,
    emulate,
    kv_head_amax,
    lse_shift,
    quantize,
    quantize_operands,
)

import attnhub
from attnhub.cli import main as cli
from attnhub.plugin import AttnParams, reference_attention
from attnhub.policy.profile import ProfileStore


def bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_quantize_scales_per_batch_and_kv_head():
    x = bf16(2, 33, 4, 16)  # 4 query heads over 2 KV heads
    x[1, 5, 3, 2] = 100.0  # batch 1, head 3 = KV group 1
    x8, descale = quantize(x, 2)
    assert x8.dtype == E4M3 and descale.shape == (2, 2) and descale.dtype == torch.float32
    assert descale[1, 1] > 10 * descale[1, 0] and descale[1, 1] > 10 * descale[0, 1]
    back = dequantize(x8, descale)
    err = (back - x.float()).abs()
    step = descale.repeat_interleave(2, dim=1).view(2, 1, 4, 1) * 2.0 ** -9  # subnormal step
    assert torch.all(err <= x.float().abs() * 2.0 ** -4 + step)
    assert float(x8.float().abs().max()) <= 448.0
    torch.testing.assert_close(kv_head_amax(x, 2), x.float().abs().amax(dim=(1, 3))
                               .view(2, 2, 2).amax(-1))


@pytest.mark.parametrize("causal", [False, True])
def test_smoothing_removes_a_key_offset_and_keeps_the_lse(causal):
    q, k, v = bf16(1, 96, 4, 32, seed=1), bf16(1, 96, 2, 32, seed=2), bf16(1, 96, 2, 32, seed=3)
    p = AttnParams(scale=32 ** -0.5, causal=causal)
    base = rel(emulate(quantize_operands(q, k, v, "plain"), p)[0],
               reference_attention(q, k, v, p)[0])
    kb = k.clone()
    kb[..., 5] += 30.0
    ref, ref_lse = reference_attention(q, kb, v, p)
    plain = rel(emulate(quantize_operands(q, kb, v, "plain"), p)[0], ref)
    ops = quantize_operands(q, kb, v, "smooth_k")
    out, lse = emulate(ops, p)
    smooth = rel(out, ref)
    assert smooth < 1.3 * base < plain, (base, smooth, plain)
    lse = lse + lse_shift(q, ops.k_mean, p.scale)  # what smoothing took off each row
    assert float((lse - ref_lse).abs().max()) < 0.1


def test_error_grows_with_a_query_outlier():
    q, k, v = bf16(1, 128, 2, 32, seed=4), bf16(1, 128, 2, 32, seed=5), bf16(1, 128, 2, 32, seed=6)
    p = AttnParams(scale=32 ** -0.5)
    errs = []
    for m in (1.0, 20.0):
        qo = q.clone()
        qo[..., 3] *= m
        errs.append(rel(emulate(quantize_operands(qo, k, v, "plain"), p)[0],
                        reference_attention(qo, k, v, p)[0]))
    assert errs[1] > 1.5 * errs[0], errs


def test_recipe_names_are_checked(monkeypatch):
    with pytest.raises(ValueError, match="recipe"):
        quantize_operands(bf16(1, 4, 1, 8), bf16(1, 4, 1, 8), bf16(1, 4, 1, 8), "smooth_q")
    monkeypatch.setenv(ENV_RECIPE, "fast")
    with pytest.raises(ValueError, match=ENV_RECIPE):
        Fa3Fp8Backend()


def run_cli(capsys, *argv):
    code = cli(["fp8-check", "--emulate", "--json", *argv])
    return code, json.loads(capsys.readouterr().out)


def test_fp8_check_records_pass_and_fail(tmp_path, capsys):
    store = tmp_path / "profile.json"
    code, res = run_cli(capsys, "--shape", "1,64,4,2,32", "--causal", "--magnitudes", "1,20",
                        "--store", str(store))
    assert code == 0 and res["passed"] and res["emulated"]
    kinds = {(c["kind"], c["magnitude"]) for c in res["cases"]}
    assert kinds == {("random", 1.0), ("q_channel", 20.0), ("k_bias", 20.0)}
    rand = next(c for c in res["cases"] if c["kind"] == "random")["errors"]
    assert rand["bf16"]["rel"] < 0.01 < rand["fp8 plain"]["rel"]
    spec = attnhub.AttentionSpec(phase="prefill", dtype="bf16", head_dim=32, num_q_heads=4,
                                 num_kv_heads=2, mask=attnhub.MaskSpec(causal=True),
                                 max_seqlen_q=64, max_seqlen_k=64, batch=1)
    rec = ProfileStore(store).accuracy(attnhub.probe(), spec, "fa3_fp8")
    assert rec is not None and rec.passed and "rel_error_q_channel_x20" in rec.metrics
    code, res = run_cli(capsys, "--shape", "1,64,4,2,32", "--causal", "--magnitudes", "1",
                        "--budget", "0.001", "--store", str(store))
    assert code == 1 and not res["passed"]
    assert not ProfileStore(store).accuracy(attnhub.probe(), spec, "fa3_fp8").passed


def test_fp8_check_takes_captured_inputs(tmp_path, capsys):
    path = tmp_path / "captured.pt"
    torch.save({"q": bf16(1, 48, 2, 32), "k": bf16(1, 48, 2, 32, seed=1),
                "v": bf16(1, 48, 2, 32, seed=2), "causal": True}, path)
    code, res = run_cli(capsys, "--shape", "1,32,2,2,32", "--magnitudes", "1", "--inputs",
                        str(path), "--no-record")
    assert code == 0
    assert [c["kind"] for c in res["cases"]] == ["random", "captured"]
