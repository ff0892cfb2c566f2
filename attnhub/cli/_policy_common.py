"""Flags and set-up shared by the policy commands (policy check, explain, plan, lock)."""

from __future__ import annotations

import argparse
import os

from ..core.device import DeviceInfo, probe, simulate
from ..core.registry import Registry
from ..errors import HardwareError
from ..policy import Policy, load_policy
from ._common import POLICY_FLAG


def add_policy(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", metavar="FILE", type=POLICY_FLAG,
                   help="policy YAML or packaged name (default: ATTNHUB_POLICY, else the "
                        "packaged default)")


def hardware_list(text: str | None) -> list[str]:
    """``"cpu,sm80, sm90"`` -> ``["cpu", "sm80", "sm90"]``; each name checked."""
    names = [h.strip() for h in (text or "").split(",") if h.strip()]
    for h in names:
        try:
            simulate(h)
        except ValueError as exc:
            raise HardwareError(f"--hardware: {exc}") from None
    return names


def env_hardware(unset: str) -> list[str]:
    """``ATTNHUB_HARDWARE`` as a list of its one name (empty when unset), refused as
    ``probe`` refuses it (``explain``, ``lock``); ``unset``: what leaving it out does."""
    named = os.environ.get("ATTNHUB_HARDWARE") or None
    if named is None:
        return []
    try:
        simulate(named)
    except HardwareError as exc:
        raise HardwareError(f"ATTNHUB_HARDWARE: {exc}; or unset it to {unset}") from None
    return [named]


def devices(text: str | None, policy: Policy | None = None) -> list[DeviceInfo]:
    """Simulated devices for ``--hardware a,b``, else for ``ATTNHUB_HARDWARE``; else this
    machine, or the policy's ``targets`` when ``policy`` is passed (``plan``: the README says
    planning commands honour the variable, and plan ignored it for the targets)."""
    names = hardware_list(text)
    if not names and policy is not None:
        names = env_hardware("plan for the policy's targets")
        if not names:
            policy.check_targets()
            names = list(policy.targets)
    if not names:
        return [probe()]
    unique: dict[str, DeviceInfo] = {}  # aliases of one device (h100, sm90): one column
    for d in map(simulate, names):
        unique.setdefault(d.describe(), d)
    return list(unique.values())


def load(args: argparse.Namespace) -> tuple[Policy, Registry]:
    return load_policy(getattr(args, "policy", None)), Registry.load()
