"""``attnhub fp8-check``: FP8 attention against an fp32 reference, before a policy trusts it.

For each shape: random bf16 inputs, then the same inputs with a planted outlier at growing
magnitudes (a query channel scaled by M, the pattern the H200 anchor measured; and a key
channel offset by +M, the per-channel bias real keys carry), plus captured inputs from a
``.pt`` file when given. Each FP8 recipe the backend offers (plain per-(batch, KV head)
scaling, K smoothing) is compared with the fp32 reference next to BF16, reporting relative
(L2) and max error and, on a GPU, speed. The check passes when the gated recipe's relative
error stays within the budget on the random inputs, every outlier case up to
``--gate-magnitude`` and every captured input; the outcome is written to the profile store as
an accuracy record per spec bucket, which ``requires: {accuracy: ...}`` rules read.

``--kv`` checks an FP8 KV cache instead (default backend ``triton_decode_fp8``): the same
inputs' keys and values are written into an e4m3 ``PagedKVCache`` (page 16, or
``--page-size``: records are per page size, as the hub's buckets are) the way a server fills
it (a prefill chunk, then one token per step, so page descales grow and pages are
requantized), and the last query token (bf16) decodes against it; the BF16 column is a
BF16 backend over the unquantized cache. Its records are for the paged decode bucket.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..core.backend import safe_check
from ..policy.fp8_gate import OUTLIER_KINDS  # one list: lint reads the metrics it names
from ._common import (STORE_FAILED, add_hardware, add_json, at_least, checked_kind, list_of,
                      nonblank, print_json, progress, recorded, seed, table)


def parse_shape(text: str) -> tuple[int, ...]:
    """``"B,S,HQ,HKV,D"``: five positive ints, HQ a multiple of HKV."""
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 5 or min(shape) < 1 or shape[2] % shape[3]:
        raise argparse.ArgumentTypeError(f"{text!r}: use B,S,HQ,HKV,D, five positive integers "
                                         "with HQ a multiple of HKV (e.g. 1,4096,16,16,128)")
    return shape


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fp8-check", help="FP8 attention vs an fp32 reference (with planted "
                                         "outliers); records pass/fail in the profile store")
    p.add_argument("--shape", action="append", type=parse_shape, default=None,
                   metavar="B,S,HQ,HKV,D",
                   help="a shape to check (repeatable; default 1,4096,16,16,128)")
    p.add_argument("--causal", action="store_true", help="causal (bottom-right) mask")
    p.add_argument("--inputs", default=None, metavar="FILE.pt",
                   type=nonblank("file", "captured.pt", "random inputs only"),
                   help="captured inputs: a dict (or list of dicts) with q, k, v (B,S,H,D)")
    p.add_argument("--backend", default=None,
                   type=nonblank("backend", "fa3_fp8", "the default FP8 backend"),
                   help="the FP8 backend (default fa3_fp8; with --kv triton_decode_fp8)")
    p.add_argument("--kv", action="store_true",
                   help="check decode over an e4m3 paged KV cache (bf16 queries)")
    p.add_argument("--page-size", type=at_least(1), default=None,
                   help="--kv: the cache's page size, as the server pages it (default 16); "
                        "records are per page size")
    p.add_argument("--recipe", default=None,
                   type=nonblank("recipe", "smooth_k", "the backend's own"),
                   help="the recipe to gate (default: the backend's configured one)")
    p.add_argument("--magnitudes", type=list_of(at_least(0, float, strict=True)),
                   default=[1.0, 5.0, 20.0, 50.0],
                   help="outlier magnitudes to sweep (default 1,5,20,50)")
    p.add_argument("--channel", type=at_least(0), default=None,
                   help="the outlier channel, below D (default 7, or D-1 when D is smaller)")
    p.add_argument("--gate-magnitude", type=at_least(0, float), default=1.0,
                   help="outlier cases up to this magnitude must pass too (default 1: none)")
    p.add_argument("--budget", type=at_least(0, float, strict=True), default=None,
                   help="relative L2 error allowed (default: the backend's error budget)")
    p.add_argument("--emulate", action="store_true",
                   help="model the FP8 kernel's numerics where it cannot run (CPU)")
    p.add_argument("--time", action="store_true", help="also time each path (GPU)")
    p.add_argument("--store", default=None, metavar="PATH",
                   help="profile store file (default ATTNHUB_PROFILE or "
                        "~/.cache/attnhub/profile.json)")
    p.add_argument("--no-record", action="store_true", help="do not write accuracy records")
    p.add_argument("--seed", type=seed, default=0, help="inputs seed (default 0)")
    add_hardware(p, help="a simulated device (sm90, ...): only with --emulate --no-record, "
                         "the modelled numerics shown, nothing recorded for a device that "
                         "did not run")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_json(p)
    p.set_defaults(func=run)


@dataclass
class Case:
    """One set of inputs (random, an outlier at a magnitude, or captured)."""

    label: str
    kind: str
    magnitude: float
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    causal: bool
    kv: bool = False  # an FP8 KV cache decode case (see ``evaluate_kv``)
    page: int = 0  # its page size (the record's bucket has it)
    errors: dict[str, dict[str, float]] = field(default_factory=dict)
    ms: dict[str, float] = field(default_factory=dict)


def rel_max_error(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Relative L2 error (the headline number) and max absolute error."""
    diff = out.double() - ref.double()
    return {"rel": float(diff.norm() / ref.double().norm().clamp_min(1e-30)),
            "max": float(diff.abs().max())}


