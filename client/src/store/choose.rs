//! Choosing a sub-cluster by labels. A process that names labels instead of a
//! sub-cluster (`nats://h:4222/<cluster>/*?pool=prefill&zone=a`) joins one of the
//! live registered sub-clusters whose labels include every one of them, picked
//! by rendezvous hashing of its node's host name: every process of a node picks
//! the same sub-cluster, nodes spread evenly over the candidates, and a
//! sub-cluster that joins or leaves moves only the nodes it wins or held. With
//! no candidate the setup fails and says which sub-clusters are registered:
//! nothing is defaulted, so a pool is never split by a guess.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::str::FromStr;
use std::time::Duration;

use hkvm_events::registry::SubmasterInfo;
use hkvm_events::{ClusterId, SubclusterId};
use xxhash_rust::xxh3::xxh3_64;

use super::address::{AddressError, Parts, StoreAddress};
use super::StoreError;
use crate::connect::connect;

/// A registry entry whose last heartbeat is older than this is not chosen (the
/// sub-masters' default registry TTL).
pub const REGISTRY_TTL: Duration = Duration::from_secs(10);

/// An address naming labels in place of a sub-cluster:
/// `nats://h:4222/<cluster>/*?k=v&k=v` (no labels: any live sub-cluster).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabeledAddress {
    /// Comma-separated NATS URLs, each with its scheme.
    pub servers: String,
    /// The cluster.
    pub cluster: ClusterId,
    /// The labels a sub-cluster must carry (with these values).
    pub labels: BTreeMap<String, String>,
}

impl FromStr for LabeledAddress {
    type Err = AddressError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let parts = Parts::of(text)?;
        if parts.last != "*" {
            return Err(AddressError {
                address: text.to_owned(),
                reason: "labels choose a sub-cluster in place of `*`: /<cluster>/*?k=v".into(),
            });
        }
        let labels = form_urlencoded::parse(parts.query.unwrap_or("").as_bytes())
            .map(|(key, value)| (key.into_owned(), value.into_owned()))
            .collect();
        Ok(Self {
            servers: parts.servers,
            cluster: parts.cluster,
            labels,
        })
    }
}

impl LabeledAddress {
    /// The address of the sub-cluster the node on `host` joins, chosen among the
    /// live sub-clusters of the cluster's registry.
    ///
    /// # Errors
    /// NATS out of reach, no registry for the cluster, or no live sub-cluster
    /// with the labels ([`StoreError::InvalidParams`], naming those registered).
    pub async fn resolve(&self, host: &str) -> Result<StoreAddress, StoreError> {
        let nats = connect(&self.servers, "hkvm-store-choose").await?;
        let js = async_nats::jetstream::new(nats);
        let registry = hkvm_log::registry::open_registry(&js, &self.cluster)
            .await
            .map_err(|e| {
                StoreError::InvalidParams(format!(
                    "cluster {}: {e} (is the cluster name right? `hkvm status`)",
                    self.cluster
                ))
            })?;
        let live: Vec<SubmasterInfo> = hkvm_log::registry::list(&registry, REGISTRY_TTL)
            .await
            .map_err(|e| StoreError::Registry(e.to_string()))?
            .into_iter()
            .filter(|registered| registered.alive)
            .map(|registered| registered.info)
            .collect();
        let Some(subcluster) = choose(&live, &self.labels, host) else {
            return Err(StoreError::InvalidParams(format!(
                "no live sub-cluster of {} has the labels {}; registered: {}",
                self.cluster,
                show(&self.labels),
                describe(&live)
            )));
        };
        tracing::info!(%subcluster, labels = %show(&self.labels), host, "joining the sub-cluster the labels chose");
        Ok(StoreAddress {
            servers: self.servers.clone(),
            cluster: self.cluster.clone(),
            subcluster: subcluster.clone(),
        })
    }
}

/// The sub-cluster the node on `host` joins among `registered`: of those whose
/// labels include `labels`, the one with the highest rendezvous score for
/// `host`. None when none has the labels.
pub fn choose<'r>(
    registered: &'r [SubmasterInfo],
    labels: &BTreeMap<String, String>,
    host: &str,
) -> Option<&'r SubclusterId> {
    registered
        .iter()
        .filter(|info| {
            labels
                .iter()
                .all(|(key, value)| info.labels.get(key) == Some(value))
        })
        .map(|info| &info.subcluster)
        .max_by_key(|subcluster| (score(host, subcluster), *subcluster))
}

