//! The monitoring artefacts in `deploy/monitoring` against what the services
//! export: every metric the alert rules, their unit tests and the Grafana
//! dashboard name is one a sub-master, a global master or an inter-DC master
//! registers; the rules and the scrape configuration pass `promtool check`, the
//! rules pass their unit tests (`promtool test rules`), and every dashboard
//! query is valid PromQL. `promtool` comes from Debian's `prometheus` package
//! (`scripts/provision` installs it).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

const MONITORING: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/monitoring");

fn artefact(name: &str) -> PathBuf {
    Path::new(MONITORING).join(name)
}

fn read(name: &str) -> String {
    std::fs::read_to_string(artefact(name)).unwrap_or_else(|e| panic!("reading {name}: {e}"))
}

/// Every sample name the services can export: from each registry's `# TYPE`
/// lines, with the suffixes OpenMetrics gives counters and histograms. A
/// labelled family is encoded only once it has a label set, so each gets one.
fn exported_sample_names() -> BTreeSet<String> {
    let labels = vec![("any".to_owned(), "value".to_owned())];
    let submaster = hkvm_submaster::metrics::SubmasterMetrics::new();
    submaster.request("op", "ok", 0.001);
    submaster
        .write_stages
        .get_or_create(&hkvm_submaster::metrics::StageLabels { stage: "queued" })
        .observe(0.001);
    let global = hkvm_globalmaster::metrics::Metrics::new();
    global.events_applied.get_or_create(&labels).inc();
    global.messages_applied.get_or_create(&labels).inc();
    global.lag_events.get_or_create(&labels).set(1);
    global.lag_seconds.get_or_create(&labels).set(1.0);
    global.resyncs.get_or_create(&labels).inc();
    global.query_seconds.get_or_create(&labels).observe(0.001);
    global.busy.get_or_create(&labels).inc();
    let interdc = hkvm_interdc::metrics::Metrics::new();
    interdc.settled.get_or_create(&labels).inc();
    interdc.failures.get_or_create(&labels).inc();
    interdc.events_applied.get_or_create(&labels).inc();
    interdc.resyncs.get_or_create(&labels).inc();
    let texts = [
        submaster.registry().text(),
        global.registry().text(),
        interdc.registry().text(),
    ];
    let mut names = BTreeSet::new();
    for text in &texts {
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("# TYPE ") else {
                continue;
            };
            let mut words = rest.split_whitespace();
            let (Some(name), Some(kind)) = (words.next(), words.next()) else {
                panic!("a TYPE line without a kind: {line}");
            };
            match kind {
                "counter" => {
                    names.insert(format!("{name}_total"));
                }
                "histogram" => {
                    for suffix in ["_bucket", "_sum", "_count"] {
                        names.insert(format!("{name}{suffix}"));
                    }
                }
                _ => {
                    names.insert(name.to_owned());
                }
            }
        }
    }
    names
}

/// The metric names (`hkvm_…` identifiers) in `text`.
fn metric_names_in(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let bytes = text.as_bytes();
    let mut at = 0;
    while let Some(found) = text[at..].find("hkvm_") {
        let start = at + found;
        let preceded_by_word =
            start > 0 && (bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        if !preceded_by_word {
            names.insert(text[start..end].to_owned());
        }
        at = end;
    }
    names
}

fn dashboard() -> serde_json::Value {
    serde_json::from_str(&read("grafana-dashboard.json")).expect("the dashboard is JSON")
}

/// Every query of the dashboard: its panels' targets and its variables.
fn dashboard_queries(dashboard: &serde_json::Value) -> Vec<String> {
    let mut queries = Vec::new();
    let panels = dashboard["panels"].as_array().expect("panels");
    for panel in panels.iter().filter(|panel| panel["type"] != "row") {
        let targets = panel["targets"].as_array().expect("a panel has targets");
        assert!(
            !targets.is_empty(),
            "panel {} queries nothing",
            panel["title"]
        );
        for target in targets {
            queries.push(target["expr"].as_str().expect("a target's expr").to_owned());
        }
    }
    for variable in dashboard["templating"]["list"]
        .as_array()
        .expect("variables")
    {
        if let Some(query) = variable["query"]["query"].as_str() {
            queries.push(query.to_owned());
        }
    }
    queries
}

/// `query` with the dashboard's variables replaced by what Grafana sends.
fn as_promql(query: &str) -> String {
    query
        .replace("$__rate_interval", "1m")
        .replace("$cluster", ".*")
        .replace("$subcluster", ".*")
}

fn promtool(args: &[&str]) -> String {
    let output = Command::new("promtool")
        .args(args)
        .current_dir(MONITORING)
        .output()
        .unwrap_or_else(|e| {
            panic!("running promtool ({e}): install it with scripts/provision (Debian's prometheus package)")
        });
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        output.status.success(),
        "promtool {args:?} failed:\n{printed}"
    );
    printed
}

