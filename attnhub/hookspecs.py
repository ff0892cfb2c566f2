"""The hooks a plugin may implement. This file is the plugin API's documentation.

A plugin is a module (named by an entry point in group ``attnhub.backends``) with functions
decorated by :data:`attnhub.plugin.hookimpl`. Hooks receive a ``register`` callback rather than
returning values, so the host decides what to do with duplicates and records provenance.
No hook is ``firstresult`` and none is a wrapper: every plugin's implementation is called, in
registration order, and an exception in one (``SystemExit`` included, not
``KeyboardInterrupt``) is recorded against that plugin only. A backend name registered by two
plugins is served by neither unless ``ATTNHUB_PROVIDERS`` picks one. docs/plugins.md is the
author's guide; ``attnhub check-plugin NAME`` tests a backend against its declaration.
"""

from __future__ import annotations

from typing import Any, Callable

import pluggy

hookspec = pluggy.HookspecMarker("attnhub")
hookimpl = pluggy.HookimplMarker("attnhub")


@hookspec
def attnhub_register_backends(register: Callable[[Any], None]) -> None:
    """Register backends: call ``register(backend_instance)`` once per backend.

    The instance must subclass :class:`attnhub.plugin.Backend`, have a unique ``name``, and
    must not import kernels or touch a GPU in its constructor. Called once per registry load.
    """


@hookspec
def attnhub_register_variants(register: Callable[..., None]) -> None:
    """Register named score/mask variants: a call passes the name as ``score_mod=`` or
    ``mask_mod=``, and a policy's ``variant:`` condition matches it.

    Call ``register(name, score_mod=None, mask_mod=None, doc="")`` with FlexAttention-style
    callables ``score_mod(score, b, h, q_idx, kv_idx)`` / ``mask_mod(b, h, q_idx, kv_idx)``.
    """
