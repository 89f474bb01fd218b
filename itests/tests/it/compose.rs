//! The Docker Compose deployment in `deploy/compose`, as a user runs it: brought
//! up with the durable NATS profile, values put into both sub-clusters and read
//! back through `hkvm` containers on its network, then one NATS node and the
//! leader sub-master of `sc-0` killed (SIGKILL), every value read back and new
//! ones put and read, and everything torn down. Needs a Docker engine with
//! `docker-compose` and the images of `scripts/build-images` (`HKVM_DOCKER_TESTS=1`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use hkvm_itests::images::{DEFAULT_HKVM_IMAGE, HKVM_IMAGE_ENV};

use crate::docker_gate::docker_or_skip;
use crate::fixture::http_get;

const COMPOSE_FILE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../deploy/compose/docker-compose.yml"
);
/// Every NATS node as the services inside the network reach it.
const NATS_URLS: &str = "nats://nats-0:4222,nats://nats-1:4222,nats://nats-2:4222";
/// How long the cluster may take to serve a first put, or a sub-cluster to serve
/// again after its leader and a NATS node were killed.
const READY_WITHIN: Duration = Duration::from_secs(120);

/// A running compose project, taken down (volumes included) on drop.
struct Project {
    name: String,
    /// Mounted at `/io` in every `hkvm` command container: values in and out.
    io: tempfile::TempDir,
}

impl Project {
    fn compose(&self) -> Command {
        let mut command = Command::new("docker-compose");
        command
            .args(["-f", COMPOSE_FILE, "-p", &self.name])
            .env("HKVM_NATS_PROFILE", "durable");
        command
    }

    fn compose_ok(&self, args: &[&str]) -> String {
        let output = self
            .compose()
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("running docker-compose {args:?}: {e}"));
        assert!(
            output.status.success(),
            "docker-compose {args:?} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    /// Runs `hkvm ARGS` in a throwaway container on the project's network.
    fn hkvm(&self, args: &[&str]) -> Output {
        let image = std::env::var(HKVM_IMAGE_ENV).unwrap_or_else(|_| DEFAULT_HKVM_IMAGE.into());
        let io = format!("{}:/io", self.io.path().display());
        let network = format!("{}_hkvm", self.name);
        Command::new("docker")
            .args(["run", "--rm", "--network", &network, "-v", &io])
            .args(["-e", "HKVM_CLUSTER=prod", "-e", "RUST_LOG=warn", &image])
            .args(args)
            .output()
            .unwrap_or_else(|e| panic!("running docker run {args:?}: {e}"))
    }

    fn put(&self, subcluster: &str, key: &str, value: &[u8]) -> Output {
        let file = format!("value-{}", key.replace('/', "_"));
        std::fs::write(self.io.path().join(&file), value).expect("writing a value");
        self.hkvm(&[
            "put",
            "--nats",
            NATS_URLS,
            "--subcluster",
            subcluster,
            "--replicas",
            "2",
            key,
            &format!("/io/{file}"),
        ])
    }

    fn get(&self, subcluster: &str, key: &str) -> Option<Vec<u8>> {
        let file = format!("out-{}", key.replace('/', "_"));
        let output = self.hkvm(&[
            "get",
            "--nats",
            NATS_URLS,
            "--subcluster",
            subcluster,
            key,
            "-o",
            &format!("/io/{file}"),
        ]);
        output
            .status
            .success()
            .then(|| std::fs::read(self.io.path().join(&file)).ok())
            .flatten()
    }

    /// The id of the sub-master `hkvm status` lists as `subcluster`'s leader.
    fn leader_of(&self, subcluster: &str) -> String {
        self.listed_leader(subcluster)
            .unwrap_or_else(|text| panic!("no leader of {subcluster} in hkvm status:\n{text}"))
    }

    /// [`Project::leader_of`], or (as the error) what `hkvm status` printed
    /// when it lists none: while a NATS node is down its registry may be
    /// briefly unreadable, and a dead leader's entry gone before the next
    /// one's is written.
    fn listed_leader(&self, subcluster: &str) -> Result<String, String> {
        let output = self.hkvm(&["status", "--nats", NATS_URLS]);
        let text = String::from_utf8_lossy(&output.stdout);
        text.lines()
            .find_map(|line| {
                let mut columns = line.split_whitespace();
                (columns.next() == Some(subcluster)).then(|| columns.next().map(str::to_owned))?
            })
            .ok_or_else(|| text.into_owned())
    }

    /// A monitoring page of nats-0, through its published port.
    fn nats_monitor(&self, path: &str) -> String {
        let published = self.compose_ok(&["port", "nats-0", "8222"]);
        let port = published
            .trim()
            .rsplit(':')
            .next()
            .and_then(|port| port.parse::<u16>().ok())
            .unwrap_or_else(|| panic!("no published monitoring port: {published:?}"));
        http_get(port, path)
    }
}

impl Drop for Project {
    fn drop(&mut self) {
        let _ = self
            .compose()
            .args(["down", "-v", "--remove-orphans", "-t", "1"])
            .output();
    }
}

impl Project {
    /// What the project's containers are doing: their states, and each one's
    /// last log lines (what a failing test prints).
    fn diagnosis(&self) -> String {
        let text = |args: &[&str]| {
            self.compose().args(args).output().map_or_else(
                |e| e.to_string(),
                |o| {
                    format!(
                        "{}{}",
                        String::from_utf8_lossy(&o.stdout),
                        String::from_utf8_lossy(&o.stderr)
                    )
                },
            )
        };
        format!(
            "{}\n{}",
            text(&["ps"]),
            text(&["logs", "--no-color", "--tail", "15"])
        )
    }

