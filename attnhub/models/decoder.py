"""A small Llama-style decoder with random weights: what ``attnhub run`` binds and runs.

Pre-norm blocks (RMSNorm, GQA attention with rotary embeddings, SwiGLU MLP), weights drawn
from a fixed seed so that two runs (or a policy run and a reference run) are the same model.
Every attention layer is an ``attnhub.nn.Attention`` with a layer kind, so a policy can bind
softmax, sliding-window and linear layers (hybrid models) differently; the model itself only
projects q/k/v and never looks at which backend serves a layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
from torch import nn

from ..core.kvcache import CacheStep, PagedKVCache, free_all
from ..nn import Attention, attach_sequence_states

LAYER_KINDS = ("softmax", "sliding", "linear")


@dataclass(frozen=True)
class DecoderConfig:
    """Sizes of the built-in decoder; ``layer_kinds`` is cycled over the layers."""

    num_layers: int = 4
    num_q_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    vocab_size: int = 1024
    intermediate: int | None = None  # default: 8/3 of the hidden size, rounded to 64
    layer_kinds: tuple[str, ...] = ("softmax",)
    window: int = 256  # left window of "sliding" layers, in tokens
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    seed: int = 0
    name: str = "attnhub-decoder"

    def __post_init__(self) -> None:
        bad = set(self.layer_kinds) - set(LAYER_KINDS)
        if bad or not self.layer_kinds:
            raise ValueError(f"layer_kinds {list(self.layer_kinds)}: use a non-empty list of "
                             f"{', '.join(LAYER_KINDS)}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"heads {self.num_q_heads}:{self.num_kv_heads}: query heads must "
                             "be a multiple of KV heads")

    @property
    def hidden(self) -> int:
        return self.num_q_heads * self.head_dim

    @property
    def ffn(self) -> int:
        return self.intermediate or 64 * math.ceil(self.hidden * 8 / 3 / 64)

    def kind(self, layer: int) -> str:
        return self.layer_kinds[layer % len(self.layer_kinds)]

    def parameter_count(self) -> int:
        """Weights the model of these sizes has (every layer kind has the same), known before
        anything is allocated, so a size the machine cannot hold is refused up front."""
        h, d, f = self.hidden, self.head_dim, self.ffn
        layer = 2 * h + h * (self.num_q_heads + 2 * self.num_kv_heads) * d \
            + self.num_q_heads * d * h + 3 * h * f
        return 2 * self.vocab_size * h + h + self.num_layers * layer

    def to_json(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_tables(positions: torch.Tensor, head_dim: int,
                theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (B, S, 1, D) for absolute ``positions`` (B, S): computed once per step, shared
    by every layer."""
    inv = theta ** (-torch.arange(0, head_dim, 2, device=positions.device,
                                  dtype=torch.float32) / head_dim)
    ang = positions.to(torch.float32).unsqueeze(-1) * inv  # (B, S, D/2)
    ang = torch.cat([ang, ang], -1).unsqueeze(2)
    return ang.cos(), ang.sin()


