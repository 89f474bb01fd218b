//! The message envelope: how a batch of events becomes one JetStream message.
//!
//! Wire layout (MessagePack), version 1:
//! ```text
//! message := array(3) [ version: uint, header: map, events: array32(N) ]
//! header  := map { "p": producer id, "e": epoch, "t": unix time in ms }
//! event   := array(2) [ kind code: uint, body: bin ]
//! body    := map of the kind's fields (short names)
//! ```
//! The body of each event is length-prefixed, so a reader skips a kind it does not
//! know (a typed, skippable error) and still decodes the rest; bodies and the header
//! are maps, so readers ignore fields they do not know and default missing ones.

use serde::{Deserialize, Serialize};

use crate::error::{DecodeError, EncodeError, EventError, EventErrorKind};
use crate::event::{
    EventKind, Evicted, KvEvent, NodeLost, PutCommitted, Removed, SegmentMounted, SegmentUnmounted,
    SnapshotTaken,
};
use crate::id::ProducerId;
use crate::limits::Limits;

/// The envelope version this build writes.
pub const ENVELOPE_VERSION: u16 = 1;
/// The newest envelope version this build reads.
pub const MAX_READABLE_VERSION: u16 = 1;

/// Who wrote a message, under which leadership epoch, and when.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    /// The producing sub-master instance.
    #[serde(rename = "p")]
    pub producer: ProducerId,
    /// Its leadership epoch (grows with every takeover).
    #[serde(rename = "e")]
    pub epoch: u64,
    /// Wall-clock time of encoding, Unix milliseconds.
    #[serde(rename = "t")]
    pub unix_ms: u64,
}

/// Builds one message incrementally, so a group commit can add submissions until
/// the size limit and roll the last one back if it does not fit.
#[derive(Debug)]
pub struct MessageBuilder {
    buf: Vec<u8>,
    count_at: usize,
    count: u32,
}

/// Bytes of a `bin32` header: marker plus 4 length bytes.
const BIN32_HEADER: usize = 5;
/// Bytes of an `array32` header.
const ARRAY32_HEADER: usize = 5;

fn write_error(err: impl std::fmt::Display) -> EncodeError {
    EncodeError::Serialize(err.to_string())
}

impl MessageBuilder {
    /// Starts a message with `header`, reusing `buf`'s allocation.
    ///
    /// # Errors
    /// [`EncodeError`] if the header cannot be serialized.
    pub fn new(header: &Header, mut buf: Vec<u8>) -> Result<Self, EncodeError> {
        buf.clear();
        rmp::encode::write_array_len(&mut buf, 3).map_err(write_error)?;
        rmp::encode::write_uint(&mut buf, u64::from(ENVELOPE_VERSION)).map_err(write_error)?;
        header
            .serialize(&mut rmp_serde::Serializer::new(&mut buf).with_struct_map())
            .map_err(write_error)?;
        let count_at = buf.len();
        // array32 with a placeholder count, patched by `finish`.
        buf.extend_from_slice(&[0xdd, 0, 0, 0, 0]);
        Ok(Self {
            buf,
            count_at,
            count: 0,
        })
    }

    /// Appends one event.
    ///
    /// # Errors
    /// [`EncodeError`] if the body cannot be serialized or is larger than 4 GiB.
    pub fn push(&mut self, event: &KvEvent) -> Result<(), EncodeError> {
        rmp::encode::write_array_len(&mut self.buf, 2).map_err(write_error)?;
        rmp::encode::write_uint(&mut self.buf, u64::from(event.kind().code()))
            .map_err(write_error)?;
        let len_at = self.buf.len();
        self.buf.extend_from_slice(&[0xc6, 0, 0, 0, 0]);
        let body_start = self.buf.len();
        let mut serializer = rmp_serde::Serializer::new(&mut self.buf).with_struct_map();
        match event {
            KvEvent::SegmentMounted(body) => body.serialize(&mut serializer),
            KvEvent::SegmentUnmounted(body) => body.serialize(&mut serializer),
            KvEvent::NodeLost(body) => body.serialize(&mut serializer),
            KvEvent::PutCommitted(body) => body.serialize(&mut serializer),
            KvEvent::Evicted(body) => body.serialize(&mut serializer),
            KvEvent::Removed(body) => body.serialize(&mut serializer),
            KvEvent::Snapshot(body) => body.serialize(&mut serializer),
        }
        .map_err(write_error)?;
        let body_len = u32::try_from(self.buf.len() - body_start)
            .map_err(|_| EncodeError::Serialize("event body larger than 4 GiB".into()))?;
        self.buf[len_at + 1..len_at + BIN32_HEADER].copy_from_slice(&body_len.to_be_bytes());
        self.count += 1;
        Ok(())
    }

