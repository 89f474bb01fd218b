//! The real client's side: accepts dummy clients on an abstract Unix socket, maps
//! each one's shared regions, and serves its requests through the real client's
//! [`Store`], reading and writing values straight in the shared regions. A dummy
//! that goes away takes nothing with it: requests it had in flight finish (a put
//! completes or is revoked by the store as any put), then its regions are
//! unmapped.

use std::collections::HashMap;
use std::os::fd::{AsFd as _, OwnedFd};
use std::os::linux::net::SocketAddrExt as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hkvm_events::rpc::dummy::{
    decode_frame, dummy_socket_name, encode_frame, frame_len, Attach, DummyReply, DummyRequest,
    Frame, Hello, Span, Welcome, DUMMY_PROTOCOL_VERSION,
};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinHandle;

use super::access::PeerAccess;
use super::fd::recv_with_fd;
use super::region::SharedRegion;
use crate::kv::PutOptions;
use crate::store::{segment_for, ErrorCode, Store};

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

/// How many dummies are connected and what they asked (for logs, metrics, tests).
#[derive(Debug, Default)]
pub struct DummyServerStats {
    /// Connections accepted.
    pub connected: AtomicU64,
    /// Connections closed.
    pub disconnected: AtomicU64,
    /// Requests served.
    pub requests: AtomicU64,
    /// Regions attached after a connection (host buffers).
    pub attached: AtomicU64,
    /// Connections refused: a stranger's, a malformed or slow handshake, a
    /// region over the limits.
    pub refused: AtomicU64,
}

/// A dummy's region as this process maps it, registered with the store's
/// transports for as long as it is mapped, so that RDMA moves the dummy's bytes
/// without a copy (TCP registers nothing).
struct ServedRegion {
    store: Arc<Store>,
    registered: bool,
    region: SharedRegion,
}

impl ServedRegion {
    fn new(region: SharedRegion, store: &Arc<Store>) -> Self {
        let len = usize::try_from(region.len()).unwrap_or(usize::MAX);
        // SAFETY: the mapping lives as long as `region`, and `Drop` ends the
        // registration before `region` unmaps it; requests hold the region (an
        // `Arc` of it) while they use its bytes.
        let registered = match unsafe { store.register_local(region.base() as *mut u8, len) } {
            Ok(()) => true,
            Err(error) => {
                tracing::warn!(%error, "a dummy's region is not registered with the transport: its bytes are copied");
                false
            }
        };
        Self {
            store: Arc::clone(store),
            registered,
            region,
        }
    }
}

impl std::ops::Deref for ServedRegion {
    type Target = SharedRegion;

    fn deref(&self) -> &SharedRegion {
        &self.region
    }
}

impl Drop for ServedRegion {
    fn drop(&mut self) {
        if self.registered {
            self.store.unregister_local(self.region.base() as *mut u8);
        }
    }
}

/// The regions one dummy shares, by number (0: the one shared at connection).
type Regions = HashMap<u32, Arc<ServedRegion>>;

/// One connected dummy.
struct Session {
    /// The connected process, as the kernel reports it.
    pid: Option<i32>,
    regions: Mutex<Regions>,
}

impl Session {
    /// The regions now; a request holds them until it is answered, so a region
    /// released meanwhile stays mapped for it.
    fn regions(&self) -> Regions {
        lock(&self.regions).clone()
    }
}

