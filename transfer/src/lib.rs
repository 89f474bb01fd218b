//! KV data movement between nodes: a TCP backend that is always available and an
//! RDMA verbs backend (through `rdma-sys`) behind the `rdma` cargo feature.
