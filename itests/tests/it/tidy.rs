//! Tidy checks over the workspace itself, as ordinary tests: the crate layering
//! (a crate uses only crates on lower rows, dev-dependencies included) read from
//! `cargo metadata`, so an edge that breaks it fails here.

use std::collections::BTreeMap;
use std::process::Command;

/// The layers, lowest first. Every workspace crate is on exactly one row.
const ROWS: &[&[&str]] = &[
    &[
        "hkvm-events",
        "hkvm-transfer",
        "hkvm-telemetry",
        "hkvm-testkit",
    ],
    &["hkvm-submaster", "hkvm-projector", "hkvm-client"],
    &["hkvm-globalmaster", "hkvm-interdc"],
    &["hkvm-cli", "hkvm-bench", "hkvm-itests", "hkvm-python"],
];

/// Edges that the layering allows but the design forbids: the masters and the
/// client read snapshots and call sub-masters through `events` and `client`, and
/// the service binary links no test kit.
const FORBIDDEN: &[(&str, &str)] = &[
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

/// Every workspace crate's hkvm dependencies (normal, dev and build).
fn workspace_edges() -> BTreeMap<String, Vec<String>> {
    let manifest = concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.toml");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let output = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
            "--manifest-path",
            manifest,
        ])
        .output()
        .expect("running cargo metadata");
    assert!(
        output.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let metadata: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("cargo metadata prints JSON");
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