    /// The encoded size so far.
    pub fn len_bytes(&self) -> usize {
        self.buf.len()
    }

    /// Events pushed so far.
    pub fn event_count(&self) -> usize {
        self.count as usize
    }

    /// A point to roll back to with [`MessageBuilder::rollback`].
    pub fn mark(&self) -> (usize, u32) {
        (self.buf.len(), self.count)
    }

    /// Drops every event pushed after `mark`.
    pub fn rollback(&mut self, mark: (usize, u32)) {
        self.buf.truncate(mark.0);
        self.count = mark.1;
    }

    /// Finishes the message and returns its bytes.
    pub fn finish(mut self) -> Vec<u8> {
        let at = self.count_at + 1;
        self.buf[at..at + ARRAY32_HEADER - 1].copy_from_slice(&self.count.to_be_bytes());
        self.buf
    }
}

/// Encodes `events` as one message.
///
/// # Errors
/// [`EncodeError`] when an event is invalid under `limits` or the message is too big.
pub fn encode_message(
    header: &Header,
    events: &[KvEvent],
    limits: &Limits,
) -> Result<Vec<u8>, EncodeError> {
    if events.len() > limits.max_events_per_message {
        return Err(EncodeError::TooManyEvents {
            count: events.len(),
            max: limits.max_events_per_message,
        });
    }
    let mut builder = MessageBuilder::new(header, Vec::new())?;
    for (index, event) in events.iter().enumerate() {
        limits
            .check_event(event)
            .map_err(|source| EncodeError::Invalid { index, source })?;
        builder.push(event)?;
    }
    if builder.len_bytes() > limits.max_message_bytes {
        return Err(EncodeError::MessageTooLarge {
            size: builder.len_bytes(),
            max: limits.max_message_bytes,
        });
    }
    Ok(builder.finish())
}

/// A decoded message: its header and a lazy iterator over its events.
#[derive(Debug)]
pub struct DecodedMessage<'a> {
    /// The envelope version it was written with.
    pub version: u16,
    /// Who wrote it.
    pub header: Header,
    /// Its events, decoded one by one.
    pub events: Events<'a>,
}

/// Decodes a message's envelope; the events decode lazily as they are iterated.
///
/// # Errors
/// [`DecodeError`] when the bytes are not a message this build can read.
pub fn decode_message<'a>(
    bytes: &'a [u8],
    limits: &Limits,
) -> Result<DecodedMessage<'a>, DecodeError> {
    let mut rest = bytes;
    let outer = rmp::decode::read_array_len(&mut rest)
        .map_err(|e| DecodeError::Framing(format!("envelope: {e}")))?;
    if outer < 3 {
        return Err(DecodeError::Framing(format!(
            "envelope has {outer} parts, expected 3"
        )));
    }
    let version: u16 = rmp::decode::read_int(&mut rest)
        .map_err(|e| DecodeError::Framing(format!("version: {e}")))?;
    if version == 0 || version > MAX_READABLE_VERSION {
        return Err(DecodeError::UnknownVersion {
            found: version,
            supported: MAX_READABLE_VERSION,
        });
    }
    let header: Header =
        rmp_serde::decode::from_read(&mut rest).map_err(|e| DecodeError::Header(e.to_string()))?;
    let count = rmp::decode::read_array_len(&mut rest)
        .map_err(|e| DecodeError::Framing(format!("event list: {e}")))? as usize;
    if count > limits.max_events_per_message {
        return Err(DecodeError::TooManyEvents {
            count,
            max: limits.max_events_per_message,
        });
    }
    Ok(DecodedMessage {
        version,
        header,
        events: Events {
            rest,
            remaining: count,
            index: 0,
            limits: *limits,
        },
    })
}

