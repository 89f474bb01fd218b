"""Mooncake's master-address and configuration forms resolve to HKVM's, or fail
saying what to set (hkvm.address; pure, no cluster)."""

from __future__ import annotations

import json

import pytest

from hkvm.address import AddressError, is_hkvm_address, load_config_file, resolve

NAMED = {"HKVM_CLUSTER": "prod", "HKVM_SUBCLUSTER": "sc-3"}


def test_hkvm_addresses_pass_unchanged():
    for address in (
        "nats://h1:4222/prod/sc-3",
        "nats://h1:4222,h2:4222/prod/sc-3",
        "tls://user:pw@h1:4222/prod/sc-3/",
        "wss://h1:443/prod/sc-3",
    ):
        assert resolve(address, environ={}) == address
        assert is_hkvm_address(address)


def test_host_port_names_the_nats_servers_and_the_environment_names_the_pool():
    assert resolve("10.0.0.5:4222", environ=NAMED) == "nats://10.0.0.5:4222/prod/sc-3"
    assert resolve(" h1:4222, h2:4222 ", environ=NAMED) == "nats://h1:4222,h2:4222/prod/sc-3"
    assert resolve("nats://h1:4222", environ=NAMED) == "nats://h1:4222/prod/sc-3"
    assert resolve("tls://h1:4222/", environ=NAMED) == "tls://h1:4222/prod/sc-3"
    assert not is_hkvm_address("10.0.0.5:4222")


def test_setup_keys_win_over_the_environment():
    config = {"hkvm_cluster": "staging", "hkvm_subcluster": "sc-0"}
    assert resolve("h1:4222", config, environ=NAMED) == "nats://h1:4222/staging/sc-0"
    # An empty key is "not given", not an empty name.
    assert resolve("h1:4222", {"hkvm_cluster": " "}, environ=NAMED) == "nats://h1:4222/prod/sc-3"


def test_lmcache_url_form_is_host_port():
    assert resolve("mooncakestore://10.0.0.5:4222", environ=NAMED) == "nats://10.0.0.5:4222/prod/sc-3"
    assert resolve("mooncakestore://10.0.0.5:4222/", environ=NAMED) == "nats://10.0.0.5:4222/prod/sc-3"


def test_no_pool_is_ever_guessed():
    with pytest.raises(AddressError, match=r"cluster \(HKVM_CLUSTER\) or the sub-cluster \(HKVM_SUBCLUSTER\)"):
        resolve("10.0.0.5:50051", environ={})
    with pytest.raises(AddressError, match=r"sub-cluster \(HKVM_SUBCLUSTER\)") as caught:
        resolve("10.0.0.5:4222", environ={"HKVM_CLUSTER": "prod"})
    assert "HKVM_CLUSTER" not in str(caught.value).split("not the HKVM")[1].split("to join")[0]


def test_labels_in_place_of_a_subcluster_let_the_registry_choose():
    env = {"HKVM_CLUSTER": "prod", "HKVM_LABELS": "pool=prefill, zone=a"}
    assert resolve("h1:4222", environ=env) == "nats://h1:4222/prod/*?pool=prefill&zone=a"
    assert resolve("h1:4222", {"hkvm_labels": {"pool": "decode"}}, environ={"HKVM_CLUSTER": "prod"}) == (
        "nats://h1:4222/prod/*?pool=decode"
    )
    # Empty: any live sub-cluster; a named sub-cluster wins over labels.
    assert resolve("h1:4222", environ={"HKVM_CLUSTER": "prod", "HKVM_LABELS": ""}) == "nats://h1:4222/prod/*"
    assert resolve("h1:4222", environ={**env, "HKVM_SUBCLUSTER": "sc-3"}) == "nats://h1:4222/prod/sc-3"
    with pytest.raises(AddressError, match="k=v pairs"):
        resolve("h1:4222", environ={"HKVM_CLUSTER": "prod", "HKVM_LABELS": "prefill"})
    with pytest.raises(AddressError, match=r"cluster \(HKVM_CLUSTER\)"):
        resolve("h1:4222", environ={"HKVM_LABELS": "pool=prefill"})
    assert resolve("nats://h1:4222/prod/*?pool=a", environ={}) == "nats://h1:4222/prod/*?pool=a"


@pytest.mark.parametrize(
    "address, reason",
    [
        ("", "no master address"),
        (None, "no master address"),
        ("etcd://h1:2379;h2:2379", "not etcd://"),
        ("http://h1:8080/metadata", "not http://"),
        ("h1:4222/prod/sc-3", "a path needs a scheme"),
        ("h1:4222;h2:4222", "separated by commas"),
        ("nats://,/", "names no server"),
    ],
)
def test_unusable_addresses_say_why(address, reason):
    with pytest.raises(AddressError, match=reason):
        resolve(address, environ=NAMED)


def test_mooncake_config_file(tmp_path, monkeypatch):
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"local_hostname": "10.0.0.5", "master_server_address": "h1:4222"}))
    assert load_config_file(str(path))["master_server_address"] == "h1:4222"
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    assert load_config_file()["local_hostname"] == "10.0.0.5"
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH")
    assert load_config_file() == {}
    path.write_text("[1, 2]")
    with pytest.raises(AddressError, match="not a JSON object"):
        load_config_file(str(path))
    path.write_text("{oops")
    with pytest.raises(AddressError, match="mooncake.json"):
        load_config_file(str(path))
    with pytest.raises(AddressError, match="No such file"):
        load_config_file(str(tmp_path / "missing.json"))
