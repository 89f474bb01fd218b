"""How SGLang's own Mooncake backend names the stored objects of a page, so that
``hkvm.sglang`` and ``--hicache-storage-backend mooncake`` share a pool's naming.

A page hash ``H`` (SGLang's chained hash of ``page_size`` tokens, the same on
every rank) becomes ``<prefix>_H`` (the prefix: ``extra_backend_tag`` and the
model name with ``/`` as ``-``), then one object per part the rank holds:

- MHA: ``H_<tp>_k`` and ``H_<tp>_v`` (``<tp>_<pp>`` under pipeline parallelism);
  with split heads (``page_head`` layout, ``tp_lcm_size > tp_size``) one pair per
  head group ``tp_rank * f + i``, ``f = tp_lcm_size // tp_size``;
- MLA (the cache is the same on every rank): ``H__k`` (``H_<pp>_k`` under PP);
- side pools of hybrid models (SGLang's ``PoolName``): Mamba ``H_<tp>_temporal``
  then ``H_<tp>_conv_<j>``; SWA ``H_<tp>_swa_k`` / ``_swa_v`` (MHA) or ``H__swa``
  (MLA); the draft model's KV ``H_<tp>_draft_k`` / ``_draft_v`` or ``H__draft_k``,
  its SWA ``H_<tp>_draft_swa_k`` / ``_v`` or ``H__draft_swa``; every other pool
  (indexers, DeepSeek V4's compressed pools) one object ``H__<pool>``.

Read from sgl-project/sglang ``python/sglang/srt/mem_cache/storage/mooncake_store/
mooncake_store.py`` at 00fe477f32b3878f64d44cc36895e1de4a113afe.
"""

from __future__ import annotations

from typing import Any, List


def pool_name(name: Any) -> str:
    """A pool's name as a string (SGLang's ``PoolName`` is a ``str`` enum)."""
    return str(getattr(name, "value", name))


class PageKeys:
    """The object keys of pages, for one rank of one model."""

    def __init__(self, storage_config: Any, extra: dict):
        tp_rank = int(getattr(storage_config, "tp_rank", 0) or 0)
        tp_size = int(getattr(storage_config, "tp_size", 1) or 1)
        pp_rank = int(getattr(storage_config, "pp_rank", 0) or 0)
        pp_size = int(getattr(storage_config, "pp_size", 1) or 1)
        self.is_mla = bool(getattr(storage_config, "is_mla_model", False))
        model = getattr(storage_config, "model_name", None) or ""
        tag = extra.get("extra_backend_tag") or ""
        prefix = "_".join(str(p) for p in (tag, model.replace("/", "-")) if p)
        self.prefix = f"{prefix}_" if prefix else ""
        pp = f"_{pp_rank}" if pp_size > 1 else ""
        self.mha = f"{tp_rank}{pp}"
        self.mla = f"{pp_rank}" if pp_size > 1 else ""
        split = bool(getattr(storage_config, "should_split_heads", False))
        lcm = int(getattr(storage_config, "tp_lcm_size", None) or tp_size)
        factor = lcm // tp_size if split and lcm > tp_size else 1
        self.head_groups = [f"{tp_rank * factor + i}{pp}" for i in range(factor)]

    def tagged(self, key: str) -> str:
        """The page hash with the deployment's prefix."""
        return f"{self.prefix}{key}"

    def kv_parts(self) -> List[str]:
        """The suffixes of a page's KV objects, in the host pool's buffer order."""
        if self.is_mla:
            return [f"_{self.mla}_k"]
        return [f"_{group}_{kv}" for group in self.head_groups for kv in ("k", "v")]

    def side_parts(self, name: Any, buffers: int, has_temporal: bool = True) -> List[str]:
        """The suffixes of a page's objects in side pool ``name``, whose host pool
        gives ``buffers`` buffers per page (a Mamba pool: its temporal state, when
        ``has_temporal``, then its conv states)."""
        name = pool_name(name)
        if name == "mamba":
            conv = buffers - 1 if has_temporal else buffers
            parts = (["temporal"] if has_temporal else []) + [f"conv_{j}" for j in range(conv)]
            return [f"_{self.mha}_{part}" for part in parts]
        paired = {"swa": "swa", "draft": "draft", "draft_swa": "draft_swa"}
        if name in paired:
            stem = paired[name]
            if buffers >= 2 and buffers % 2 == 0:
                return [f"_{self.mha}_{stem}_k", f"_{self.mha}_{stem}_v"]
            return [f"_{self.mla}_{stem}_k" if name == "draft" else f"_{self.mla}_{stem}"]
        return [f"_{self.mla}_{name}"]

    def objects(self, keys: List[str], parts: List[str]) -> List[str]:
        """Every object of pages ``keys``: page after page, ``parts`` in order."""
        return [f"{self.prefix}{key}{part}" for key in keys for part in parts]

