"""Hugging Face transformers: ``attn_implementation="attnhub"`` routes every layer through
the policy.

``register()`` adds an attention function to transformers' ``AttentionInterface`` and, since a
name without a mask function gets no mask at all (``masking_utils`` then returns None), the
boolean ``sdpa_mask`` under the same name (a skipped bidirectional mask comes back as an
all-True one, ``masks.sdpa_mask_marked``, so that None always means a skipped causal
mask). Each call turns the mask transformers built back
into attnhub's mask vocabulary (``masks.mask_args``): plain causal, sliding window and key
padding (column-sparse ranges) when the mask is exactly that, a dense ``mask_mod`` otherwise,
so the policy sees what the mask really is. The phase comes from the call: one new query over
a longer key sequence (a step of ``generate()`` with a cache) is ``decode``, anything else
``prefill`` (``train`` when gradients flow). The bind context names the model and the layer.

A model class whose attention does not go through ``AttentionInterface`` (transformers marks
those with ``_supports_attention_backend = False``: Bloom, Falcon, T5, ...) would ignore the
name or misuse the mask; building one with ``attn_implementation="attnhub"`` raises
``InputError`` (``VETTED`` encoder-decoders, which leave the flag False but route through the
interface, excepted), and so does a call carrying what attnhub would ignore (``guards``:
biases, sparse indices, packed documents the mask does not keep apart, attention weights
requested). Attention sinks (GPT-OSS's ``s_aux``) are applied exactly from the output and its
LSE (``with_sinks``). See docs/transformers.md.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ...core.decision import BindContext
from ...errors import DTypeMismatchError, InputError, NoBackendError
from ...hub import Hub, HubRef, default_hub
from .causality import call_causal
from .guards import HARMLESS, check_documents, refuse_unsupported, weights_requested, where
from .kv_sharing import keep_whole_sequences
from .masks import DenseMask, is_attend_all, mask_args, sdpa_mask_marked

if TYPE_CHECKING:
    from ...bind import BindingTable

__all__ = ["NAME", "DenseMask", "attention_forward", "attention_modules", "bind_model",
           "check_model_class", "mask_args", "register", "with_sinks"]

NAME = "attnhub"
#: registered name -> the hub serving models built with it (None: the process-wide hub)
_hubs: dict[str, Hub | None] = {}


def register(hub: Hub | None = None, name: str = NAME) -> str:
    """Register ``name`` with transformers' attention and mask interfaces; returns the name.

    ``hub`` (default: the process-wide hub) is the policy + registry that serves the calls
    of models built with ``attn_implementation=name``. Calling again with the same name
    replaces its hub; each name keeps its own.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    taken = _builtin_names(AttentionInterface)
    if not isinstance(name, str) or not name.strip() or name in taken:
        raise InputError(
            f"register(name={name!r}): "
            + (f"{name!r} is transformers' own implementation; registering it would serve "
               "every model that asks for it through attnhub" if isinstance(name, str)
               and name.strip() else "the name must be a non-empty string")
            + f"; pick a name of your own (default {NAME!r}; taken: {', '.join(sorted(taken))})")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask_marked)
    _hubs[name] = hub
    _guard_model_classes()
    keep_whole_sequences(_hubs)
    return name


@functools.cache
def _builtin_names(interface: Any) -> frozenset[str]:
    """transformers' own implementation names, read before attnhub registers any (cached
    at the first ``register``: names attnhub registered since are its own to replace)."""
    return frozenset(getattr(interface, "_global_mapping", {})) - set(_hubs) | {"eager"}


def registered_hub(name: str = NAME) -> Hub | None:
    """The hub ``register`` gave ``name`` (None: the process-wide hub, or not registered)."""
    return _hubs.get(name)


def _hub_of(module: torch.nn.Module) -> Hub | None:
    """The registered hub of the name the module's model was built with."""
    if len(_hubs) <= 1:
        return next(iter(_hubs.values()), None)
    cfg = module.__dict__.get("config")
    return _hubs.get(getattr(cfg, "_attn_implementation", NAME))


