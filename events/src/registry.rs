//! The registry's value format: what one sub-master announces about itself in its
//! cluster's registry bucket (`hkvm-log` reads and writes the bucket).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::id::{ClusterId, ProducerId, SubclusterId};

/// What one sub-master says about itself (MessagePack, named fields).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SubmasterInfo {
    /// The serving sub-master instance.
    pub id: ProducerId,
    /// Its cluster.
    pub cluster: ClusterId,
    /// The sub-cluster it is authoritative for (the registry key).
    pub subcluster: SubclusterId,
    /// Prefix of its RPC subjects (`hkvm.<cluster>.<subcluster>.rpc`).
    pub rpc_prefix: String,
    /// Free-form labels (e.g. `pool=prefill`, `zone=a`), used to partition answers.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// Bytes mounted in the sub-cluster.
    #[serde(default)]
    pub capacity_bytes: u64,
    /// Bytes allocated.
    #[serde(default)]
    pub used_bytes: u64,
    /// Complete objects.
    #[serde(default)]
    pub objects: u64,
    /// The sub-master's leadership epoch.
    #[serde(default)]
    pub epoch: u64,
    /// The JetStream stream holding its events.
    pub stream: String,
    /// The last stream sequence it appended or applied.
    #[serde(default)]
    pub last_seq: u64,
    /// When this announcement was made, Unix milliseconds.
    #[serde(default)]
    pub unix_ms: u64,
}

impl SubmasterInfo {
    /// Encodes the announcement (named-field MessagePack).
    ///
    /// # Errors
    /// When serialization fails (it does not for this type).
    pub fn encode(&self) -> Result<Vec<u8>, rmp_serde::encode::Error> {
        rmp_serde::to_vec_named(self)
    }

    /// Decodes an announcement.
    ///
    /// # Errors
    /// The decoder's error, naming what did not decode.
    pub fn decode(bytes: &[u8]) -> Result<Self, rmp_serde::decode::Error> {
        rmp_serde::from_slice(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn info_round_trips_with_named_fields_and_defaults() {
        let info = SubmasterInfo {
            id: ProducerId::new("sm-0").unwrap(),
            cluster: ClusterId::new("c").unwrap(),
            subcluster: SubclusterId::new("sc-0").unwrap(),
            rpc_prefix: "hkvm.c.sc-0.rpc".into(),
            labels: BTreeMap::from([("pool".into(), "prefill".into())]),
            capacity_bytes: 10,
            used_bytes: 5,
            objects: 2,
            epoch: 3,
            stream: "HKVM_c_sc-0".into(),
            last_seq: 7,
            unix_ms: 1,
        };
        let bytes = info.encode().unwrap();
        assert_eq!(SubmasterInfo::decode(&bytes).unwrap(), info);
        #[derive(Serialize)]
        struct Minimal<'a> {
            id: &'a str,
            cluster: &'a str,
            subcluster: &'a str,
            rpc_prefix: &'a str,
            stream: &'a str,
        }
        let minimal = rmp_serde::to_vec_named(&Minimal {
            id: "sm",
            cluster: "c",
            subcluster: "sc-1",
            rpc_prefix: "p",
            stream: "s",
        })
        .unwrap();
        let decoded = SubmasterInfo::decode(&minimal).unwrap();
        assert!(decoded.labels.is_empty());
        assert_eq!(decoded.last_seq, 0);
        assert!(SubmasterInfo::decode(b"\xc1garbage").is_err());
    }
}
