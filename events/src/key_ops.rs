//! Stored messages as a key index folds them: each committed put becomes the hash
//! of its key, each evicted or removed key the hash to drop, and only the rare
//! other events (segments, nodes, snapshot markers) are decoded whole. Keys are
//! borrowed from the message bytes, so a put costs no allocation; one `Vec` per
//! message holds the result. A put in the encoder's own (canonical) form is read
//! in one pass over its bytes (`canonical`); any other form goes through serde.
//! Validation is the owned decoder's (`codec`): the same events are accepted,
//! skipped or refused, which the tests check against it.

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::Deserialize;

use self::canonical::PutFields;
use crate::codec::{decode_body, decode_message, Decoded, Frame, UndecodableMessage};
use crate::error::{EventError, EventErrorKind};
use crate::event::{key_hash, EventKind, KvEvent};
use crate::id::validate_id;
use crate::limits::Limits;

mod canonical;

/// What one event does to a key index.
#[derive(Debug, Clone, PartialEq)]
pub enum KeyOp {
    /// A put committed the key with this hash.
    Put(u64),
    /// An eviction or removal dropped the key with this hash.
    Drop(u64),
    /// Any other event, decoded whole (boxed: these are rare, and a put's
    /// operation stays 16 bytes instead of an event's size).
    Event(Box<KvEvent>),
}

// One message's operations are written and read once per event at the
// projector's full rate: a put's operation must stay small.
const _: () = assert!(std::mem::size_of::<KeyOp>() <= 16);

/// A stored message as key operations, ready to fold.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyOps {
    /// The message's stream sequence.
    pub seq: u64,
    /// When it was stored, Unix milliseconds.
    pub unix_ms: u64,
    /// The operations, in event order (an eviction of n keys gives n).
    pub ops: Vec<KeyOp>,
    /// Events that decoded.
    pub events: usize,
    /// Events skipped because they did not decode (unknown kinds, bad bodies).
    pub skipped: usize,
}

impl KeyOps {
    /// The key operations of an owned decoded message: what
    /// [`decode_key_ops`] yields for the same bytes.
    pub fn of(decoded: &Decoded) -> Self {
        let mut ops = Vec::with_capacity(decoded.events.len());
        for event in &decoded.events {
            push_owned(&mut ops, event);
        }
        Self {
            seq: decoded.seq,
            unix_ms: decoded.unix_ms,
            ops,
            events: decoded.events.len(),
            skipped: decoded.skipped,
        }
    }
}

fn push_owned(ops: &mut Vec<KeyOp>, event: &KvEvent) {
    match event {
        KvEvent::PutCommitted(put) => ops.push(KeyOp::Put(put.key_hash)),
        KvEvent::Evicted(crate::Evicted { keys }) | KvEvent::Removed(crate::Removed { keys }) => {
            ops.extend(keys.iter().map(|key| KeyOp::Drop(key_hash(key))));
        }
        other => ops.push(KeyOp::Event(Box::new(other.clone()))),
    }
}

/// The fields of a committed put an index needs, borrowed; the others are
/// decoded only to check them as the owned form does.
#[derive(Deserialize)]
struct PutView<'a> {
    #[serde(rename = "k", borrow)]
    key: &'a str,
    #[serde(rename = "h")]
    key_hash: u64,
    #[serde(rename = "s")]
    size: u64,
    #[serde(rename = "c")]
    _checksum: u64,
    #[serde(rename = "p")]
    placements: PlacementCount,
    #[serde(rename = "f", default)]
    _flags: u32,
    #[serde(rename = "i", default)]
    _put_id: u64,
}

impl<'a> PutView<'a> {
    fn fields(&self) -> PutFields<'a> {
        PutFields {
            key: self.key,
            key_hash: self.key_hash,
            size: self.size,
            placements: self.placements.0,
        }
    }
}

