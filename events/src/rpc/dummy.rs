//! The local protocol between a real client (`hkvm node`, one per host) and its
//! dummy clients (one per inference process), over a Unix domain socket. A dummy
//! shares one memory region with its real client (a memfd passed with the first
//! frame); requests name bytes by [`Span`]s of that region, so values move
//! between the dummy's buffers and the pool with no copy through the socket.
//!
//! A dummy may share more regions later (host buffers it allocated before it
//! connected, such as an inference engine's host KV pool): each comes over a
//! connection of its own whose [`Hello`] names the session ([`Attach`]) and the
//! region number the dummy chose; spans then name that number. The real client
//! accepts an attachment only from the process that opened the session.
//!
//! Framing: a 4-byte little-endian length, then a named-field MessagePack
//! [`Frame`]. Replies carry the id of their request; requests are pipelined.

use serde::{Deserialize, Serialize};

use super::submaster::ReplicaList;

/// The protocol version this build speaks.
pub const DUMMY_PROTOCOL_VERSION: u16 = 1;
/// The largest frame either side accepts.
pub const MAX_FRAME_BYTES: usize = 16 << 20;

/// The abstract Unix socket name a real client serving dummies on `port` listens
/// on (Mooncake's `server_address` is `host:port`; the port names the socket).
pub fn dummy_socket_name(port: u16) -> String {
    format!("hkvm-node-{port}")
}

/// The first frame of a connection, sent by the dummy with the region's file
/// descriptor attached.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// The dummy's protocol version.
    pub version: u16,
    /// The dummy's process id (for logs).
    pub pid: u32,
    /// The shared region's length in bytes.
    pub region_bytes: u64,
    /// Set when this connection only attaches its region to an open session
    /// (answered with [`Welcome::Attached`], then closed).
    #[serde(default)]
    pub attach: Option<Attach>,
}

/// Which session a region joins, under which number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attach {
    /// The session, from [`Welcome::Ready`].
    pub session: u64,
    /// The number spans will name (not 0, which is the session's first region;
    /// unique within the session).
    pub region: u32,
}

/// The real client's answer to [`Hello`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Welcome {
    /// The region is mapped; requests may follow.
    Ready {
        /// The real client's node endpoint (`host:port`).
        hostname: String,
        /// The session id regions attach to.
        #[serde(default)]
        session: u64,
    },
    /// The region of an [`Attach`] connection is mapped.
    Attached {
        /// Its number.
        region: u32,
    },
    /// The connection is refused.
    Refused {
        /// Why.
        reason: String,
    },
}

/// A range of a shared region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    /// The region: 0 for the one shared at connection, else an attached one.
    #[serde(default)]
    pub region: u32,
    /// Offset from the region's start.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

impl Span {
    /// A span of the region shared at connection (number 0).
    pub fn in_pool(offset: u64, len: u64) -> Self {
        Self {
            region: 0,
            offset,
            len,
        }
    }

    /// Whether the span lies inside a region of `region_bytes`.
    pub fn fits(&self, region_bytes: u64) -> bool {
        self.offset
            .checked_add(self.len)
            .is_some_and(|end| end <= region_bytes)
    }
}

/// How a put is placed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    /// Replicas on distinct nodes.
    pub replicas: u32,
    /// The first replica's preferred segment (`host:port`).
    pub preferred_segment: Option<String>,
    /// Never evict.
    pub hard_pin: bool,
}

/// A dummy's request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DummyRequest {
    /// Store each key's value: the concatenation of its spans.
    Put {
        /// The keys.
        keys: Vec<String>,
        /// Per key, the spans holding its value, in order.
        spans: Vec<Vec<Span>>,
        /// Placement.
        placement: Placement,
    },
    /// Read each key's value into its spans, in order.
    GetInto {
        /// The keys.
        keys: Vec<String>,
        /// Per key, where to put its value.
        spans: Vec<Vec<Span>>,
    },
    /// Each key's value size.
    Size {
        /// The keys.
        keys: Vec<String>,
    },
    /// Where each key's replicas are (Mooncake's `get_replica_desc`).
    Replicas {
        /// The keys.
        keys: Vec<String>,
    },
    /// Whether each key exists anywhere.
    Exist {
        /// The keys.
        keys: Vec<String>,
    },
    /// Remove keys wherever they are.
    Remove {
        /// The keys.
        keys: Vec<String>,
        /// Even when leased.
        force: bool,
    },
    /// Remove every object, or those whose key matches `pattern`.
    RemoveAll {
        /// A regular expression, or all.
        pattern: Option<String>,
        /// Even when leased.
        force: bool,
        /// Only this tenant's keys (see [`crate::tenant`]); none: every key.
        #[serde(default)]
        tenant: Option<String>,
    },
    /// Whether the real client's sub-master answers.
    Health,
    /// Stop using an attached region (the real client unmaps it once the
    /// requests using it finished); answered with `Codes([0])`.
    ReleaseRegion {
        /// Its number.
        region: u32,
    },
}

