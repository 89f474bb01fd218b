//! The pool every in-process test builds on: a nats-server child of the test kit
//! ([`Fixture`]), on which a test writes sub-cluster streams itself through the
//! event log and group commit with stand-in registry entries ([`Sub`]), runs real
//! sub-masters and global-master replicas, or starts a whole pool of sub-clusters
//! with their sub-masters, nodes and KV clients ([`Pool`]).
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_nats::jetstream;
use futures::StreamExt as _;
use hkvm_client::{
    GlobalClient, KvClient, NodeConfig, NodeHandle, Protocol, RetryPolicy, SubmasterClient,
    Transports,
};
use hkvm_events::registry::SubmasterInfo;
use hkvm_events::rpc::global::{GlobalOp, GlobalStatus, GlobalStatusReply};
use hkvm_events::subject::{event_subject, stream_name, submaster_rpc_subject};
use hkvm_events::{
    decode_message, ClusterId, Evicted, KvEvent, Limits, NodeId, Placement, ProducerId,
    PutCommitted, Removed, SegmentId, SubclusterId,
};
use hkvm_globalmaster::{GlobalMaster, GlobalMasterConfig};
use hkvm_log::commit::{CommitConfig, GroupCommitter};
use hkvm_log::registry::{ensure_registry_bucket, register};
use hkvm_log::stream::{ensure_stream, StreamSettings};
use hkvm_log::{EventLog, JetStreamLog, LogErrorKind, ReadOptions};
use hkvm_submaster::{SubmasterConfig, SubmasterHandle};
use hkvm_testkit::{NatsServer, ServerOptions};
use hkvm_transfer::{TcpConfig, TcpTransport};

mod pool;
pub use pool::{Pool, PoolSpec};

/// How long a bounded wait of this suite waits before it fails.
pub const WAIT: Duration = Duration::from_secs(30);

/// A short leader lease, so that a standby takes over quickly (a `PoolSpec`
/// tweak, or applied to a standby's config).
pub fn quick_failover(config: &mut hkvm_submaster::SubmasterConfig) {
    config.leader_lease_ttl = Duration::from_millis(1500);
}

/// Polls `probe` every 20 ms until it returns `Some`, and returns that; fails the
/// test, saying `what` it waited for, after `within`.
pub async fn poll_until<T, F, Fut>(what: &str, within: Duration, probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    poll_every(Duration::from_millis(20), what, within, probe).await
}

/// How often a probe that lists an object store polls: each listing makes an
/// ephemeral consumer that the server keeps for 30 s, and a stream holds only
/// so many consumers.
pub const LISTING_POLL: Duration = Duration::from_millis(250);

/// As [`poll_until`], polling every `every`.
pub async fn poll_every<T, F, Fut>(every: Duration, what: &str, within: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Some(found) = probe().await {
            return found;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "waited {within:?} in vain for {what}"
        );
        tokio::time::sleep(every).await;
    }
}

/// Waits (at most [`WAIT`]) until `counter` reaches `n`; `what` names it.
pub async fn wait_count(what: &str, counter: &AtomicUsize, n: usize) {
    poll_until(what, WAIT, || async move {
        (counter.load(Ordering::Relaxed) >= n).then_some(())
    })
    .await;
}

/// The whole answer (status line, headers, body) to `GET path` on
/// `127.0.0.1:port`, over HTTP/1.0 (the server closes when done).
pub fn http_get(port: u16, path: &str) -> String {
    use std::io::{Read as _, Write as _};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port))
        .unwrap_or_else(|e| panic!("connecting to 127.0.0.1:{port}: {e}"));
    write!(stream, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").expect("sending");
    let mut answer = String::new();
    stream.read_to_string(&mut answer).expect("reading");
    answer
}

/// Logs of in-process services to the test's output (`RUST_LOG`, `warn` by
/// default); once per process.
pub fn logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
}

/// A nats-server with JetStream, a connection to it, and the cluster name the
/// test uses.
pub struct Fixture {
    /// The server (stopped on drop).
    pub server: NatsServer,
    /// A connection for the test's own requests.
    pub client: async_nats::Client,
    /// JetStream over [`Fixture::client`].
    pub js: jetstream::Context,
    /// The cluster.
    pub cluster: ClusterId,
    /// Whether the server runs the generated users (`Fixture::secured`): then
    /// the test's own connections log in as the operator.
    pub secured: bool,
}

