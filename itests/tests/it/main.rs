//! Every HKVM test that needs a server, in one test binary: in-process pools on a
//! nats-server child ([`fixture`]), `hkvm` processes ([`process`]), and the
//! Docker suites ([`containers`], [`chaos`]), which run only with
//! `HKVM_DOCKER_TESTS=1` and otherwise report themselves skipped ([`docker_gate`]);
//! plus the workspace's tidy checks ([`tidy`]).
#![allow(clippy::unwrap_used)]

mod docker_gate;
mod fixture;
mod process;

mod chaos;
mod cli_failover;
mod cli_global;
mod cli_interdc;
mod cli_local;
mod cli_nats_conf;
mod cli_replay;
mod client_data_path;
mod cluster;
mod compose;
mod connection_loss;
mod containers;
mod data_port_grants;
mod deploy_artefacts;
mod direct_requests;
mod dummies;
mod events_log;
mod follow;
mod globalmaster_queries;
mod globalmaster_recovery;
mod history;
mod library;
mod monitoring;
mod nats_roles;
mod object_retention;
mod rdma;
mod snapshot_restore;
mod space_leases;
mod store_queries;
mod submaster_failover;
mod submaster_server;
mod submaster_stages;
mod tidy;
