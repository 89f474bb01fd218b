//! The out-of-band exchange that connects two RC queue pairs: each side sends its
//! [`QpInfo`] (queue pair number, LID, GID, starting packet sequence number, and the
//! memory regions the peer may access one-sidedly: address, rkey, length) over a TCP
//! connection, length-prefixed and checksummed. Pure Rust: runs without a device.
//!
//! ```text
//! len u32 | magic "HKRD" | version u8 | qp_num u32 | lid u16 | gid [16] | psn u32
//! | regions u16 | { id len u8 | id | addr u64 | rkey u32 | len u64 }* | xxh3 u64
//! ```

use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use xxhash_rust::xxh3::xxh3_64;

use crate::error::TransferError;
use crate::region::RegionId;

const MAGIC: &[u8; 4] = b"HKRD";
const VERSION: u8 = 1;
/// The largest exchange message accepted.
pub const MAX_INFO_BYTES: usize = 64 * 1024;
/// Queue pair numbers and packet sequence numbers are 24-bit in the wire protocol.
pub const MAX_24BIT: u32 = (1 << 24) - 1;

/// A memory region a peer may read and write with one-sided operations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteRegion {
    /// The region's id (its segment id).
    pub id: RegionId,
    /// Its virtual address in the owner's process.
    pub addr: u64,
    /// The remote key of its registration.
    pub rkey: u32,
    /// Its length in bytes.
    pub len: u64,
}

/// What one side of an RC connection tells the other.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QpInfo {
    /// The queue pair number (24-bit).
    pub qp_num: u32,
    /// The port's LID (InfiniBand; zero on RoCE).
    pub lid: u16,
    /// The port's GID (RoCE and routed InfiniBand).
    pub gid: [u8; 16],
    /// The first packet sequence number (24-bit).
    pub psn: u32,
    /// Regions this side serves.
    pub regions: Vec<RemoteRegion>,
}

fn protocol(message: impl Into<String>) -> TransferError {
    TransferError::Protocol(message.into())
}

/// A little reader over a byte slice that fails cleanly at the end.
struct Cursor<'a> {
    bytes: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], TransferError> {
        if self.bytes.len() < n {
            return Err(protocol("truncated queue pair info"));
        }
        let (head, tail) = self.bytes.split_at(n);
        self.bytes = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], TransferError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }
}

impl QpInfo {
    /// Encodes the info (without the length prefix).
    ///
    /// # Errors
    /// [`TransferError::Invalid`] for numbers wider than 24 bits, too many regions or
    /// an encoding larger than [`MAX_INFO_BYTES`].
    pub fn encode(&self) -> Result<Vec<u8>, TransferError> {
        if self.qp_num > MAX_24BIT || self.psn > MAX_24BIT {
            return Err(TransferError::Invalid("qp_num and psn are 24-bit".into()));
        }
        let count = u16::try_from(self.regions.len())
            .map_err(|_| TransferError::Invalid("too many regions".into()))?;
        let mut out = Vec::with_capacity(64 + self.regions.len() * 64);
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        out.extend_from_slice(&self.qp_num.to_le_bytes());
        out.extend_from_slice(&self.lid.to_le_bytes());
        out.extend_from_slice(&self.gid);
        out.extend_from_slice(&self.psn.to_le_bytes());
        out.extend_from_slice(&count.to_le_bytes());
        for region in &self.regions {
            let id = region.id.as_str().as_bytes();
            // Region ids are at most 255 bytes by construction.
            out.push(id.len() as u8);
            out.extend_from_slice(id);
            out.extend_from_slice(&region.addr.to_le_bytes());
            out.extend_from_slice(&region.rkey.to_le_bytes());
            out.extend_from_slice(&region.len.to_le_bytes());
        }
        let check = xxh3_64(&out);
        out.extend_from_slice(&check.to_le_bytes());
        if out.len() > MAX_INFO_BYTES {
            return Err(TransferError::Invalid("queue pair info too large".into()));
        }
        Ok(out)
    }

    /// Decodes an info.
    ///
    /// # Errors
    /// [`TransferError::Corrupt`] when the checksum fails, [`TransferError::Protocol`]
    /// for anything malformed.
    pub fn decode(bytes: &[u8]) -> Result<Self, TransferError> {
        if bytes.len() < 8 {
            return Err(protocol("truncated queue pair info"));
        }
        let (body, check) = bytes.split_at(bytes.len() - 8);
        let mut raw = [0u8; 8];
        raw.copy_from_slice(check);
        if u64::from_le_bytes(raw) != xxh3_64(body) {
            return Err(TransferError::Corrupt {
                what: "queue pair info",
            });
        }
        let mut cursor = Cursor { bytes: body };
        if cursor.take(4)? != MAGIC {
            return Err(protocol("not a queue pair info"));
        }
        let version = cursor.array::<1>()?[0];
        if version != VERSION {
            return Err(protocol(format!("queue pair info version {version}")));
        }
        let qp_num = u32::from_le_bytes(cursor.array()?);
        let lid = u16::from_le_bytes(cursor.array()?);
        let gid = cursor.array::<16>()?;
        let psn = u32::from_le_bytes(cursor.array()?);
        if qp_num > MAX_24BIT || psn > MAX_24BIT {
            return Err(protocol("qp_num or psn wider than 24 bits"));
        }
        let count = u16::from_le_bytes(cursor.array()?);
        let mut regions = Vec::with_capacity(usize::from(count).min(1024));
        for _ in 0..count {
            let id_len = usize::from(cursor.array::<1>()?[0]);
            let id = std::str::from_utf8(cursor.take(id_len)?)
                .map_err(|_| protocol("region id is not UTF-8"))?;
            let id = RegionId::new(id).map_err(|error| protocol(error.to_string()))?;
            regions.push(RemoteRegion {
                id,
                addr: u64::from_le_bytes(cursor.array()?),
                rkey: u32::from_le_bytes(cursor.array()?),
                len: u64::from_le_bytes(cursor.array()?),
            });
        }
        if !cursor.bytes.is_empty() {
            return Err(protocol("trailing bytes after queue pair info"));
        }
        Ok(Self {
            qp_num,
            lid,
            gid,
            psn,
            regions,
        })
    }
}

