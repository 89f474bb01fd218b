//! KVEvent wire types: the versioned envelope, event kinds, validation, subject and
//! stream names, and the event log over NATS JetStream.
