"""Tenants, as ``hkvm_events::tenant`` stores them: a key ``k`` of a tenant ``t``
other than the default is stored as ``"\\x1e" + t + "\\x1f" + k``; tenant names
follow Mooncake's rules."""

from __future__ import annotations

from typing import Optional

DEFAULT_TENANT = "default"
#: The first character of a key that belongs to a tenant other than the default.
TENANT_MARK = "\x1e"
#: The character that ends the tenant's name in a stored key.
TENANT_END = "\x1f"
MAX_TENANT_LEN = 128


def tenant_refused(tenant: str) -> Optional[str]:
    """Why ``tenant`` cannot name a tenant (Mooncake's rules), or None."""
    if len(tenant.encode()) > MAX_TENANT_LEN:
        return f"longer than {MAX_TENANT_LEN} bytes"
    if tenant.startswith("_"):
        return "a leading '_' is reserved"
    if any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in tenant):
        return "control characters are not allowed"
    return None


def key_prefix(tenant: str) -> str:
    """What every stored key of ``tenant`` starts with ("" for the default)."""
    return "" if tenant == DEFAULT_TENANT else f"{TENANT_MARK}{tenant}{TENANT_END}"