/// Whether one more region of `bytes` fits a session holding `regions`.
fn within_limits(config: &DummyServerConfig, regions: &Regions, bytes: u64) -> Result<(), String> {
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

/// The open sessions, by id.
#[derive(Default)]
struct Sessions {
    next: AtomicU64,
    open: Mutex<HashMap<u64, Arc<Session>>>,
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// A running dummy server. Dropping it stops accepting (connected dummies are
/// served until they close).
#[derive(Debug)]
pub struct DummyServer {
    name: String,
    stats: Arc<DummyServerStats>,
    task: JoinHandle<()>,
}

impl Drop for DummyServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl DummyServer {
    /// Listens on the abstract socket of `port` ([`dummy_socket_name`]) and serves
    /// dummies of this process's user through `store`, within the default
    /// limits.
    ///
    /// # Errors
    /// When the socket name is taken (another real client serves that port).
    pub fn start(store: Arc<Store>, port: u16) -> std::io::Result<Self> {
        Self::start_with(store, port, DummyServerConfig::default())
    }

    /// As [`DummyServer::start`], accepting what `config` says.
    ///
    /// # Errors
    /// When the socket name is taken (another real client serves that port).
    pub fn start_with(
        store: Arc<Store>,
        port: u16,
        config: DummyServerConfig,
    ) -> std::io::Result<Self> {
        let config = Arc::new(config);
        let name = dummy_socket_name(port);
        let address = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
        let listener = std::os::unix::net::UnixListener::bind_addr(&address)?;
        listener.set_nonblocking(true)?;
        let listener = tokio::net::UnixListener::from_std(listener)?;
        let stats = Arc::new(DummyServerStats::default());
        let sessions = Arc::new(Sessions::default());
        let task = {
            let stats = Arc::clone(&stats);
            tokio::spawn(async move {
                loop {
                    match listener.accept().await {
                        Ok((stream, _)) => {
                            let (store, stats, sessions, config) = (
                                Arc::clone(&store),
                                Arc::clone(&stats),
                                Arc::clone(&sessions),
                                Arc::clone(&config),
                            );
                            tokio::spawn(async move {
                                if let Err(error) =
                                    serve(stream, store, &stats, &sessions, &config).await
                                {
                                    tracing::warn!(%error, "a dummy client's connection failed");
                                }
                            });
                        }
                        Err(error) => {
                            tracing::warn!(%error, "accepting a dummy client");
                            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        }
                    }
                }
            })
        };
        tracing::info!(socket = %name, "serving dummy clients");
        Ok(Self { name, stats, task })
    }

    /// The abstract socket name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// What it served so far.
    pub fn stats(&self) -> &DummyServerStats {
        &self.stats
    }
}

/// Reads the Hello frame and the region's descriptor (not mapped yet: that
/// waits until the hello is accepted). A peer that closes or sends a frame too
/// long for a hello is an error, at once.
async fn handshake(stream: &UnixStream) -> std::io::Result<(Hello, OwnedFd)> {
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

/// Adds the region of an attaching connection to its session: only the process
/// that opened the session may, within the session's limits; the region is
/// mapped (and registered with the transports) only once all that holds.
fn attach(
    sessions: &Sessions,
    config: &DummyServerConfig,
    store: &Arc<Store>,
    request: Attach,
    pid: Option<i32>,
    (fd, bytes): (OwnedFd, u64),
) -> Result<u32, String> {
    let session = lock(&sessions.open)
        .get(&request.session)
        .cloned()
        .ok_or_else(|| format!("no open session {}", request.session))?;
    if session.pid.is_none() || session.pid != pid {
        return Err("a region may only be attached by the process that opened the session".into());
    }
    if request.region == 0 {
        return Err("region 0 is the session's first region".into());
    }
    let mut regions = lock(&session.regions);
    if regions.contains_key(&request.region) {
        return Err(format!("region {} is attached already", request.region));
    }
    within_limits(config, &regions, bytes)?;
    let region = SharedRegion::map(fd, bytes).map_err(|error| error.to_string())?;
    regions.insert(request.region, Arc::new(ServedRegion::new(region, store)));
    Ok(request.region)
}

/// Why a connection's hello is refused before anything of it is mapped: a
/// stranger's, another protocol version, a first region over the limits.
fn refusal(config: &DummyServerConfig, stream: &UnixStream, hello: &Hello) -> Option<String> {
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

async fn serve(
    stream: UnixStream,
    store: Arc<Store>,
    stats: &DummyServerStats,
    sessions: &Sessions,
    config: &DummyServerConfig,
) -> std::io::Result<()> {
    let pid = stream.peer_cred().ok().and_then(|cred| cred.pid());
    let handshake = tokio::time::timeout(config.handshake_timeout, handshake(&stream)).await;
    let (hello, fd) = match handshake {
        Ok(Ok(received)) => received,
        Ok(Err(error)) => {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            return Err(error);
        }
        Err(_) => {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no hello within {:?}", config.handshake_timeout),
            ));
        }
    };
    let refused = refusal(config, &stream, &hello);
    let (reader, mut writer) = stream.into_split();
    let mut opened = None;
    let welcome = if let Some(reason) = refused {
        tracing::warn!(pid = ?pid, %reason, "a dummy client's connection refused");
        Welcome::Refused { reason }
    } else if let Some(request) = hello.attach {
        match attach(
            sessions,
            config,
            &store,
            request,
            pid,
            (fd, hello.region_bytes),
        ) {
            Ok(region) => {
                stats.attached.fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    pid = hello.pid,
                    region,
                    region_bytes = hello.region_bytes,
                    "a dummy client attached a region"
                );
                Welcome::Attached { region }
            }
            Err(reason) => Welcome::Refused { reason },
        }
    } else {
        match SharedRegion::map(fd, hello.region_bytes) {
            Ok(region) => {
                let id = sessions.next.fetch_add(1, Ordering::Relaxed) + 1;
                let region = ServedRegion::new(region, &store);
                let session = Arc::new(Session {
                    pid,
                    regions: Mutex::new(HashMap::from([(0, Arc::new(region))])),
                });
                lock(&sessions.open).insert(id, Arc::clone(&session));
                opened = Some((id, session));
                Welcome::Ready {
                    hostname: store.hostname().to_owned(),
                    session: id,
                }
            }
            Err(error) => Welcome::Refused {
                reason: error.to_string(),
            },
        }
    };
    if matches!(welcome, Welcome::Refused { .. }) {
        stats.refused.fetch_add(1, Ordering::Relaxed);
    }
    let bytes = encode_frame(&Frame {
        id: 0,
        body: welcome,
    })
    .map_err(std::io::Error::other)?;
    let written = writer.write_all(&bytes).await;
    let Some((id, session)) = opened else {
        return written;
    };
    stats.connected.fetch_add(1, Ordering::Relaxed);
    let served = match written {
        Ok(()) => serve_session(reader, writer, &hello, &store, stats, &session, config).await,
        Err(error) => Err(error),
    };
    lock(&sessions.open).remove(&id);
    stats.disconnected.fetch_add(1, Ordering::Relaxed);
    tracing::info!(pid = hello.pid, "a dummy client disconnected");
    served
}

/// Serves one session's requests until the dummy closes it.
async fn serve_session(
    mut reader: tokio::net::unix::OwnedReadHalf,
    mut writer: tokio::net::unix::OwnedWriteHalf,
    hello: &Hello,
    store: &Arc<Store>,
    stats: &DummyServerStats,
    session: &Arc<Session>,
    config: &DummyServerConfig,
) -> std::io::Result<()> {
    let in_flight = Arc::new(Semaphore::new(config.max_in_flight.max(1)));
    tracing::info!(
        pid = hello.pid,
        region_bytes = hello.region_bytes,
        "a dummy client connected"
    );
    let (replies, mut outgoing) = mpsc::channel::<Vec<u8>>(256);
    let writing = tokio::spawn(async move {
        while let Some(bytes) = outgoing.recv().await {
            if writer.write_all(&bytes).await.is_err() {
                break;
            }
        }
    });
    let mut prefix = [0u8; 4];
    loop {
        if reader.read_exact(&mut prefix).await.is_err() {
            break;
        }
        let len = frame_len(prefix).map_err(std::io::Error::other)?;
        let mut body = vec![0u8; len];
        reader.read_exact(&mut body).await?;
        let frame: Frame<DummyRequest> = match decode_frame(&body) {
            Ok(frame) => frame,
            Err(error) => {
                tracing::warn!(%error, pid = hello.pid, "a malformed request; closing");
                break;
            }
        };
        stats.requests.fetch_add(1, Ordering::Relaxed);
        if let DummyRequest::ReleaseRegion { region } = frame.body {
            let body = release(session, region);
            let bytes =
                encode_frame(&Frame { id: frame.id, body }).map_err(std::io::Error::other)?;
            if replies.send(bytes).await.is_err() {
                break;
            }
            continue;
        }
        // At the limit, the next request is not read until one is answered.
        let Ok(permit) = Arc::clone(&in_flight).acquire_owned().await else {
            break;
        };
        let (store, regions, replies) = (Arc::clone(store), session.regions(), replies.clone());
        tokio::spawn(async move {
            let body = handle(&store, &regions, frame.body).await;
            drop(permit);
            if let Ok(bytes) = encode_frame(&Frame { id: frame.id, body }) {
                let _ = replies.send(bytes).await;
            }
        });
    }
    drop(replies);
    let _ = writing.await;
    Ok(())
}

/// Drops an attached region from the session.
fn release(session: &Session, region: u32) -> DummyReply {
    let refused = |reason: String| DummyReply::Refused {
        code: ErrorCode::InvalidParams.value(),
        reason,
    };
    if region == 0 {
        return refused("region 0 lasts as long as the session".into());
    }
    match lock(&session.regions).remove(&region) {
        Some(_) => DummyReply::Codes(vec![0]),
        None => refused(format!("no region {region} is attached")),
    }
}

/// Slices of the regions for `spans`, or `None` when one lies outside them.
fn read_slices<'r>(regions: &'r Regions, spans: &[Span]) -> Option<Vec<&'r [u8]>> {
    spans
        .iter()
        // SAFETY: the dummy hands these ranges to this request and does not write
        // them until it has the reply (the protocol's contract, as with DMA).
        .map(|span| unsafe { regions.get(&span.region)?.slice(span.offset, span.len) })
        .collect()
}

