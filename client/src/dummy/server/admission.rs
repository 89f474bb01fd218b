//! Admitting a dummy's connection: its hello and region descriptor read within a
//! deadline (a peer that closes or stalls ends the handshake), and the checks made
//! before anything of it is mapped: who the peer is, its protocol version, and the
//! session's limits on regions and bytes.

use std::os::fd::{AsFd as _, OwnedFd};
use std::time::Duration;

use hkvm_events::rpc::dummy::{decode_frame, frame_len, Frame, Hello, DUMMY_PROTOCOL_VERSION};
use tokio::net::UnixStream;

use super::super::access::PeerAccess;
use super::super::fd::recv_with_fd;
use super::Regions;

/// What a real client accepts from its dummies.
#[derive(Debug, Clone)]
pub struct DummyServerConfig {
    /// The users whose processes may connect (this process's own always).
    pub access: PeerAccess,
    /// How long a connection may take to send its first frame.
    pub handshake_timeout: Duration,
    /// Regions one dummy may share at once (the first included).
    pub max_regions: usize,
    /// Bytes of one dummy's regions mapped at once.
    pub max_mapped_bytes: u64,
    /// Requests of one dummy served at once; further ones wait to be read.
    pub max_in_flight: usize,
}

impl Default for DummyServerConfig {
    fn default() -> Self {
        Self {
            access: PeerAccess::own_user(),
            handshake_timeout: Duration::from_secs(5),
            max_regions: 1024,
            max_mapped_bytes: 16 << 40,
            max_in_flight: 1024,
        }
    }
}

/// Whether one more region of `bytes` fits a session holding `regions`.
pub(super) fn within_limits(
    config: &DummyServerConfig,
    regions: &Regions,
    bytes: u64,
) -> Result<(), String> {
    if regions.len() >= config.max_regions {
        return Err(format!(
            "{} regions are shared already (the limit)",
            regions.len()
        ));
    }
    let mapped: u64 = regions.values().map(|region| region.len()).sum();
    if mapped.saturating_add(bytes) > config.max_mapped_bytes {
        return Err(format!(
            "{bytes} more bytes would map {} of at most {}",
            mapped.saturating_add(bytes),
            config.max_mapped_bytes
        ));
    }
    Ok(())
}

/// Reads the Hello frame and the region's descriptor (not mapped yet: that
/// waits until the hello is accepted). A peer that closes or sends a frame too
/// long for a hello is an error, at once.
pub(super) async fn handshake(stream: &UnixStream) -> std::io::Result<(Hello, OwnedFd)> {
    let invalid = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidData, what);
    let closed = || invalid("closed during the handshake".into());
    let mut buffer = vec![0u8; 4096];
    let (mut filled, fd) = loop {
        stream.readable().await?;
        match stream.try_io(tokio::io::Interest::READABLE, || {
            recv_with_fd(stream.as_fd(), &mut buffer)
        }) {
            Ok((0, _)) => return Err(closed()),
            Ok(received) => break received,
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(error) => return Err(error),
        }
    };
    let fd = fd.ok_or_else(|| invalid("the first frame carried no region".into()))?;
    read_until(stream, &mut buffer, &mut filled, 4).await?;
    let len = frame_len([buffer[0], buffer[1], buffer[2], buffer[3]])
        .map_err(|e| invalid(e.to_string()))?;
    if 4 + len > buffer.len() {
        return Err(invalid(format!("hello frame of {len} bytes")));
    }
    read_until(stream, &mut buffer, &mut filled, 4 + len).await?;
    let hello: Frame<Hello> =
        decode_frame(&buffer[4..4 + len]).map_err(|e| invalid(e.to_string()))?;
    Ok((hello.body, fd))
}

/// Reads into `buffer` until `filled` reaches `want`; the peer closing first is
/// an error.
async fn read_until(
    stream: &UnixStream,
    buffer: &mut [u8],
    filled: &mut usize,
    want: usize,
) -> std::io::Result<()> {
    while *filled < want {
        stream.readable().await?;
        match stream.try_read(&mut buffer[*filled..want]) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "closed during the handshake",
                ))
            }
            Ok(n) => *filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Why a connection's hello is refused before anything of it is mapped: a
