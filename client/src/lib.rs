//! The client library used by inference processes: metadata RPCs to sub-masters and
//! the global master, and the checksummed data path to nodes.