/// The keys (indexes) whose spans share bytes with an earlier key's spans or
/// with each other; empty spans share none.
fn overlapping_keys(spans: &[Vec<Span>]) -> Vec<usize> {
    use std::collections::BTreeMap;
    // Accepted spans: (region, start) -> end.
    let mut taken: BTreeMap<(u32, u64), u64> = BTreeMap::new();
    let clashes = |taken: &BTreeMap<(u32, u64), u64>, span: &Span| {
        let end = span.offset.saturating_add(span.len);
        let before = taken
            .range(..=(span.region, span.offset))
            .next_back()
            .is_some_and(|(&(region, _), &taken_end)| {
                region == span.region && taken_end > span.offset
            });
        let after = taken
            .range((span.region, span.offset)..(span.region, end))
            .next()
            .is_some();
        before || after
    };
    let mut refused = Vec::new();
    for (index, key_spans) in spans.iter().enumerate() {
        let mut mine: BTreeMap<(u32, u64), u64> = BTreeMap::new();
        let mut clash = false;
        for span in key_spans.iter().filter(|span| span.len > 0) {
            if clashes(&taken, span) || clashes(&mine, span) {
                clash = true;
                break;
            }
            mine.insert(
                (span.region, span.offset),
                span.offset.saturating_add(span.len),
            );
        }
        if clash {
            refused.push(index);
        } else {
            taken.extend(mine);
        }
    }
    refused
}