/// stranger's, another protocol version, a first region over the limits.
pub(super) fn refusal(
    config: &DummyServerConfig,
    stream: &UnixStream,
    hello: &Hello,
) -> Option<String> {
    if let Err(error) = config.access.check(stream) {
        return Some(error.to_string());
    }
    if hello.version != DUMMY_PROTOCOL_VERSION {
        return Some(format!(
            "protocol version {} (this real client speaks {DUMMY_PROTOCOL_VERSION})",
            hello.version
        ));
    }
    if hello.attach.is_none() {
        return within_limits(config, &Regions::new(), hello.region_bytes).err();
    }
    None
}

#[cfg(test)]
mod tests {
    use hkvm_events::rpc::dummy::{encode_frame, Attach};

    use super::super::super::fd::send_with_fd;
    use super::super::super::region::SharedRegion;
    use super::*;

    fn hello(attach: Option<Attach>, region_bytes: u64) -> Hello {
        Hello {
            version: DUMMY_PROTOCOL_VERSION,
            pid: std::process::id(),
            region_bytes,
            attach,
        }
    }

    fn pair() -> (UnixStream, std::os::unix::net::UnixStream) {
        let (server, peer) = std::os::unix::net::UnixStream::pair().unwrap();
        server.set_nonblocking(true).unwrap();
        (UnixStream::from_std(server).unwrap(), peer)
    }

    #[tokio::test]
    async fn a_hello_and_its_region_are_received_unmapped() {
        let (server, peer) = pair();
        let region = SharedRegion::create("hello", 4096).unwrap();
        let frame = encode_frame(&Frame {
            id: 0,
            body: hello(None, 4096),
        })
        .unwrap();
        send_with_fd(peer.as_fd(), &frame, region.fd()).unwrap();
        let (received, fd) = handshake(&server).await.unwrap();
        assert_eq!(received, hello(None, 4096));
        assert_eq!(SharedRegion::map(fd, 4096).unwrap().len(), 4096);
    }

    #[tokio::test]
    async fn a_peer_that_closes_mid_handshake_ends_it_at_once() {
        // Nothing at all, then EOF.
        let (server, peer) = pair();
        drop(peer);
        let error = handshake(&server).await.unwrap_err();
        assert_eq!(error.kind(), std::io::ErrorKind::InvalidData, "{error}");
        // A descriptor and two bytes of the length prefix, then EOF: once this
        // spun forever, reading EOF as "nothing yet".
        let (server, peer) = pair();
        let region = SharedRegion::create("cut", 4096).unwrap();
        send_with_fd(peer.as_fd(), &[0, 0], region.fd()).unwrap();
        drop(peer);
        let error = tokio::time::timeout(Duration::from_secs(10), handshake(&server))
            .await
            .expect("the handshake ends")
            .unwrap_err();
        assert_eq!(error.kind(), std::io::ErrorKind::UnexpectedEof, "{error}");
    }

    #[tokio::test]
    async fn strangers_other_versions_and_oversized_regions_are_refused_before_mapping() {
        let (server, _peer) = pair();
        let config = DummyServerConfig::default();
        assert_eq!(refusal(&config, &server, &hello(None, 4096)), None);
        let own = rustix::process::geteuid().as_raw();
        let strict = DummyServerConfig {
            access: PeerAccess::only(vec![own.wrapping_add(1)]),
            ..DummyServerConfig::default()
        };
        let reason = refusal(&strict, &server, &hello(None, 4096)).unwrap();
        assert!(reason.contains(&format!("uid {own}")), "{reason}");
        let mut old = hello(None, 4096);
        old.version = DUMMY_PROTOCOL_VERSION + 1;
        assert!(refusal(&config, &server, &old)
            .unwrap()
            .contains("protocol version"));
        let small = DummyServerConfig {
            max_mapped_bytes: 1 << 20,
            ..DummyServerConfig::default()
        };
        let reason = refusal(&small, &server, &hello(None, 2 << 20)).unwrap();
        assert!(reason.contains("at most 1048576"), "{reason}");
    }

    #[test]
    fn a_sessions_regions_are_bounded_in_number_and_bytes() {
        let config = DummyServerConfig {
            max_regions: 2,
            max_mapped_bytes: 10_000,
            ..DummyServerConfig::default()
        };
        assert!(within_limits(&config, &Regions::new(), 10_000).is_ok());
        assert!(within_limits(&config, &Regions::new(), 10_001).is_err());
    }
}