#: transformers model packages whose classes leave ``_supports_attention_backend`` False yet
#: send every attention layer through ``AttentionInterface`` with masks from
#: ``masking_utils``, compared with eager (tests/test_adversarial_hf_families_4.py). Others
#: with the flag False stay refused: some call the interface too but fold ALiBi (Falcon) or
#: a position bias (T5) in around it. The encoder-decoder wrappers hold no attention of their
#: own: their sub-models are checked when they are built or switched.
VETTED = frozenset({"bart", "mbart", "pegasus", "marian", "whisper", "blenderbot",
                    "blenderbot_small", "m2m_100", "plbart", "encoder_decoder",
                    "vision_encoder_decoder",
                    # hybrids whose full-attention layers go through the interface (their
                    # linear / Mamba layers hold no attention), and StableLM; logits,
                    # generate() and training gradients against eager in
                    # tests/test_hf_vetted.py
                    "qwen3_next", "olmo_hybrid", "falcon_h1", "nemotron_h", "lara_mini",
                    "stablelm"})
#: Classes vetted where their package also holds others that are not (Qwen3.5's vision-
#: language models): the text models, checked as ``VETTED``.
VETTED_CLASSES = frozenset({"Qwen3_5ForCausalLM", "Qwen3_5TextModel", "Qwen3_5MoeForCausalLM",
                            "Qwen3_5MoeTextModel"})


def _vetted(cls: type) -> bool:
    return any(k.__module__.startswith("transformers.models.")
               and (k.__module__.split(".")[2] in VETTED or k.__name__ in VETTED_CLASSES)
               for k in cls.__mro__)


def check_model_class(cls: type, name: str = NAME) -> None:
    """Raise ``InputError`` unless transformers routes ``cls``'s attention through
    ``AttentionInterface`` (its ``_supports_attention_backend`` flag, or a ``VETTED``
    package)."""
    if getattr(cls, "_supports_attention_backend", False) or _vetted(cls):
        return
    raise InputError(
        f"{cls.__name__} cannot use attn_implementation={name!r}: transformers does not mark "
        "its attention as routed through AttentionInterface (_supports_attention_backend is "
        "False), so attnhub could be bypassed or miss a bias the model adds (Bloom and Falcon "
        "add ALiBi, T5 a relative position bias). Use attn_implementation='sdpa' or 'eager' "
        "for this model, or a model class that supports attention backends")


