"""Mooncake's master-address and configuration forms, resolved to HKVM's.

Engines hand ``setup`` a Mooncake master address; HKVM serves one form,
``nats://h1:4222,h2:4222/<cluster>/<subcluster>``. This module turns every form
an engine passes into that one, or says exactly what is missing:

- ``nats://…/<cluster>/<subcluster>`` (and ``tls://``, ``ws://``, ``wss://``): as is;
- ``nats://h:4222`` without a path, ``host:port``, ``host1:port,host2:port``: the
  NATS servers; the cluster and sub-cluster come from the configuration
  (``hkvm_cluster`` / ``hkvm_subcluster`` keys) or the environment
  (``HKVM_CLUSTER`` / ``HKVM_SUBCLUSTER``); in place of a sub-cluster, labels
  (``hkvm_labels`` key: a dict or ``"k=v,k=v"``; ``HKVM_LABELS``) let the registry
  choose one that carries them all, the same for every process of a node
  (``nats://…/<cluster>/*?k=v&k=v``, which may also be given as is);
- ``mooncakestore://host:port`` (LMCache's URL form): as ``host:port``.

Nothing is defaulted: a sub-cluster nobody named would split a pool into the
processes that guessed and those that did not, so a missing name is an error.
It is pure (no I/O beyond reading the environment it is given) so that every
form is unit-tested.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Mapping, Optional
from urllib.parse import urlencode

__all__ = [
    "AddressError",
    "HKVM_SCHEMES",
    "is_hkvm_address",
    "load_config_file",
    "resolve",
]

#: URL schemes of HKVM's own address form (NATS's transports).
HKVM_SCHEMES = ("nats", "tls", "ws", "wss")
_LMCACHE_SCHEME = "mooncakestore"


class AddressError(ValueError):
    """A master address HKVM cannot use, with the reason and what to set."""


def _scheme(address: str) -> Optional[str]:
    scheme, sep, _ = address.partition("://")
    return scheme.lower() if sep else None


def is_hkvm_address(address: Optional[str]) -> bool:
    """Whether ``address`` is in HKVM's own form (a NATS URL), whatever its path."""
    return bool(address) and _scheme(str(address).strip()) in HKVM_SCHEMES


def _name(config: Mapping[str, Any], environ: Mapping[str, str], key: str, variable: str) -> Optional[str]:
    value = config.get(key)
    if value is None or str(value).strip() == "":
        value = environ.get(variable)
    value = None if value is None else str(value).strip()
    return value or None


def resolve(
    address: Optional[str],
    config: Optional[Mapping[str, Any]] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> str:
    """HKVM's ``nats://servers/<cluster>/<subcluster>`` for a Mooncake-style
    master ``address``; ``config`` is the setup's configuration (its
    ``hkvm_cluster`` / ``hkvm_subcluster`` keys), ``environ`` the environment
    (``os.environ`` when None).

    Raises :class:`AddressError` naming what is wrong and what to set."""
    environ = os.environ if environ is None else environ
    config = config or {}
    text = "" if address is None else str(address).strip()
    if not text:
        raise AddressError("no master address (pass master_server_addr, or set it in MOONCAKE_CONFIG_PATH's file)")
    scheme = _scheme(text)
    if scheme == _LMCACHE_SCHEME:
        text = text.split("://", 1)[1].strip("/")
        scheme = None
    if scheme is not None and scheme not in HKVM_SCHEMES:
        raise AddressError(
            f"master address {text!r}: HKVM speaks NATS ({', '.join(HKVM_SCHEMES)}://), not {scheme}://"
        )
    if scheme is None:
        servers, path = text, ""
        if "/" in text:
            raise AddressError(f"master address {text!r}: a path needs a scheme (nats://host:port/<cluster>/<subcluster>)")
    else:
        servers, _, path = text.split("://", 1)[1].partition("/")
    path = path.strip("/")
    if path:
        # A full HKVM address: the names it carries win; the parser in the
        # extension checks them.
        return text
    hosts = [host.strip() for host in servers.split(",") if host.strip()]
    if not hosts:
        raise AddressError(f"master address {text!r} names no server")
    for host in hosts:
        if ";" in host or " " in host:
            raise AddressError(f"master address {text!r}: servers are separated by commas")
    cluster = _name(config, environ, "hkvm_cluster", "HKVM_CLUSTER")
    subcluster = _name(config, environ, "hkvm_subcluster", "HKVM_SUBCLUSTER")
    labels = _labels(config, environ)
    if subcluster is None and labels is not None and cluster is not None:
        # The registry chooses (in the extension, at setup).
        return f"{scheme or 'nats'}://{','.join(hosts)}/{cluster}/*" + (f"?{urlencode(labels)}" if labels else "")
    missing = [
        what
        for what, value in (("cluster (HKVM_CLUSTER)", cluster), ("sub-cluster (HKVM_SUBCLUSTER)", subcluster))
        if value is None
    ]
    if missing:
        raise AddressError(
            f"master address {text!r} names NATS servers but not the HKVM {' or the '.join(missing)} "
            "to join: set the environment variable, the hkvm_cluster / hkvm_subcluster setup keys "
            "(or hkvm_labels / HKVM_LABELS to have the registry choose a sub-cluster), "
            "or pass nats://host:port/<cluster>/<subcluster>"
        )
    scheme = scheme or "nats"
    return f"{scheme}://{','.join(hosts)}/{cluster}/{subcluster}"


def _labels(config: Mapping[str, Any], environ: Mapping[str, str]) -> Optional[Dict[str, str]]:
    """The labels that choose a sub-cluster (``hkvm_labels``, else
    ``HKVM_LABELS``), or None when neither is set; an empty value asks for any
    live sub-cluster."""
    value = config.get("hkvm_labels")
    if value is None:
        value = environ.get("HKVM_LABELS")
    if value is None:
        return None
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    labels: Dict[str, str] = {}
    for pair in str(value).split(","):
        if not pair.strip():
            continue
        key, sep, val = pair.partition("=")
        if not sep or not key.strip():
            raise AddressError(f"labels {value!r}: expected k=v pairs separated by commas")
        labels[key.strip()] = val.strip()
    return labels


def load_config_file(path: Optional[str] = None) -> Dict[str, Any]:
    """The JSON object in ``path`` (``MOONCAKE_CONFIG_PATH`` when None): Mooncake's
    configuration file (``local_hostname``, ``metadata_server``,
    ``global_segment_size``, ``local_buffer_size``, ``protocol``, ``device_name``,
    ``master_server_address``). Empty when no path is set.

    Raises :class:`AddressError` when the file cannot be read or is not a JSON
    object."""
    path = path if path is not None else os.environ.get("MOONCAKE_CONFIG_PATH")
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as file:
            loaded = json.load(file)
    except (OSError, ValueError) as error:
        raise AddressError(f"MOONCAKE_CONFIG_PATH {path!r}: {error}") from error
    if not isinstance(loaded, dict):
        raise AddressError(f"MOONCAKE_CONFIG_PATH {path!r}: not a JSON object")
    return {str(key): value for key, value in loaded.items()}
