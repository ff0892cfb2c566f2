"""``attnhub explain``: the decision record for one call shape, here or on simulated hardware.

``--json`` prints schema ``attnhub.explain/1`` (documented in docs/policy.md); ``--trace``
adds each rule tried and the ``when`` key that failed; ``--run`` executes the binding once on
this machine through a Hub and reports run-time fallbacks (``Hub.fallback_counts``).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch

from ..core.backend import safe_available
from ..core.contract import bounding_window
from ..core.decision import BindContext
from ..core.masking import window_within
from ..core.registry import Registry
from ..core.spec import (DTYPES, LAYOUTS, MASK_KINDS, PHASES, AttentionSpec, bucket,
                         torch_dtype)
from ..errors import AttnhubError
from ..hub import Hub
from ..policy.cells import mask_from_kinds
from ..core.memory import check_memory
from ._common import (MAX_BATCH, MAX_HEAD_DIM, MAX_LENGTH, MAX_WORLD_SIZE, add_hardware,
                      add_json, at_least, name_list, nonblank, print_json)
from ._decoder import parse_heads
from ._policy_common import add_policy, devices, load
from .doctor import forced_backend, forced_problem

SCHEMA = "attnhub.explain/1"
#: A note on ATTNHUB_BACKEND: explain said nothing of it, although every call in its
#: environment bypasses the decision it shows.
_FORCED = ("ATTNHUB_BACKEND={0} forces every attention call in this environment onto {0}; "
           "this decision is the policy's (unset the variable to follow it)")


#: The sizing flags, bounded: a 20-digit value is a typo, not a call anyone can make.
_HEAD_DIM = at_least(1, high=MAX_HEAD_DIM, why="past any kernel: they take at most 1024")
_LENGTH = at_least(1, high=MAX_LENGTH, why="lengths are int32, as cu_seqlens hold them")
_WINDOW = at_least(0, high=MAX_LENGTH, why="lengths are int32, as cu_seqlens hold them")
_LAYER = at_least(0, high=MAX_LENGTH, why="a layer index is an int32")
_BATCH = at_least(1, high=MAX_BATCH, why="sequences in one call")
_WORLD_SIZE = at_least(1, high=MAX_WORLD_SIZE, why="context-parallel ranks")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explain", help="why a backend is chosen for a call shape (and why "
                                       "every other candidate is not)")
    add_policy(p)
    add_hardware(p)
    p.add_argument("--phase", choices=PHASES, default="prefill", help="default prefill")
    p.add_argument("--dtype", choices=DTYPES, default="bf16",
                   help="query dtype: fp32, fp16 or bf16 (default bf16)")
    p.add_argument("--kv-dtype", choices=DTYPES, help="KV dtype (default: --dtype)")
    p.add_argument("--head-dim", type=_HEAD_DIM, default=128, help="default 128")
    p.add_argument("--head-dim-v", type=_HEAD_DIM, help="value head dim (default: --head-dim)")
    p.add_argument("--heads", type=parse_heads, default=(32, 32), metavar="Q:KV",
                   help="query:KV heads (default 32:32)")
    p.add_argument("--seqlen", type=_LENGTH, default=4096, help="KV length (and query length "
                                                            "outside decode)")
    p.add_argument("--seqlen-q", type=_LENGTH, help="query length (default: 1 for decode, else "
                                                "--seqlen)")
    p.add_argument("--batch", type=_BATCH, default=1, help="default 1")
    p.add_argument("--mask", default="none", type=name_list("mask kind", "causal", "no mask"),
                   help=f"comma-separated kinds: {', '.join(MASK_KINDS)}")
    p.add_argument("--window", type=_WINDOW, help="left window for sliding_window "
                                                        "(default 1024)")
    p.add_argument("--top-left", action="store_true", help="top-left causal alignment")
    p.add_argument("--layout", choices=[x for x in LAYOUTS if x != "bhsd"],
                   help="default: thd with a document mask, else bshd")
    p.add_argument("--page-size", type=_LENGTH,
                   help="KV page size for --layout paged (default 16)")
    p.add_argument("--grad", action="store_true", help="gradients needed (default for train)")
    p.add_argument("--deterministic", action="store_true",
                   help="bitwise-reproducible forward (and backward with --grad)")
    p.add_argument("--return-lse", action="store_true", help="the call asks for the LSE")
    p.add_argument("--dropout", type=at_least(0, float), default=0.0, metavar="P",
                   help="attention dropout probability in [0, 1) (training with "
                        "attention_dropout > 0; default 0)")
    g = p.add_argument_group("bind context")
    g.add_argument("--model", type=nonblank("model", "llama-3-8b", "no model"),
                   help="model name, for `when: {model: ...}` rules")
    g.add_argument("--layer", type=_LAYER, help="layer index, for `when: {layer: ...}`")
    g.add_argument("--layer-kind", default="softmax", type=_layer_kind,
                   help="softmax (default), sliding, linear, gla, ... for `layer: {kind: ...}`")
    g.add_argument("--world-size", type=_WORLD_SIZE, default=1,
                   help="context-parallel ranks (default 1; >= 2 for ring rules)")
    p.add_argument("--trace", action="store_true", help="list each rule tried and why it did "
                                                        "not match")
    p.add_argument("--run", action="store_true", help="run the binding once on this machine "
                                                      "and report run-time fallbacks")
    add_json(p)
    p.set_defaults(func=run)


#: Query dtypes the API takes (contract.check_qkv); only an FP8 KV cache may differ.
_Q_DTYPES = ("fp32", "fp16", "bf16")


def _check_dtypes(args: argparse.Namespace) -> None:
    """Refuse dtype pairs the API refuses, so explain never shows a binding for a call that
    cannot be made (an FP8 query, or a KV dtype other than the query's that is not FP8)."""
    if args.dtype not in _Q_DTYPES:
        raise AttnhubError(f"--dtype {args.dtype}: attention takes {', '.join(_Q_DTYPES)} "
                           f"queries; for an FP8 KV cache pass --dtype bf16 --kv-dtype "
                           f"{args.dtype}")
    kv = args.kv_dtype or args.dtype
    if kv != args.dtype and not kv.startswith("fp8"):
        raise AttnhubError(f"--kv-dtype {kv} with --dtype {args.dtype}: k/v must have the "
                           "query's dtype (only an FP8 KV cache may differ); drop --kv-dtype "
                           "or pass an fp8 one")


def spec_from_args(args: argparse.Namespace) -> AttentionSpec:
    _check_dtypes(args)
    if args.dropout >= 1:
        raise AttnhubError(f"--dropout {args.dropout:g}: a probability below 1 (1 would zero "
                           "every output); e.g. --dropout 0.1")
    kinds = [k.strip() for k in args.mask.split(",") if k.strip()]
    if args.window is not None and "sliding_window" not in kinds:
        raise AttnhubError(f"--window {args.window} is read only with --mask sliding_window "
                           f"(the mask here is {args.mask!r}); add sliding_window to --mask or "
                           "drop --window")
    try:
        mask = mask_from_kinds(kinds, 1024 if args.window is None else args.window)
    except ValueError as exc:
        raise AttnhubError(f"--mask: {exc}") from None
    if args.top_left:
        if not (mask.causal or mask.window):
            raise AttnhubError(f"--top-left aligns a causal or sliding-window mask (the mask "
                               f"here is {args.mask!r}); add causal to --mask or drop it")
        mask = dataclasses.replace(mask, alignment="top_left")
    layout = args.layout or ("thd" if mask.document else "bshd")
    if args.page_size is not None and layout != "paged":
        raise AttnhubError(f"--page-size {args.page_size} is read only with --layout paged "
                           f"(the layout here is {layout}); add --layout paged or drop it")
    sq = _seqlen_q(args)
    if mask.window is not None:
        # as the call's check normalises it (contract.check_call): an edge past every key of
        # the lengths' bucket is unbounded, and a causal window unbounded on the left is no
        # window; explain showed a sliding-window rule where the hub ran another one
        mask = dataclasses.replace(mask, window=bounding_window(
            window_within(mask.window, bucket(max(sq, args.seqlen, 1))), mask.causal,
            mask.prefix_lm))
    extra = {"page_size": args.page_size or 16} if layout == "paged" else {}
    return AttentionSpec(
        phase=args.phase, dtype=args.dtype, kv_dtype=args.kv_dtype, head_dim=args.head_dim,
        head_dim_v=args.head_dim_v, num_q_heads=args.heads[0], num_kv_heads=args.heads[1],
        layout=layout, mask=mask, max_seqlen_q=sq, max_seqlen_k=args.seqlen, batch=args.batch,
        needs_grad=args.grad or args.phase == "train", deterministic=args.deterministic,
        return_lse=args.return_lse, dropout=args.dropout > 0, **extra).bucketed()


def _forced_note(registry: Registry, device: Any) -> str | None:
    """The note on ATTNHUB_BACKEND, or None when unset: on this (real, not simulated) device a
    forced backend that cannot run makes every call raise, which doctor says; explain said
    every call was "forced onto" it."""
    name = forced_backend()
    if not name:
        return None
    usable = reasons = None
    if not device.simulated and name in registry.backends:
        reasons = safe_available(registry.backends[name], device)
        usable = [] if reasons else [name]
    return forced_problem(registry, usable, reasons) or _FORCED.format(name)


def _seqlen_q(args: argparse.Namespace) -> int:
    return args.seqlen_q or (1 if args.phase == "decode" else args.seqlen)


def run(args: argparse.Namespace) -> int:
    policy, registry = load(args)
    device = devices(args.hardware)[0]
    spec = spec_from_args(args)
    ctx = BindContext(model=args.model, layer=args.layer, layer_kind=args.layer_kind,
                      world_size=args.world_size)
    decision = policy.resolve(spec, device, registry, ctx)
    trace = [{"rule": lr.rule.name, "location": lr.location, "failed": failed}
             for lr, failed in policy.trace(spec, device, ctx)] if args.trace else None
    ran = _run_once(policy, registry, spec, ctx, args) if args.run else None
    forced = _forced_note(registry, device)
    if args.json:
        record = decision.to_json()
        record["notes"] += [forced] if forced else []
        print_json({"schema": SCHEMA,
                    "policy": {"name": policy.name, "files": list(policy.data.files)},
                    "device": {"arch": device.arch, "vendor": device.vendor, "name": device.name,
                               "simulated": device.simulated},
                    "decision": record, "trace": trace, "run": ran})
        return 0 if decision.backend else 1
    print(f"policy:  {policy.name} ({' <- '.join(policy.data.files)})")
    print(decision.explain())
    if forced:
        print(f"  note: {forced}")
    for t in trace or []:
        state = "matched" if t["failed"] is None else f"no match on `{t['failed']}`"
        print(f"  tried {t['rule']} ({t['location']}): {state}")
    if ran is not None:
        counts = ", ".join(f"{a} -> {b} x{n}" for a, b, n in ran["fallbacks"]) or "none"
        why = f" ({ran['why']})" if ran["why"] else ""
        print(f"run:     {ran['backend']} ran on {ran['device']}{why}; fallbacks: {counts}")
    return 0 if decision.backend else 1


def _run_once(policy: Any, registry: Any, spec: AttentionSpec, ctx: BindContext,
              args: argparse.Namespace) -> dict[str, Any]:
    """Call attention once with random inputs of ``spec`` through a Hub on this machine."""
    if args.hardware:
        raise AttnhubError("--run executes on this machine; drop --hardware")
    supported = {"none", "causal", "sliding_window", "alibi", "softcap"}
    if not spec.mask.kinds <= supported or spec.layout != "bshd":
        raise AttnhubError(f"--run supports layout bshd with masks {', '.join(sorted(supported))}"
                           f"; got {spec.layout} {spec.mask.describe()}")
    hub = Hub(policy=policy, registry=registry)
    dev = hub.device.torch_device
    dt = torch_dtype(spec.dtype)
    sq, dv = _seqlen_q(args), spec.head_dim_v or spec.head_dim
    sizes = [args.batch * sq * spec.num_q_heads * spec.head_dim,
             args.batch * args.seqlen * spec.num_kv_heads * spec.head_dim,
             args.batch * args.seqlen * spec.num_kv_heads * dv,
             args.batch * sq * spec.num_q_heads * dv]  # q, k, v, out (and grads when trained)
    check_memory(sum(sizes) * dt.itemsize * (2 if spec.needs_grad else 1) + max(sizes) * 4,
                 torch.device(dev), "--run's inputs and output",
                 "pass a smaller --seqlen, --seqlen-q, --batch or --heads")
    # drawn in fp32 and cast: torch has no random kernels for FP8 (a KV cache may be FP8)
    q = torch.randn(args.batch, _seqlen_q(args), spec.num_q_heads, spec.head_dim,
                    dtype=torch.float32, device=dev).to(dt)
    k, v = (torch.randn(args.batch, args.seqlen, spec.num_kv_heads, d, dtype=torch.float32,
                        device=dev)
            .to(torch_dtype(spec.kv_dtype or spec.dtype))
            for d in (spec.head_dim, spec.head_dim_v or spec.head_dim))
    m = spec.mask
    slopes = torch.rand(spec.num_q_heads, dtype=torch.float32, device=dev) if m.alibi else None
    with torch.set_grad_enabled(spec.needs_grad):
        if spec.needs_grad:
            q.requires_grad_(True)
        hub.attention(q, k, v, causal=m.causal, window=m.window, alibi_slopes=slopes,
                      softcap=30.0 if m.softcap else None, phase=spec.phase, context=ctx,
                      deterministic=spec.deterministic, causal_alignment=m.alignment,
                      return_lse=spec.return_lse, dropout_p=args.dropout)
    bound = hub.bound()[-1].decision
    ran = ran_backend(bound.backend, hub.fallback_counts)
    why = []
    if bound.rule == "forced":
        why.append(f"forced by ATTNHUB_BACKEND={hub.forced_backend}" if hub.forced_backend
                   else "forced")
    if bound.backend != (policy_choice := policy.resolve(spec, hub.device, registry,
                                                         ctx).backend):
        why.append(f"the policy chose {policy_choice}")
    if ran != bound.backend:
        why.append(f"{bound.backend} failed at run time and {ran} served as its fallback")
    return {"backend": ran, "bound": bound.backend, "policy_choice": policy_choice,
            "forced": bound.rule == "forced", "why": "; ".join(why),
            "device": hub.device.describe(),
            "fallbacks": [[a, b, n] for (a, b), n in sorted(hub.fallback_counts.items())]}


def ran_backend(bound: str | None, counts: Any) -> str | None:
    """The backend that produced the output of one call: the bound one, or the end of the
    run-time fallback chain it started (``Hub.fallback_counts``)."""
    ran, seen = bound, set()
    while ran is not None and ran not in seen:
        seen.add(ran)
        nxt = [b for (a, b), n in counts.items() if a == ran and n]
        if not nxt:
            break
        ran = nxt[0]
    return ran


def _layer_kind(text: str) -> str:
    """``--layer-kind``: not blank, and a name a policy's ``layer: {kind: ...}`` can write
    (an ASCII identifier: ``"x y"`` or a line break was explained as a kind no rule names)."""
    from ..policy.schema import _identifier

    nonblank("layer kind", "sliding", "softmax")(text)
    try:
        return str(_identifier(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc}; a policy's `layer: {{kind: ...}}` names "
                                         "only such kinds") from None