def plant(q: torch.Tensor, k: torch.Tensor, kind: str, magnitude: float,
          channel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A query channel scaled by M, or a key channel offset by +M (both heads-wide)."""
    q, k = q.clone(), k.clone()
    if kind == "q_channel":
        q[..., channel] *= magnitude
    else:
        k[..., channel] += magnitude
    return q, k


def synthetic_cases(shape: tuple[int, ...], causal: bool, magnitudes: list[float],
                    channel: int | None, device: torch.device, seed: int) -> list[Case]:
    b, s, hq, hkv, d = shape
    g = torch.Generator(device).manual_seed(seed)
    # drawn in fp32 (not the default dtype, whose draw of one seed differs), then cast
    q, k, v = (torch.randn(b, s, h, d, generator=g, dtype=torch.float32,
                           device=device).to(torch.bfloat16)
               for h in (hq, hkv, hkv))
    label = f"b={b} s={s} h={hq}:{hkv} d={d}"
    cases = [Case(label, "random", 1.0, q, k, v, causal)]
    for kind in OUTLIER_KINDS:
        for m in magnitudes:
            if m != 1.0:
                qo, ko = plant(q, k, kind, m, min(7, d - 1) if channel is None else channel)
                cases.append(Case(label, kind, m, qo, ko, v, causal))
    return cases


def captured_cases(path: str, device: torch.device) -> list[Case]:
    if checked_kind("--inputs", path) != "file":  # a FIFO would block the load forever
        raise SystemExit(f"attnhub fp8-check: --inputs {path}: not a regular file; pass a "
                         "file saved with torch.save")
    try:
        data = torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # noqa: BLE001  missing, unreadable, not a tensor file
        raise SystemExit(f"attnhub fp8-check: --inputs {path}: cannot load it ({exc})") from None
    items = data if isinstance(data, list) else [data]
    if not items:
        raise SystemExit(f"attnhub fp8-check: --inputs {path}: an empty list checks nothing; "
                         "save a dict (or a list of dicts) with q, k, v")
    cases = []
    for i, item in enumerate(items):
        try:
            raw = [item[n] for n in ("q", "k", "v")]
            if not all(isinstance(t, torch.Tensor) and t.is_floating_point() for t in raw):
                raise TypeError
            q, k, v = (t.to(torch.bfloat16) for t in raw)
        except (KeyError, TypeError, AttributeError, IndexError):
            raise SystemExit(f"attnhub fp8-check: {path}[{i}] needs keys q, k, v "
                             "(B, S, H, D floating tensors)") from None
        causal = item.get("causal", False)
        if not isinstance(causal, bool):
            raise SystemExit(f"attnhub fp8-check: --inputs {path}[{i}]: causal={causal!r}; "
                             "save true or false")
        why = _captured_shapes(q, k, v)
        if why:
            raise SystemExit(f"attnhub fp8-check: --inputs {path}[{i}]: {why}; save q, k, v "
                             "as (B, S, H, D) with k, v alike and query heads a multiple of "
                             "KV heads")
        cases.append(Case(f"{path}[{i}] {tuple(q.shape)}", "captured", 1.0, q, k, v, causal))
    return cases


def _captured_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """Why captured q, k, v cannot be one attention call, or "" (checked before any case
    runs: a mismatch failed deep in a backend with a traceback)."""
    shapes = f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
    if not q.dim() == k.dim() == v.dim() == 4:
        return f"{shapes}: each must have 4 dims"
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        return f"{shapes}: batch and head dim must agree, and k and v must match"
    if min(q.shape) < 1 or min(k.shape) < 1 or q.shape[2] % k.shape[2]:
        return f"{shapes}: every dim must be >= 1 and query heads a multiple of KV heads"
    return ""


def _spec(case: Case) -> Any:
    from ..core.spec import AttentionSpec, MaskSpec

    b, s, hq, d = case.q.shape
    if case.kv:  # what the hub builds for a one-token paged decode over an e4m3 cache
        return AttentionSpec(phase="decode", dtype="bf16", kv_dtype="fp8_e4m3", head_dim=d,
                             num_q_heads=hq, num_kv_heads=case.k.shape[2], layout="paged",
                             mask=MaskSpec(causal=case.causal), max_seqlen_q=1,
                             max_seqlen_k=case.k.shape[1], batch=b,
                             page_size=case.page).bucketed()
    return AttentionSpec(phase="prefill", dtype="bf16", head_dim=d, num_q_heads=hq,
                         num_kv_heads=case.k.shape[2], mask=MaskSpec(causal=case.causal),
                         max_seqlen_q=s, max_seqlen_k=case.k.shape[1], batch=b)


def evaluate(case: Case, fp8: Any, bf16: Any, recipes: tuple[str, ...], emulate: bool,
             timed: bool) -> None:
    """Fill ``case.errors`` (and ``case.ms``): bf16 and each FP8 recipe vs fp32."""
    from ..core.reference import reference_attention
    from ..core.spec import AttnParams

    spec = _spec(case)
    base = AttnParams(scale=1.0 / math.sqrt(case.q.shape[-1]), causal=case.causal,
                      max_seqlen_q=case.q.shape[1], max_seqlen_k=case.k.shape[1])
    ref, _ = reference_attention(case.q, case.k, case.v, base, compute_dtype=torch.float32)
    runs: dict[str, Any] = {"bf16": lambda: bf16.forward(case.q, case.k, case.v, spec, base)}
    for r in recipes:
        p = replace(base, extra={"fp8_recipe": r})
        call = fp8.emulate if emulate else fp8.forward
        runs[f"fp8 {r}"] = (lambda call=call, p=p: call(case.q, case.k, case.v, spec, p))
    for name, fn in runs.items():
        case.errors[name] = rel_max_error(fn().out, ref)
        if timed and case.q.is_cuda:
            from ..timing import median_ms

            case.ms[name] = median_ms(fn, case.q.device, warmup=3, repeats=10)


#: Default page size of the FP8 KV cache ``--kv`` builds, and how many tokens it appends
#: one by one.
KV_PAGE, KV_STEPS = 16, 8


def evaluate_kv(case: Case, fp8: Any, bf16: Any, timed: bool) -> None:
    """Fill ``case.errors``: the last query token over an e4m3 paged cache of ``case.k/v``
    (written as a prefill then single-token steps) vs fp32, beside BF16 over the originals."""
    from ..core.kvcache import PagedKVCache
    from ..core.reference import reference_attention
    from ..core.spec import AttnParams

    b, s, hkv, d = case.k.shape
    q = case.q[:, -1:]
    cache = PagedKVCache(num_layers=1, num_pages=b * -(-s // case.page), page_size=case.page,
                         num_kv_heads=hkv, head_dim=d, dtype=torch.float8_e4m3fn,
                         device=case.q.device)
    ids = [cache.allocate() for _ in range(b)]
    first = max(s - KV_STEPS, 0)
    for i, sid in enumerate(ids):
        cache.append(sid, [case.k[i, :first]], [case.v[i, :first]])
        for t in range(first, s):
            cache.append(sid, [case.k[i, t:t + 1]], [case.v[i, t:t + 1]])
    base = AttnParams(scale=1.0 / math.sqrt(d), causal=case.causal, max_seqlen_q=1,
                      max_seqlen_k=s)
    ref, _ = reference_attention(q, case.k, case.v, base, compute_dtype=torch.float32)
    paged = replace(base, block_table=cache.block_table(ids), seqlens_k=cache.seqlens(ids),
                    extra=cache.scales.descales(0))  # type: ignore[union-attr]
    bf16_spec = replace(_spec(case), kv_dtype="bf16", layout="bshd", page_size=0)
    runs = {"bf16": lambda: bf16.forward(q, case.k, case.v, bf16_spec, base),
            "fp8 default": lambda: fp8.forward(q, cache.k_cache(0), cache.v_cache(0),
                                               _spec(case), paged)}
    for name, fn in runs.items():
        case.errors[name] = rel_max_error(fn().out, ref)
        if timed and q.is_cuda:
            from ..timing import median_ms

            case.ms[name] = median_ms(fn, q.device, warmup=3, repeats=10)


def _bf16_backend(hub: Any, spec: Any) -> Any:
    """The BF16 baseline: fa3 where it can run, else torch SDPA (on the CPU for a simulated
    device, whose installs are not checked); one that fails to load is passed over, said."""
    names = ("torch_sdpa",) if hub.device.simulated else ("fa3", "torch_sdpa")
    why = []
    for name in names:
        if name not in hub.registry.backends:
            continue
        b = hub.registry.get(name)
        reasons = [] if hub.device.simulated else safe_check(b, spec, hub.device)
        try:
            if not reasons:
                b.load()
                return b
        except Exception as exc:  # noqa: BLE001  a plugin's import error, said below
            reasons = [f"{type(exc).__name__}: {exc}"]
        why.append(f"{name}: {reasons[0]}")
    raise SystemExit("attnhub fp8-check: no BF16 backend for the baseline ("
                     + "; ".join(why) + ")")


def run(args: argparse.Namespace) -> int:
    from ..core.registry import Registry
    from ..hub import Hub

    hub = Hub(hardware=args.hardware, registry=Registry.load())
    if hub.device.simulated and not (args.emulate and args.no_record):
        raise SystemExit(f"attnhub fp8-check: {hub.device.arch} is a simulated device (--hardware "
                         "or ATTNHUB_HARDWARE): the FP8 kernel runs on the real machine only, "
                         "and an emulation must not stand as that device's accuracy record; "
                         "run it there, or add --emulate --no-record to see the modelled "
                         "numerics here")
    args.backend = args.backend or ("triton_decode_fp8" if args.kv else "fa3_fp8")
    fp8 = hub.registry.get(args.backend)
    if not fp8.capabilities.fp8:  # its budget (None: exact) and record would mean nothing
        fp8s = sorted(n for n, b in hub.registry.backends.items() if b.capabilities.fp8)
        raise SystemExit(f"attnhub fp8-check: --backend {args.backend} computes in no FP8 "
                         f"dtype; name an FP8 backend ({', '.join(fp8s) or 'none installed'})")
    device = torch.device("cpu" if hub.device.simulated else hub.device.torch_device)
    shapes = args.shape or [(1, 4096, 16, 16, 128)]
    mags = args.magnitudes
    if args.channel is not None and args.channel >= min(s[4] for s in shapes):
        raise SystemExit(f"attnhub fp8-check: --channel {args.channel} is no channel of head "
                         f"dim {min(s[4] for s in shapes)}; pick one below it")
    cases = [c for i, s in enumerate(shapes)
             for c in synthetic_cases(s, args.causal, mags, args.channel, device, args.seed + i)]
    if args.inputs:
        cases += captured_cases(args.inputs, device)
    if args.kv:
        if args.emulate:
            raise SystemExit("attnhub fp8-check: --kv runs the kernel itself (on a CPU under "
                             "TRITON_INTERPRET=1); it has no --emulate")
        cases = [replace(c, kv=True, page=args.page_size or KV_PAGE) for c in cases]
    elif args.page_size is not None:
        raise SystemExit("attnhub fp8-check: --page-size is the FP8 KV cache's (--kv); a "
                         "prefill check has no pages")
    why = safe_check(fp8, _spec(cases[0]), hub.device)
    if why and not args.emulate:
        raise SystemExit(f"attnhub fp8-check: {args.backend} cannot run here: "
                         f"{'; '.join(why)} (use --emulate to model its numerics)")
    if args.emulate and not hasattr(fp8, "emulate"):
        raise SystemExit(f"attnhub fp8-check: {args.backend} has no emulation")
    if not args.emulate:
        fp8.load()
    recipes = tuple(getattr(fp8, "recipes", ("default",)))
    gated = args.recipe or getattr(fp8, "recipe", recipes[0])
    known = ("default",) if args.kv else recipes  # --kv runs the kernel's own recipe
    if gated not in known:
        raise SystemExit(f"attnhub fp8-check: --recipe {gated!r} is not one of {args.backend}'s "
                         f"recipes here ({', '.join(known)})")
    budget = args.budget if args.budget is not None else fp8.capabilities.error_budget
    bf16 = _bf16_backend(hub, replace(_spec(cases[0]), kv_dtype="bf16", layout="bshd",
                                      page_size=0) if args.kv else _spec(cases[0]))
    bar = progress(args, "fp8-check", len(cases), unit="case")
    for c in cases:
        if c.kv:
            evaluate_kv(c, fp8, bf16, args.time)
        else:
            evaluate(c, fp8, bf16, recipes, args.emulate, args.time)
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    verdicts = _verdicts(cases, f"fp8 {gated}", budget, args.gate_magnitude)
    rc = _report(args, hub, cases, verdicts, gated, budget)
    if args.no_record:
        return rc
    # after the report: a store that cannot be written loses none of the results
    from ..policy.profile import default_profile_path

    done = recorded("fp8-check", args.store or default_profile_path(), lambda: _record(
        args, hub.device, cases, verdicts, args.backend, gated, budget,
        hub.registry.provider_text(fp8.plugin)), "--no-record")
    return rc if done else STORE_FAILED


def _gates(case: Case, gate_magnitude: float) -> bool:
    return case.kind in ("random", "captured") or case.magnitude <= gate_magnitude


def _verdicts(cases: list[Case], path: str, budget: float,
              gate_magnitude: float) -> dict[str, dict[str, Any]]:
    """Per shape label: passed, and the metrics the accuracy record carries."""
    out: dict[str, dict[str, Any]] = {}
    for c in cases:
        v = out.setdefault(c.label, {"passed": True, "metrics": {}, "case": c})
        m = v["metrics"]
        err = c.errors[path]
        tag = "" if c.kind in ("random", "captured") else f"_{c.kind}_x{c.magnitude:g}"
        m[f"rel_error{tag}"] = _worst(m.get(f"rel_error{tag}", 0.0), err["rel"])
        m[f"max_error{tag}"] = _worst(m.get(f"max_error{tag}", 0.0), err["max"])
        if c.kind == "random":
            m["bf16_rel_error"] = c.errors["bf16"]["rel"]
        if _gates(c, gate_magnitude):
            v["passed"] = v["passed"] and err["rel"] <= budget
    return out


def _worst(a: float, b: float) -> float:
    """The larger error, NaN if either is NaN (``max(0.0, nan)`` is 0.0: a NaN error would
    read as exact)."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _record(args: argparse.Namespace, device: Any, cases: list[Case],
            verdicts: dict[str, dict[str, Any]], backend: str, recipe: str,
            budget: float, provider: str = "?") -> None:
    from ..policy.fp8_gate import reference as fp8_reference
    from ..policy.profile import ProfileStore

    store = ProfileStore(args.store)
    ref = fp8_reference(args.emulate, recipe, provider)
    with store.batch():  # every case, or none
        for spec, passed, found in per_bucket(verdicts):
            # the store holds finite numbers (a NaN error fails the case, and the report
            # shows it)
            metrics = {k: x for k, x in dict(found, budget=budget).items()
                       if math.isfinite(x)}
            store.record_accuracy(device, spec, backend, passed, metrics, reference=ref)


