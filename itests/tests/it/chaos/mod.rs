//! The chaos suite: a real multi-host HKVM cluster in containers on private Docker
//! networks (3-node NATS JetStream with R3 streams, sub-masters with hot standbys,
//! nodes, global-master replicas, load generators), made to lose processes, links
//! and NATS nodes; every scenario asserts on data. Images come from
//! `scripts/build-images`. `HKVM_ITESTS_QUICK=1` skips the slowest scenario for
//! local runs; CI runs them all.
#![allow(clippy::unwrap_used)]

mod docker;
mod global;
mod loadgen;
mod report;
mod scenario_avalanche;
mod scenario_bad_input;
mod scenario_e2e;
mod scenario_interdc;
mod scenario_kill_global;
mod scenario_kill_leader;
mod scenario_nats_node;
mod scenario_partition;
mod scenario_security;
mod topology;