def _guard_model_classes() -> None:
    """Check the model class when transformers resolves ``attn_implementation`` (at build
    and in ``set_attn_implementation``), before any layer exists. The hook is
    ``get_correct_attn_implementation`` (transformers 4.5x-5.x), else
    ``_check_and_adjust_attn_implementation``; both take the requested name first."""
    from transformers import PreTrainedModel

    for hook in ("get_correct_attn_implementation", "_check_and_adjust_attn_implementation"):
        original = getattr(PreTrainedModel, hook, None)
        if original is not None:
            break
    else:
        raise InputError("this transformers version has no attention-implementation hook "
                         "(get_correct_attn_implementation); attnhub cannot check model "
                         "classes: upgrade transformers")
    if getattr(original, "_attnhub_guard", False):
        return

    @functools.wraps(original)
    def guarded(self: Any, requested: Any = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(requested, str) and requested in _hubs:
            check_model_class(type(self), requested)
            keep_whole_sequences(_hubs)  # its module is loaded now
        return original(self, requested, *args, **kwargs)

    guarded._attnhub_guard = True  # type: ignore[attr-defined]
    setattr(PreTrainedModel, hook, guarded)


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None,
                      is_causal: bool | None = None, sliding_window: int | None = None,
                      softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D) in,
    (B, Sq, Hq, Dv) out, contiguous (models ``.view()`` it), and no attention weights."""
    sinks = kwargs.pop("s_aux", None)  # GPT-OSS and kin: one learned logit per head
    if sinks is None:
        sinks = kwargs.pop("sinks", None)
    if not HARMLESS.issuperset(kwargs) or weights_requested():
        refuse_unsupported(module, kwargs)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    device_type = q.device.type
    if torch.is_autocast_enabled(device_type):
        # under autocast q and k leave the rotary embedding in fp32 while v stays in the
        # autocast dtype; eager's matmuls and sdpa cast all three to that dtype: so do we
        dt = torch.get_autocast_dtype(device_type)
        q, k, v = q.to(dt), k.to(dt), v.to(dt)
    # a module without is_causal (Mllama's cross-attention) is read as eager reads it: the
    # mask alone decides, and no mask means every key (sdpa's default True slices the keys)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
    if attention_mask is not None and is_attend_all(attention_mask):
        # a skipped bidirectional mask: every key, whatever the module's is_causal says
        # (Phi-4-multimodal's vision attention says True), as eager reads it
        attention_mask, causal = None, False
    # transformers' windows: causal keeps kv > q - w; bidirectional keeps |q - kv| <= w, and
    # some models pass w + 1 (ModernBERT): the mask, when there is one, decides, and may hold
    # no window at all (OLMoE passes its config's window with a full causal mask)
    window, other = None, ()
    if sliding_window:
        w = sliding_window
        window, other = ((w - 1, 0), (None,)) if causal else ((w, w), ((w - 1, w - 1), None))
    sq, sk = q.shape[1], k.shape[1]
    if attention_mask is None and causal and 1 < sq < sk:
        # transformers drops the mask only for a prefill into an empty static cache, whose
        # keys past the queries are unused slots: keep the keys the queries can see
        k, v, sk = k[:, :sq], v[:, :sq], sq
    # the module's own hub (set by bind_model) or the registered one; read from the
    # instance dict: nn.Module's __getattr__ raises (slowly) for a missing name
    bound = module.__dict__.get("_attnhub_hub")
    if bound.__class__ is HubRef:
        bound = bound.hub
    hub = bound or _hub_of(module) or default_hub()
    # phase left to the hub: one query over a longer cache is decode, else prefill or train
    if attention_mask is None:  # decode without padding: no mask to translate
        if sq > 1 and kwargs.get("cu_seq_lens_q") is not None:
            check_documents(module, kwargs["cu_seq_lens_q"], None, sq, sk)
        # and no window: transformers drops a sliding layer's mask only while the window
        # does not reach past the keys, and eager and sdpa, which apply the window through
        # the mask alone, apply none here (OLMoE passes its config's window with a full
        # causal mask)
        out = _attend(hub, module, q, k, v, sinks, causal=causal and sq > 1, scale=scaling,
                      softcap=softcap, context=_context(module, sliding_window),
                      dropout_p=dropout)
        return out.contiguous(), None
    if isinstance(attention_mask, torch.Tensor) and attention_mask.device != q.device:
        raise InputError(f"attention_mask is on {attention_mask.device} but the queries are on "
                         f"{q.device}: move the mask to {q.device}")
    try:
        mask = mask_args(attention_mask, causal and sq > 1, window, q.shape[0], sq, sk, module,
                         heads=q.shape[2], other_windows=other,
                         reach=window[0] if causal and window else None)
    except InputError as e:  # name the layer: Swin's window bias reaches here as a "mask"
        raise InputError(f"{where(module)}: {e}") from None
    if sq > 1 and kwargs.get("cu_seq_lens_q") is not None:
        check_documents(module, kwargs["cu_seq_lens_q"], mask.get("mask_mod"), sq, sk)
    out = _attend(hub, module, q, k, v, sinks, scale=scaling, softcap=softcap,
                  context=_context(module, sliding_window), dropout_p=dropout, **mask)
    # contiguous, as eager and sdpa return it: some models .view() it (AfMoE, JetMoE)
    return out.contiguous(), None


def _attend(hub: Hub, module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor,
            v: torch.Tensor, sinks: torch.Tensor | None, **kw: Any) -> torch.Tensor:
    """``hub.attention``, with attention sinks when the model passes them."""
    try:
        if sinks is None:
            return hub.attention(q, k, v, **kw)
        out, lse = hub.attention(q, k, v, return_lse=True, **kw)
    except DTypeMismatchError as e:  # name the layer; a float64 model (model.double()): the fix
        fix = ("; run the model in fp32 (model.float()), or use attn_implementation='eager' "
               "for float64") if q.dtype == torch.float64 else ""
        raise type(e)(f"{where(module)}: {e}{fix}") from None
    except NoBackendError as e:
        if not kw.get("dropout_p"):
            raise
        raise InputError(  # Gemma 2 training: softcap and dropout, which no CPU backend has
            f"{where(module)}: no backend here serves attention dropout "
            f"({kw['dropout_p']}) together with the rest of this call; train with the "
            "config's attention dropout at 0, use attn_implementation='eager', or bind a "
            f"backend that declares dropout for this model in the policy. {e}") from None
    try:
        return with_sinks(out, lse, sinks)
    except InputError as e:  # name the layer (built only on error: this is the hot path)
        raise InputError(f"{where(module)}: {e}") from None


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention whose softmax has one more logit per row, a sink that takes probability
    mass and gives no value (GPT-OSS's ``s_aux``, one per head; per query ``(B, H, Sq, 1)``):
    the keys keep ``e^lse / (e^lse + e^sink) = sigmoid(lse - sink)`` of the mass, so it is the
    exact attention's output (bshd) scaled by that per row, from its LSE. A row that sees no
    key (LSE -inf) stays 0, as in eager. Gradients reach q, k, v through the output and the
    LSE, and the sinks through the factor."""
    b, sq, hq, _ = out.shape
    s = sinks.view(1, -1, 1) if sinks.dim() == 1 else (
        sinks.squeeze(-1) if sinks.dim() == 4 and sinks.shape[-1] == 1 else sinks)
    if s.dim() != 3 or any(n not in (1, m) for n, m in zip(s.shape, (b, hq, sq))):
        raise InputError(f"attention sinks of shape {tuple(sinks.shape)}; expected one per "
                         f"head ({hq},) or one per query ({b}, {hq}, {sq}, 1)")
    if out.requires_grad and not lse.requires_grad:
        raise InputError("attention sinks scale the output by a function of its LSE, but the "
                         "backend bound here returns an LSE that carries no gradient, so q "
                         "and k would get wrong gradients; bind a backend with a "
                         "differentiable LSE for this model in the policy (a rule with "
                         "use: [triton] or [reference]), or train with "
                         "attn_implementation='eager'")
    keep = torch.sigmoid(lse.float() - s.to(device=lse.device, dtype=torch.float32))
    return (out.float() * keep.transpose(1, 2).unsqueeze(-1)).to(out.dtype)


