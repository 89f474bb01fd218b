//! The direct request framing: the same request and reply bodies as over NATS
//! request/reply, sent on one TCP connection from a client to its sub-cluster's
//! leader, many in flight at once (pipelined), each matched to its reply by an id.
//!
//! Every frame is `len: u32` (big-endian, the bytes after it) then its content:
//! - hello (client, first frame): [`HELLO_MAGIC`], the version byte
//!   ([`DIRECT_VERSION`]), then a MessagePack [`DirectHello`];
//! - hello reply (server): a MessagePack `RpcReply<DirectWelcome>`;
//! - request (client): `id: u64`, `op_len: u8`, the operation's subject token
//!   (`Op::name`), the request body;
//! - reply (server): `id: u64`, the reply body (an `RpcReply`).
//!
//! A frame longer than [`MAX_FRAME_BYTES`] is refused before it is read.

use serde::{Deserialize, Serialize};

use super::submaster::Op;
use super::MAX_RPC_BYTES;
use crate::id::{ClusterId, SubclusterId};

/// The first bytes of a hello: a connection that does not start with them is
/// not a direct client.
pub const HELLO_MAGIC: &[u8; 8] = b"HKVM-DRQ";
/// The framing version this build speaks.
pub const DIRECT_VERSION: u8 = 1;
/// The longest frame content accepted: a largest body with its header.
pub const MAX_FRAME_BYTES: usize = MAX_RPC_BYTES + 512;
/// Bytes of a request's or reply's id.
const ID_BYTES: usize = 8;

/// What a client says first: which service it wants (a sub-cluster's leader, or
/// a global-master replica), so that an endpoint now used by another server is
/// recognised at once, and the ticket that lets it in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirectHello {
    /// The cluster.
    #[serde(rename = "c")]
    pub cluster: ClusterId,
    /// The sub-cluster whose leader it wants; none: a global-master replica.
    #[serde(rename = "s", default, skip_serializing_if = "Option::is_none")]
    pub subcluster: Option<SubclusterId>,
    /// The server's ticket, as the client read it over NATS with the endpoint.
    #[serde(rename = "t", default, skip_serializing_if = "Option::is_none")]
    pub ticket: Option<DirectTicket>,
}

/// Bytes of randomness in a [`DirectTicket`].
pub const TICKET_BYTES: usize = 16;

/// The credential of a direct port: 128 random bits a server draws when it
/// opens the port and publishes only with its endpoint, over NATS (a sub-master
/// leader in its lease record and announcement, a global-master replica in its
/// status). So only a process that may read those over NATS (a user of the
/// cluster's NATS account) links; one that merely reaches the port is refused.
/// Its `Debug` form hides it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct DirectTicket(String);

impl DirectTicket {
    /// The ticket of these random bytes (hex).
    pub fn from_random(bytes: [u8; TICKET_BYTES]) -> Self {
        Self(bytes.iter().map(|byte| format!("{byte:02x}")).collect())
    }

    /// Whether `offered` is this ticket (compared in constant time).
    pub fn admits(&self, offered: Option<&DirectTicket>) -> bool {
        offered.is_some_and(|offered| {
            constant_time_eq::constant_time_eq(self.0.as_bytes(), offered.0.as_bytes())
        })
    }
}

impl std::fmt::Debug for DirectTicket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DirectTicket(..)")
    }
}

/// The server's answer to a hello it accepts: who serves, in which epoch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirectWelcome {
    /// The serving sub-master's producer id, or the global-master replica's name.
    #[serde(rename = "p")]
    pub server: String,
    /// The sub-master's leadership epoch (0 for a global-master replica).
    #[serde(rename = "e")]
    pub epoch: u64,
}

/// Whether a client may send `op` on a direct connection: the hot operations.
/// Mounts, unmounts, removing everything and status stay on NATS, where the
/// broker's permissions say who may send them.
pub fn is_direct_op(op: Op) -> bool {
    matches!(
        op,
        Op::Ping
            | Op::Exist
            | Op::GetReplicaList
            | Op::PutStart
            | Op::PutEnd
            | Op::PutRevoke
            | Op::PutCommit
            | Op::Mixed
            | Op::Remove
            | Op::LeaseSpace
            | Op::LeaseReturn
    )
}

/// [`is_direct_op`] of the operation named `name` (false for unknown names).
pub fn is_direct_name(name: &str) -> bool {
    Op::from_name(name).is_some_and(is_direct_op)
}