    /// Retries `attempt` until it gives a value or `within` has passed; then
    /// fails with the containers' state and logs.
    fn eventually<T>(
        &self,
        what: &str,
        within: Duration,
        mut attempt: impl FnMut() -> Option<T>,
    ) -> T {
        let deadline = Instant::now() + within;
        loop {
            if let Some(value) = attempt() {
                return value;
            }
            if Instant::now() >= deadline {
                panic!("{what}: not within {within:?}\n{}", self.diagnosis());
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }
}

fn value_of(key: &str) -> Vec<u8> {
    let seed = key
        .bytes()
        .fold(0u8, |a, b| a.wrapping_mul(31).wrapping_add(b));
    (0..96 * 1024)
        .map(|i: u32| (i as u8).wrapping_mul(7) ^ seed)
        .collect()
}

#[test]
fn the_compose_cluster_serves_and_survives_a_nats_node_and_a_leader_killed() {
    if !docker_or_skip(
        "compose::the_compose_cluster_serves_and_survives_a_nats_node_and_a_leader_killed",
    ) {
        return;
    }
    let project = Project {
        name: format!("hkvmcompose{}", std::process::id()),
        io: tempfile::tempdir().expect("a temp dir"),
    };
    project.compose_ok(&["config", "--quiet"]);
    project.compose_ok(&["up", "-d"]);

    // The profile is the one asked for: every write fsynced.
    let varz = project.eventually("nats-0's /varz", READY_WITHIN, || {
        let answer = project.nats_monitor("/varz");
        answer.contains("\"sync_always\"").then_some(answer)
    });
    assert!(varz.contains("\"sync_always\": true"), "{varz}");

    // Serving: a first put into each sub-cluster succeeds once its leader and its
    // nodes are up.
    let mut written: Vec<(&str, String)> = Vec::new();
    for subcluster in ["sc-0", "sc-1"] {
        let key = format!("{subcluster}/first");
        project.eventually(
            &format!("a first put into {subcluster}"),
            READY_WITHIN,
            || {
                // A put whose answer was lost may have landed: a read says so.
                let value = value_of(&key);
                let put = project.put(subcluster, &key, &value);
                let stored = put.status.success() || project.get(subcluster, &key) == Some(value);
                if !stored {
                    eprintln!("put {key}: {}", String::from_utf8_lossy(&put.stderr).trim());
                }
                stored.then_some(())
            },
        );
        written.push((subcluster, key));
        for index in 0..3 {
            let key = format!("{subcluster}/before-{index}");
            let output = project.put(subcluster, &key, &value_of(&key));
            assert!(output.status.success(), "put {key}: {output:?}");
            written.push((subcluster, key));
        }
    }
    for (subcluster, key) in &written {
        assert_eq!(project.get(subcluster, key), Some(value_of(key)), "{key}");
    }

    // A NATS node and sc-0's leader die without warning.
    let leader = project.leader_of("sc-0");
    let service = match leader.as_str() {
        "sc-0-a" => "sm-0a",
        "sc-0-b" => "sm-0b",
        other => panic!("unexpected leader {other}"),
    };
    project.compose_ok(&["kill", "nats-2", service]);

    // Everything acknowledged is read back, byte for byte, once sc-0's standby
    // leads; and the sub-cluster takes new puts.
    for (subcluster, key) in &written {
        let value = project.eventually(&format!("reading {key} back"), READY_WITHIN, || {
            project.get(subcluster, key)
        });
        assert_eq!(value, value_of(key), "{key}");
    }
    project.eventually(
        "sc-0's registry entry naming its new leader",
        READY_WITHIN,
        || {
            project
                .listed_leader("sc-0")
                .ok()
                .filter(|listed| *listed != leader)
                .map(|_| ())
        },
    );
    for index in 0..3 {
        let key = format!("sc-0/after-{index}");
        let output = project.put("sc-0", &key, &value_of(&key));
        assert!(output.status.success(), "put {key}: {output:?}");
        assert_eq!(project.get("sc-0", &key), Some(value_of(&key)), "{key}");
    }
}

/// `deploy/compose` and `deploy/config` hold what the compose file mounts.
#[test]
fn the_compose_file_mounts_only_files_that_exist() {
    let dir = Path::new(COMPOSE_FILE).parent().expect("a directory");
    let text = std::fs::read_to_string(COMPOSE_FILE).expect("the compose file");
    let mut mounts = 0;
    for line in text.lines() {
        let Some(mount) = line.trim().strip_prefix("- ") else {
            continue;
        };
        if !mount.starts_with("./") && !mount.starts_with("../") {
            continue;
        }
        let source: PathBuf = dir.join(mount.split(':').next().expect("a source"));
        assert!(
            source.exists(),
            "{} is mounted but missing",
            source.display()
        );
        mounts += 1;
    }
    assert!(mounts >= 3, "{mounts} mounts found");
    for profile in ["default", "durable"] {
        let conf = dir.join(format!("../config/nats/{profile}.conf"));
        assert!(conf.exists(), "{}", conf.display());
    }
}
