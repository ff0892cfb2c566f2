"""An ``attnhub.nn.Attention`` bound by ``attnhub.bind`` stays an ordinary module: a deep copy
(an EMA or teacher copy) shares the hub and gives the same outputs; ``torch.save`` drops the
hub (it holds locks and plugin modules), and the loaded layer runs on the default hub."""

from __future__ import annotations

import copy
import io

import torch

import attnhub
from attnhub.nn import Attention


def test_bound_layer_deep_copies_and_pickles() -> None:
    hub = attnhub.Hub()
    layer = Attention(num_q_heads=4, num_kv_heads=2, head_dim=16, causal=True, layer_idx=0)
    layer.hub = hub
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 8, h, 16, generator=g) for h in (4, 2, 2))
    want = layer(q, k, v)
    twin = copy.deepcopy(layer)
    assert twin.hub is hub and twin is not layer
    torch.testing.assert_close(twin(q, k, v), want, rtol=0, atol=0)
    buf = io.BytesIO()
    torch.save(layer, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded.hub is None and layer.hub is hub
    torch.testing.assert_close(loaded(q, k, v), want, rtol=1e-6, atol=1e-6)