/// Why bytes are not a direct frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The length prefix names more than [`MAX_FRAME_BYTES`].
    #[error("frame of {0} bytes exceeds {MAX_FRAME_BYTES}")]
    TooLong(usize),
    /// The frame ends before its header does.
    #[error("frame of {len} bytes is shorter than its {needed}-byte header")]
    Truncated {
        /// The frame's length.
        len: usize,
        /// What its header needs.
        needed: usize,
    },
    /// A hello that does not start with [`HELLO_MAGIC`].
    #[error("not a direct hello")]
    NotHello,
    /// A hello of a framing version this build does not speak.
    #[error("direct framing version {0}, this build speaks {DIRECT_VERSION}")]
    UnknownVersion(u8),
    /// The operation token is not UTF-8.
    #[error("operation name is not UTF-8")]
    BadOperation,
    /// A MessagePack part does not decode.
    #[error("malformed {what}: {message}")]
    Malformed {
        /// Which part.
        what: &'static str,
        /// The decoder's message.
        message: String,
    },
}

/// The length a frame's 4-byte prefix announces.
///
/// # Errors
/// [`FrameError::TooLong`] past [`MAX_FRAME_BYTES`].
pub fn frame_len(prefix: [u8; 4]) -> Result<usize, FrameError> {
    let len = u32::from_be_bytes(prefix) as usize;
    if len > MAX_FRAME_BYTES {
        return Err(FrameError::TooLong(len));
    }
    Ok(len)
}

/// Appends one length-prefixed frame of `parts` to `out`.
fn push_frame(out: &mut Vec<u8>, parts: &[&[u8]]) {
    let len: usize = parts.iter().map(|part| part.len()).sum();
    out.reserve(4 + len);
    out.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
    for part in parts {
        out.extend_from_slice(part);
    }
}

/// The hello frame of `hello`.
pub fn encode_hello(hello: &DirectHello) -> Vec<u8> {
    // A hello of two validated ids always encodes.
    let body = rmp_serde::to_vec_named(hello).unwrap_or_default();
    let mut out = Vec::new();
    push_frame(&mut out, &[HELLO_MAGIC, &[DIRECT_VERSION], &body]);
    out
}

/// Reads a hello frame's content (after its length prefix).
///
/// # Errors
/// [`FrameError::NotHello`], [`FrameError::UnknownVersion`] or
/// [`FrameError::Malformed`].
pub fn decode_hello(frame: &[u8]) -> Result<DirectHello, FrameError> {
    let rest = frame
        .strip_prefix(HELLO_MAGIC)
        .ok_or(FrameError::NotHello)?;
    let (&version, body) = rest.split_first().ok_or(FrameError::Truncated {
        len: frame.len(),
        needed: HELLO_MAGIC.len() + 1,
    })?;
    if version != DIRECT_VERSION {
        return Err(FrameError::UnknownVersion(version));
    }
    rmp_serde::from_slice(body).map_err(|e| FrameError::Malformed {
        what: "hello",
        message: e.to_string(),
    })
}

/// Appends the hello reply frame carrying `body` (an encoded
/// `RpcReply<DirectWelcome>`) to `out`.
pub fn push_welcome(out: &mut Vec<u8>, body: &[u8]) {
    push_frame(out, &[body]);
}

/// Appends a request frame to `out`.
pub fn push_request(out: &mut Vec<u8>, id: u64, op: &str, body: &[u8]) {
    let op = &op.as_bytes()[..op.len().min(usize::from(u8::MAX))];
    push_frame(out, &[&id.to_be_bytes(), &[op.len() as u8], op, body]);
}

/// A request frame's parts, borrowed from its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestFrame<'a> {
    /// The id its reply carries.
    pub id: u64,
    /// The operation's subject token.
    pub op: &'a str,
    /// The request body.
    pub body: &'a [u8],
}

/// Reads a request frame's content (after its length prefix).
///
/// # Errors
/// [`FrameError::Truncated`] or [`FrameError::BadOperation`].
pub fn decode_request(frame: &[u8]) -> Result<RequestFrame<'_>, FrameError> {
    let truncated = |needed| FrameError::Truncated {
        len: frame.len(),
        needed,
    };
    let (id, rest) = frame
        .split_first_chunk::<ID_BYTES>()
        .ok_or(truncated(ID_BYTES + 1))?;
    let (&op_len, rest) = rest.split_first().ok_or(truncated(ID_BYTES + 1))?;
    let op_len = usize::from(op_len);
    if rest.len() < op_len {
        return Err(truncated(ID_BYTES + 1 + op_len));
    }
    let (op, body) = rest.split_at(op_len);
    let op = std::str::from_utf8(op).map_err(|_| FrameError::BadOperation)?;
    Ok(RequestFrame {
        id: u64::from_be_bytes(*id),
        op,
        body,
    })
}