def rotary(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate-half RoPE of x (B, S, H, D) with tables from ``rope_tables``."""
    cos, sin = rope
    x1, x2 = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, index: int):
        super().__init__()
        h, d = cfg.hidden, cfg.head_dim
        self.cfg = cfg
        self.norm1 = RMSNorm(h, cfg.norm_eps)
        self.qkv = nn.Linear(h, (cfg.num_q_heads + 2 * cfg.num_kv_heads) * d, bias=False)
        self.out = nn.Linear(cfg.num_q_heads * d, h, bias=False)
        kind = cfg.kind(index)
        self.attn = Attention(cfg.num_q_heads, cfg.num_kv_heads, d, layer_idx=index,
                              layer_kind=kind, model=cfg.name,
                              window=(cfg.window, 0) if kind == "sliding" else None)
        self.norm2 = RMSNorm(h, cfg.norm_eps)
        self.gate_up = nn.Linear(h, 2 * cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, h, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                cache: CacheStep | None) -> torch.Tensor:
        c = self.cfg
        b, s, _ = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, s, c.num_q_heads + 2 * c.num_kv_heads, c.head_dim)
        qk = rotary(qkv[:, :, : c.num_q_heads + c.num_kv_heads], rope)  # one pass for q and k
        q, k = qk.split([c.num_q_heads, c.num_kv_heads], dim=2)
        a = self.attn(q, k, qkv[:, :, c.num_q_heads + c.num_kv_heads:].contiguous(), cache)
        x = x + self.out(a.reshape(b, s, -1))
        g, u = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(g) * u)


class Decoder(nn.Module):
    """Token ids in, next-token logits out; ``prefill``/``decode`` run with a paged cache."""

    def __init__(self, cfg: DecoderConfig, *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        super().__init__()
        self.cfg = cfg
        self.attnhub_name = cfg.name
        with torch.device(device):  # built in place: an 8B-sized config never visits the CPU
            self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden)
            self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
            self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
            self.head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        self.to(dtype=dtype).eval()
        if torch.device(device).type != "meta":  # meta: shapes only, for binding plans
            self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        """Deterministic weights from ``cfg.seed`` on the model's device (scaled so that
        activations stay O(1)); a CPU and a GPU draw different, equally valid, weights."""
        gen = torch.Generator(self.device).manual_seed(self.cfg.seed)
        for name, p in self.named_parameters():
            if "norm" in name:
                continue
            fan_in = p.shape[-1] if "embed" not in name else 1
            # fp32 draws whatever the default dtype: the same weights for one seed
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32,
                                device=self.device) / math.sqrt(fan_in))

    @property
    def dtype(self) -> torch.dtype:
        return self.head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    def forward(self, ids: torch.Tensor, cache: CacheStep | None = None, *,
                last_only: bool = False) -> torch.Tensor:
        """ids (B, S) -> logits (B, S, vocab) in fp32; with ``cache``, the step's new tokens.
        ``last_only``: logits of the last position only, (B, 1, vocab) (a prefill at a large
        vocabulary would otherwise materialise B x S x vocab)."""
        if cache is None:
            positions = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        else:
            positions = cache.positions()
        x = self.embed(ids)
        rope = rope_tables(positions, self.cfg.head_dim, self.cfg.rope_theta)
        for layer in self.layers:
            x = layer(x, rope, cache)
        if last_only:
            x = x[:, -1:]
        return self.head(self.norm(x)).float()

    def new_cache(self, batch: int, max_len: int, *, page_size: int = 16,
                  spare_pages: int = 0, max_seqs: int | None = None,
                  sequence_state: bool = True) -> PagedKVCache:
        """A paged cache sized for ``batch`` sequences of up to ``max_len`` tokens, with the
        per-sequence state of the layers bound to stateful backends (linear layers) for up
        to ``max_seqs`` live sequences (default ``2 * batch``: the prompts and one decode fork
        each, as ``generate.decode`` runs). ``sequence_state=False``: no state, those layers
        recompute their context every step (slower; a check of the state path)."""
        c = self.cfg
        cache = PagedKVCache.for_sequences(
            num_layers=c.num_layers, batch=batch, max_len=max_len, page_size=page_size,
            num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, spare=spare_pages,
            dtype=self.dtype, device=self.device)
        if sequence_state:
            attach_sequence_states(self, cache, max_seqs or 2 * batch)
        return cache

    @torch.no_grad()
    def prefill(self, cache: PagedKVCache, ids: torch.Tensor) -> tuple[list[int], torch.Tensor]:
        """Start one sequence per row of ``ids`` (B, S); returns their ids and the logits of
        the last position (B, vocab)."""
        seqs: list[int] = []
        mark = cache.steps_taken
        try:  # allocated inside: one refused half-way (a full state store) leaks none
            for _ in range(ids.shape[0]):
                seqs.append(cache.allocate())
            with cache.step(seqs, ids.shape[1]) as step:  # a failing layer undoes the step
                return seqs, self(ids, step, last_only=True)[:, -1]
        except BaseException as exc:
            try:  # a Ctrl-C before the block was entered: its pages back in order first
                cache.abort_unentered_steps(mark, exc)
            finally:
                free_all(cache, seqs)
            raise

    @torch.no_grad()
    def decode(self, cache: PagedKVCache, seqs: Sequence[int],
               tokens: torch.Tensor) -> torch.Tensor:
        """One decode step: ``tokens`` (B,) appended to ``seqs``; logits (B, vocab). Raising
        (a failing layer, Ctrl-C) leaves ``seqs`` as they were: a Ctrl-C as ``cache.step``
        returns or as the block's exit starts escapes the ``with``'s own undo, so the step
        it left reserved (one all-zero token per sequence) is aborted here."""
        mark = cache.steps_taken
        try:
            with cache.step(seqs, 1) as step:  # a failing layer undoes the step
                return self(tokens.view(-1, 1), step)[:, -1]
        except BaseException as exc:
            cache.abort_unentered_steps(mark, exc)
            raise


def random_prompts(cfg: DecoderConfig, batch: int, length: int,
                   device: str | torch.device = "cpu") -> torch.Tensor:
    """Token ids (B, S) from the config's seed (the same prompts for every run)."""
    gen = torch.Generator().manual_seed(cfg.seed + 1)  # on the CPU: the same ids everywhere
    return torch.randint(0, cfg.vocab_size, (batch, length), generator=gen,
                         device="cpu").to(device)