/// One sub-cluster written by the test itself: its stream, a group committer on
/// it, and the registry entry of a stand-in sub-master.
pub struct Sub {
    /// The sub-cluster.
    pub id: SubclusterId,
    /// Its event stream.
    pub log: JetStreamLog,
    /// Appends events as a sub-master would.
    pub committer: GroupCommitter,
    /// The registry entry.
    pub info: SubmasterInfo,
}

impl Sub {
    /// Commits `events` in one message; returns its sequence.
    pub async fn commit(&self, events: Vec<KvEvent>) -> u64 {
        self.committer.commit(events).await.unwrap().seq
    }
}

/// A `put` of `key` (64 bytes at offset 0 of `seg-0`).
pub fn put(key: &str) -> KvEvent {
    KvEvent::PutCommitted(PutCommitted::new(
        key,
        64,
        7,
        vec![Placement {
            segment: SegmentId::new("seg-0").unwrap(),
            offset: 0,
        }],
    ))
}

/// An eviction of `keys`.
pub fn evicted(keys: &[&str]) -> KvEvent {
    KvEvent::Evicted(Evicted {
        keys: keys.iter().map(|k| (*k).to_owned()).collect(),
    })
}

/// A removal of `keys`.
pub fn removed(keys: &[&str]) -> KvEvent {
    KvEvent::Removed(Removed {
        keys: keys.iter().map(|k| (*k).to_owned()).collect(),
    })
}

/// Owned keys.
pub fn keys(names: &[&str]) -> Vec<String> {
    names.iter().map(|k| (*k).to_owned()).collect()
}

/// The RPC prefix a sub-master registers (`hkvm.<cluster>.<subcluster>.rpc`).
pub fn rpc_prefix(cluster: &ClusterId, subcluster: &SubclusterId) -> String {
    submaster_rpc_subject(cluster, subcluster, "")
        .trim_end_matches('.')
        .to_owned()
}

/// `server`'s URL with `user`'s test credentials.
fn url_as(server: &NatsServer, user: &str) -> String {
    let password = hkvm_itests::security::password(user);
    server
        .url()
        .replacen("nats://", &format!("nats://{user}:{password}@"), 1)
}

impl Fixture {
    /// Starts a nats-server for cluster `cluster`.
    pub async fn new(cluster: &str) -> Self {
        Self::with_server(cluster, ServerOptions::default()).await
    }

    /// Starts a nats-server with `options` (limits, accounts) for `cluster`.
    pub async fn with_server(cluster: &str, options: ServerOptions) -> Self {
        let server = NatsServer::start_with(options).await.unwrap();
        let client = server.connect().await.unwrap();
        let js = jetstream::new(client.clone());
        Self {
            server,
            client,
            js,
            cluster: ClusterId::new(cluster).unwrap(),
            secured: false,
        }
    }

    /// Starts a nats-server running `deployment`'s generated users (with the
    /// test passwords of `hkvm_itests::security`) for its cluster; the test's
    /// own connections log in as the operator.
    pub async fn secured(deployment: &hkvm_itests::security::Deployment<'_>) -> Self {
        let options = ServerOptions {
            extra_config: hkvm_itests::security::nats_conf_for(deployment).unwrap(),
            ..ServerOptions::default()
        };
        let server = NatsServer::start_with(options).await.unwrap();
        let admin = hkvm_itests::security::ADMIN_USER;
        let client = hkvm_client::connect::connect(&url_as(&server, admin), "test")
            .await
            .unwrap();
        let js = jetstream::new(client.clone());
        Self {
            server,
            client,
            js,
            cluster: ClusterId::new(deployment.cluster).unwrap(),
            secured: true,
        }
    }

    /// The server's client URL.
    pub fn url(&self) -> String {
        self.server.url()
    }

    /// The server's client URL with `user`'s credentials (on a secured
    /// fixture; the plain URL otherwise).
    pub fn url_as(&self, user: &str) -> String {
        if self.secured {
            url_as(&self.server, user)
        } else {
            self.url()
        }
    }