/// Sends `local` and receives the peer's info on `stream`, both within `timeout`.
/// Both sides call this; each writes before it reads, and the infos are small
/// enough to sit in socket buffers, so neither waits for the other.
///
/// # Errors
/// [`TransferError::Timeout`], [`TransferError::Disconnected`], or the decoding
/// errors of [`QpInfo::decode`].
pub async fn exchange<S>(
    stream: &mut S,
    local: &QpInfo,
    timeout: Duration,
) -> Result<QpInfo, TransferError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let encoded = local.encode()?;
    let lost = |source| TransferError::Disconnected {
        endpoint: "queue pair exchange".into(),
        source,
    };
    let work = async {
        let mut message = Vec::with_capacity(4 + encoded.len());
        message.extend_from_slice(&(encoded.len() as u32).to_le_bytes());
        message.extend_from_slice(&encoded);
        stream.write_all(&message).await.map_err(lost)?;
        stream.flush().await.map_err(lost)?;
        let mut len = [0u8; 4];
        stream.read_exact(&mut len).await.map_err(lost)?;
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_INFO_BYTES {
            return Err(TransferError::TooLarge {
                what: "queue pair info",
                len: len as u64,
                max: MAX_INFO_BYTES as u64,
            });
        }
        let mut body = vec![0u8; len];
        stream.read_exact(&mut body).await.map_err(lost)?;
        QpInfo::decode(&body)
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| TransferError::Timeout {
            what: "queue pair exchange",
            endpoint: "peer".into(),
            after: timeout,
        })?
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use tokio::net::{TcpListener, TcpStream};

    fn info(qp_num: u32, regions: usize) -> QpInfo {
        QpInfo {
            qp_num,
            lid: 0x1234,
            gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
            psn: 0x00ab_cdef,
            regions: (0..regions)
                .map(|i| RemoteRegion {
                    id: RegionId::new(format!("node-{i}-seg-0")).unwrap(),
                    addr: 0x7f00_0000_0000 + (i as u64) * (1 << 30),
                    rkey: 0x1000 + i as u32,
                    len: 1 << 30,
                })
                .collect(),
        }
    }

    #[test]
    fn infos_round_trip_and_refuse_corruption() {
        let original = info(77, 3);
        let bytes = original.encode().unwrap();
        assert_eq!(QpInfo::decode(&bytes).unwrap(), original);
        for at in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[at] ^= 0x02;
            assert!(QpInfo::decode(&bad).is_err(), "byte {at}");
        }
        assert!(QpInfo::decode(&bytes[..bytes.len() - 1]).is_err());
        assert!(QpInfo::decode(&[]).is_err());
    }

    #[test]
    fn numbers_wider_than_24_bits_are_refused() {
        let mut wide = info(1 << 24, 0);
        assert_eq!(wide.encode().unwrap_err().kind(), crate::ErrorKind::Invalid);
        wide.qp_num = 1;
        wide.psn = 1 << 24;
        assert!(wide.encode().is_err());
    }

    #[tokio::test]
    async fn both_sides_exchange_over_a_real_tcp_socket() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server_info = info(9, 2);
        let server = {
            let server_info = server_info.clone();
            tokio::spawn(async move {
                let (mut stream, _) = listener.accept().await.unwrap();
                exchange(&mut stream, &server_info, Duration::from_secs(5))
                    .await
                    .unwrap()
            })
        };
        let client_info = info(21, 0);
        let mut stream = TcpStream::connect(addr).await.unwrap();
        let got = exchange(&mut stream, &client_info, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(got, server_info);
        assert_eq!(server.await.unwrap(), client_info);
    }

    #[tokio::test]
    async fn a_silent_or_lying_peer_is_a_typed_error() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut first, _) = listener.accept().await.unwrap();
            let (mut second, _) = listener.accept().await.unwrap();
            // The second peer announces a gigantic message.
            second.write_all(&u32::MAX.to_le_bytes()).await.unwrap();
            let mut sink = [0u8; 1024];
            let _ = first.read(&mut sink).await;
            tokio::time::sleep(Duration::from_secs(3600)).await;
        });
        let mut silent = TcpStream::connect(addr).await.unwrap();
        let error = exchange(&mut silent, &info(1, 0), Duration::from_millis(200))
            .await
            .unwrap_err();
        assert_eq!(error.kind(), crate::ErrorKind::Timeout);
        let mut liar = TcpStream::connect(addr).await.unwrap();
        let error = exchange(&mut liar, &info(1, 0), Duration::from_secs(5))
            .await
            .unwrap_err();
        assert_eq!(error.kind(), crate::ErrorKind::TooLarge);
    }
}
