//! The leader lease record of a sub-cluster: who leads it, in which epoch, and
//! where it takes direct requests. It is the value of the sub-cluster's key in
//! the leader bucket ([`Bucket::Leader`](crate::subject::Bucket::Leader)) and the
//! body of the leader's announcement on
//! [`leader_subject`](crate::subject::leader_subject), so a client learns the
//! direct endpoint either by reading the lease or by hearing a new leader.

use serde::{Deserialize, Serialize};

use crate::id::ProducerId;

/// The lease record (MessagePack, named fields; unknown fields are skipped, so
/// an older reader reads a newer record).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseHolder {
    /// Who holds it.
    pub producer: ProducerId,
    /// The epoch it leads in.
    pub epoch: u64,
    /// `host:port` where it takes direct requests ([`crate::rpc::direct`]), once
    /// it leads with a direct front; none while it only tries to lead, or when
    /// direct requests are off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub direct: Option<String>,
    /// The ticket a client shows on that endpoint (with it, or none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub direct_ticket: Option<crate::rpc::direct::DirectTicket>,
}

impl LeaseHolder {
    /// Encodes the record.
    ///
    /// # Errors
    /// When serialization fails (it does not for this type).
    pub fn encode(&self) -> Result<Vec<u8>, rmp_serde::encode::Error> {
        rmp_serde::to_vec_named(self)
    }

    /// Decodes a record.
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
    fn a_record_without_an_endpoint_reads_as_before_and_one_with_it_round_trips() {
        #[derive(Serialize)]
        struct Older<'a> {
            producer: &'a str,
            epoch: u64,
        }
        let older = rmp_serde::to_vec_named(&Older {
            producer: "sm-0",
            epoch: 3,
        })
        .unwrap();
        let read = LeaseHolder::decode(&older).unwrap();
        assert_eq!(read.direct, None);
        assert_eq!(read.encode().unwrap(), older);
        let with = LeaseHolder {
            direct: Some("10.0.0.1:4100".into()),
            direct_ticket: Some(crate::rpc::direct::DirectTicket::from_random([3; 16])),
            ..read
        };
        assert_eq!(LeaseHolder::decode(&with.encode().unwrap()).unwrap(), with);
        assert!(LeaseHolder::decode(b"\xc1").is_err());
    }
}
