//! The sub-master: the authoritative, strongly consistent metadata master of one
//! sub-cluster, whose state is a fold over its own JetStream event stream.
