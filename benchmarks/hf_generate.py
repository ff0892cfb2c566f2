"""``generate()`` of a transformers model with ``attn_implementation="attnhub"`` vs ``"sdpa"``.

A Llama-style model (about 1.1B parameters: 22 layers, hidden 2048, 32 query / 8 KV heads of
64) with random weights (no download), bf16, on one GPU. Per cell (batch x prompt length) and
per implementation, the same weights and inputs:

* prefill tokens/s: one forward over the prompt with a fresh DynamicCache, through the public
  ``model(...)`` call (host time included), median of ``--repeats``;
* decode tokens/s: ``generate()`` of ``1 + N`` new tokens minus ``generate()`` of 1 token, over
  ``batch * N`` tokens (greedy, DynamicCache, every step a real decode call);
* first-step agreement: max |logits(attnhub) - logits(sdpa)| at the last prompt position,
  beside the bf16 noise floor max |logits(sdpa, bf16) - logits(fp32 weights)| of the same
  input; ``within_noise`` when the first is at most twice the second (FlashAttention's rule).

Cells: batch 8 x 2k prompt and batch 1 x 16k prompt (the shapes of issue 13). It prints each
step as it goes, starts no work after ``--budget-s`` (default 150 s; what was not started is
listed as skipped), rewrites ``hf_generate.json`` and ``hf_generate.md`` (a table with date,
GPU, commit and library versions) under ``--out`` after every cell, and a watchdog ends the
process with exit code 124 at ``--hard-timeout-s`` (default twice the budget) if a call hangs.

    python benchmarks/hf_generate.py --out docs/benchmarks            # the H200 run
    python benchmarks/hf_generate.py --device cpu --tiny --out /tmp/x  # a dry run (seconds)

Needs no network: weights are random, the attnhub plugins are whatever is installed (set
ATTNHUB_PLUGIN_MODULES as benchmarks/gpu_session.sh does).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from attnhub.timing import source_commit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

IMPLS = ("sdpa", "attnhub")


def big_config() -> Any:
    """TinyLlama-1.1B's layers (22, hidden 2048, MLP 5632, head dim 64) with 32 query / 8 KV
    heads and a 32k vocabulary: 1.12B parameters."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
        rope_theta=10000.0, tie_word_embeddings=False)


def tiny_config() -> Any:
    import transformers

    return transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def log(msg: str) -> None:
    print(f"[hf_generate {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Budget:
    """Wall-clock budget: work not started before the deadline is skipped and reported."""

    def __init__(self, seconds: float):
        self.start = time.perf_counter()
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> tuple[float, Any]:
    """(median seconds over ``repeats`` runs after one warm-up, last result); host clock
    around a synchronised region, so host work is included."""
    out = fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def build_model(cfg: Any, dtype: torch.dtype, device: torch.device) -> Any:
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(cfg)
    return model.to(dtype).eval()


def run_cell(model: Any, batch: int, prompt: int, new_tokens: int, repeats: int,
             device: torch.device, budget: Budget) -> dict[str, Any]:
    """Both implementations on one (batch, prompt) cell, same weights and inputs."""
    gen = torch.Generator().manual_seed(batch * 100003 + prompt)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (batch, prompt), generator=gen).to(device)
    mask = torch.ones_like(ids)
    row: dict[str, Any] = {"batch": batch, "prompt": prompt, "new_tokens": new_tokens}
    last: dict[str, torch.Tensor] = {}
    tokens: dict[str, torch.Tensor] = {}
    for impl in IMPLS:
        if budget.left() <= 0:
            row[impl] = {"skipped": "budget spent"}
            continue
        model.set_attn_implementation(impl)
        log(f"  {impl}: prefill {batch} x {prompt}")

        def prefill() -> torch.Tensor:
            with torch.no_grad():
                return model(ids, attention_mask=mask, use_cache=True,
                             logits_to_keep=1).logits[:, -1].float()

        t_prefill, logits = timed(prefill, device, repeats)
        last[impl] = logits
        kw = {"attention_mask": mask, "do_sample": False, "pad_token_id": 0}

        def generate(n: int) -> torch.Tensor:
            with torch.no_grad():
                return model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)

        log(f"  {impl}: generate 1 and {1 + new_tokens} tokens")
        t_one, _ = timed(lambda: generate(1), device, repeats)
        t_many, out = timed(lambda: generate(1 + new_tokens), device, repeats)
        tokens[impl] = out[:, prompt:]
        decode_s = max(t_many - t_one, 1e-9)
        row[impl] = {"prefill_s": t_prefill, "prefill_tok_s": batch * prompt / t_prefill,
                     "decode_s": decode_s, "decode_tok_s": batch * new_tokens / decode_s,
                     "decode_ms_per_step": 1e3 * decode_s / new_tokens}
        log(f"  {impl}: prefill {row[impl]['prefill_tok_s']:.0f} tok/s, decode "
            f"{row[impl]['decode_tok_s']:.1f} tok/s")
    if len(last) == 2:
        row["agreement"] = agreement(model, ids, mask, last, device)
        row["agreement"]["greedy_tokens_equal"] = float(
            (tokens["sdpa"] == tokens["attnhub"]).float().mean())
        for key in ("prefill_tok_s", "decode_tok_s"):
            row[f"speedup_{key}"] = row["attnhub"][key] / row["sdpa"][key]
    return row


