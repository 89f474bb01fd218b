//! The address a Mooncake program gives as its master, in HKVM's form:
//! `nats://h1:4222,h2:4222/<cluster>/<subcluster>` (credentials as `user:pass@` in
//! any server, as the CLI accepts them); `/<cluster>/*?k=v&k=v` names labels
//! instead of a sub-cluster (see [`super::choose`]).

use std::fmt;
use std::str::FromStr;

use hkvm_events::{ClusterId, SubclusterId};

/// Where a store connects: NATS servers, the cluster and the sub-cluster it joins.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreAddress {
    /// Comma-separated NATS URLs, each with its scheme.
    pub servers: String,
    /// The cluster.
    pub cluster: ClusterId,
    /// The sub-cluster this process is a node and client of.
    pub subcluster: SubclusterId,
}

/// Why an address does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad HKVM address {address:?}: {reason} (expected nats://host:port[,host:port]/<cluster>/<subcluster>)")]
pub struct AddressError {
    /// The address as given.
    pub address: String,
    /// What is wrong.
    pub reason: String,
}

/// The parts every address form shares: `scheme://hosts/<cluster>/<last>[?query]`.
pub(super) struct Parts<'t> {
    /// Comma-separated NATS URLs, each with its scheme.
    pub(super) servers: String,
    /// The cluster.
    pub(super) cluster: ClusterId,
    /// The path's second segment (a sub-cluster, or `*`).
    pub(super) last: &'t str,
    /// What follows `?`, if anything.
    pub(super) query: Option<&'t str>,
}

impl<'t> Parts<'t> {
    /// Splits `text`, or says what is wrong.
    pub(super) fn of(text: &'t str) -> Result<Self, AddressError> {
        let bad = |reason: &str| AddressError {
            address: text.to_owned(),
            reason: reason.to_owned(),
        };
        let (scheme, rest) = text.split_once("://").ok_or_else(|| bad("no scheme"))?;
        if !matches!(scheme, "nats" | "tls" | "ws" | "wss") {
            return Err(bad("the scheme is not nats, tls, ws or wss"));
        }
        let (rest, query) = match rest.split_once('?') {
            Some((rest, query)) => (rest, Some(query)),
            None => (rest, None),
        };
        let (hosts, path) = rest
            .split_once('/')
            .ok_or_else(|| bad("no /<cluster>/<subcluster> path"))?;
        let mut segments = path.trim_end_matches('/').split('/');
        let (Some(cluster), Some(last), None) = (segments.next(), segments.next(), segments.next())
        else {
            return Err(bad("the path must be /<cluster>/<subcluster>"));
        };
        let cluster = ClusterId::new(cluster).map_err(|e| bad(&e.to_string()))?;
        let servers: Vec<String> = hosts
            .split(',')
            .map(str::trim)
            .filter(|host| !host.is_empty())
            .map(|host| {
                if host.contains("://") {
                    host.to_owned()
                } else {
                    format!("{scheme}://{host}")
                }
            })
            .collect();
        if servers.is_empty() {
            return Err(bad("no server"));
        }
        Ok(Self {
            servers: servers.join(","),
            cluster,
            last,
            query,
        })
    }
}

impl FromStr for StoreAddress {
    type Err = AddressError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let parts = Parts::of(text)?;
        let bad = |reason: String| AddressError {
            address: text.to_owned(),
            reason,
        };
        if parts.query.is_some() {
            return Err(bad(
                "labels (`?k=v`) choose a sub-cluster only in place of one (`/<cluster>/*?k=v`)"
                    .into(),
            ));
        }
        let subcluster = SubclusterId::new(parts.last).map_err(|e| bad(e.to_string()))?;
        Ok(Self {
            servers: parts.servers,
            cluster: parts.cluster,
            subcluster,
        })
    }
}

impl fmt::Display for StoreAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Credentials stay out of logs.
        let hosts: Vec<&str> = self
            .servers
            .split(',')
            .map(|url| {
                let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
                rest.rsplit_once('@').map_or(rest, |(_, host)| host)
            })
            .collect();
        write!(
            f,
            "nats://{}/{}/{}",
            hosts.join(","),
            self.cluster,
            self.subcluster
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn servers_cluster_and_subcluster_are_read() {
        let address: StoreAddress = "nats://h1:4222,h2:4222/prod/sc-3".parse().unwrap();
        assert_eq!(address.servers, "nats://h1:4222,nats://h2:4222");
        assert_eq!(address.cluster.as_str(), "prod");
        assert_eq!(address.subcluster.as_str(), "sc-3");
        let secret: StoreAddress = "nats://u:p@h1:4222/prod/sc-0/".parse().unwrap();
        assert_eq!(secret.servers, "nats://u:p@h1:4222");
        assert_eq!(
            secret.to_string(),
            "nats://h1:4222/prod/sc-0",
            "no credentials shown"
        );
    }

    #[test]
    fn malformed_addresses_say_why() {
        for bad in [
            "127.0.0.1:50051",
            "http://h:1/a/b",
            "nats://h:4222",
            "nats://h:4222/only-cluster",
            "nats://h:4222/a/b/c",
            "nats:///a/b",
            "nats://h:4222/bad.cluster/sc-0",
            "nats://h:4222/prod/sc-0?pool=a",
            "nats://h:4222/prod/*",
        ] {
            assert!(bad.parse::<StoreAddress>().is_err(), "{bad} parsed");
        }
    }
}
