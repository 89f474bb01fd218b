//! The inter-DC fetch RPC: the inter-DC master asks a gateway of the source pool
//! (NATS request on [`interdc_fetch_subject`](crate::subject::interdc_fetch_subject),
//! queue group [`GATEWAY_QUEUE`]) to read a block there and send it over the WAN to
//! a UDP address in the [`WanShape`] it chose; the gateway answers with a
//! [`FetchReply`]. Requests and replies are named-field MessagePack.

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The queue group every gateway of a cluster joins.
pub const GATEWAY_QUEUE: &str = "hkvm-interdc-gateway";

/// The stripe shape and pacing of one copy, chosen by the master.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WanShape {
    /// Bytes per second on the wire for this copy.
    pub rate_bytes_per_sec: u64,
    /// Original shards per stripe.
    pub data_shards: u16,
    /// Recovery shards per stripe.
    pub parity_shards: u16,
    /// Bytes per shard.
    pub shard_bytes: u32,
    /// How long the sender waits for the answer to an end-of-round probe before
    /// probing again, milliseconds (0: the sender's default). A few round trips of
    /// the WAN: a lost probe or acknowledgement costs this much.
    #[serde(default)]
    pub feedback_timeout_ms: u32,
}

impl WanShape {
    /// The feedback timeout for a WAN round trip of `rtt`: three round trips and
    /// some slack for the receiver, within 50 ms .. 2 s.
    pub fn feedback_timeout_for(rtt: Duration) -> u32 {
        let timeout = (rtt * 3 + Duration::from_millis(20))
            .clamp(Duration::from_millis(50), Duration::from_secs(2));
        u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX)
    }
}

/// A fetch request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FetchRequest {
    /// The source sub-cluster holding the block.
    pub subcluster: String,
    /// The key.
    pub key: String,
    /// The checksum the master expects (from the source's events).
    pub checksum: u64,
    /// Where to send the packets (`host:port`, UDP).
    pub reply_addr: String,
    /// How to send them.
    pub shape: WanShape,
}

/// What a gateway's send cost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SentReport {
    /// Payload bytes.
    pub bytes: u64,
    /// Bytes on the wire.
    pub wire_bytes: u64,
    /// Rounds.
    pub rounds: u32,
    /// Stripes sent again.
    pub stripes_retransmitted: u64,
}

/// A gateway's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum FetchReply {
    /// The block was sent and acknowledged by the receiver.
    Sent(SentReport),
    /// The source no longer holds the key (evicted or removed).
    Gone,
    /// The source holds a different value under the key now.
    Changed {
        /// Its checksum.
        checksum: u64,
    },
    /// The request was malformed.
    BadRequest(String),
    /// Reading or sending failed.
    Failed(String),
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn request() -> FetchRequest {
        FetchRequest {
            subcluster: "sc-0".into(),
            key: "model/block-1".into(),
            checksum: 42,
            reply_addr: "10.0.0.1:40000".into(),
            shape: WanShape {
                rate_bytes_per_sec: 1_000_000,
                data_shards: 64,
                parity_shards: 16,
                shard_bytes: 1024,
                feedback_timeout_ms: 170,
            },
        }
    }

    #[test]
    fn requests_and_replies_round_trip() {
        let bytes = rmp_serde::to_vec_named(&request()).unwrap();
        assert_eq!(
            rmp_serde::from_slice::<FetchRequest>(&bytes).unwrap(),
            request()
        );
        for reply in [
            FetchReply::Sent(SentReport {
                bytes: 1,
                wire_bytes: 2,
                rounds: 1,
                stripes_retransmitted: 0,
            }),
            FetchReply::Gone,
            FetchReply::Changed { checksum: 7 },
            FetchReply::BadRequest("x".into()),
            FetchReply::Failed("y".into()),
        ] {
            let bytes = rmp_serde::to_vec_named(&reply).unwrap();
            assert_eq!(rmp_serde::from_slice::<FetchReply>(&bytes).unwrap(), reply);
        }
    }

    #[test]
    fn the_feedback_timeout_follows_the_round_trip_within_bounds() {
        assert_eq!(
            WanShape::feedback_timeout_for(Duration::from_millis(50)),
            170
        );
        assert_eq!(WanShape::feedback_timeout_for(Duration::ZERO), 50);
        assert_eq!(
            WanShape::feedback_timeout_for(Duration::from_secs(10)),
            2000
        );
    }

    proptest! {
        /// Whatever arrives on the fetch subject or as its reply decodes or is
        /// refused with an error, never a panic.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = rmp_serde::from_slice::<FetchRequest>(&bytes);
            let _ = rmp_serde::from_slice::<FetchReply>(&bytes);
        }

        /// A valid request with some bytes flipped still never panics the decoder.
        #[test]
        fn mutated_requests_never_panic(flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8)) {
            let mut bytes = rmp_serde::to_vec_named(&request()).unwrap();
            for (at, value) in flips {
                let len = bytes.len();
                bytes[at % len] = value;
            }
            let _ = rmp_serde::from_slice::<FetchRequest>(&bytes);
        }
    }
}