def agreement(model: Any, ids: torch.Tensor, mask: torch.Tensor,
              last: dict[str, torch.Tensor], device: torch.device) -> dict[str, Any]:
    """max |attnhub - sdpa| at the first generated position, and the bf16 noise floor: the
    same logits of sdpa against fp32 weights and activations."""
    diff = float((last["attnhub"] - last["sdpa"]).abs().max())
    noise = None  # fp32 runs have no lower-precision noise to compare with
    if next(model.parameters()).dtype != torch.float32:
        dtype = next(model.parameters()).dtype
        model.set_attn_implementation("sdpa")
        model.float()
        try:
            with torch.no_grad():
                ref = model(ids, attention_mask=mask, logits_to_keep=1).logits[:, -1].float()
            noise = float((last["sdpa"] - ref).abs().max())
        finally:
            model.to(dtype)
    return {"max_abs_diff": diff, "bf16_noise": noise,
            "logit_absmax": float(last["sdpa"].abs().max()),
            "within_noise": bool(diff <= 2 * noise) if noise is not None else diff < 1e-4}


def markdown(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = [
        f"# generate(): attn_implementation='attnhub' vs 'sdpa' ({meta['model']})", "",
        f"{meta['date']}, {meta['device']}, commit {meta['commit']}, torch {meta['torch']}, "
        f"transformers {meta['transformers']}, {meta['dtype']}, random weights. Prefill: one "
        "forward over the prompt (DynamicCache); decode: generate(1+N) - generate(1), greedy; "
        "medians, host time included. Agreement: max |logit diff| at the first generated "
        "position vs the bf16 noise floor (sdpa bf16 vs fp32 weights).", "",
        "| batch x prompt | impl | prefill tok/s | decode tok/s | decode ms/step | "
        "speedup prefill / decode | max logit diff (noise) | greedy tokens equal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["cells"]:
        cell = f"{row['batch']} x {row['prompt']}"
        agree = row.get("agreement", {})
        for impl in IMPLS:
            r = row.get(impl, {})
            if "skipped" in r or not r:
                lines.append(f"| {cell} | {impl} | skipped: {r.get('skipped', '-')} | | | | | |")
                continue
            speed = (f"{row['speedup_prefill_tok_s']:.2f}x / {row['speedup_decode_tok_s']:.2f}x"
                     if impl == "attnhub" and "speedup_prefill_tok_s" in row else "")
            noise = agree.get("bf16_noise")
            ag = (f"{agree['max_abs_diff']:.3g} ({'-' if noise is None else f'{noise:.3g}'})"
                  f"{'' if agree['within_noise'] else ' **outside noise**'}"
                  if impl == "attnhub" and agree else "")
            eq = f"{agree['greedy_tokens_equal']:.0%}" if impl == "attnhub" and agree else ""
            lines.append(f"| {cell} | {impl} | {r['prefill_tok_s']:.0f} | "
                         f"{r['decode_tok_s']:.1f} | {r['decode_ms_per_step']:.2f} | {speed} | "
                         f"{ag} | {eq} |")
    for note in result.get("notes", []):
        lines += ["", f"- {note}"]
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny model and shapes (a dry run)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="default: bf16 on GPUs, fp32 with --tiny on the CPU")
    p.add_argument("--cells", default=None,
                   help="comma list of BxS (default 8x2048,1x16384; --tiny: 2x16,1x40)")
    p.add_argument("--new-tokens", type=int, default=None, help="decode steps (default 32)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget-s", type=float, default=150.0)
    p.add_argument("--hard-timeout-s", type=float, default=None)
    p.add_argument("--out", default="docs/benchmarks")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("hf_generate: --device cuda but no GPU; use --device cpu --tiny")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("fp32" if device.type == "cpu" else "bf16")]
    cells = args.cells or ("2x16,1x40" if args.tiny else "8x2048,1x16384")
    shapes = [tuple(int(x) for x in c.lower().split("x")) for c in cells.split(",")]
    new_tokens = args.new_tokens or (4 if args.tiny else 32)
    budget = Budget(args.budget_s)
    timer = watchdog(args.hard_timeout_s or 2 * args.budget_s)
    try:
        return _run(args, device, dtype, shapes, new_tokens, budget)
    finally:  # a caller in this process (the tests) outlives main: never leave it armed
        timer.cancel()


