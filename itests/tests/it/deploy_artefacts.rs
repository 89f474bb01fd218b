//! The deployment artefacts in `deploy/` that run without Docker:
//! - the systemd units with the example settings of `deploy/config`:
//!   `systemd-analyze verify` finds nothing to say about them, and every `hkvm`
//!   command line they run, with their environment file, starts and serves
//!   against a real nats-server (so every flag and config value in them is one
//!   the binary reads);
//! - the Kubernetes manifests: valid against the Kubernetes schemas
//!   (`kubernetes-validate --strict`, offline), their ConfigMaps holding
//!   `deploy/config`'s files verbatim, every `hkvm` flag they pass one the
//!   subcommand takes (as in the Compose file);
//! - the NATS configs of both profiles pass `nats-server -t`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::fixture::Fixture;
use crate::process::{hkvm, hkvm_bin_async, Process, Stream};

const DEPLOY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy");
/// How long a unit's process may take to say it serves.
const READY_WITHIN: Duration = Duration::from_secs(30);

fn deploy(path: &str) -> PathBuf {
    Path::new(DEPLOY).join(path)
}

fn read(path: &str) -> String {
    std::fs::read_to_string(deploy(path)).unwrap_or_else(|e| panic!("reading {path}: {e}"))
}

/// The `KEY=value` lines of an environment file.
fn environment_file(path: &str) -> BTreeMap<String, String> {
    read(path)
        .lines()
        .map(str::trim)
        .filter(|line| !line.is_empty() && !line.starts_with('#'))
        .map(|line| {
            let (key, value) = line
                .split_once('=')
                .unwrap_or_else(|| panic!("{path}: {line}"));
            (key.to_owned(), value.to_owned())
        })
        .collect()
}

/// A unit's `ExecStart` words, with its specifiers (`%i` the instance, `%l` the
/// host) and `${VAR}`s expanded as systemd would.
fn exec_start(unit: &str, instance: &str, env: &BTreeMap<String, String>) -> Vec<String> {
    let text = read(&format!("systemd/{unit}"));
    let line = text
        .lines()
        .find_map(|line| line.strip_prefix("ExecStart="))
        .unwrap_or_else(|| panic!("{unit} has no ExecStart"));
    let mut expanded = line.replace("%i", instance).replace("%l", "host1");
    for (key, value) in env {
        expanded = expanded.replace(&format!("${{{key}}}"), value);
    }
    assert!(
        !expanded.contains("${"),
        "{unit}: unexpanded variable in {expanded}"
    );
    expanded.split_whitespace().map(str::to_owned).collect()
}

/// `words` as this test runs them: the repository's binary and example configs,
/// ports any free one, and one stream replica (the test's NATS is one node).
fn as_run_here(words: &[String]) -> Vec<String> {
    words
        .iter()
        .enumerate()
        .skip(1)
        .map(
            |(index, word)| match (words[index - 1].as_str(), word.as_str()) {
                ("--replicas", _) => "1".to_owned(),
                ("--metrics" | "--listen", _) => "127.0.0.1:0".to_owned(),
                ("--config", path) => {
                    let name = Path::new(path).file_name().expect("a config file name");
                    deploy("config").join(name).display().to_string()
                }
                (_, word) => word.to_owned(),
            },
        )
        .collect()
}

async fn start_unit(
    unit: &str,
    instance: &str,
    env: &BTreeMap<String, String>,
    ready: (Stream, &str),
) -> Process {
    let words = exec_start(unit, instance, env);
    assert_eq!(words[0], "/usr/local/bin/hkvm", "{unit}");
    let args = as_run_here(&words);
    let mut command = hkvm(&args).await;
    command.envs(env).env("RUST_LOG", "info");
    let process = Process::spawn(unit, command);
    process.wait_for_line(ready.0, ready.1, READY_WITHIN).await;
    process
}

#[tokio::test]
async fn every_unit_starts_and_serves_with_the_example_settings() {
    let fixture = Fixture::new("prod").await;
    let mut env = environment_file("systemd/hkvm.env");
    assert_eq!(env.get("HKVM_CLUSTER").map(String::as_str), Some("prod"));
    env.insert("HKVM_NATS_URL".into(), fixture.url());
    // The example's 64 GiB segment is committed at mount: too much for a test.
    env.insert("HKVM_SEGMENT_SIZE".into(), "64MiB".into());
    let subcluster = env["HKVM_SUBCLUSTER"].clone();

    let _submaster = start_unit(
        "hkvm-submaster@.service",
        &subcluster,
        &env,
        (Stream::Stderr, "sub-master starting"),
    )
    .await;
    let _node = start_unit(
        "hkvm-node.service",
        "",
        &env,
        (Stream::Stdout, "node serving"),
    )
    .await;
    let _global = start_unit(
        "hkvm-globalmaster.service",
        "",
        &env,
        (Stream::Stderr, "caught up: serving queries"),
    )
    .await;
}