/// A stored message decoded and validated, ready to fold. Decoding needs no access
/// to what it is folded into, so it can run outside that state's lock.
#[derive(Debug, Clone, PartialEq)]
pub struct Decoded {
    /// The message's stream sequence.
    pub seq: u64,
    /// When it was stored, Unix milliseconds.
    pub unix_ms: u64,
    /// Its events.
    pub events: Vec<KvEvent>,
    /// Events skipped because they did not decode (unknown kinds, bad bodies).
    pub skipped: usize,
}

/// Why a stored message was refused whole.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UndecodableCause {
    /// The envelope does not decode.
    #[error(transparent)]
    Envelope(#[from] DecodeError),
    /// An event frame is broken, so the events after it cannot be found.
    #[error(transparent)]
    Frame(#[from] EventError),
}

/// A stored message that does not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("message {seq} does not decode")]
pub struct UndecodableMessage {
    /// Its stream sequence.
    pub seq: u64,
    /// Why.
    #[source]
    pub cause: UndecodableCause,
}

/// Decodes the message stored at `seq`. Events that do not decode are skipped and
/// counted; a message whose envelope or an event frame is broken is refused whole,
/// so nothing of it is folded.
///
/// # Errors
/// [`UndecodableMessage`] (a follower re-reads the stream, then skips it).
pub fn decode_stored(
    seq: u64,
    unix_ms: u64,
    payload: &[u8],
    limits: &Limits,
) -> Result<Decoded, UndecodableMessage> {
    let message = decode_message(payload, limits).map_err(|e| UndecodableMessage {
        seq,
        cause: e.into(),
    })?;
    let mut decoded = Decoded {
        seq,
        unix_ms,
        events: Vec::with_capacity(message.events.remaining()),
        skipped: 0,
    };
    for event in message.events {
        match event {
            Ok(event) => decoded.events.push(event),
            Err(error) if error.is_skippable() => {
                tracing::warn!(seq, %error, "skipping an event that does not decode");
                decoded.skipped += 1;
            }
            Err(error) => {
                return Err(UndecodableMessage {
                    seq,
                    cause: error.into(),
                })
            }
        }
    }
    Ok(decoded)
}

/// The events of one message, decoded lazily. An event whose kind is unknown or
/// whose body is bad yields a skippable [`EventError`] and the iteration goes on; a
/// broken frame yields a final, non-skippable error and ends the iteration.
#[derive(Debug, Clone)]
pub struct Events<'a> {
    rest: &'a [u8],
    remaining: usize,
    index: usize,
    limits: Limits,
}

/// One event's frame: its position in the message, its kind and its body bytes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Frame<'a> {
    /// Its position in the message.
    pub(crate) index: usize,
    /// Its kind.
    pub(crate) kind: EventKind,
    /// Its body, undecoded.
    pub(crate) body: &'a [u8],
}

impl<'a> Events<'a> {
    /// Events not yet iterated, as the envelope announced them.
    pub fn remaining(&self) -> usize {
        self.remaining
    }

    /// The limits the events are checked against.
    pub(crate) fn limits(&self) -> &Limits {
        &self.limits
    }