async fn handle(store: &Store, regions: &Regions, request: DummyRequest) -> DummyReply {
    let invalid = ErrorCode::InvalidParams.value();
    match request {
        DummyRequest::Put {
            keys,
            spans,
            placement,
        } => {
            if spans.len() != keys.len() {
                return DummyReply::Codes(vec![invalid; keys.len()]);
            }
            let mut codes = vec![0; keys.len()];
            let mut slices = Vec::with_capacity(keys.len());
            let mut indexes = Vec::with_capacity(keys.len());
            for (index, spans) in spans.iter().enumerate() {
                match read_slices(regions, spans) {
                    Some(parts) => {
                        slices.push(parts);
                        indexes.push(index);
                    }
                    None => codes[index] = invalid,
                }
            }
            let items: Vec<(&str, &[&[u8]])> = indexes
                .iter()
                .zip(&slices)
                .map(|(&i, parts)| (keys[i].as_str(), parts.as_slice()))
                .collect();
            let options = PutOptions {
                replicas: placement.replicas.max(1),
                preferred_segment: placement
                    .preferred_segment
                    .as_deref()
                    .filter(|s| !s.is_empty())
                    .and_then(segment_for),
                hard_pin: placement.hard_pin,
            };
            if !items.is_empty() {
                match store.put(&items, &options).await {
                    Ok(results) => {
                        for (&index, result) in indexes.iter().zip(results) {
                            codes[index] = result.map_or_else(|e| e.code().value(), |()| 0);
                        }
                    }
                    Err(error) => {
                        for &index in &indexes {
                            codes[index] = error.code().value();
                        }
                    }
                }
            }
            DummyReply::Codes(codes)
        }
        DummyRequest::GetInto { keys, spans } => {
            if spans.len() != keys.len() {
                return DummyReply::Sizes(vec![i64::from(invalid); keys.len()]);
            }
            // Two writable slices of the same bytes at once would alias: a key
            // whose destination overlaps an earlier key's (or its own) is refused.
            let clashing = overlapping_keys(&spans);
            if !clashing.is_empty() {
                tracing::warn!(keys = ?clashing, "get_into destinations that overlap earlier ones; refused");
            }
            let mut sizes = vec![0i64; keys.len()];
            let mut parts: Vec<Vec<&mut [u8]>> = Vec::with_capacity(keys.len());
            let mut indexes = Vec::with_capacity(keys.len());
            for (index, spans) in spans.iter().enumerate() {
                if clashing.contains(&index) {
                    sizes[index] = i64::from(invalid);
                    continue;
                }
                // SAFETY: as for reads; the dummy leaves these ranges to this
                // request until the reply, and no two of them overlap (above).
                let buffers: Option<Vec<&mut [u8]>> = spans
                    .iter()
                    .map(|span| unsafe {
                        regions.get(&span.region)?.slice_mut(span.offset, span.len)
                    })
                    .collect();
                match buffers {
                    Some(buffers) => {
                        parts.push(buffers);
                        indexes.push(index);
                    }
                    None => sizes[index] = i64::from(invalid),
                }
            }
            let mut items: Vec<(&str, &mut [&mut [u8]])> = indexes
                .iter()
                .zip(parts.iter_mut())
                .map(|(&i, buffers)| (keys[i].as_str(), buffers.as_mut_slice()))
                .collect();
            if !items.is_empty() {
                match store.get_into(&mut items).await {
                    Ok(results) => {
                        for (&index, result) in indexes.iter().zip(results) {
                            sizes[index] = result.map_or_else(
                                |e| i64::from(e.code().value()),
                                |n| i64::try_from(n).unwrap_or(i64::MAX),
                            );
                        }
                    }
                    Err(error) => {
                        for &index in &indexes {
                            sizes[index] = i64::from(error.code().value());
                        }
                    }
                }
            }
            DummyReply::Sizes(sizes)
        }
        DummyRequest::Size { keys } => {
            let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
            match store.locate(&refs).await {
                Ok(located) => DummyReply::Sizes(
                    located
                        .into_iter()
                        .map(|l| {
                            l.map_or_else(
                                |e| i64::from(e.code().value()),
                                |l| i64::try_from(l.list.size).unwrap_or(i64::MAX),
                            )
                        })
                        .collect(),
                ),
                Err(error) => DummyReply::Sizes(vec![i64::from(error.code().value()); keys.len()]),
            }
        }
        DummyRequest::Exist { keys } => match store.exist(&keys).await {
            Ok(exists) => DummyReply::Exist(exists.into_iter().map(i32::from).collect()),
            Err(_) => DummyReply::Exist(vec![-1; keys.len()]),
        },
        DummyRequest::Remove { keys, force } => match store.remove(&keys, force).await {
            Ok(results) => DummyReply::Codes(
                results
                    .into_iter()
                    .map(|r| r.map_or_else(|e| e.code().value(), |()| 0))
                    .collect(),
            ),
            Err(error) => DummyReply::Codes(vec![error.code().value(); keys.len()]),
        },
        DummyRequest::RemoveAll { pattern, force } => {
            match store.remove_all(pattern.as_deref(), force).await {
                Ok(removed) => DummyReply::Count(i64::try_from(removed).unwrap_or(i64::MAX)),
                Err(error) => DummyReply::Count(i64::from(error.code().value())),
            }
        }
        DummyRequest::Health => DummyReply::Health(store.health().await as i32),
        // Answered in order by the session loop, never here.
        DummyRequest::ReleaseRegion { .. } => DummyReply::Refused {
            code: invalid,
            reason: "a region is released by its session".into(),
        },
    }
}

