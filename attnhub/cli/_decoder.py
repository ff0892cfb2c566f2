"""Flags and set-up shared by the commands that run the built-in decoder (run, profile, bench
--from-model): sizes, dtype, device, policy; build the model and bind it."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..core.memory import check_memory
from ._common import (MAX_HEADS, POLICY_FLAG, add_hardware, at_least, progress, seed,
                      wants_progress)

#: The deepest model ``--layers`` builds: well past any published decoder (under 200 layers);
#: each layer is a Python module, so 10**8 of them would run for hours before any check.
MAX_LAYERS = 4096


def parse_heads(text: str) -> tuple[int, int]:
    """``"32:8"`` -> (32, 8); ``"8"`` -> (8, 8)."""
    try:
        q, _, kv = text.partition(":")
        hq, hkv = int(q), int(kv or q)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--heads {text!r}: use Q:KV, e.g. 32:8") from None
    if hq <= 0 or hkv <= 0 or hq % hkv:
        raise argparse.ArgumentTypeError(f"--heads {text!r}: query heads must be a positive "
                                         "multiple of KV heads")
    if hq > MAX_HEADS:  # (KV heads divide the query heads: no more of them)
        raise argparse.ArgumentTypeError(f"--heads {text!r}: at most {MAX_HEADS} heads "
                                         "(published models use a few hundred at most), e.g. "
                                         "32:8")
    return hq, hkv


def even_head_dim(text: str) -> int:
    """``--head-dim``: a positive even number (the decoder's rotary embedding rotates pairs of
    channels; an odd one failed mid-run with a shape error)."""
    value = at_least(1)(text)
    if value % 2:
        near = " or ".join(str(x) for x in (value - 1, value + 1) if x)
        raise argparse.ArgumentTypeError(f"{text!r}: the decoder's rotary embedding needs an "
                                         f"even head dim; use {near}")
    return value


def parse_kinds(text: str) -> tuple[str, ...]:
    """``"linear,softmax"`` -> ("linear", "softmax"), each a layer kind the decoder has."""
    from ..models.decoder import LAYER_KINDS

    kinds = tuple(k.strip() for k in text.split(","))
    bad = [k for k in kinds if k not in LAYER_KINDS]
    if bad:
        raise argparse.ArgumentTypeError(f"{text!r}: {', '.join(map(repr, bad))} is no layer "
                                         f"kind; use a comma list of {', '.join(LAYER_KINDS)}")
    return kinds


def parse_device(text: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N`` of a GPU this machine has (checked before anything is
    built; ``--hardware`` plans for a machine not here)."""
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: use cpu, cuda or cuda:N (to plan for "
                                         "another machine, --hardware)")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {count} CUDA "
                                             "device(s); use cpu, or --hardware to plan")
    return device


def add_decoder_args(p: argparse.ArgumentParser, *, batch: int = 4, prompt_len: int = 128,
                     new_tokens: int = 32, hardware_help: str | None = None) -> None:
    """The model and run-size flags (small CPU-friendly defaults)."""
    p.add_argument("--policy", metavar="FILE", type=POLICY_FLAG,
                   help="policy YAML (default: ATTNHUB_POLICY, else the packaged default)")
    add_hardware(p, hardware_help)
    g = p.add_argument_group("model (built-in decoder, random weights)")
    g.add_argument("--layers", type=at_least(1, high=MAX_LAYERS), default=4,
                   help=f"decoder layers (default 4, at most {MAX_LAYERS})")
    g.add_argument("--heads", type=parse_heads, default=(8, 2), metavar="Q:KV",
                   help="query:KV heads (default 8:2)")
    g.add_argument("--head-dim", type=even_head_dim, default=64,
                   help="head dim, even (default 64)")
    g.add_argument("--vocab", type=at_least(1), default=1024, help="vocabulary size (default 1024)")
    g.add_argument("--intermediate", type=at_least(1), default=None,
                   help="MLP width (default 8/3 of the hidden size)")
    g.add_argument("--layer-kinds", type=parse_kinds, default=("softmax",),
                   metavar="K1,K2,..",
                   help="layer kinds cycled over the layers: softmax, sliding, linear "
                        "(a hybrid model: linear,linear,linear,softmax)")
    g.add_argument("--window", type=at_least(0), default=256, help="left window of sliding layers")
    g.add_argument("--seed", type=seed, default=0, help="weights and prompts seed")
    g = p.add_argument_group("run size")
    g.add_argument("--batch", type=at_least(1), default=batch, help=f"prompts (default {batch})")
    g.add_argument("--prompt-len", type=at_least(1), default=prompt_len,
                   help=f"prompt tokens (default {prompt_len})")
    g.add_argument("--new-tokens", type=at_least(1), default=new_tokens,
                   help=f"decode steps (default {new_tokens})")
    g.add_argument("--page-size", type=at_least(1), default=16,
                   help="KV cache page size (default 16)")
    g.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="default: bf16 on a GPU, fp32 on the CPU")
    g.add_argument("--device", type=parse_device, default=None,
                   help="cpu, cuda or cuda:N (default: cuda if present)")