#[test]
fn every_metric_the_alerts_and_the_dashboard_name_is_exported() {
    let exported = exported_sample_names();
    assert!(
        exported.contains("hkvm_submaster_requests_total"),
        "{exported:?}"
    );
    for name in ["alerts.yml", "alerts.test.yml", "grafana-dashboard.json"] {
        let named = metric_names_in(&read(name));
        assert!(named.len() >= 10, "{name} names only {named:?}");
        let unknown: Vec<_> = named.difference(&exported).collect();
        assert!(
            unknown.is_empty(),
            "{name} names metrics nobody exports: {unknown:?}"
        );
    }
}

#[test]
fn the_alerts_watch_what_an_operator_is_paged_for() {
    let alerts = metric_names_in(&read("alerts.yml"));
    for watched in [
        "hkvm_submaster_role",                   // a sub-cluster without a leader
        "hkvm_submaster_takeovers_total",        // leader changes
        "hkvm_submaster_standby_lag",            // a standby's stream lag
        "hkvm_global_lag_seconds",               // the global master's staleness
        "hkvm_global_lag_events",                // its stream lag
        "hkvm_submaster_history_first_seq",      // purge falling behind
        "hkvm_submaster_requests_total",         // Busy rates
        "hkvm_global_busy_total",                // the global master's Busy rate
        "hkvm_submaster_nodes_lost_total",       // node loss
        "hkvm_interdc_backlog_bytes",            // inter-DC backlog
        "hkvm_submaster_request_seconds_bucket", // latency
    ] {
        assert!(alerts.contains(watched), "no alert watches {watched}");
    }
    // Every alert is unit-tested.
    let tests = read("alerts.test.yml");
    for line in read("alerts.yml").lines() {
        if let Some(alert) = line.trim().strip_prefix("- alert: ") {
            assert!(
                tests.contains(&format!("alertname: {alert}\n")),
                "alerts.test.yml does not test {alert}"
            );
        }
    }
}

#[test]
fn the_rules_and_the_scrape_config_pass_promtool_and_the_rules_their_unit_tests() {
    promtool(&["check", "rules", "alerts.yml"]);
    promtool(&["check", "config", "prometheus.yml"]);
    let tested = promtool(&["test", "rules", "alerts.test.yml"]);
    assert!(tested.contains("SUCCESS"), "{tested}");
}

#[test]
fn every_dashboard_query_is_valid_promql() {
    let dashboard = dashboard();
    let queries = dashboard_queries(&dashboard);
    assert!(queries.len() >= 20, "{queries:?}");
    // Recording rules are PromQL that promtool parses and type-checks.
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (index, query) in queries.iter().enumerate() {
        // label_values() is Grafana's, not PromQL: its selector is the query.
        let promql = match query.strip_prefix("label_values(") {
            Some(rest) => rest
                .rsplit_once(',')
                .map_or(rest, |(selector, _)| selector)
                .to_owned(),
            None => as_promql(query),
        };
        rules.push_str(&format!(
            "      - record: dashboard:query_{index}\n        expr: {}\n",
            serde_json::Value::String(promql)
        ));
    }
    let dir = tempfile::tempdir().expect("a temp dir");
    let file = dir.path().join("dashboard-queries.yml");
    std::fs::write(&file, rules).expect("writing the queries");
    let file = file.to_str().expect("a UTF-8 temp path");
    let checked = promtool(&["check", "rules", file]);
    assert!(
        checked.contains(&format!("SUCCESS: {} rules found", queries.len())),
        "{checked}"
    );
    // Panel ids are unique, as Grafana requires.
    let ids: Vec<_> = dashboard["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .map(|panel| panel["id"].as_u64().expect("a panel id"))
        .collect();
    let distinct: BTreeSet<_> = ids.iter().collect();
    assert_eq!(distinct.len(), ids.len(), "panel ids repeat: {ids:?}");
}