/// Appends a reply frame to `out`.
pub fn push_reply(out: &mut Vec<u8>, id: u64, body: &[u8]) {
    push_frame(out, &[&id.to_be_bytes(), body]);
}

/// Reads a reply frame's content (after its length prefix): its id and body.
///
/// # Errors
/// [`FrameError::Truncated`] when it is shorter than an id.
pub fn decode_reply(frame: &[u8]) -> Result<(u64, &[u8]), FrameError> {
    let (id, body) = frame
        .split_first_chunk::<ID_BYTES>()
        .ok_or(FrameError::Truncated {
            len: frame.len(),
            needed: ID_BYTES,
        })?;
    Ok((u64::from_be_bytes(*id), body))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The content of the one frame in `bytes`, checking its prefix.
    fn content(bytes: &[u8]) -> &[u8] {
        let (prefix, rest) = bytes.split_first_chunk::<4>().unwrap();
        assert_eq!(frame_len(*prefix).unwrap(), rest.len());
        rest
    }

    #[test]
    fn a_hello_round_trips_and_foreign_bytes_are_refused() {
        let hello = DirectHello {
            cluster: ClusterId::new("c").unwrap(),
            subcluster: Some(SubclusterId::new("sc-0").unwrap()),
            ticket: Some(DirectTicket::from_random([7; TICKET_BYTES])),
        };
        let bytes = encode_hello(&hello);
        assert_eq!(decode_hello(content(&bytes)).unwrap(), hello);
        let global = DirectHello {
            subcluster: None,
            ticket: None,
            ..hello.clone()
        };
        assert_eq!(
            decode_hello(content(&encode_hello(&global))).unwrap(),
            global
        );
        assert_eq!(decode_hello(b"GET / HTTP/1.1"), Err(FrameError::NotHello));
        let mut other = content(&bytes).to_vec();
        other[HELLO_MAGIC.len()] = DIRECT_VERSION + 1;
        assert_eq!(
            decode_hello(&other),
            Err(FrameError::UnknownVersion(DIRECT_VERSION + 1))
        );
        assert!(matches!(
            decode_hello(HELLO_MAGIC),
            Err(FrameError::Truncated { .. })
        ));
    }

    #[test]
    fn only_hot_operations_go_direct() {
        assert!(is_direct_name("exist"));
        assert!(is_direct_name("mixed"));
        assert!(is_direct_name("ping"));
        assert!(!is_direct_name("mount_segment"));
        assert!(!is_direct_name("remove_all"));
        assert!(!is_direct_name("status"));
        assert!(!is_direct_name("no_such_op"));
    }

    #[test]
    fn an_oversized_prefix_is_refused_before_reading() {
        let len = u32::try_from(MAX_FRAME_BYTES + 1).unwrap();
        assert_eq!(
            frame_len(len.to_be_bytes()),
            Err(FrameError::TooLong(MAX_FRAME_BYTES + 1))
        );
    }

    /// Golden bytes: the framing is a wire format.
    #[test]
    fn request_and_reply_frames_have_a_fixed_layout() {
        let mut out = Vec::new();
        push_request(&mut out, 7, "exist", b"\x90");
        assert_eq!(
            out,
            b"\x00\x00\x00\x0f\x00\x00\x00\x00\x00\x00\x00\x07\x05exist\x90".to_vec()
        );
        out.clear();
        push_reply(&mut out, 7, b"\x81");
        assert_eq!(
            out,
            b"\x00\x00\x00\x09\x00\x00\x00\x00\x00\x00\x00\x07\x81".to_vec()
        );
    }

    proptest::proptest! {
        /// Whatever the bytes, the decoders answer with a frame or a typed
        /// error, never a panic.
        #[test]
        fn decoders_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..64)) {
            let _ = decode_request(&bytes);
            let _ = decode_reply(&bytes);
            let _ = decode_hello(&bytes);
            let mut hello = HELLO_MAGIC.to_vec();
            hello.push(DIRECT_VERSION);
            hello.extend_from_slice(&bytes);
            let _ = decode_hello(&hello);
        }

        /// A request frame reads back as written.
        #[test]
        fn requests_round_trip(
            id in proptest::num::u64::ANY,
            op in "[a-z_]{0,40}",
            body in proptest::collection::vec(proptest::num::u8::ANY, 0..200),
        ) {
            let mut out = Vec::new();
            push_request(&mut out, id, &op, &body);
            let frame = decode_request(content(&out)).unwrap();
            proptest::prop_assert_eq!(frame, RequestFrame { id, op: &op, body: &body });
            out.clear();
            push_reply(&mut out, id, &body);
            proptest::prop_assert_eq!(decode_reply(content(&out)).unwrap(), (id, body.as_slice()));
        }
    }
}