#[cfg(test)]
mod tests {
    use hkvm_events::rpc::dummy::encode_frame;

    use super::super::fd::send_with_fd;
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

    #[test]
    fn destinations_that_share_bytes_are_found() {
        let span = |region, offset, len| Span {
            region,
            offset,
            len,
        };
        let apart = vec![
            vec![span(0, 0, 100), span(0, 100, 100)],
            vec![span(1, 50, 100)],
            vec![span(0, 200, 1)],
        ];
        assert_eq!(overlapping_keys(&apart), Vec::<usize>::new());
        // The later key is refused, the first one served.
        let shared = vec![vec![span(0, 0, 100)], vec![span(0, 99, 10)]];
        assert_eq!(overlapping_keys(&shared), vec![1]);
        // A span inside, or around, an earlier one; across keys, out of order.
        let inside = vec![
            vec![span(2, 500, 10)],
            vec![span(2, 0, 5), span(2, 505, 1)],
            vec![span(2, 400, 200)],
            vec![span(2, 10, 5)],
        ];
        assert_eq!(overlapping_keys(&inside), vec![1, 2]);
        // A key's own spans that overlap; a refused key's spans do not count.
        let own = vec![vec![span(0, 0, 10), span(0, 5, 10)], vec![span(0, 0, 10)]];
        assert_eq!(overlapping_keys(&own), vec![0]);
        // Empty spans share nothing.
        assert!(
            overlapping_keys(&[vec![span(0, 5, 0), span(0, 5, 0)], vec![span(0, 5, 0)]]).is_empty()
        );
    }
}
