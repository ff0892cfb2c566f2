"""Every causal-LM model type of the installed transformers, tiny random config, under
``attn_implementation="attnhub"`` against eager: logits of a left-padded batch (valid
positions), greedy generate() from it, and with ``--train`` the gradients of a right-padded
loss. Each family ends as one of: ok, MISMATCH / GEN_MISMATCH / TRAIN_MISMATCH (attnhub and
eager disagree: a bug), refused (at build, with the reason), refused_call (at the first
call, with the reason), not_judged (the generic tiny config does not build or eager fails on
it), timeout.

Families run in worker processes of a few each (a default config too large for this machine
kills its worker, not the sweep; those run again alone).

    python benchmarks/hf_family_sweep.py [--only gpt_oss qwen3_next ...] [--train]
        [--workers 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BAD = ("MISMATCH", "GEN_MISMATCH", "TRAIN_MISMATCH")


def judge(model_type: str, train: bool) -> tuple[str, str]:
    """(status, detail) of one family; runs in a worker."""
    import torch
    import transformers as t

    from attnhub import InputError
    from attnhub.integrations.transformers.testing import padded, sharpened, tiny_config

    cfg = tiny_config(model_type)
    if cfg is None:
        return "not_judged", "no such config"
    try:
        ours, twin = sharpened(cfg, t.AutoModelForCausalLM, factor=4.0)
    except InputError as e:
        return "refused", str(e)[:200]
    except Exception as e:  # noqa: BLE001 - the generic tiny config does not fit it
        return "not_judged", f"build: {type(e).__name__}: {str(e)[:150]}"
    except MemoryError:
        return "not_judged", "build: out of memory (a default config too large to be tiny)"
    ids, mask = padded(torch.Generator().manual_seed(0), (9, 6), 99, side="left")
    keep = mask.bool()
    try:
        with torch.no_grad():
            want = twin(input_ids=ids, attention_mask=mask).logits
    except Exception as e:  # noqa: BLE001
        return "not_judged", f"eager: {type(e).__name__}: {str(e)[:150]}"
    try:
        with torch.no_grad():
            got = ours(input_ids=ids, attention_mask=mask).logits
        err = float((got.float() - want.float())[keep].abs().max())
        scale = float(want.float()[keep].abs().max())
        if err > 2e-4 + 1e-4 * scale:
            return "MISMATCH", f"logits error {err:.2e} (scale {scale:.1f})"
        outs = [m.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                           output_logits=True, return_dict_in_generate=True, pad_token_id=0)
                for m in (ours, twin)]
        if not torch.equal(outs[0].sequences, outs[1].sequences):
            return "GEN_MISMATCH", "generated tokens differ"
        gen = max(float((a.float() - b.float()).abs().max())
                  for a, b in zip(outs[0].logits, outs[1].logits))
        if gen > 1e-3:
            return "GEN_MISMATCH", f"generate() logits error {gen:.2e}"
        detail = f"logits error {err:.1e}, generate() {gen:.1e}"
        if train:
            ids, mask = padded(torch.Generator().manual_seed(2), (9, 6), 99, side="right")
            labels = ids.masked_fill(~mask.bool(), -100)
            for m in (ours, twin):  # one seed: the same dropout outside attention
                m.train()
                m.zero_grad()
                torch.manual_seed(3)
                m(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            # against the largest gradient of the model: some are 0 in exact arithmetic (a
            # key bias under softmax) and rounding noise in both, which no ratio of their own
            # can judge
            pairs = [(p.grad, p2.grad) for p, p2 in zip(ours.parameters(), twin.parameters())
                     if p2.grad is not None]
            top = max(float(g2.abs().max()) for _, g2 in pairs)
            rel = max(float((g - g2).abs().max()) for g, g2 in pairs) / (top + 1e-30)
            if rel > 1e-3:
                return "TRAIN_MISMATCH", f"{detail}; gradient relative error {rel:.1e}"
            detail += f", gradients {rel:.1e}"
        return "ok", detail
    except InputError as e:
        return "refused_call", str(e)[:200]


def worker(types: list[str], train: bool) -> None:
    import torch

    from attnhub import Hub
    from attnhub.integrations import transformers as hf

    torch.set_num_threads(1)
    hf.register(Hub(hardware="cpu"))
    for mt in types:
        t0 = time.perf_counter()
        status, detail = judge(mt, train)
        print(json.dumps({"model_type": mt, "status": status, "detail": detail,
                          "s": round(time.perf_counter() - t0, 1)}), flush=True)


#: Address space of a worker: a default config too large to be tiny (Gemma 4's per-layer
#: sizes take 20 GiB) fails in its worker instead of swapping the machine.
WORKER_BYTES = 6 * 2**30


def _limit() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (WORKER_BYTES, WORKER_BYTES))


def _run(types: list[str], train: bool, timeout: float) -> list[dict]:
    cmd = [sys.executable, __file__, "--worker", *types] + (["--train"] if train else [])
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                           preexec_fn=_limit)
        lines = p.stdout.splitlines()
    except subprocess.TimeoutExpired as e:
        lines = (e.stdout or b"").decode().splitlines() if isinstance(e.stdout, bytes) else (
            e.stdout or "").splitlines()
    return [json.loads(x) for x in lines if x.startswith("{")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, help="model types (default: all)")
    ap.add_argument("--train", action="store_true", help="also compare training gradients")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=8, help="families per worker process")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per family")
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", nargs="*", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker is not None:
        worker(a.worker, a.train)
        return
    from concurrent.futures import ThreadPoolExecutor

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    types = a.only or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    chunks = [types[i:i + a.chunk] for i in range(0, len(types), a.chunk)]
    rows: dict[str, dict] = {}
    with ThreadPoolExecutor(a.workers) as pool:
        for got in pool.map(lambda c: _run(c, a.train, a.timeout * len(c)), chunks):
            rows.update({r["model_type"]: r for r in got})
            print(f"{len(rows)}/{len(types)} families", file=sys.stderr, flush=True)
    for mt in types:  # a worker that died or timed out: its unfinished families alone
        if mt not in rows:
            got = _run([mt], a.train, a.timeout)
            rows[mt] = got[0] if got else {"model_type": mt, "status": "timeout",
                                           "detail": "died or ran out of time alone", "s": None}
    counts: dict[str, int] = {}
    for r in rows.values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    import transformers

    print(f"transformers {transformers.__version__}: {counts}")
    for r in sorted(rows.values(), key=lambda r: (r["status"] not in BAD, r["status"])):
        if r["status"] != "ok":
            print(f"  {r['model_type']}: {r['status']}: {r['detail'][:160]}")
    if a.json:
        Path(a.json).write_text(json.dumps({"transformers": transformers.__version__,
                                            "counts": counts, "rows": list(rows.values())},
                                           indent=1))
    sys.exit(1 if any(r["status"] in BAD for r in rows.values()) else 0)


if __name__ == "__main__":
    main()