def _context(module: torch.nn.Module, sliding_window: int | None) -> BindContext:
    """The layer's bind context, kept on the module. Its kind follows the window the call
    passes (the truth: Mixtral passes its config's window while its layers hold none,
    Exaone 4's full layers hold one they never pass); ``bind_model`` builds it first from
    ``_layer_window``, and a call that disagrees replaces it."""
    ctx = _fresh_context(module, sliding_window)
    if ctx is not None:
        module._attnhub_context = ctx  # type: ignore[assignment]
    return module.__dict__["_attnhub_context"]


def _fresh_context(module: torch.nn.Module, sliding_window: int | None) -> BindContext | None:
    """The context ``_context`` would store for this layer, or None when the one it holds
    stands (read only: ``bind_model`` stores nothing until every layer resolved)."""
    kind = "sliding" if sliding_window else "softmax"
    ctx = module.__dict__.get("_attnhub_context")
    if ctx is not None and ctx.layer_kind == kind:
        return None
    cfg = getattr(module, "config", None)
    model = (getattr(cfg, "_name_or_path", None) or getattr(cfg, "model_type", None)
             or type(module).__name__)
    return BindContext(model=str(model), layer=getattr(module, "layer_idx", None),
                       layer_kind=kind)


def _layer_window(module: torch.nn.Module) -> int | None:
    """The window transformers will pass this layer, read before any call: the config's
    ``layer_types`` where it has them, else the module's ``is_sliding``, else the module's
    or the config's ``sliding_window`` (Mistral, Mixtral: every layer)."""
    cfg = module.config
    w = getattr(cfg, "sliding_window", None)
    types, idx = getattr(cfg, "layer_types", None), getattr(module, "layer_idx", None)
    if types is not None and idx is not None and idx < len(types):
        return w if types[idx] == "sliding_attention" else None
    if hasattr(module, "is_sliding"):
        return w if module.is_sliding else None
    return getattr(module, "sliding_window", None) or w


def attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The attention modules of a transformers model whose (sub-)config names a registered
    attnhub implementation (modules with a causal flag, not whole models), in module order:
    decoder layers with a layer index, and encoders' (ViT, CLIP) without one."""
    from transformers import PreTrainedModel

    return [(name, m) for name, m in model.named_modules()
            if hasattr(m, "is_causal") and not isinstance(m, PreTrainedModel)
            and getattr(getattr(m, "config", None), "_attn_implementation", None) in _hubs]


