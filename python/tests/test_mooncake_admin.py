"""The Mooncake master's read-only HTTP routes on a sub-master's metrics port:
what engines and operators poll on a Mooncake master answers the same on HKVM."""

from __future__ import annotations

import json
import time
import uuid
from urllib.parse import quote

from conftest import http_get, open_store


def test_sglangs_check_server_finds_the_pool_ready(cluster, mooncake_admin):
    """SGLang's `MooncakeStore.check_server` (sgl-project/sglang,
    python/sglang/srt/mem_cache/storage/mooncake_store/mooncake_store.py at
    00fe477f32b3878f64d44cc36895e1de4a113afe) polls
    `http://<master host>:<master_metrics_port>/get_all_segments` until the body
    is not empty; a store's segment is listed under the name its `get_hostname()`
    gives, as on a Mooncake master."""
    store = open_store(cluster)
    try:
        deadline = time.monotonic() + 30
        while True:
            status, body = http_get(f"{mooncake_admin}/get_all_segments")
            if status == 200 and store.get_hostname() in body.splitlines():
                break
            assert time.monotonic() < deadline, f"segment never listed: {status} {body!r}"
            time.sleep(0.1)
        assert body != ""
        status, body = http_get(f"{mooncake_admin}/query_segment?segment={quote(store.get_hostname())}")
        assert status == 200, body
        lines = body.splitlines()
        assert lines[0] == store.get_hostname()
        assert lines[1].startswith("Used(bytes): ")
        assert int(lines[2].split(":")[1]) >= 32 << 20
        status, body = http_get(f"{mooncake_admin}/query_segment?segment=no-such-segment")
        assert status == 500  # as on Mooncake
        detail = json.loads(http_get(f"{mooncake_admin}/get_segments_detail")[1])
        assert detail["total_segments"] == len(detail["segments"]) >= 1
        mine = [s for s in detail["segments"] if s["segment_name"] == store.get_hostname()]
        assert mine and mine[0]["te_endpoint"] == store.get_hostname()
        assert mine[0]["allocator_capacity_bytes"] >= 32 << 20
    finally:
        store.close()


def test_query_key_describes_the_replicas_or_answers_not_found(cluster, mooncake_admin):
    store = open_store(cluster)
    key = f"admin/{uuid.uuid4().hex}/a key with spaces"
    try:
        assert store.put(key, b"x" * 5000) == 0
        status, body = http_get(f"{mooncake_admin}/query_key?key={quote(key)}")
        assert status == 200, body
        answer = json.loads(body)
        assert answer["success"] is True
        assert len(answer["data"]) == 1
        replica = answer["data"][0]
        assert replica["size_"] == 5000
        assert replica["protocol_"] == "tcp"
        # placed on any mounted segment: the endpoint is one the pool lists
        segments = http_get(f"{mooncake_admin}/get_all_segments")[1].splitlines()
        assert replica["transport_endpoint_"] in segments
        assert isinstance(replica["buffer_address_"], int)

        status, body = http_get(f"{mooncake_admin}/query_key?key=absent-{uuid.uuid4().hex}")
        assert status == 404
        assert json.loads(body) == {
            "success": False, "error_code": -704, "error_message": "OBJECT_NOT_FOUND",
        }
        assert http_get(f"{mooncake_admin}/query_key")[0] == 404  # as on Mooncake

        absent = f"absent-{uuid.uuid4().hex}"
        status, body = http_get(f"{mooncake_admin}/batch_query_keys?keys={quote(key)},{absent}")
        assert status == 200, body
        data = json.loads(body)["data"]
        assert data[key]["ok"] is True and data[key]["values"][0]["size_"] == 5000
        assert data[absent]["ok"] is False and data[absent]["error"] == "OBJECT_NOT_FOUND"
        assert data[absent]["values"] is None
        assert http_get(f"{mooncake_admin}/batch_query_keys?keys=")[0] == 400
    finally:
        store.close()


def test_health_and_metrics(mooncake_admin):
    status, body = http_get(f"{mooncake_admin}/health")
    assert status == 200
    health = json.loads(body)
    assert health["status"] == "ok"
    assert health["role"] == "standby"  # this instance; the leader answered for it
    assert health["service_ready"] is True
    assert health["leader_address"]
    status, body = http_get(f"{mooncake_admin}/metrics")
    assert status == 200 and "hkvm_submaster_" in body
    assert http_get(f"{mooncake_admin}/no_such_route")[0] == 404


def test_the_global_master_answers_for_every_subcluster(cluster, global_admin):
    """The same routes on a global master's metrics port cover the whole cluster:
    segments of every sub-cluster, keys wherever they are."""
    stores = {sc: open_store(cluster, sc) for sc in ("sc-0", "sc-1")}
    keys = {sc: f"global-admin/{sc}/{uuid.uuid4().hex}" for sc in stores}
    try:
        for sc, store in stores.items():
            assert store.put(keys[sc], sc.encode() * 1000) == 0
        segments = http_get(f"{global_admin}/get_all_segments")[1].splitlines()
        for store in stores.values():
            assert store.get_hostname() in segments
        for sc in stores:
            status, body = http_get(f"{global_admin}/query_key?key={quote(keys[sc])}")
            assert status == 200, body
            (replica,) = json.loads(body)["data"]
            assert replica["size_"] == len(sc) * 1000
            assert replica["transport_endpoint_"] in segments
        absent = f"absent-{uuid.uuid4().hex}"
        status, body = http_get(f"{global_admin}/batch_query_keys?keys={quote(keys['sc-0'])},{quote(keys['sc-1'])},{absent}")
        data = json.loads(body)["data"]
        assert data[keys["sc-0"]]["ok"] and data[keys["sc-1"]]["ok"] and not data[absent]["ok"]
        detail = json.loads(http_get(f"{global_admin}/get_segments_detail")[1])
        assert detail["total_segments"] >= 2
        health = json.loads(http_get(f"{global_admin}/health")[1])
        assert health["service_ready"] is True and health["role"] == "leader"
        assert "hkvm_global_" in http_get(f"{global_admin}/metrics")[1]
    finally:
        for store in stores.values():
            store.close()