/// The keys of an eviction or removal, borrowed.
#[derive(Deserialize)]
struct KeysView<'a> {
    #[serde(rename = "k", borrow)]
    keys: Vec<&'a str>,
}

/// A placement, checked as the owned form checks it.
#[derive(Deserialize)]
struct PlacementView<'a> {
    #[serde(rename = "g", borrow)]
    segment: &'a str,
    #[serde(rename = "o")]
    _offset: u64,
}

/// How many placements a put lists, each checked, none kept.
struct PlacementCount(usize);

impl<'de> Deserialize<'de> for PlacementCount {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Counter;

        impl<'de> Visitor<'de> for Counter {
            type Value = PlacementCount;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a sequence of placements")
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<PlacementCount, A::Error> {
                let mut count = 0;
                while let Some(placement) = seq.next_element::<PlacementView<'de>>()? {
                    validate_id("segment", placement.segment).map_err(de::Error::custom)?;
                    count += 1;
                }
                Ok(PlacementCount(count))
            }
        }

        deserializer.deserialize_seq(Counter)
    }
}

/// Decodes one event body into `ops`; on failure `ops` is as it was.
fn push_body(ops: &mut Vec<KeyOp>, frame: Frame<'_>, limits: &Limits) -> Result<(), EventError> {
    let Frame { index, kind, body } = frame;
    let body_error = |reason: String| EventError {
        index,
        kind: EventErrorKind::Body { kind, reason },
    };
    let invalid = |source| EventError {
        index,
        kind: EventErrorKind::Invalid { kind, source },
    };
    match kind {
        EventKind::PutCommitted => {
            let put = match canonical::read_put(body) {
                Some(put) => put,
                None => rmp_serde::from_slice::<PutView<'_>>(body)
                    .map_err(|e| body_error(e.to_string()))?
                    .fields(),
            };
            limits
                .check_put(put.key, put.key_hash, put.placements, put.size)
                .map_err(invalid)?;
            ops.push(KeyOp::Put(put.key_hash));
        }
        EventKind::Evicted | EventKind::Removed => {
            let view: KeysView<'_> =
                rmp_serde::from_slice(body).map_err(|e| body_error(e.to_string()))?;
            limits.check_keys(&view.keys).map_err(invalid)?;
            ops.extend(view.keys.iter().map(|key| KeyOp::Drop(key_hash(key))));
        }
        _ => {
            let event = decode_body(kind, body).map_err(|e| body_error(e.to_string()))?;
            limits.check_event(&event).map_err(invalid)?;
            ops.push(KeyOp::Event(Box::new(event)));
        }
    }
    Ok(())
}

/// Decodes the message stored at `seq` into key operations. Events that do not
/// decode are skipped and counted; a message whose envelope or an event frame is
/// broken is refused whole (as `codec::decode_stored` does).
///
/// # Errors
/// [`UndecodableMessage`].
pub fn decode_key_ops(
    seq: u64,
    unix_ms: u64,
    payload: &[u8],
    limits: &Limits,
) -> Result<KeyOps, UndecodableMessage> {
    let undecodable = |cause| UndecodableMessage { seq, cause };
    let message = decode_message(payload, limits).map_err(|e| undecodable(e.into()))?;
    let mut events = message.events;
    let mut decoded = KeyOps {
        seq,
        unix_ms,
        ops: Vec::with_capacity(events.remaining()),
        events: 0,
        skipped: 0,
    };
    let limits = *events.limits();
    while let Some(frame) = events.next_frame() {
        let pushed = frame.and_then(|frame| push_body(&mut decoded.ops, frame, &limits));
        match pushed {
            Ok(()) => decoded.events += 1,
            Err(error) if error.is_skippable() => {
                tracing::warn!(seq, %error, "skipping an event that does not decode");
                decoded.skipped += 1;
            }
            Err(error) => return Err(undecodable(error.into())),
        }
    }
    Ok(decoded)
}