    /// A new connection (each service of a test gets its own, as in
    /// production); on a secured fixture as the operator.
    pub async fn connect(&self) -> async_nats::Client {
        if self.secured {
            return self.connect_as(hkvm_itests::security::ADMIN_USER).await;
        }
        self.server.connect().await.unwrap()
    }

    /// A new connection as `user`, as HKVM's processes connect, on a secured
    /// fixture; [`Fixture::connect`] otherwise.
    pub async fn connect_as(&self, user: &str) -> async_nats::Client {
        if !self.secured {
            return self.server.connect().await.unwrap();
        }
        hkvm_client::connect::connect(&self.url_as(user), user)
            .await
            .unwrap()
    }

    /// Creates `subcluster`'s stream (default settings) and returns its log.
    pub async fn stream(&self, subcluster: &str) -> JetStreamLog {
        self.stream_with(subcluster, &StreamSettings::default())
            .await
    }

    /// Creates `subcluster`'s stream with `settings` and returns its log.
    pub async fn stream_with(&self, subcluster: &str, settings: &StreamSettings) -> JetStreamLog {
        let id = SubclusterId::new(subcluster).unwrap();
        ensure_stream(&self.js, &self.cluster, &id, settings)
            .await
            .unwrap();
        self.log(&id)
    }

    /// The log of `subcluster`'s stream (which may not exist).
    pub fn log(&self, subcluster: &SubclusterId) -> JetStreamLog {
        JetStreamLog::new(
            self.js.clone(),
            stream_name(&self.cluster, subcluster),
            event_subject(&self.cluster, subcluster),
        )
    }

    /// Creates the stream of `name` and registers its stand-in sub-master
    /// `sm-<name>` with `labels`.
    pub async fn subcluster(&self, name: &str, labels: &[(&str, &str)]) -> Sub {
        let id = SubclusterId::new(name).unwrap();
        let log = self.stream(name).await;
        let last = log.bounds().await.unwrap().last_seq;
        let producer = ProducerId::new(format!("sm-{name}")).unwrap();
        let committer = GroupCommitter::spawn(
            log.clone(),
            producer.clone(),
            1,
            last,
            CommitConfig::default(),
        );
        let info = SubmasterInfo {
            id: producer,
            cluster: self.cluster.clone(),
            subcluster: id.clone(),
            rpc_prefix: rpc_prefix(&self.cluster, &id),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect::<BTreeMap<_, _>>(),
            capacity_bytes: 1 << 30,
            used_bytes: 0,
            objects: 0,
            epoch: 1,
            stream: stream_name(&self.cluster, &id),
            last_seq: last,
            unix_ms: 0,
        };
        self.register(&info).await;
        Sub {
            id,
            log,
            committer,
            info,
        }
    }

    /// Writes a registry entry.
    pub async fn register(&self, info: &SubmasterInfo) {
        let store = ensure_registry_bucket(&self.js, &self.cluster, Duration::from_secs(10))
            .await
            .unwrap();
        register(&store, info).await.unwrap();
    }

    /// How many times each key was committed in `subcluster`'s stream (none when
    /// the stream does not exist yet). An audit of every commit: it fails when the
    /// history was purged (run such tests with `history.purge` off).
    pub async fn commits(&self, subcluster: &str) -> BTreeMap<String, u32> {
        let log = self.log(&SubclusterId::new(subcluster).unwrap());
        let mut commits = BTreeMap::new();
        let mut entries = match log.read(ReadOptions::from(1)).await {
            Ok(entries) => entries,
            Err(error) if *error.kind() == LogErrorKind::StreamNotFound => return commits,
            Err(error) => panic!("cannot audit every commit of {subcluster}: {error}"),
        };
        while let Some(entry) = entries.next().await {
            let entry = entry.unwrap();
            let message = decode_message(&entry.payload, &Limits::default()).unwrap();
            for event in message.events {
                if let Ok(KvEvent::PutCommitted(put)) = event {
                    *commits.entry(put.key).or_insert(0) += 1;
                }
            }
        }
        commits
    }

