"""Review round 11, the hub boundary: a paged call's window normalised against the table's
capacity (so a bound model's decode resolved the policy again, under a spec ``bind`` never
saw), and the hub's own answer to an empty call taking torch's default dtype for its LSE."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import attnhub
from attnhub.core.reference import reference_attention
from attnhub.core.spec import AttnParams
from attnhub.models.decoder import Decoder, DecoderConfig, random_prompts
from attnhub.nn import call_spec
from attnhub.policy import load_policy


class Counting:
    """The default policy, counting resolutions and keeping the specs resolved."""

    def __init__(self) -> None:
        self.inner = load_policy()
        self.name, self.specs = self.inner.name, []

    def resolve(self, spec: Any, *rest: Any) -> Any:
        self.specs.append(spec)
        return self.inner.resolve(spec, *rest)


def _paged(pages_per_row: int, lens: list[int], page: int = 4, heads: int = 2, d: int = 8
           ) -> tuple[torch.Tensor, ...]:
    """A random paged cache of 32 pages, a table of ``pages_per_row`` random pages per row,
    and the lengths."""
    kc, vc = torch.randn(32, page, heads, d), torch.randn(32, page, heads, d)
    table = torch.randint(0, 32, (len(lens), pages_per_row), dtype=torch.int32)
    return kc, vc, table, torch.tensor(lens, dtype=torch.int32)


def _paged_reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, table: torch.Tensor,
                     lens: torch.Tensor, window: tuple[int, int]) -> torch.Tensor:
    """fp64 attention of each row over its own keys, gathered from its pages."""
    outs = []
    for b, n in enumerate(lens.tolist()):
        k = kc[table[b].long()].flatten(0, 1)[:n][None]
        v = vc[table[b].long()].flatten(0, 1)[:n][None]
        params = AttnParams(scale=q.shape[-1] ** -0.5, window=window)
        outs.append(reference_attention(q[b:b + 1], k, v, params)[0])
    return torch.cat(outs)


def test_paged_window_is_normalised_by_the_lengths_not_the_table_capacity() -> None:
    """Two paged decodes of the same lengths (bucket 16) through a table of 4 pages (16
    tokens) and one of 16 pages (64), each the first call of its hub: the window's left
    edge 20 reaches past every key in both, so both resolve the spec ``call_spec`` gives
    bind, and answer exactly. The wider table made the edge "bounded" there: another spec."""
    policy = Counting()
    window = (20, 0)
    lens = [int(n) for n in torch.randint(9, 17, (2,))]
    q = torch.randn(2, 1, 2, 8)
    for width in (4, 16):
        hub = attnhub.Hub(policy=policy, hardware="cpu")
        kc, vc, table, sl = _paged(width, lens)
        out = hub.attention(q, kc, vc, layout="paged", block_table=table, seqlens_k=sl,
                            window=window)
        ref = _paged_reference(q, kc, vc, table, sl, window)
        torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)
    bound = call_spec("decode", num_q_heads=2, num_kv_heads=2, head_dim=8, head_dim_v=8,
                      causal=False, window=window, softcap=False, batch=2, seqlen_q=1,
                      seqlen_k=max(lens), dtype=torch.float32, layout="paged", page_size=4)
    assert policy.specs == [bound, bound], [s.describe() for s in policy.specs]


def test_bound_decode_through_a_wide_page_resolves_nothing_on_the_call_path() -> None:
    """A sliding-window model bound for decode, then decoded from a cache of 64-token pages
    (each table's capacity far past the lengths): every call finds bind's decision."""
    cfg = DecoderConfig(num_layers=1, num_q_heads=2, num_kv_heads=1, head_dim=8,
                        vocab_size=32, layer_kinds=("sliding",), window=20, seed=1)
    policy = Counting()
    hub = attnhub.Hub(policy=policy, hardware="cpu")
    model = Decoder(cfg)
    hub.bind(model, batch=1, prompt_len=10, max_len=16, page_size=64)
    at_bind = len(policy.specs)
    cache = model.new_cache(1, 16, page_size=64)
    seqs, logits = model.prefill(cache, random_prompts(cfg, 1, 10))
    for _ in range(3):
        logits = model.decode(cache, seqs, logits.argmax(-1))
    assert len(policy.specs) == at_bind, [s.describe() for s in policy.specs[at_bind:]]


@pytest.fixture
def float64_default() -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@pytest.mark.parametrize("layout", ["bshd", "thd", "paged"])
def test_empty_call_lse_is_fp32_whatever_the_default_dtype(float64_default: None,
                                                           layout: str) -> None:
    """The hub answers a call without keys itself: its LSE is fp32 (the contract), not the
    dtype ``torch.set_default_dtype`` chose, as every backend's result is held to."""
    hub = attnhub.Hub(hardware="cpu")
    q = torch.randn(2, 3, 2, 8, dtype=torch.float32)
    kw: dict[str, Any] = {}
    if layout == "bshd":
        k = v = torch.randn(2, 0, 2, 8, dtype=torch.float32)
    elif layout == "thd":
        q, k = q.flatten(0, 1), torch.randn(0, 2, 8, dtype=torch.float32)
        v, cu = k, torch.tensor([0, 6], dtype=torch.int32)
        kw = {"cu_seqlens_q": cu, "cu_seqlens_k": torch.tensor([0, 0], dtype=torch.int32)}
    else:
        k = v = torch.randn(4, 4, 2, 8, dtype=torch.float32)
        kw = {"block_table": torch.zeros(2, 1, dtype=torch.int32),
              "seqlens_k": torch.zeros(2, dtype=torch.int32)}
    out, lse = hub.attention(q, k, v, layout=layout, return_lse=True, **kw)
    assert out.dtype == torch.float32 and not out.any()
    assert lse.dtype == torch.float32 and torch.isneginf(lse).all()


def test_a_registered_variants_callable_is_that_variant_to_the_policy(tmp_path) -> None:
    """docs/policy.md: ``when.variant`` matches "a registered name, or its callable". Passed
    as its callable, a variant registered as a lambda was matched by ``__name__``
    (``<lambda>``), never by its name; and an unregistered lambda of the same shape must not
    share the registered one's exact-table entry (one call handed another's binding)."""
    from attnhub.core.registry import Registry
    from attnhub.hookspecs import hookimpl

    class Variants:
        @hookimpl
        def attnhub_register_variants(self, register: Any) -> None:
            register("halved_lambda", score_mod=lambda s, b, h, q, kv: s * 0.5)

    reg = Registry.of()
    reg.add_plugin(Variants(), "v11")
    p = tmp_path / "p.yaml"
    p.write_text("name: t\nrules:\n"
                 "  - {name: by-variant, when: {variant: [halved_lambda]}, use: [reference]}\n"
                 "  - {name: rest, use: [reference]}\n")
    registered = reg.variants["halved_lambda"].score_mod
    other = lambda s, b, h, q, kv: s * 0.25  # noqa: E731  (same name and shape, not registered)
    q, k, v = (torch.randn(1, 5, 2, 8) for _ in range(3))
    for first, then in ((registered, other), (other, registered)):  # either one first
        hub = attnhub.Hub(policy=p, hardware="cpu", registry=reg)
        for mod in (first, first, then, then, first):  # slow path, then the exact table
            out = hub.attention(q, k, v, score_mod=mod)
            scale = 0.5 if mod is registered else 0.25
            torch.testing.assert_close(out, attnhub.attention(q, k, v, scale=scale / 8 ** 0.5))
        rules = [b.decision.rule for b in hub.bound()]  # in the order they were made
        assert rules == (["by-variant", "rest"] if first is registered else
                         ["rest", "by-variant"])
