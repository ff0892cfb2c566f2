"""The ROCm column of the default policy, `attnhub plan/explain --hardware gfx942`, and a CPU
dry run of an AMD binding (simulated gfx942, kernels in the Triton interpreter)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import attnhub
from attnhub import AttentionSpec, BindContext, MaskSpec
from attnhub.cli import main as cli_main  # the `attnhub` console script
from attnhub.plugin import AttnParams, reference_attention
from attnhub.testing import assert_fa_rule


def _decide(hub: attnhub.Hub, **kw: object) -> attnhub.Decision:
    base: dict[str, object] = dict(dtype="bf16", head_dim=128, num_q_heads=32, num_kv_heads=8,
                                   max_seqlen_q=4096, max_seqlen_k=4096)
    base.update(kw)
    return hub.decide(AttentionSpec(**base), BindContext())  # type: ignore[arg-type]


def test_default_policy_binds_the_rocm_column() -> None:
    hub = attnhub.Hub(hardware="gfx942")
    prefill = _decide(hub, phase="prefill", mask=MaskSpec(causal=True))
    assert (prefill.backend, prefill.rule) == ("ck_fa", "rocm-dense")
    train = _decide(hub, phase="train", needs_grad=True, mask=MaskSpec(causal=True))
    assert train.backend == "ck_fa"
    decode = _decide(hub, phase="decode", max_seqlen_q=1, mask=MaskSpec(causal=True))
    assert (decode.backend, decode.rule) == ("triton_rocm", "rocm-decode")
    paged = _decide(hub, phase="decode", max_seqlen_q=1, layout="paged", page_size=16)
    assert paged.backend == "triton_rocm"
    softcap = _decide(hub, phase="prefill", mask=MaskSpec(causal=True, softcap=True))
    assert softcap.backend == "triton_rocm"


def test_a_policy_that_puts_ck_first_still_routes_softcap_to_triton(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNHUB_CK_FA_LIBRARY", "flash_attn")
    policy = tmp_path / "amd.yaml"
    policy.write_text("name: amd\nversion: 1\nrules:\n"
                      "  - name: amd-all\n    when: {hardware: rocm}\n"
                      "    use: [ck_fa, triton_rocm]\n")
    hub = attnhub.Hub(policy=policy, hardware="gfx942")
    d = _decide(hub, phase="prefill", mask=MaskSpec(causal=True, softcap=True))
    assert d.backend == "triton_rocm"
    ck = [r for r in d.rejected if r.backend == "ck_fa"]
    assert ck and any("silently ignores" in reason for reason in ck[0].reasons)
    assert "silently ignores" in d.explain()


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """Run the ``attnhub`` console command in-process (a subprocess costs seconds of imports)."""
    capsys.readouterr()
    assert cli_main(list(args)) == 0
    return capsys.readouterr().out


def test_cli_plan_and_explain_show_rocm_bindings(capsys: pytest.CaptureFixture[str]) -> None:
    plan = json.loads(_cli(capsys, "plan", "--hardware", "gfx942", "--json"))
    cells = {(c["phase"], c["dtype"], c["mask"]): c["bindings"]["gfx942"]["backend"]
             for c in plan["cells"] if not c["dropout"]}
    assert cells[("prefill", "bf16", "causal")] == "ck_fa"
    assert cells[("train", "bf16", "none")] == "ck_fa"
    assert cells[("decode", "bf16", "causal")] == "triton_rocm"
    assert cells[("prefill", "bf16", "softcap")] == "triton_rocm"
    text = _cli(capsys, "explain", "--hardware", "gfx942", "--phase", "prefill", "--dtype", "bf16",
                "--heads", "32:8", "--seqlen", "4096", "--mask", "causal")
    assert "chosen:  ck_fa" in text and "rocm-dense" in text and "gfx942" in text


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="runs triton_rocm on CPU tensors in Triton's interpreter, which "
                           "the conftest turns on only without a GPU")
def test_cpu_dry_run_of_an_amd_decode_binding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNHUB_HARDWARE", "gfx942")
    hub = attnhub.Hub()
    q = torch.randn(2, 1, 8, 32, dtype=torch.float16)
    k = torch.randn(2, 40, 2, 32, dtype=torch.float16)
    v = torch.randn(2, 40, 2, 32, dtype=torch.float16)
    out = hub.attention(q, k, v, causal=True, phase="decode")
    assert sum(hub.fallback_counts.values()) == 0  # triton_rocm itself served it
    params = AttnParams(scale=32 ** -0.5, causal=True)
    ref64, _ = reference_attention(q, k, v, params)
    ref16, _ = reference_attention(q, k, v, params, compute_dtype=torch.float16)
    assert_fa_rule(out, ref64, ref16)  # type: ignore[arg-type]