/// The real client's reply. Integer results are Mooncake codes (0 or negative),
/// sizes (≥ 0 or a negative code), or existence (1, 0, -1).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DummyReply {
    /// Per key, 0 or a negative code (put, remove).
    Codes(Vec<i32>),
    /// Per key, a size or a negative code (get_into, size).
    Sizes(Vec<i64>),
    /// Per key, 1, 0, or -1 (exist).
    Exist(Vec<i32>),
    /// A count or a negative code (remove_all).
    Count(i64),
    /// 0 healthy, 2 sub-master unreachable (health).
    Health(i32),
    /// Per key, its replicas or a negative code (replicas).
    Replicas(Vec<Result<Vec<ReplicaDesc>, i32>>),
    /// The request as a whole was refused (malformed, a span outside the region).
    Refused {
        /// A Mooncake code.
        code: i32,
        /// Why.
        reason: String,
    },
}

/// One replica of a value, as Mooncake's buffer descriptor gives it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaDesc {
    /// The value's size in bytes.
    pub size: u64,
    /// Its offset in the segment (where Mooncake gives the buffer's address).
    pub offset: u64,
    /// The transfer endpoint of the node holding it, `host:port`.
    pub endpoint: String,
}

impl ReplicaDesc {
    /// The descriptors of every replica in `list`.
    pub fn of(list: &ReplicaList) -> Vec<Self> {
        list.replicas
            .iter()
            .map(|replica| Self {
                size: list.size,
                offset: replica.offset,
                endpoint: replica.endpoint.clone(),
            })
            .collect()
    }
}

/// A request or reply with the id that pairs them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Frame<T> {
    /// Chosen by the dummy, echoed by the real client.
    pub id: u64,
    /// The request or reply.
    pub body: T,
}

/// Why a frame could not be encoded or decoded.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// Longer than [`MAX_FRAME_BYTES`].
    #[error("frame of {len} bytes exceeds {MAX_FRAME_BYTES}")]
    TooLarge {
        /// Its length.
        len: usize,
    },
    /// The body does not decode.
    #[error("malformed frame")]
    Malformed(#[source] rmp_serde::decode::Error),
    /// The body could not be encoded.
    #[error("encoding a frame")]
    Encode(#[source] rmp_serde::encode::Error),
}

/// Encodes `value` with its 4-byte length prefix.
///
/// # Errors
/// [`FrameError::TooLarge`] or [`FrameError::Encode`].
pub fn encode_frame<T: Serialize>(value: &T) -> Result<Vec<u8>, FrameError> {
    let mut bytes = vec![0u8; 4];
    rmp_serde::encode::write_named(&mut bytes, value).map_err(FrameError::Encode)?;
    let len = bytes.len() - 4;
    if len > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge { len });
    }
    bytes[..4].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(bytes)
}

/// The body length a 4-byte prefix announces.
///
/// # Errors
/// [`FrameError::TooLarge`] for a length beyond the limit.
pub fn frame_len(prefix: [u8; 4]) -> Result<usize, FrameError> {
    let len = u32::from_le_bytes(prefix) as usize;
    if len > MAX_FRAME_BYTES {
        return Err(FrameError::TooLarge { len });
    }
    Ok(len)
}

/// Decodes a frame body (without its prefix).
///
/// # Errors
/// [`FrameError::Malformed`].
pub fn decode_frame<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, FrameError> {
    rmp_serde::from_slice(body).map_err(FrameError::Malformed)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn request() -> Frame<DummyRequest> {
        Frame {
            id: 7,
            body: DummyRequest::Put {
                keys: vec!["k".into()],
                spans: vec![vec![Span::in_pool(16, 4), Span::in_pool(64, 2)]],
                placement: Placement {
                    replicas: 2,
                    preferred_segment: Some("h:1".into()),
                    hard_pin: true,
                },
            },
        }
    }

    #[test]
    fn frames_round_trip() {
        let bytes = encode_frame(&request()).unwrap();
        let len = frame_len(bytes[..4].try_into().unwrap()).unwrap();
        assert_eq!(len, bytes.len() - 4);
        let back: Frame<DummyRequest> = decode_frame(&bytes[4..]).unwrap();
        assert_eq!(back, request());
        let replies = [
            DummyReply::Sizes(vec![5, -704]),
            DummyReply::Replicas(vec![
                Ok(vec![ReplicaDesc {
                    size: 5,
                    offset: 4096,
                    endpoint: "h:1".into(),
                }]),
                Err(-704),
            ]),
        ];
        for body in replies {
            let reply = Frame { id: 7, body };
            let bytes = encode_frame(&reply).unwrap();
            assert_eq!(
                decode_frame::<Frame<DummyReply>>(&bytes[4..]).unwrap(),
                reply
            );
        }
        assert_eq!(dummy_socket_name(50052), "hkvm-node-50052");
    }

    #[test]
    fn spans_must_fit_the_region() {
        assert!(Span::in_pool(0, 10).fits(10));
        assert!(!Span::in_pool(1, 10).fits(10));
        assert!(!Span::in_pool(u64::MAX, 2).fits(u64::MAX));
        assert!(frame_len((MAX_FRAME_BYTES as u32 + 1).to_le_bytes()).is_err());
    }

    proptest! {
        #[test]
        fn arbitrary_bodies_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode_frame::<Frame<DummyRequest>>(&bytes);
            let _ = decode_frame::<Frame<DummyReply>>(&bytes);
            let _ = decode_frame::<Frame<Hello>>(&bytes);
        }
    }
}
