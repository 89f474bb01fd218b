//! The multi-host cluster every chaos scenario runs: a 3-node NATS JetStream cluster
//! (R3 streams), sub-clusters each with a leader and a standby sub-master and two
//! nodes, and global-master replicas — each a container on one private Docker
//! network, reachable from the test only through NATS's mapped client ports.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use hkvm_client::{RetryPolicy, SubmasterClient};
use hkvm_events::{ClusterId, SubclusterId};
use hkvm_itests::images::{hkvm_image, nats_image, NATS_CLIENT_PORT};
use hkvm_itests::security;
use testcontainers::core::WaitFor;
use testcontainers::runners::AsyncRunner as _;
use testcontainers::{ContainerAsync, GenericImage, ImageExt as _};

/// The HKVM cluster name every scenario uses.
pub const CLUSTER: &str = "chaos";

/// Sub-master settings: a one-second leader lease so failovers are quick.
pub const SUBMASTER_TOML: &str = "leader_lease_ttl_ms = 1000\nnode_timeout_ms = 30000\n";

/// Global-master settings: frequent checkpoints so a restart has one to load.
pub const GLOBAL_TOML: &str = "registry_ttl_ms = 5000\ncheckpoint_interval_ms = 1000\n\
                               lag_poll_ms = 200\nbloom_interval_ms = 0\n";

/// A container started from one of the suite's images.
pub type Container = ContainerAsync<GenericImage>;

/// What to start.
#[derive(Debug, Clone)]
pub struct Spec {
    /// Sub-clusters with their labels (`k=v`).
    pub subclusters: Vec<(&'static str, &'static str)>,
    /// Sub-master containers per sub-cluster (the first leads).
    pub submasters: usize,
    /// Node containers per sub-cluster.
    pub nodes: usize,
    /// Global-master replicas.
    pub globals: usize,
    /// Segment size of every node: large enough that no scenario's puts are
    /// evicted (eviction would make acknowledged keys legitimately missing).
    pub segment_size: &'static str,
    /// Run NATS with the per-role users and permissions of
    /// `hkvm_itests::security` (every HKVM process logs in as its role).
    pub secure: bool,
    /// The sub-masters' TOML settings.
    pub submaster_toml: String,
}

impl Default for Spec {
    fn default() -> Self {
        Self {
            subclusters: vec![("sc-0", "zone=a"), ("sc-1", "zone=b")],
            submasters: 2,
            nodes: 2,
            globals: 2,
            segment_size: "96MiB",
            secure: false,
            submaster_toml: SUBMASTER_TOML.to_owned(),
        }
    }
}

impl Spec {
    /// One sub-cluster `sc-0` (labels `zone=a`) with `globals` global masters and
    /// the default sub-masters and nodes.
    pub fn one_subcluster(globals: usize) -> Self {
        Self {
            subclusters: vec![("sc-0", "zone=a")],
            globals,
            ..Self::default()
        }
    }
}

/// A running cluster; every container is removed on drop.
pub struct Topology {
    /// The private network.
    pub network: String,
    /// Whether NATS runs with per-role users (see [`Spec::secure`]).
    pub secure: bool,
    /// NATS nodes (index = name suffix).
    pub nats: Vec<Container>,
    /// Sub-masters by `<subcluster>/<index>`; index 0 started first and leads.
    pub submasters: BTreeMap<String, Container>,
    /// Nodes by `<subcluster>/<index>`.
    pub nodes: BTreeMap<String, Container>,
    /// Global-master replicas.
    pub globals: Vec<Container>,
}

static NEXT: AtomicU32 = AtomicU32::new(0);