fn score(host: &str, subcluster: &SubclusterId) -> u64 {
    let mut both = String::with_capacity(host.len() + subcluster.as_str().len() + 1);
    both.push_str(host);
    both.push('\0');
    both.push_str(subcluster.as_str());
    xxh3_64(both.as_bytes())
}

fn show(labels: &BTreeMap<String, String>) -> String {
    if labels.is_empty() {
        return "{} (any)".into();
    }
    let pairs: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!("{{{}}}", pairs.join(","))
}

fn describe(live: &[SubmasterInfo]) -> String {
    if live.is_empty() {
        return "none alive".into();
    }
    let mut out = String::new();
    for (index, info) in live.iter().enumerate() {
        let separator = if index == 0 { "" } else { "; " };
        let _ = write!(out, "{separator}{} {}", info.subcluster, show(&info.labels));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(subcluster: &str, labels: &[(&str, &str)]) -> SubmasterInfo {
        SubmasterInfo {
            id: hkvm_events::ProducerId::new("sm").unwrap(),
            cluster: ClusterId::new("c").unwrap(),
            subcluster: SubclusterId::new(subcluster).unwrap(),
            rpc_prefix: format!("hkvm.c.{subcluster}.rpc"),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            capacity_bytes: 0,
            used_bytes: 0,
            objects: 0,
            epoch: 1,
            stream: format!("HKVM_c_{subcluster}"),
            last_seq: 0,
            unix_ms: 0,
        }
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn labeled_addresses_parse_and_others_do_not() {
        let address: LabeledAddress = "nats://h1:4222,h2:4222/prod/*?pool=prefill&zone=a%2F1"
            .parse()
            .unwrap();
        assert_eq!(address.servers, "nats://h1:4222,nats://h2:4222");
        assert_eq!(
            address.labels,
            labels(&[("pool", "prefill"), ("zone", "a/1")])
        );
        let any: LabeledAddress = "nats://h/prod/*".parse().unwrap();
        assert!(any.labels.is_empty());
        assert!("nats://h/prod/sc-0?pool=a"
            .parse::<LabeledAddress>()
            .is_err());
        assert!("nats://h/prod".parse::<LabeledAddress>().is_err());
    }

    #[test]
    fn only_subclusters_with_every_label_are_chosen() {
        let registered = [
            info("sc-0", &[("pool", "prefill"), ("zone", "a")]),
            info("sc-1", &[("pool", "decode"), ("zone", "a")]),
            info("sc-2", &[("pool", "prefill"), ("zone", "b")]),
        ];
        let wanted = labels(&[("pool", "prefill"), ("zone", "b")]);
        for host in ["10.0.0.1", "10.0.0.2", "node-7"] {
            assert_eq!(
                choose(&registered, &wanted, host).map(SubclusterId::as_str),
                Some("sc-2")
            );
        }
        assert_eq!(choose(&registered, &labels(&[("pool", "none")]), "h"), None);
        assert!(choose(&registered, &BTreeMap::new(), "h").is_some());
        assert_eq!(choose(&[], &BTreeMap::new(), "h"), None);
    }

    #[test]
    fn a_node_always_picks_the_same_and_nodes_spread_and_move_little() {
        let registered: Vec<SubmasterInfo> = (0..8)
            .map(|i| info(&format!("sc-{i}"), &[("pool", "p")]))
            .collect();
        let wanted = labels(&[("pool", "p")]);
        let hosts: Vec<String> = (0..800)
            .map(|i| format!("10.1.{}.{}", i / 256, i % 256))
            .collect();
        let mut counts = BTreeMap::new();
        for host in &hosts {
            let first = choose(&registered, &wanted, host).unwrap();
            assert_eq!(choose(&registered, &wanted, host), Some(first), "stable");
            *counts.entry(first.clone()).or_insert(0u32) += 1;
        }
        // 800 nodes over 8 sub-clusters: 100 each on average.
        assert!(
            counts.values().all(|&n| (50..150).contains(&n)),
            "{counts:?}"
        );
        // Without sc-3, only the nodes it held move.
        let without: Vec<SubmasterInfo> = registered
            .iter()
            .filter(|info| info.subcluster.as_str() != "sc-3")
            .cloned()
            .collect();
        for host in &hosts {
            let before = choose(&registered, &wanted, host).unwrap();
            let after = choose(&without, &wanted, host).unwrap();
            if before.as_str() != "sc-3" {
                assert_eq!(before, after);
            }
        }
    }
}
