"""The YAML policy engine: which backend serves which (model, layer, phase, spec bucket).

    from attnhub.policy import load_policy
    policy = load_policy("policies/h100-training.yaml")     # or None: ATTNHUB_POLICY / default
    decision = policy.resolve(spec, device, registry, ctx)  # a Decision record

Schema, precedence and overlay rules: docs/policy.md.
"""

from __future__ import annotations

import os

from ..errors import PolicyError
from .loader import default_policy_path, load_data, paused_gc, policies_dir, resolve_policy_path
from .profile import ProfileStore
from .resolver import Policy

__all__ = ["Policy", "ProfileStore", "load_policy", "policies_dir"]


def load_policy(path: str | os.PathLike[str] | None = None, *,
                profile: ProfileStore | None = None) -> Policy:
    """Load and validate a policy file (``None``: ``ATTNHUB_POLICY``, else the packaged
    ``default.yaml``; a bare name such as ``portable`` means a packaged policy).

    Raises :class:`attnhub.errors.PolicyError` listing every problem, each located.
    """
    if path is not None and not os.fspath(path).strip():  # read as "." (Is a directory)
        raise PolicyError([f"policy path {os.fspath(path)!r} is empty, expected a policy file "
                           "or a packaged name such as `default` (or None for the default)"])
    p = default_policy_path() if path is None else resolve_policy_path(path)
    env = os.environ.get("ATTNHUB_POLICY")
    via_env = bool(env) and (path is None or os.fspath(path) == env)  # the Hub passes it on
    with paused_gc():
        return Policy(load_data(p, origin=f"ATTNHUB_POLICY={env}" if via_env else None),
                      profile=profile)