/// A network (and container-name prefix) unique to this process and call.
fn unique_network() -> String {
    format!(
        "hkvm-chaos-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

impl Topology {
    /// Starts everything in `spec` and waits until every sub-cluster's leader serves
    /// and every node is mounted.
    pub async fn start(spec: &Spec) -> Self {
        let network = unique_network();
        let mut topology = Self {
            network: network.clone(),
            secure: spec.secure,
            nats: Vec::new(),
            submasters: BTreeMap::new(),
            nodes: BTreeMap::new(),
            globals: Vec::new(),
        };
        // NATS nodes start together: none is ready before a quorum routes.
        let starts = (0..3).map(|i| topology.nats_request(i, spec).start());
        for started in futures::future::join_all(starts).await {
            let container = started.expect("start a NATS container (run scripts/build-images)");
            topology.nats.push(container);
        }
        topology.wait_jetstream().await;
        for (subcluster, labels) in &spec.subclusters {
            for index in 0..spec.submasters {
                let container = topology
                    .submaster_request(spec, subcluster, labels, index)
                    .start()
                    .await
                    .unwrap();
                topology
                    .submasters
                    .insert(format!("{subcluster}/{index}"), container);
                if index == 0 {
                    topology.wait_leader(subcluster).await;
                }
            }
            for index in 0..spec.nodes {
                let name = format!("{network}-{subcluster}-n{index}");
                let node = hkvm_image()
                    .with_wait_for(WaitFor::message_on_stdout("node serving"))
                    .with_network(&network)
                    .with_container_name(&name)
                    .with_env_var("RUST_LOG", "warn")
                    .with_cmd([
                        "node".to_owned(),
                        "--nats".to_owned(),
                        topology.node_url(),
                        "--cluster".to_owned(),
                        CLUSTER.to_owned(),
                        "--subcluster".to_owned(),
                        (*subcluster).to_owned(),
                        "--id".to_owned(),
                        format!("{subcluster}-n{index}"),
                        "--segment-size".to_owned(),
                        spec.segment_size.to_owned(),
                        "--listen".to_owned(),
                        "0.0.0.0:7000".to_owned(),
                        "--advertise".to_owned(),
                        format!("{name}:7000"),
                    ])
                    .with_startup_timeout(Duration::from_secs(60))
                    .start()
                    .await
                    .unwrap();
                topology.nodes.insert(format!("{subcluster}/{index}"), node);
            }
        }
        for index in 0..spec.globals {
            let global = topology.global_request(index).start().await.unwrap();
            topology.globals.push(global);
        }
        topology
    }

    fn nats_request(
        &self,
        index: usize,
        spec: &Spec,
    ) -> testcontainers::ContainerRequest<GenericImage> {
        let name = self.nats_name(index);
        let routes = (0..3)
            .filter(|i| *i != index)
            .map(|i| format!("nats://{}:6222", self.nats_name(i)))
            .collect::<Vec<_>>()
            .join(",");
        let mut cmd = vec![
            "-js".to_owned(),
            "-sd".to_owned(),
            "/data/js".to_owned(),
            "--server_name".to_owned(),
            format!("n{index}"),
            "--cluster_name".to_owned(),
            "hkvm".to_owned(),
            "--cluster".to_owned(),
            "nats://0.0.0.0:6222".to_owned(),
            "--routes".to_owned(),
            routes,
        ];
        let mut request = nats_image()
            .with_network(&self.network)
            .with_container_name(&name)
            .with_startup_timeout(Duration::from_secs(60));
        if spec.secure {
            let subclusters: Vec<&str> = spec.subclusters.iter().map(|(s, _)| *s).collect();
            let conf = security::nats_conf(CLUSTER, &subclusters, &[]).unwrap();
            cmd.extend(["-c".to_owned(), "/etc/nats.conf".to_owned()]);
            request = request.with_copy_to("/etc/nats.conf", conf.into_bytes());
        }
        request.with_cmd(cmd)
    }

    fn submaster_request(
        &self,
        spec: &Spec,
        subcluster: &str,
        labels: &str,
        index: usize,
    ) -> testcontainers::ContainerRequest<GenericImage> {
        let credentials = self.credentials(&security::submaster_user(subcluster));
        hkvm_image()
            .with_wait_for(WaitFor::message_on_stderr("sub-master starting"))
            .with_network(&self.network)
            .with_container_name(format!("{}-{subcluster}-sm{index}", self.network))
            .with_env_var("RUST_LOG", "info")
            .with_copy_to(
                "/etc/submaster.toml",
                spec.submaster_toml.clone().into_bytes(),
            )
            .with_cmd([
                "submaster".to_owned(),
                "--nats".to_owned(),
                self.inside_url_with(&credentials),
                "--cluster".to_owned(),
                CLUSTER.to_owned(),
                "--subcluster".to_owned(),
                subcluster.to_owned(),
                "--id".to_owned(),
                format!("{subcluster}-sm{index}"),
                "--labels".to_owned(),
                labels.to_owned(),
                "--replicas".to_owned(),
                "3".to_owned(),
                "--config".to_owned(),
                "/etc/submaster.toml".to_owned(),
            ])
            .with_startup_timeout(Duration::from_secs(60))
    }

    fn global_request(&self, index: usize) -> testcontainers::ContainerRequest<GenericImage> {
        hkvm_image()
            .with_wait_for(WaitFor::message_on_stderr("caught up: serving queries"))
            .with_network(&self.network)
            .with_container_name(format!("{}-gm{index}", self.network))
            .with_env_var("RUST_LOG", "info")
            .with_copy_to("/etc/global.toml", GLOBAL_TOML.as_bytes().to_vec())
            .with_cmd([
                "globalmaster".to_owned(),
                "--nats".to_owned(),
                self.inside_url_with(&self.credentials(security::GLOBAL_USER)),
                "--cluster".to_owned(),
                CLUSTER.to_owned(),
                "--replica".to_owned(),
                format!("g{index}"),
                "--config".to_owned(),
                "/etc/global.toml".to_owned(),
            ])
            .with_startup_timeout(Duration::from_secs(60))
    }

    /// The container name (= hostname on the network) of NATS node `index`.
    pub fn nats_name(&self, index: usize) -> String {
        format!("{}-nats-{index}", self.network)
    }

    /// `user:password@` for `user` when NATS is secured, else nothing.
    pub fn credentials(&self, user: &str) -> String {
        if self.secure {
            format!("{user}:{}@", security::password(user))
        } else {
            String::new()
        }
    }

    /// The NATS URLs as seen from inside the network, as a client.
    pub fn client_url(&self) -> String {
        self.inside_url_with(&self.credentials(security::CLIENT_USER))
    }

    /// The NATS URLs as seen from inside the network, as a node.
    pub fn node_url(&self) -> String {
        self.inside_url_with(&self.credentials(security::NODE_USER))
    }

    /// Like [`Topology::inside_url`], with `user:password@` credentials.
    pub fn inside_url_with(&self, credentials: &str) -> String {
        (0..3)
            .map(|i| format!("nats://{credentials}{}:4222", self.nats_name(i)))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The host-side URL of NATS node `index` (looked up each time: a restarted
    /// container gets a new host port).
    pub async fn host_url(&self, index: usize) -> String {
        let port = self.nats[index]
            .get_host_port_ipv4(NATS_CLIENT_PORT)
            .await
            .unwrap();
        format!("nats://127.0.0.1:{port}")
    }

    /// A connection from the test to NATS node `index` (as the operator).
    pub async fn connect(&self, index: usize) -> async_nats::Client {
        self.connect_as(index, security::ADMIN_USER).await
    }

    /// A connection from the test to NATS node `index` as `user`.
    pub async fn connect_as(&self, index: usize, user: &str) -> async_nats::Client {
        let mut options = async_nats::ConnectOptions::new();
        if self.secure {
            options = options
                .custom_inbox_prefix(hkvm_events::subject::inbox_prefix(user))
                .user_and_password(user.to_owned(), security::password(user));
        }
        options.connect(self.host_url(index).await).await.unwrap()
    }

    /// A sub-master client from the test (through NATS node 0).
    pub async fn client(&self, subcluster: &str) -> SubmasterClient {
        SubmasterClient::with_policy(
            self.connect(0).await,
            ClusterId::new(CLUSTER).unwrap(),
            SubclusterId::new(subcluster).unwrap(),
            RetryPolicy {
                request_timeout: Duration::from_secs(2),
                retry_deadline: Duration::from_secs(60),
                ..RetryPolicy::default()
            },
        )
    }

    /// Waits until JetStream can place an R3 stream (a meta leader, and every
    /// peer known to it), by creating and deleting a probe stream.
    async fn wait_jetstream(&self) {
        let js = async_nats::jetstream::new(self.connect(0).await);
        let probe = async_nats::jetstream::stream::Config {
            name: "CHAOS_PROBE".to_owned(),
            subjects: vec!["chaos.probe".to_owned()],
            num_replicas: 3,
            ..Default::default()
        };
        for _ in 0..300 {
            if js.create_stream(probe.clone()).await.is_ok() {
                let _ = js.delete_stream("CHAOS_PROBE").await;
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("JetStream never could place an R3 stream");
    }

    /// Waits until `subcluster`'s leader answers `status`.
    pub async fn wait_leader(&self, subcluster: &str) -> String {
        let client = self.client(subcluster).await;
        for _ in 0..60 {
            if let Ok(status) = client.status().await {
                return status.producer;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        panic!("no leader in {subcluster}");
    }

    /// A container by role key (`sc-0/0`), sub-masters first, then nodes.
    pub fn container(&self, key: &str) -> &Container {
        self.submasters
            .get(key)
            .or_else(|| self.nodes.get(key))
            .unwrap_or_else(|| panic!("no container {key}"))
    }
}