def per_bucket(verdicts: dict[str, dict[str, Any]]) -> list[tuple[Any, bool, dict[str, float]]]:
    """``(spec, passed, metrics)`` per profile-store bucket: shapes of one bucket (lengths
    40 and 48, a captured input beside a ``--shape``) share one record, which passes only
    when every one of them passed and holds the worst of each metric; written one by one,
    the last shape's verdict replaced a failing one's."""
    from ..policy.profile import _acc_key

    out: dict[str, tuple[Any, bool, dict[str, float]]] = {}
    for v in verdicts.values():
        spec = _spec(v["case"])
        key = _acc_key(spec)  # the store's own key: a spec's bucket, or a label as itself
        first, passed, metrics = out.get(key, (spec, True, {}))
        for name, x in v["metrics"].items():
            metrics[name] = _worst(metrics[name], x) if name in metrics else x
        out[key] = (first, passed and v["passed"], metrics)
    return list(out.values())


def _report(args: argparse.Namespace, hub: Any, cases: list[Case],
            verdicts: dict[str, dict[str, Any]], gated: str, budget: float) -> int:
    passed = all(v["passed"] for v in verdicts.values())
    if args.json:
        print_json({
            "device": hub.device.describe(), "backend": args.backend, "recipe": gated,
            "budget": budget, "emulated": args.emulate, "passed": passed,
            "shapes": {k: {"passed": v["passed"], "metrics": v["metrics"]}
                       for k, v in verdicts.items()},
            "cases": [{"shape": c.label, "kind": c.kind, "magnitude": c.magnitude,
                       "errors": c.errors, "ms": c.ms} for c in cases]})
        return 0 if passed else 1
    paths = list(cases[0].errors)
    rows = [(c.label, c.kind, f"{c.magnitude:g}",
             *(f"{c.errors[p]['rel']:.4f} / {c.errors[p]['max']:.3f}"
               + (f" ({c.ms[p]:.3f} ms)" if p in c.ms else "") for p in paths))
            for c in cases]
    print(f"{args.backend} on {hub.device.describe()}"
          f"{' (emulated)' if args.emulate else ''}: relative L2 / max error vs fp32")
    print(table(rows, ("shape", "inputs", "M", *paths)))
    for label, v in verdicts.items():
        print(f"{label}: {'PASS' if v['passed'] else 'FAIL'} (fp8 {gated}, relative error "
              f"{v['metrics']['rel_error']:.4f}, budget {budget})")
    return 0 if passed else 1
