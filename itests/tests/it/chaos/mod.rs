//! The chaos suite: a real multi-host HKVM cluster in containers on private Docker
//! networks (3-node NATS JetStream with R3 streams, sub-masters with hot standbys,
//! nodes, global-master replicas, load generators), made to lose processes, links
//! and NATS nodes; every scenario asserts on data. Images come from
//! `scripts/build-images`. Runs only with `HKVM_DOCKER_TESTS=1`;
//! `HKVM_ITESTS_QUICK=1` skips the slowest scenario for local runs (CI runs them
//! all). Every scenario writes one row to the summary ([`report`]).

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