    /// The next event's position, kind and body bytes, undecoded: an unknown kind
    /// is a skippable error, a broken frame a final one that ends the iteration.
    pub(crate) fn next_frame(&mut self) -> Option<Result<Frame<'a>, EventError>> {
        if self.remaining == 0 {
            return None;
        }
        self.remaining -= 1;
        let index = self.index;
        self.index += 1;
        let (code, body) = match self.frame() {
            Ok(frame) => frame,
            Err(reason) => {
                // The frame is broken: nothing after it can be trusted.
                self.remaining = 0;
                return Some(Err(EventError {
                    index,
                    kind: EventErrorKind::Framing(reason),
                }));
            }
        };
        match EventKind::from_code(code) {
            Some(kind) => Some(Ok(Frame { index, kind, body })),
            None => Some(Err(EventError {
                index,
                kind: EventErrorKind::UnknownKind(code),
            })),
        }
    }

    fn frame(&mut self) -> Result<(u16, &'a [u8]), String> {
        if let Some(frame) = self.builders_frame() {
            return Ok(frame);
        }
        let parts = rmp::decode::read_array_len(&mut self.rest).map_err(|e| e.to_string())?;
        if parts < 2 {
            return Err(format!("event frame has {parts} parts, expected 2"));
        }
        let code: u16 = rmp::decode::read_int(&mut self.rest).map_err(|e| e.to_string())?;
        let len = rmp::decode::read_bin_len(&mut self.rest).map_err(|e| e.to_string())? as usize;
        if len > self.rest.len() {
            return Err(format!(
                "event body of {len} bytes but only {} left",
                self.rest.len()
            ));
        }
        let (body, rest) = self.rest.split_at(len);
        self.rest = rest;
        Ok((code, body))
    }

    /// The next frame when it is in [`MessageBuilder`]'s own form (a fixarray
    /// of 2, the kind as a positive fixint, the body as a bin 32), read without
    /// the general decoder's calls; `None` (nothing consumed) for any other form,
    /// which [`Events::frame`] then reads or refuses.
    #[inline]
    fn builders_frame(&mut self) -> Option<(u16, &'a [u8])> {
        let [0x92, code @ 0..=0x7f, 0xc6, b0, b1, b2, b3, ref rest @ ..] = *self.rest else {
            return None;
        };
        let len = usize::try_from(u32::from_be_bytes([b0, b1, b2, b3])).ok()?;
        let body = rest.get(..len)?;
        self.rest = &rest[len..];
        Some((u16::from(code), body))
    }
}

/// Decodes one event body of `kind` into its owned form.
pub(crate) fn decode_body(
    kind: EventKind,
    body: &[u8],
) -> Result<KvEvent, rmp_serde::decode::Error> {
    Ok(match kind {
        EventKind::SegmentMounted => {
            KvEvent::SegmentMounted(rmp_serde::from_slice::<SegmentMounted>(body)?)
        }
        EventKind::SegmentUnmounted => {
            KvEvent::SegmentUnmounted(rmp_serde::from_slice::<SegmentUnmounted>(body)?)
        }
        EventKind::NodeLost => KvEvent::NodeLost(rmp_serde::from_slice::<NodeLost>(body)?),
        EventKind::PutCommitted => {
            KvEvent::PutCommitted(rmp_serde::from_slice::<PutCommitted>(body)?)
        }
        EventKind::Evicted => KvEvent::Evicted(rmp_serde::from_slice::<Evicted>(body)?),
        EventKind::Removed => KvEvent::Removed(rmp_serde::from_slice::<Removed>(body)?),
        EventKind::Snapshot => KvEvent::Snapshot(rmp_serde::from_slice::<SnapshotTaken>(body)?),
    })
}

impl Iterator for Events<'_> {
    type Item = Result<KvEvent, EventError>;

    fn next(&mut self) -> Option<Self::Item> {
        let Frame { index, kind, body } = match self.next_frame()? {
            Ok(frame) => frame,
            Err(error) => return Some(Err(error)),
        };
        let event = match decode_body(kind, body) {
            Ok(event) => event,
            Err(e) => {
                return Some(Err(EventError {
                    index,
                    kind: EventErrorKind::Body {
                        kind,
                        reason: e.to_string(),
                    },
                }))
            }
        };
        if let Err(source) = self.limits.check_event(&event) {
            return Some(Err(EventError {
                index,
                kind: EventErrorKind::Invalid { kind, source },
            }));
        }
        Some(Ok(event))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (0, Some(self.remaining))
    }
}
