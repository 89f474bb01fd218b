//! The global master: a registry of sub-masters plus a projection of all their event
//! streams, answering cluster-wide `batch_is_exist`, `locate` and routing queries.
