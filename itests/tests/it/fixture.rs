//! Shared set-up of the global-master tests: a real nats-server, sub-cluster
//! streams written through the event log and group commit, registry entries, and
//! global-master replicas.
#![allow(clippy::unwrap_used, dead_code)]

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream;
use hkvm_events::commit::{CommitConfig, GroupCommitter};
use hkvm_events::log::{EventLog, JetStreamLog};
use hkvm_events::registry::{ensure_registry_bucket, register, SubmasterInfo};
use hkvm_events::rpc::global::{GlobalOp, GlobalStatus, GlobalStatusReply};
use hkvm_events::stream::{ensure_stream, StreamSettings};
use hkvm_events::subject::{bucket_name, event_subject, stream_name};
use hkvm_events::{
    ClusterId, Evicted, KvEvent, Placement, ProducerId, PutCommitted, Removed, SegmentId,
    SubclusterId,
};
use hkvm_globalmaster::{GlobalClient, GlobalMaster, GlobalMasterConfig};
use hkvm_testkit::NatsServer;

/// A nats-server and a cluster name.
pub struct Fixture {
    pub server: NatsServer,
    pub client: async_nats::Client,
    pub js: jetstream::Context,
    pub cluster: ClusterId,
}

/// One sub-cluster's stream and registry entry.
pub struct Sub {
    pub id: SubclusterId,
    pub log: JetStreamLog,
    pub committer: GroupCommitter,
    pub info: SubmasterInfo,
}

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

pub fn evicted(keys: &[&str]) -> KvEvent {
    KvEvent::Evicted(Evicted {
        keys: keys.iter().map(|k| (*k).to_owned()).collect(),
    })
}

pub fn removed(keys: &[&str]) -> KvEvent {
    KvEvent::Removed(Removed {
        keys: keys.iter().map(|k| (*k).to_owned()).collect(),
    })
}

pub fn keys(names: &[&str]) -> Vec<String> {
    names.iter().map(|k| (*k).to_owned()).collect()
}

impl Fixture {
    pub async fn new() -> Self {
        let server = NatsServer::start().await.unwrap();
        let client = server.connect().await.unwrap();
        let js = jetstream::new(client.clone());
        Self {
            server,
            client,
            js,
            cluster: ClusterId::new("t").unwrap(),
        }
    }

    /// Creates the stream of `name` and registers its (stand-in) sub-master.
    pub async fn subcluster(&self, name: &str, labels: &[(&str, &str)]) -> Sub {
        let id = SubclusterId::new(name).unwrap();
        ensure_stream(&self.js, &self.cluster, &id, &StreamSettings::default())
            .await
            .unwrap();
        let log = JetStreamLog::new(
            self.js.clone(),
            stream_name(&self.cluster, &id),
            event_subject(&self.cluster, &id),
        );
        let last = log.bounds().await.unwrap().last_seq;
        let committer = GroupCommitter::spawn(
            log.clone(),
            ProducerId::new(format!("sm-{name}")).unwrap(),
            1,
            last,
            CommitConfig::default(),
        );
        let info = SubmasterInfo {
            id: ProducerId::new(format!("sm-{name}")).unwrap(),
            cluster: self.cluster.clone(),
            subcluster: id.clone(),
            rpc_prefix: format!("hkvm.{}.{name}.rpc", self.cluster),
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

    pub async fn register(&self, info: &SubmasterInfo) {
        let store = ensure_registry_bucket(&self.js, &self.cluster, Duration::from_secs(10))
            .await
            .unwrap();
        register(&store, info).await.unwrap();
    }

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

    pub async fn start(&self, replica: &str) -> GlobalMaster {
        self.start_with(self.config(replica)).await
    }

    pub async fn start_with(&self, config: GlobalMasterConfig) -> GlobalMaster {
        let master = GlobalMaster::start(config, self.client.clone())
            .await
            .unwrap();
        tokio::time::timeout(Duration::from_secs(30), master.wait_serving())
            .await
            .expect("the replica catches up");
        master
    }

    pub fn global(&self) -> GlobalClient {
        GlobalClient::new(self.client.clone(), self.cluster.clone())
    }

    pub fn checkpoint_bucket(&self) -> String {
        bucket_name(&self.cluster, "checkpoints")
    }
}

impl Sub {
    pub async fn commit(&self, events: Vec<KvEvent>) -> u64 {
        self.committer.commit(events).await.unwrap().seq
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
    tokio::time::timeout(Duration::from_secs(30), async {
        while !reached() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{subcluster} never reached {seq}: {:?}", master.status()));
}

pub async fn status(global: &GlobalClient) -> GlobalStatusReply {
    global
        .call(GlobalOp::Status, &GlobalStatus {})
        .await
        .unwrap()
}