    /// The names of the consumers reading `subcluster`'s stream now.
    pub async fn readers(&self, subcluster: &str) -> BTreeSet<String> {
        let name = stream_name(&self.cluster, &SubclusterId::new(subcluster).unwrap());
        let stream = self.js.get_stream(&name).await.unwrap();
        let mut names = stream.consumer_names();
        let mut found = BTreeSet::new();
        while let Some(name) = names.next().await {
            found.insert(name.unwrap());
        }
        found
    }

    /// Waits until a reader of `subcluster`'s stream that is not in `before` has
    /// been delivered the stream's last message: a sub-master started after
    /// `before` was taken has replayed the whole stream (a hot standby follows it
    /// from there).
    pub async fn wait_new_reader_at_end(&self, subcluster: &str, before: &BTreeSet<String>) {
        let name = stream_name(&self.cluster, &SubclusterId::new(subcluster).unwrap());
        poll_until("a new reader at the end of the stream", WAIT, || async {
            let mut stream = self.js.get_stream(&name).await.ok()?;
            let last = stream.info().await.ok()?.state.last_sequence;
            let mut consumers = stream.consumers();
            while let Some(info) = consumers.next().await {
                let info = info.ok()?;
                if !before.contains(&info.name) && info.delivered.stream_sequence >= last {
                    return Some(());
                }
            }
            None
        })
        .await;
    }

    /// The configuration of sub-master `producer` of `subcluster`.
    pub fn submaster_config(&self, subcluster: &str, producer: &str) -> SubmasterConfig {
        let mut config = SubmasterConfig::new(
            self.cluster.clone(),
            SubclusterId::new(subcluster).unwrap(),
            ProducerId::new(producer).unwrap(),
        );
        // Test nodes mount and never ping: on a loaded machine a test can run past
        // the default 10 s node timeout, and its nodes must not be declared lost.
        config.policy.node_timeout_ms = 600_000;
        config
    }

    /// Runs a sub-master in this process on its own connection.
    pub async fn spawn_submaster(&self, config: SubmasterConfig) -> SubmasterHandle {
        SubmasterHandle::spawn(self.connect().await, config)
    }

    /// A sub-master client of `subcluster` on its own connection.
    pub async fn submaster_client(&self, subcluster: &str, policy: RetryPolicy) -> SubmasterClient {
        SubmasterClient::with_policy(
            self.connect().await,
            self.cluster.clone(),
            SubclusterId::new(subcluster).unwrap(),
            policy,
        )
    }

    /// A global-master configuration for tests: no periodic checkpoints or bloom
    /// filters, a quick lag poll.
    pub fn config(&self, replica: &str) -> GlobalMasterConfig {
        GlobalMasterConfig {
            cluster: self.cluster.clone(),
            replica: replica.to_owned(),
            checkpoint_interval_ms: 0,
            bloom_interval_ms: 0,
            lag_poll_ms: 100,
            ..GlobalMasterConfig::default()
        }
    }

    /// Starts global-master replica `replica` with [`Fixture::config`] and waits
    /// until it serves.
    pub async fn start(&self, replica: &str) -> GlobalMaster {
        self.start_with(self.config(replica)).await
    }

    /// Starts a global-master replica and waits (bounded) until it serves.
    pub async fn start_with(&self, config: GlobalMasterConfig) -> GlobalMaster {
        let master = GlobalMaster::start(config, self.client.clone())
            .await
            .unwrap();
        tokio::time::timeout(WAIT, master.wait_serving())
            .await
            .expect("the replica catches up");
        master
    }

    /// A global-master client.
    pub fn global(&self) -> GlobalClient {
        GlobalClient::new(self.client.clone(), self.cluster.clone())
    }
}

/// Waits (bounded) until `master` has applied `seq` of `subcluster`.
pub async fn wait_applied(master: &GlobalMaster, subcluster: &SubclusterId, seq: u64) {
    let reached = || {
        master
            .status()
            .sources
            .iter()
            .any(|s| s.lag.subcluster == *subcluster && s.lag.applied_seq >= seq)
    };
    tokio::time::timeout(WAIT, async {
        while !reached() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{subcluster} never reached {seq}: {:?}", master.status()));
}

/// The global master's `status`.
pub async fn status(global: &GlobalClient) -> GlobalStatusReply {
    global
        .call(GlobalOp::Status, &GlobalStatus {})
        .await
        .unwrap()
}