@dataclass
class Setup:
    """A built and bound decoder with the hub that serves it."""

    hub: Any
    model: Any
    table: Any
    device: torch.device
    dtype: torch.dtype
    simulated: bool


def build(args: argparse.Namespace) -> Setup:
    """Build the decoder from the flags and bind it with the policy (nothing runs yet). With
    ``--hardware`` the model is shapes only (meta device): a plan for a machine not here."""
    from ..core.device import DeviceInfo, library_versions
    from ..core.spec import torch_dtype
    from ..errors import AttnhubError
    from ..hub import Hub
    from ..models.decoder import Decoder, DecoderConfig

    hub = Hub(policy=args.policy, hardware=args.hardware)
    simulated = hub.device.simulated
    device = torch.device("meta" if simulated else
                          (args.device or ("cuda" if torch.cuda.is_available() else "cpu")))
    if device.type == "cpu" and hub.device.vendor != "cpu":  # --device cpu on a GPU machine
        hub.device = DeviceInfo(vendor="cpu", arch="cpu", name="CPU",
                                versions=library_versions())
    gpu = hub.device.vendor != "cpu"
    dtype = torch_dtype(args.dtype or ("bf16" if gpu else "fp32"))
    hq, hkv = args.heads
    try:
        cfg = DecoderConfig(num_layers=args.layers, num_q_heads=hq, num_kv_heads=hkv,
                            head_dim=args.head_dim, vocab_size=args.vocab,
                            intermediate=args.intermediate, layer_kinds=args.layer_kinds,
                            window=args.window, seed=args.seed)
    except ValueError as exc:  # sizes the flags' own checks let through
        raise AttnhubError(f"the decoder flags: {exc}") from None
    if not simulated:
        pages = -(-(args.prompt_len + args.new_tokens) // args.page_size)
        kv = 2 * cfg.num_layers * args.batch * pages * args.page_size * hkv * args.head_dim
        check_memory((cfg.parameter_count() + kv) * dtype.itemsize, device,
                     "the decoder's weights and KV cache", "pass smaller --layers, --heads, "
                     "--head-dim, --vocab, --intermediate, --batch, --prompt-len or "
                     "--new-tokens")
    model = Decoder(cfg, dtype=dtype, device=device)
    table = hub.bind(model, batch=args.batch, prompt_len=args.prompt_len,
                     max_len=args.prompt_len + args.new_tokens, dtype=dtype,
                     page_size=args.page_size)
    return Setup(hub, model, table, device, dtype, simulated)


def describe(args: argparse.Namespace, s: Setup) -> str:
    """One line of what is about to run: the sizes behind the binding table's buckets."""
    hq, hkv = args.heads
    window = f" (window {args.window})" if "sliding" in args.layer_kinds else ""
    where = f"{s.hub.device.arch} (simulated: plan only)" if s.simulated else s.device
    return (f"run: {str(s.dtype).removeprefix('torch.')} on {where}, {args.layers} "
            f"layer(s) of {','.join(args.layer_kinds)}{window}, heads {hq}:{hkv}, head dim "
            f"{args.head_dim}; {args.batch} prompt(s) of {args.prompt_len} tokens, then "
            f"{args.new_tokens} decode steps over a paged KV cache (page {args.page_size})")


def progress_bar(args: argparse.Namespace, desc: str,
                 total: int) -> Callable[[Iterable[int]], Iterable[int]] | None:
    """Wraps a loop in a new progress bar per call (``_common.progress``: none when piped,
    with --json or --no-progress), or None when there would be no bar."""
    if not wants_progress(args):
        return None

    def wrap(it: Iterable[int]) -> Iterable[int]:
        with progress(args, desc, total, unit="step") as bar:
            for i in it:
                yield i
                bar.update()

    return wrap
