//! Tidy checks over the workspace itself, as ordinary tests: the crate layering
//! (a crate uses only crates on lower rows, dev-dependencies included) and the
//! formats crate's freedom from any async runtime or NATS client, read from
//! `cargo metadata`, so an edge that breaks either fails here.

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

/// The layers, lowest first. Every workspace crate is on exactly one row.
const ROWS: &[&[&str]] = &[
    &[
        "hkvm-events",
        "hkvm-transfer",
        "hkvm-telemetry",
        "hkvm-natsd",
    ],
    &["hkvm-log", "hkvm-direct", "hkvm-testkit"],
    &["hkvm-submaster", "hkvm-projector", "hkvm-client"],
    &["hkvm-globalmaster", "hkvm-interdc"],
    &["hkvm-cli", "hkvm-bench", "hkvm-itests", "hkvm-python"],
];

/// Edges that the layering allows but the design forbids: the projector folds
/// without I/O, the masters and the client read snapshots and call sub-masters
/// through `events`, `log` and `client`, and the service binary links no test kit.
const FORBIDDEN: &[(&str, &str)] = &[
    ("hkvm-projector", "hkvm-log"),
    ("hkvm-globalmaster", "hkvm-submaster"),
    ("hkvm-globalmaster", "hkvm-testkit"),
    ("hkvm-interdc", "hkvm-submaster"),
    ("hkvm-interdc", "hkvm-testkit"),
    ("hkvm-client", "hkvm-submaster"),
    ("hkvm-client", "hkvm-testkit"),
    ("hkvm-cli", "hkvm-testkit"),
    ("hkvm-cli", "hkvm-bench"),
];

fn row_of(name: &str) -> Option<usize> {
    ROWS.iter().position(|row| row.contains(&name))
}

/// `cargo metadata` of the workspace (`--no-deps`: its own packages only).
fn cargo_metadata(no_deps: bool) -> serde_json::Value {
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.toml");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut args = vec!["metadata", "--format-version", "1", "--offline"];
    if no_deps {
        args.push("--no-deps");
    }
    args.extend(["--manifest-path", manifest]);
    let output = Command::new(cargo)
        .args(args)
        .output()
        .expect("running cargo metadata");
    assert!(
        output.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("cargo metadata prints JSON")
}

/// Every workspace crate's hkvm dependencies (normal, dev and build).
fn workspace_edges() -> BTreeMap<String, Vec<String>> {
    let metadata = cargo_metadata(true);
    let mut edges = BTreeMap::new();
    for package in metadata["packages"].as_array().expect("a package list") {
        let name = package["name"].as_str().expect("a name").to_owned();
        let deps = package["dependencies"]
            .as_array()
            .expect("a dependency list")
            .iter()
            .filter_map(|dep| dep["name"].as_str())
            .filter(|dep| dep.starts_with("hkvm-"))
            .map(str::to_owned)
            .collect();
        edges.insert(name, deps);
    }
    edges
}

#[test]
fn every_crate_uses_only_crates_on_lower_rows() {
    let edges = workspace_edges();
    let mut broken = Vec::new();
    for (crate_name, deps) in &edges {
        let Some(row) = row_of(crate_name) else {
            broken.push(format!("{crate_name} is on no row of the layering"));
            continue;
        };
        for dep in deps {
            match row_of(dep) {
                Some(dep_row) if dep_row < row => {}
                Some(dep_row) => broken.push(format!(
                    "{crate_name} (row {}) uses {dep} (row {})",
                    row + 1,
                    dep_row + 1
                )),
                None => broken.push(format!("{crate_name} uses {dep}, which is on no row")),
            }
        }
    }
    for (from, to) in FORBIDDEN {
        if edges
            .get(*from)
            .is_some_and(|deps| deps.iter().any(|d| d == to))
        {
            broken.push(format!("{from} must not use {to}"));
        }
    }
    assert!(broken.is_empty(), "layering broken:\n{}", broken.join("\n"));
}

/// Crates that only an I/O crate may link: an async runtime, a NATS client, and
/// their stream and buffer types.
const RUNTIME_CRATES: &[&str] = &["tokio", "async-nats", "futures", "bytes", "mio"];

/// Every package `root` links in a normal build (its normal dependencies, and
/// theirs), by name.
fn linked_packages(metadata: &serde_json::Value, root: &str) -> BTreeSet<String> {
    let packages = metadata["packages"].as_array().expect("a package list");
    let name_of = |id: &str| {
        packages
            .iter()
            .find(|package| package["id"] == id)
            .and_then(|package| package["name"].as_str())
            .expect("every resolved id is a package")
            .to_owned()
    };
    let nodes = metadata["resolve"]["nodes"]
        .as_array()
        .expect("a resolve graph");
    let root_id = packages
        .iter()
        .find(|package| package["name"] == root)
        .and_then(|package| package["id"].as_str())
        .expect("the root is a workspace package")
        .to_owned();
    let mut seen = BTreeSet::from([root_id.clone()]);
    let mut pending = vec![root_id];
    while let Some(id) = pending.pop() {
        let node = nodes
            .iter()
            .find(|node| node["id"] == id.as_str())
            .expect("every package is a node");
        for dep in node["deps"].as_array().expect("a dependency list") {
            let normal = dep["dep_kinds"]
                .as_array()
                .expect("dependency kinds")
                .iter()
                .any(|kind| kind["kind"].is_null());
            let dep_id = dep["pkg"].as_str().expect("a package id").to_owned();
            if normal && seen.insert(dep_id.clone()) {
                pending.push(dep_id);
            }
        }
    }
    seen.iter().map(|id| name_of(id)).collect()
}

#[test]
fn the_formats_crate_links_no_async_runtime_or_nats_client() {
    let metadata = cargo_metadata(false);
    let linked = linked_packages(&metadata, "hkvm-events");
    assert!(
        linked.contains("rmp-serde"),
        "the walk found the formats crate's own dependencies: {linked:?}"
    );
    let runtime: Vec<&str> = RUNTIME_CRATES
        .iter()
        .copied()
        .filter(|name| linked.contains(*name))
        .collect();
    assert!(
        runtime.is_empty(),
        "hkvm-events links {runtime:?}; formats decode without a runtime, and I/O belongs in hkvm-log"
    );
}