def _unflagged_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules of ``model`` under a registered attnhub name without a causal flag: some are
    attention that transformers calls the function with (Mllama's cross-attention), which
    ``attention_modules`` cannot tell from the rest; ``bind_model`` pins them all to its hub
    (it is read only by the attention function), and they resolve on their first call."""
    from transformers import PreTrainedModel

    return [m for m in model.modules()
            if not hasattr(m, "is_causal") and not isinstance(m, PreTrainedModel)
            and getattr(getattr(m, "config", None), "_attn_implementation", None) in _hubs]


def bind_model(model: torch.nn.Module, hub: Hub, *, batch: int, prompt_len: int,
               max_len: int, dtype: torch.dtype,
               phases: Sequence[str] = ("prefill", "decode")) -> BindingTable:
    """``attnhub.bind`` for a transformers model: route its layers through ``hub`` and
    resolve each for each phase at the shapes given (no padding; transformers' contiguous
    cache, so decode is ``bshd`` with one query). Every layer is resolved before any is
    changed: a bind that raises leaves the model bound as it was."""
    from ...bind import Binding, BindingTable, model_name
    from ...nn import call_spec

    rows = []
    routed: list[tuple[torch.nn.Module, BindContext | None]] = []
    for position, (path, m) in enumerate(attention_modules(model)):
        cfg = m.config
        hq = cfg.num_attention_heads
        hkv = getattr(cfg, "num_key_value_heads", None) or hq
        # MLA (DeepSeek) keys are wider than its values: qk_head_dim and v_head_dim
        d = (getattr(m, "qk_head_dim", None) or getattr(m, "head_dim", None)
             or cfg.hidden_size // hq)
        dv = getattr(m, "v_head_dim", None) or d
        sw = _layer_window(m)
        fresh = _fresh_context(m, sw)
        routed.append((m, fresh))
        ctx = fresh or m.__dict__["_attnhub_context"]
        layer = getattr(m, "layer_idx", None)
        causal = call_causal(model, path, m)  # what its calls compute, not its flag
        # decode: a causal layer with a cache layer (an index); CLIP's text tower has none
        for phase in phases if causal and layer is not None else [
                p for p in phases if p != "decode"]:
            for sq, sk, window in _call_shapes(phase, prompt_len, max_len, sw, causal,
                                               getattr(m, "sliding_window", None)):
                spec = call_spec(phase, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                 head_dim_v=dv, causal=causal and sq > 1,
                                 window=window,
                                 softcap=getattr(cfg, "attn_logit_softcapping", None) is not None,
                                 batch=batch, seqlen_q=sq, seqlen_k=sk, dtype=dtype,
                                 layout="bshd")
                rows.append(Binding(position if layer is None else layer, path, phase,
                                    hub.decide(spec, ctx)))
    for m, fresh in routed:  # every layer resolved: now route them all
        m._attnhub_hub = HubRef(hub)  # type: ignore[assignment]
        if fresh is not None:
            m._attnhub_context = fresh  # type: ignore[assignment]
    for m in _unflagged_modules(model):  # attention without is_causal: routed, unresolved
        m._attnhub_hub = HubRef(hub)  # type: ignore[assignment]
    return BindingTable(model_name(model), getattr(hub.resolver, "name", "?"),
                        hub.device.describe(), rows)


def _call_shapes(phase: str, prompt_len: int, max_len: int, sw: int | None,
                 causal: bool = True, passed: int | None = None
                 ) -> list[tuple[int, int, tuple[int, int] | None]]:
    """(queries, keys, window) of one layer's calls without padding. A sliding layer's cache
    (transformers' sliding cache layers) holds at most ``sw`` keys at a decode step, and
    transformers drops the mask, so the window, while the keys fit in it. A bidirectional
    sliding layer's mask is the band ``|q - kv| <= sw``; one that covers every key is read
    as the window the call passes (``passed``: ModernBERT passes ``sw + 1``), the first form
    ``attention_forward`` tries."""
    from ...bind import decode_buckets

    if phase != "decode":
        if not causal:
            reach = sw if not sw or prompt_len > sw + 1 else passed or sw
            return [(prompt_len, prompt_len, (reach, reach) if reach else None)]
        return [(prompt_len, prompt_len, (sw - 1, 0) if sw and prompt_len >= sw else None)]
    if not sw:
        return [(1, n, None) for n in decode_buckets(prompt_len, max_len)]
    short = (decode_buckets(prompt_len, min(max_len, sw - 1)) if prompt_len + 1 < sw
             else [])  # decode steps whose keys still fit in the window
    return [(1, n, None) for n in short] + ([(1, sw, (sw - 1, 0))] if max_len >= sw else [])