#[tokio::test]
async fn systemd_analyze_verify_finds_nothing_to_say_about_the_units() {
    let dir = tempfile::tempdir().expect("a temp dir");
    let hkvm = hkvm_bin_async().await;
    let nats_server = hkvm_natsd_binary();
    let mut units = Vec::new();
    for entry in std::fs::read_dir(deploy("systemd")).expect("deploy/systemd") {
        let path = entry.expect("an entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("service") {
            continue;
        }
        let name = path.file_name().and_then(|n| n.to_str()).expect("a name");
        // The binaries where this checkout has them (verify checks they exist).
        let text = std::fs::read_to_string(&path)
            .expect("a unit")
            .replace("/usr/local/bin/hkvm", &hkvm.display().to_string())
            .replace(
                "/usr/local/bin/nats-server",
                &nats_server.display().to_string(),
            );
        std::fs::write(dir.path().join(name), text).expect("writing a unit");
        units.push(name.replace("@.service", "@sc-0.service"));
    }
    assert!(units.len() >= 4, "{units:?}");
    let output = Command::new("systemd-analyze")
        .arg("verify")
        .args(units.iter().map(|unit| format!("./{unit}")))
        .current_dir(dir.path())
        .output()
        .expect("running systemd-analyze (Debian's systemd package)");
    let said = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success() && said.trim().is_empty(), "{said}");
}

#[test]
fn both_nats_profiles_are_valid_nats_server_configs() {
    let nats_server = hkvm_natsd_binary();
    for profile in ["default", "durable"] {
        let output = Command::new(&nats_server)
            .args(["-t", "-c"])
            .arg(deploy(&format!("config/nats/{profile}.conf")))
            .output()
            .expect("running nats-server -t");
        assert!(
            output.status.success(),
            "{profile}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    assert!(read("config/nats/durable.conf").contains("sync_interval: always"));
    assert!(!read("config/nats/default.conf").contains("sync_interval"));
}

/// The provisioned nats-server.
fn hkvm_natsd_binary() -> PathBuf {
    hkvm_testkit::find_nats_server(hkvm_testkit::ToolsDir::default())
        .expect("nats-server (run scripts/provision)")
}

/// The Kubernetes version the manifests are validated against.
const KUBERNETES_VERSION: &str = "1.33.0";

#[test]
fn the_kubernetes_manifests_validate_against_the_schemas() {
    let validate =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../.tools/venv/bin/kubernetes-validate");
    let output = Command::new(&validate)
        .args(["--strict", "--quiet", "-k", KUBERNETES_VERSION])
        .arg(deploy("kubernetes/hkvm.yaml"))
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "running {} ({e}): run scripts/provision",
                validate.display()
            )
        });
    assert!(
        output.status.success(),
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn the_kubernetes_config_maps_hold_deploy_config_verbatim() {
    let manifests = read("kubernetes/hkvm.yaml");
    for (key, file) in [
        ("submaster.toml", "config/submaster.toml"),
        ("globalmaster.toml", "config/globalmaster.toml"),
        ("default.conf", "config/nats/default.conf"),
        ("durable.conf", "config/nats/durable.conf"),
    ] {
        let mut expected = format!("  {key}: |\n");
        for line in read(file).lines() {
            if line.is_empty() {
                expected.push('\n');
            } else {
                expected.push_str(&format!("    {line}\n"));
            }
        }
        assert!(
            manifests.contains(&expected),
            "{key} differs from deploy/{file}"
        );
    }
}

/// The `hkvm` argument lists of a manifest or Compose file: every one-line
/// `[subcommand, --flag, value, ...]` list whose first word is a subcommand.
fn hkvm_argument_lists(text: &str) -> Vec<Vec<String>> {
    text.lines()
        .filter_map(|line| {
            let list = line.split_once('[')?.1.rsplit_once(']')?.0;
            let words: Vec<String> = list
                .split(',')
                .map(|word| word.trim().trim_matches('"').to_owned())
                .collect();
            matches!(words[0].as_str(), "submaster" | "globalmaster" | "node").then_some(words)
        })
        .collect()
}

#[tokio::test]
async fn every_hkvm_flag_in_the_manifests_and_the_compose_file_exists() {
    let mut checked = 0;
    for file in ["kubernetes/hkvm.yaml", "compose/docker-compose.yml"] {
        let lists = hkvm_argument_lists(&read(file));
        assert!(lists.len() >= 3, "{file}: {lists:?}");
        for words in lists {
            let help = crate::process::run(hkvm([words[0].as_str(), "--help"]).await).await;
            assert!(help.success(), "{file}: hkvm {} --help", words[0]);
            for flag in words.iter().filter(|word| word.starts_with("--")) {
                assert!(
                    help.stdout.contains(&format!("{flag} "))
                        || help.stdout.contains(&format!("{flag}\n")),
                    "{file}: hkvm {} has no {flag}",
                    words[0]
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 20, "{checked} flags checked");
}
