//! `NATS_URL:CLUSTER`: how a pool is named on the command line.

use std::fmt;
use std::str::FromStr;

use hkvm_events::ClusterId;

use crate::error::InterDcError;

/// A pool: the NATS it lives on and its cluster id.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterAddress {
    /// The NATS URL (`nats://host:port` or `host:port`).
    pub url: String,
    /// The cluster id.
    pub cluster: ClusterId,
}

impl FromStr for ClusterAddress {
    type Err = InterDcError;

    /// Splits at the last `:`; the cluster part must be a valid id that is not a
    /// bare port number (so `host:4222` alone is refused, not read as cluster
    /// `4222`).
    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let bad = || InterDcError::Address(text.to_owned());
        let (url, cluster) = text.rsplit_once(':').ok_or_else(bad)?;
        if url.is_empty() || cluster.chars().all(|c| c.is_ascii_digit()) {
            return Err(bad());
        }
        let cluster = ClusterId::new(cluster).map_err(|_| bad())?;
        Ok(Self {
            url: url.to_owned(),
            cluster,
        })
    }
}

impl ClusterAddress {
    /// Connects to the pool's NATS, naming the connection `name`. `url` may be a
    /// comma-separated list of servers; `user:password@` in one of them is used
    /// for the connection.
    ///
    /// # Errors
    /// [`InterDcError::Nats`] when the URLs do not parse or no server accepts.
    pub async fn connect(&self, name: &str) -> Result<async_nats::Client, InterDcError> {
        hkvm_client::connect(&self.url, name)
            .await
            .map_err(|e| InterDcError::nats(format!("connecting to {}", self.url), e))
    }
}

impl fmt::Display for ClusterAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.url, self.cluster)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_url_and_cluster() {
        let address: ClusterAddress = "nats://10.0.0.1:4222:prefill".parse().unwrap();
        assert_eq!(address.url, "nats://10.0.0.1:4222");
        assert_eq!(address.cluster.as_str(), "prefill");
        assert_eq!(address.to_string(), "nats://10.0.0.1:4222:prefill");
        let short: ClusterAddress = "127.0.0.1:4222:pd".parse().unwrap();
        assert_eq!(short.url, "127.0.0.1:4222");
    }

    #[test]
    fn server_lists_keep_their_commas() {
        let address: ClusterAddress = "nats://a:4222,nats://b:4222:pd".parse().unwrap();
        assert_eq!(address.url, "nats://a:4222,nats://b:4222");
        assert_eq!(address.cluster.as_str(), "pd");
    }

    #[test]
    fn refuses_missing_or_bad_cluster() {
        for bad in ["", "prefill", "nats://h:4222", ":c", "nats://h:4222:bad.id"] {
            assert!(
                matches!(bad.parse::<ClusterAddress>(), Err(InterDcError::Address(_))),
                "{bad:?}"
            );
        }
    }
}