def _run(args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
         shapes: list[tuple[int, ...]], new_tokens: int, budget: Budget) -> dict[str, Any]:
    import transformers

    from attnhub import Hub
    from attnhub.integrations.transformers import register

    register(Hub())
    cfg = tiny_config() if args.tiny else big_config()
    log(f"building {'tiny' if args.tiny else '1.1B'} Llama ({dtype}) on {device}")
    model = build_model(cfg, dtype, device)
    params = sum(p.numel() for p in model.parameters())
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else platform.processor() or "CPU")
    result: dict[str, Any] = {
        "meta": {"date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                 "device": name, "commit": source_commit(ROOT), "torch": torch.__version__,
                 "transformers": transformers.__version__, "dtype": str(dtype).split(".")[-1],
                 "model": f"Llama-style {params / 1e9:.2f}B params, random init",
                 "new_tokens": new_tokens, "repeats": args.repeats},
        "cells": [], "notes": []}
    for batch, prompt in shapes:
        if budget.left() <= 0:
            result["notes"].append(f"cell {batch} x {prompt} skipped: --budget-s "
                                   f"{args.budget_s:.0f} spent")
            continue
        log(f"cell {batch} x {prompt} ({budget.left():.0f} s of budget left)")
        try:
            result["cells"].append(run_cell(model, batch, prompt, new_tokens, args.repeats,
                                            device, budget))
        except torch.cuda.OutOfMemoryError as exc:  # report the cell, keep the others
            result["notes"].append(f"cell {batch} x {prompt}: out of memory ({exc})"[:300])
            torch.cuda.empty_cache()
        write(result, Path(args.out))
    write(result, Path(args.out))
    print(markdown(result), flush=True)
    log(f"wrote {Path(args.out) / 'hf_generate.json'} and .md")
    return result


def write(result: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "hf_generate.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "hf_generate.md").write_text(markdown(result))


def watchdog(seconds: float) -> threading.Timer:
    """End the process (exit 124) if it is still running after ``seconds``: the results of
    the cells finished so far are already on disk. The caller cancels the timer it gets."""
    def fire() -> None:
        log(f"hard timeout after {seconds:.0f} s: exiting; finished cells are on disk")
        os._exit(124)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


if __name__ == "__main__":
    main()
